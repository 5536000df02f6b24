"""The train state, the objectives (recall-weighted LM loss, ZHA KL distillation) and the train and eval steps."""

import flax.struct
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
  """Everything a step changes, as one pytree.

  Attributes:
    step: optimizer steps taken (skipped non-finite steps count as taken).
    params: trainable parameters (fp32 master copy).
    frozen: other variable collections (e.g. FreeSolo's "routing" λ, σ), carried unchanged.
    opt_state: optax state.
    bad_steps: consecutive non-finite steps so far (reset by a good one).
    skipped: total non-finite steps skipped.
  """
  step: jax.Array
  params: dict
  frozen: dict
  opt_state: optax.OptState
  bad_steps: jax.Array
  skipped: jax.Array


def create_state(variables, optimizer):
  """A step-0 state from `model.init` variables."""
  params = variables["params"]
  frozen = {name: col for name, col in variables.items() if name != "params"}
  zero = jnp.zeros((), jnp.int32)
  return TrainState(step=zero, params=params, frozen=frozen, opt_state=optimizer.init(params), bad_steps=zero,
                    skipped=zero)


def loss_weights(batch, recall_beta, recall_switch_beta):
  """FS Eq. 13 weights `w_t = 1 + β f_t + β_sw χ_t` of each target `tokens[:, 1:]`; all ones when β = 0.

  Args:
    batch: dict with `tokens` `[B, T+1]` and, when β > 0, `recall` and `switch` `[B, T+1]` masks aligned
      with `tokens` (the weight of predicting token t+1 is its own mask value).

  Returns:
    `[B, T]` float32.
  """
  shape = batch["tokens"][:, 1:].shape
  weights = jnp.ones(shape, jnp.float32)
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


def zha_kl_objective(model, params, frozen, batch):
  """ZHA III-B: the per-level KL every layer sowed (its model runs with `zha_distill`), summed over levels and
  averaged over layers. Returns `(loss, {"kl_level_ℓ": mean over layers})`."""
  _, state = model.apply({"params": params, **frozen}, batch["tokens"][:, :-1], mutable=["intermediates"])
  levels = model.config.attention.zha_levels
  per_layer = jnp.concatenate([x.reshape(-1, levels) for x in jax.tree_util.tree_leaves(state["intermediates"])])
  per_level = jnp.mean(per_layer, axis=0)
  return jnp.sum(per_level), {f"kl_level_{i + 1}": per_level[i] for i in range(levels)}


def make_objective(model, train):
  """`(params, frozen, batch) -> (loss, extra metrics)` for `train.objective` (a `TrainConfig`)."""
  if train.objective == "zha_kl":
    return lambda params, frozen, batch: zha_kl_objective(model, params, frozen, batch)
  return lambda params, frozen, batch: (weighted_loss(model, params, frozen, batch, train.recall_beta,
                                                      train.recall_switch_beta), {})


def make_train_step(objective, optimizer, schedule):
  """`(state, batch) -> (state, metrics)` for an objective of `make_objective`; a non-finite loss or gradient
  skips the update and is counted."""

  def train_step(state, batch):
    (loss, extra), grads = jax.value_and_grad(objective, has_aux=True)(state.params, state.frozen, batch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(
        step=state.step + 1,
        params=keep(new_params, state.params),
        opt_state=keep(new_opt_state, state.opt_state),
        bad_steps=jnp.where(finite, 0, state.bad_steps + 1),
        skipped=state.skipped + jnp.where(finite, 0, 1))
    metrics = dict(loss=loss, grad_norm=grad_norm, learning_rate=schedule(state.step), finite=finite, **extra)
    return new_state, metrics

  return train_step


def make_eval_step(model):
  """`(params, frozen, tokens [B, T+1]) -> (sum of NLL, token count)` for held-out perplexity."""

  def eval_step(params, frozen, tokens):
    logits = model.apply({"params": params, **frozen}, tokens[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(nll), nll.size

  return eval_step
