"""Training objectives (`train.objective`): what a step minimises, which parameters it trains, the model its loss
runs, the parent checkpoints it starts from and the metrics it adds. The loop and the step ask the objective, so
they know no attention kind.

"lm" is the next-token loss, recall-weighted (FS Eq. 13). "zha_kl" converts a TF++ model to ZHA (ZHA III-B).
"""

import dataclasses
from collections.abc import Callable

import flax.traverse_util
import jax
import jax.numpy as jnp
import optax

from fsjax.config import ConfigError
from fsjax.model import init_variables


def loss_weights(batch, recall_beta, recall_switch_beta):
  """FS Eq. 13 weights `w_t = 1 + β f_t + β_sw χ_t` of each target `tokens[:, 1:]`; all ones when β = 0. Rows
  that carry a `loss_mask` (associative recall, `fsjax.data.associative`) weigh only the targets it marks.

  Args:
    batch: dict with `tokens` `[B, T+1]`, optionally `loss_mask` `[B, T+1]` bool, and, when β > 0, `recall` and
      `switch` `[B, T+1]` masks, each aligned with `tokens` (the weight of predicting token t+1 is its own mask
      value).

  Returns:
    `[B, T]` float32.
  """
  shape = batch["tokens"][:, 1:].shape
  weights = jnp.ones(shape, jnp.float32)
  if "loss_mask" in batch:
    weights = batch["loss_mask"][:, 1:].astype(jnp.float32)
  if recall_beta:
    weights += recall_beta * batch["recall"][:, 1:].astype(jnp.float32)
  if recall_switch_beta:
    weights += recall_switch_beta * batch["switch"][:, 1:].astype(jnp.float32)
  return weights


def weighted_loss(model, params, frozen, batch, recall_beta=0.0, recall_switch_beta=0.0):
  """`-Σ w_t log p(x_{t+1} | x_≤t) / Σ w_t` over the batch (FS Eq. 13; the plain mean when β = 0)."""
  tokens = batch["tokens"]
  logits = model.apply({"params": params, **frozen}, tokens[:, :-1])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  weights = loss_weights(batch, recall_beta, recall_switch_beta)
  return jnp.sum(weights * nll) / jnp.sum(weights)


def zha_kl_loss(model, params, frozen, batch):
  """ZHA III-B: the per-level KL every layer sowed (its model runs with `attention.zha.distill`), summed over levels
  and averaged over layers. Returns `(loss, {"kl_level_ℓ": mean over layers})`."""
  _, state = model.apply({"params": params, **frozen}, batch["tokens"][:, :-1], mutable=["intermediates"])
  levels = model.config.attention.zha.levels
  per_layer = jnp.concatenate([x.reshape(-1, levels) for x in jax.tree_util.tree_leaves(state["intermediates"])])
  per_level = jnp.mean(per_layer, axis=0)
  return jnp.sum(per_level), {f"kl_level_{i + 1}": per_level[i] for i in range(levels)}


@dataclasses.dataclass(frozen=True)
class Objective:
  """One `train.objective`.

  Attributes:
    name: the `train.objective` value.
    loss: `(model, train_config)` → `(params, frozen, batch) -> (loss, {metric name: value})`; `model` is built
      from `model_config`'s result.
    model_config: `model_config` → the config of the model the loss runs.
    trainable: None (every parameter trains), or `params` → a pytree of bools like it, True where the optimizer
      updates.
    parent_params: `(config, parent_config, abstract_params, where)` → the part of this run's abstract params a
      `train.init_from` parent must hold (the rest keeps its fresh initialisation); raises ConfigError for a parent
      the objective cannot start from (`where` names the parent checkpoint).
    metric_names: `model_config` → the names of the loss's extra metrics, in logging order.
  """

  name: str
  loss: Callable
  model_config: Callable = lambda model_config: model_config
  trainable: Callable | None = None
  parent_params: Callable = lambda config, parent_config, abstract_params, where: abstract_params
  metric_names: Callable = lambda model_config: ()


def _lm_loss(model, train):
  return lambda params, frozen, batch: (
    weighted_loss(model, params, frozen, batch, train.recall_beta, train.recall_switch_beta),
    {},
  )


def _zha_kl_loss(model, train):
  del train
  return lambda params, frozen, batch: zha_kl_loss(model, params, frozen, batch)


def _distilling(model_config):
  """The model with each ZHA layer running its frozen dense attention and sowing its KL."""
  att = model_config.attention
  return dataclasses.replace(
    model_config, attention=dataclasses.replace(att, zha=dataclasses.replace(att.zha, distill=True))
  )


def ref_queries_only(params):
  """True for ZHA's reference queries, False for every other parameter (ZHA III-B freezes the backbone)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: any(getattr(p, "key", None) == "ref_queries" for p in path), params
  )


def _zha_parent_params(config, parent_config, abstract_params, where):
  """A ZHA parent holds every array; a TF++ parent (the ZHA III-B conversion) all but the reference queries."""
  del config
  parent_kind = parent_config.model.attention.kind
  if parent_kind == "zha":
    return abstract_params
  if parent_kind != "tfpp":
    raise ConfigError(
      f"train.init_from: a ZHA model converts a TF++ checkpoint (ZHA III-B), but {where} holds a {parent_kind!r} model"
    )
  flat = flax.traverse_util.flatten_dict(abstract_params)
  return flax.traverse_util.unflatten_dict({k: v for k, v in flat.items() if "ref_queries" not in k})


def _lm_parent_params(config, parent_config, abstract_params, where):
  """The arrays of this run that the parent's own architecture defines: those of a FreeSolo kind that a dense
  parent lacks (FS's branch mix α when a TF++ or imported model is continued as FS) start fresh; everything
  else must be in the parent, with this run's shapes."""
  del config, where
  parent = jax.eval_shape(lambda: init_variables(parent_config.model, jax.random.PRNGKey(0)))["params"]
  defined = set(flax.traverse_util.flatten_dict(parent))
  flat = flax.traverse_util.flatten_dict(abstract_params)
  return flax.traverse_util.unflatten_dict({k: v for k, v in flat.items() if k in defined})


def _kl_levels(model_config):
  return tuple(f"kl_level_{i + 1}" for i in range(model_config.attention.zha.levels))


OBJECTIVES = {
  # Next-token loss with FS Eq. 13's recall weights; every parameter trains.
  "lm": Objective(name="lm", loss=_lm_loss, parent_params=_lm_parent_params),
  # ZHA III-B: the backbone frozen and run dense, only the reference queries train, on the per-level KL.
  "zha_kl": Objective(
    name="zha_kl",
    loss=_zha_kl_loss,
    model_config=_distilling,
    trainable=ref_queries_only,
    parent_params=_zha_parent_params,
    metric_names=_kl_levels,
  ),
}


def get(name):
  """The `Objective` of `train.objective` `name`."""
  return OBJECTIVES[name]
