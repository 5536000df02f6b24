"""Loss by position (fsjax.eval.perplexity)."""

import dataclasses

import jax
import numpy as np

from fsjax.config import MeshConfig, model_preset
from fsjax.data.pipeline import default_corpus_path, make_eval_batches
from fsjax.eval import perplexity
from fsjax.model import Transformer
from fsjax.train import checkpoint, loop, sharding

from helpers import jitted_init


def test_buckets_split_positions_evenly_and_average():
  losses = np.arange(10, dtype=float)
  assert perplexity.buckets(losses, 3) == [(0, 2, 1.0), (3, 6, 4.5), (7, 9, 8.0)]


def test_position_losses_average_to_the_training_loops_held_out_loss(micro_workdir):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  batches = make_eval_batches(
    path=default_corpus_path("valid"), tokenizer_path=config.data.tokenizer, seq_len=96, batch_size=2, max_batches=2
  )
  model = Transformer(config.model)
  losses, attended = perplexity.position_losses(model, {"params": params, **frozen}, batches)
  assert losses.shape == (96,) and np.all(np.isfinite(losses)) and attended is None
  mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
  expected = loop.evaluate(model, params, frozen, [{"tokens": b} for b in batches], mesh)["loss"]
  np.testing.assert_allclose(losses.mean(), expected, rtol=1e-5)


def test_cli_prints_a_table_per_bucket_and_writes_csv(micro_workdir, tmp_path, capsys):
  out = tmp_path / "ppl.csv"
  assert (
    perplexity.main(
      ["--checkpoint", str(micro_workdir), "--length", "128", "--buckets", "4", "--batches", "1", "--out", str(out)]
    )
    == 0
  )
  printed = capsys.readouterr().out
  assert printed.count(f"| {micro_workdir.name}@2 |") == 4 and "| 96-127 |" in printed
  assert len(out.read_text().splitlines()) == 5
  assert perplexity.main(["--checkpoint", str(micro_workdir), "--length", "4", "--buckets", "8"]) == 2


def test_zha_reports_the_fraction_of_keys_attended_by_position():
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (2, 129), 0, 512))
  fractions = {}
  for top_p in (1.0, 0.5):
    config = model_preset("tiny", kind="zha")
    att = config.attention
    config = dataclasses.replace(
      config, attention=dataclasses.replace(att, zha=dataclasses.replace(att.zha, chunk=4, levels=2, top_p=(top_p,)))
    )
    variables = jitted_init(config, 128)
    _, fractions[top_p] = perplexity.position_losses(Transformer(config), variables, [tokens])
  np.testing.assert_allclose(fractions[1.0], 1.0)  # p = 1 reads every visible key (ZHA III-C)
  assert fractions[0.5].shape == (128,) and np.all(fractions[0.5] <= 1.0)
  assert fractions[0.5][-32:].mean() < 0.9  # far from the start, routing skips keys
