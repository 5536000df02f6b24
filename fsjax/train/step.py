"""The train state and the train and eval steps; the losses they differentiate are in `fsjax.train.objectives`."""

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
  return TrainState(
    step=zero, params=params, frozen=frozen, opt_state=optimizer.init(params), bad_steps=zero, skipped=zero
  )


def make_train_step(loss_fn, optimizer, schedule):
  """`(state, batch) -> (state, metrics)` for `loss_fn(params, frozen, batch) -> (loss, extra metrics)` (an
  objective's loss, `fsjax.train.objectives`); a non-finite loss or gradient skips the update and is counted."""

  def train_step(state, batch):
    (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.frozen, batch)
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
      skipped=state.skipped + jnp.where(finite, 0, 1),
    )
    metrics = dict(loss=loss, grad_norm=grad_norm, learning_rate=schedule(state.step), finite=finite, **extra)
    return new_state, metrics

  return train_step


def make_eval_step(model):
  """`(params, frozen, tokens [B, T+1], loss_mask [B, T+1] or None) -> (sum of NLL, targets counted)` for held-out
  perplexity: every target, or those `loss_mask` marks (the answers of associative-recall rows)."""

  def eval_step(params, frozen, tokens, loss_mask=None):
    logits = model.apply({"params": params, **frozen}, tokens[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    if loss_mask is None:
      return jnp.sum(nll), nll.size
    weights = loss_mask[:, 1:].astype(nll.dtype)
    return jnp.sum(weights * nll), jnp.sum(weights)

  return eval_step
