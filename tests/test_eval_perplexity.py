"""Loss by position (fsjax.eval.perplexity)."""

import jax
import numpy as np

from fsjax.config import MeshConfig
from fsjax.data.pipeline import default_corpus_path, make_eval_batches
from fsjax.eval import perplexity
from fsjax.model import Transformer
from fsjax.train import checkpoint, loop, sharding


def test_buckets_split_positions_evenly_and_average():
  losses = np.arange(10, dtype=float)
  assert perplexity.buckets(losses, 3) == [(0, 2, 1.0), (3, 6, 4.5), (7, 9, 8.0)]


def test_position_losses_average_to_the_training_loops_held_out_loss(micro_workdir):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  batches = make_eval_batches(path=default_corpus_path("valid"), tokenizer_path=config.data.tokenizer,
                              seq_len=96, batch_size=2, max_batches=2)
  model = Transformer(config.model)
  losses = perplexity.position_losses(model, {"params": params, **frozen}, batches)
  assert losses.shape == (96,) and np.all(np.isfinite(losses))
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  expected = loop.evaluate(model, params, frozen, batches, mesh)["loss"]
  np.testing.assert_allclose(losses.mean(), expected, rtol=1e-5)


def test_cli_prints_a_table_per_bucket_and_writes_csv(micro_workdir, tmp_path, capsys):
  out = tmp_path / "ppl.csv"
  assert perplexity.main(["--checkpoint", str(micro_workdir), "--length", "128", "--buckets", "4", "--batches", "1",
                          "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert printed.count(f"| {micro_workdir.name}@2 |") == 4 and "| 96-127 |" in printed
  assert len(out.read_text().splitlines()) == 5
  assert perplexity.main(["--checkpoint", str(micro_workdir), "--length", "4", "--buckets", "8"]) == 2
