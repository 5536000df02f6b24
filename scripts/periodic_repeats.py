"""Can a config's model learn to copy? Trains it on rows of random ids that repeat with one period (half the row)
and prints the loss and the greedy accuracy on the repeat (docs/results.md, run 4, part 2).

    python scripts/periodic_repeats.py [--config configs/repro/repro_tfpp.yaml] [--ids 512] [--batch-size 16]
        [--set train.steps=600 --set train.warmup_steps=50 --set model.attention.impl=reference ...]

One period means a head attending exactly one period back solves the task, so success here shows that the
model, its attention path and the optimizer can learn an attention pattern that copies, not that the model has
content-based induction (train with `data.source: random` for that). The optimizer and schedule are the config's
(`fsjax.train.optim.make_optimizer`); fresh rows every step from a fixed seed.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsjax import cli
from fsjax.config import load_config
from fsjax.model import Transformer
from fsjax.train.optim import make_optimizer


def main():
  parser = cli.parser(__doc__)
  parser.add_argument("--config", default="configs/repro/repro_tfpp.yaml")
  cli.add_set_argument(parser, "config overrides, e.g. --set train.steps=100 data.seq_len=512")
  parser.add_argument("--ids", type=int, default=512, help="rows draw ids from [0, ids)")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--every", type=int, default=50, help="print every this many steps")
  args = parser.parse_args()
  config = load_config(args.config, args.set)
  if not 0 < args.ids <= config.model.vocab_size:
    raise SystemExit(f"--ids must be in [1, vocab_size={config.model.vocab_size}], got {args.ids}")
  model = Transformer(config.model)
  period = config.data.seq_len // 2
  params = jax.jit(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64), jnp.int32))["params"])()
  optimizer = make_optimizer(config.train)
  opt_state = optimizer.init(params)

  def loss_fn(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    return nll.mean(), (logits.argmax(-1) == tokens[:, 1:])[:, period:].mean()  # targets inside the repeat

  @jax.jit
  def step(params, opt_state, tokens):
    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, accuracy

  rng = np.random.default_rng(0)
  start = time.time()
  for i in range(config.train.steps + 1):
    ids = rng.integers(0, args.ids, (args.batch_size, period))
    tokens = jnp.asarray(np.concatenate([ids, ids, ids[:, :1]], axis=1), jnp.int32)
    params, opt_state, loss, accuracy = step(params, opt_state, tokens)
    if i % args.every == 0:
      print(
        f"step {i} loss {float(loss):.3f} repeat-accuracy {float(accuracy):.3f} {time.time() - start:.0f}s", flush=True
      )


if __name__ == "__main__":
  main()
