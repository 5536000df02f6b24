"""Smoke run (until `train.py` lands): a tiny FS model takes a few AdamW steps on one batch on CPU.

    python -m fsjax.smoke [--kind fs|fsl|tfpp|swa|moba] [--steps N] [--seq-len T]

Prints the parameter count and the loss per step, and exits non-zero unless the loss fell.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import optax

from fsjax.config import ATTENTION_KINDS, model_preset
from fsjax.model import Transformer, init_variables, param_counts


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--kind", default="fs", choices=[k for k in ATTENTION_KINDS if k != "fsb"])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--batch", type=int, default=2)
  args = parser.parse_args(argv)

  config = model_preset("tiny", kind=args.kind)
  print(f"fsjax smoke run (a forward/backward check, not training): tiny {args.kind} model, "
        f"{param_counts(config)['total']:,} parameters, JAX {jax.__version__} on {jax.default_backend()}")
  model = Transformer(config)
  rng_init, rng_data = jax.random.split(jax.random.PRNGKey(0))
  variables = init_variables(config, rng_init, args.seq_len)
  params, frozen = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  tokens = jax.random.randint(rng_data, (args.batch, args.seq_len + 1), 0, config.vocab_size)
  optimizer = optax.adamw(3e-3, weight_decay=0.1)

  @jax.jit
  def step(params, opt_state):
    def loss_fn(params):
      logits = model.apply({"params": params, **frozen}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  start = time.perf_counter()
  for i in range(args.steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
    if i % 5 == 0 or i == args.steps - 1:
      print(f"step {i:3d}  loss {losses[-1]:.4f}")
  print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s (first includes compile); "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
  sys.exit(main())
