"""Routing probes (fsjax.eval.probe) on the micro FS checkpoint."""

import dataclasses
import json

import numpy as np
import pytest

from fsjax.config import ConfigError
from fsjax.data.tokenizer import load_tokenizer
from fsjax.eval import probe
from fsjax.model import Transformer
from fsjax.train import checkpoint


def test_needle_span_covers_exactly_the_value_tokens():
  tokenizer = load_tokenizer()
  text = "Some text. One of the special magic numbers for calm-lake is: 4815162. More text."
  first, last = probe.needle_token_span(tokenizer, text, "4815162")
  ids = tokenizer.encode(text, add_special_tokens=False).ids
  assert tokenizer.decode(ids[first : last + 1]).strip() == "4815162"


def test_probe_records_causal_selections_and_retention(micro_workdir):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  variables, tokenizer = {"params": params, **frozen}, load_tokenizer(config.data.tokenizer)
  att = config.model.attention
  for kind in ("fs", "fsl"):
    model_config = dataclasses.replace(config.model, attention=dataclasses.replace(att, kind=kind))
    summary, distance = probe.probe(
      Transformer(model_config), variables, tokenizer, task="niah_single_1", length=384, seed=3, chunk=64
    )
    assert distance.shape == (summary["length"], model_config.num_layers, model_config.num_heads, att.top_k)
    read = distance[np.isfinite(distance)]
    assert read.size and read.min() >= att.cell / 2  # only complete cells before the query's block
    assert np.all(np.isnan(distance[: att.block]))  # the first block reads nothing
    eta = np.asarray(summary["eta_per_layer_head"])
    if kind == "fs":
      np.testing.assert_array_equal(eta, 1.0)
      assert summary["needle_retained_rate"] == 1.0
    else:
      eligible = ((summary["length"] - 1) // att.block) * (att.block // att.cell)
      assert np.all(eta <= (att.retain_top + att.retain_recent) / eligible)
    assert 0.0 <= summary["needle_selected_rate"] <= 1.0


def test_cli_writes_numbers_and_plots(micro_workdir, tmp_path, capsys):
  assert (
    probe.main(
      ["--checkpoint", str(micro_workdir), "--length", "384", "--task", "niah_single_1", "--out", str(tmp_path)]
    )
    == 0
  )
  assert json.loads((tmp_path / "probe.json").read_text())["task"] == "niah_single_1"
  assert (tmp_path / "distances.png").stat().st_size > 0 and (tmp_path / "heatmap.png").stat().st_size > 0
  assert "| layer | η per head" in capsys.readouterr().out


def test_a_dense_model_is_refused_with_a_clear_error(micro_workdir):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  dense = dataclasses.replace(config.model, attention=dataclasses.replace(config.model.attention, kind="tfpp"))
  with pytest.raises(ConfigError, match="routing probes need a FreeSolo model"):
    probe.probe(Transformer(dense), {"params": params}, load_tokenizer(), task="niah_single_1", length=384, seed=0)


def test_copy_target_hits_match_a_loop():
  rng = np.random.default_rng(7)
  n, length, layers, heads, k, span, cue, cell, block = 3, 200, 2, 3, 4, 24, 4, 8, 32
  selections = rng.integers(-1, length // cell, (n, length, layers, heads, k))
  sources = rng.integers(0, 128, n)
  for offset in (0, 13):
    hits, eligible = probe.copy_target_hits(
      selections, sources, span=span, cue=cue, cell=cell, block=block, offset=offset
    )
    assert hits.shape == (n, span - cue, layers, heads) and eligible.shape == (n, span - cue)
    for i in range(n):
      for j, t in enumerate(range(cue - 1, span - 1)):
        query = length - span + t
        target = (sources[i] + t + 1 + offset) // cell
        assert eligible[i, j] == (target < (query // block) * (block // cell))
        for layer in range(layers):
          for head in range(heads):
            assert hits[i, j, layer, head] == (target in selections[i, query, layer, head])
    assert hits.any() and not hits.all()


def test_copy_probe_rates_and_cli(micro_workdir, tmp_path, capsys):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  att = config.model.attention
  stream = np.random.default_rng(0).integers(3, 1000, 4000).astype(np.int32)
  summary = probe.probe_copies(
    Transformer(config.model),
    {"params": params, **frozen},
    stream,
    length=192,
    count=2,
    span=16,
    cue=2,
    seed=1,
    chunk=64,
  )
  per_head = np.asarray(summary["copy_per_layer_head"])
  assert len(summary["copy_by_offset_layer"]) == len(probe.OFFSET_CELLS)
  assert all(len(rates) == config.model.num_layers for rates in summary["copy_by_offset_layer"] if rates)
  assert summary["copy_by_offset_layer"][probe.OFFSET_CELLS.index(0)] == per_head.mean(axis=1).round(4).tolist()
  assert per_head.shape == (config.model.num_layers, config.model.num_heads)
  assert 0.0 <= per_head.min() and per_head.max() <= 1.0
  assert 0.0 < summary["chance_rate"] <= 1.0 and summary["target_retained_rate"] == 1.0  # FS keeps every cell
  assert summary["retained_chance_rate"] == 1.0
  fsl = dataclasses.replace(config.model, attention=dataclasses.replace(att, kind="fsl"))
  pruned = probe.probe_copies(
    Transformer(fsl), {"params": params, **frozen}, stream, length=192, count=2, span=16, cue=2, seed=1, chunk=64
  )
  eligible = (190 // att.block) * (att.block // att.cell)  # 20 cells, of which the pool keeps P to P + W
  assert att.retain_top / eligible <= pruned["retained_chance_rate"] <= (att.retain_top + att.retain_recent) / eligible
  assert 0.0 <= pruned["target_retained_rate"] < 1.0
  assert summary["target_eligible_rate"] == 1.0  # targets end by position 142, eligible from query 160 on
  assert summary["chance_rate"] == pytest.approx(att.top_k / ((190 // att.block) * (att.block // att.cell)))
  assert (
    probe.main(
      ["--checkpoint", str(micro_workdir), "--length", "176", "--copies", "1", "--span", "24", "--out", str(tmp_path)]
    )
    == 0
  )
  assert json.loads((tmp_path / "copies.json").read_text())["samples"] == 1
  assert "target cell selected, copy / control" in capsys.readouterr().out
  assert probe.main(["--checkpoint", str(micro_workdir), "--length", "100", "--copies", "1"]) == 2
  assert "--length: 100 is below 176" in capsys.readouterr().err
  assert (
    probe.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--length",
        "176",
        "--copies",
        "1",
        "--random-ids",
        "3,99",
        "--out",
        str(tmp_path / "ids"),
      ]
    )
    == 0
  )
  assert json.loads((tmp_path / "ids" / "copies.json").read_text())["samples"] == 1
  assert (
    probe.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--length",
        "176",
        "--copies",
        "1",
        "--needle-ids",
        "3,99",
        "--out",
        str(tmp_path / "needles"),
      ]
    )
    == 0
  )
  assert "target cell selected, copy / control" in capsys.readouterr().out
  for bad, message in (
    (["--random-ids", "3,99"], "--random-ids needs --copies"),
    (["--needle-ids", "3,99"], "--needle-ids needs --copies"),
    (["--copies", "1", "--random-ids", "3,99", "--data", "x.txt"], "--random-ids and --data"),
    (["--copies", "1", "--random-ids", "3,100000"], "below the model's vocab_size"),
  ):
    capsys.readouterr()
    assert probe.main(["--checkpoint", str(micro_workdir), "--length", "176", *bad]) == 2
    assert message in capsys.readouterr().err
