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
  assert tokenizer.decode(ids[first:last + 1]).strip() == "4815162"


def test_probe_records_causal_selections_and_retention(micro_workdir):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  variables, tokenizer = {"params": params, **frozen}, load_tokenizer(config.data.tokenizer)
  att = config.model.attention
  for kind in ("fs", "fsl"):
    model_config = dataclasses.replace(config.model, attention=dataclasses.replace(att, kind=kind))
    summary, distance = probe.probe(Transformer(model_config), variables, tokenizer, task="niah_single_1",
                                    length=384, seed=3, chunk=64)
    assert distance.shape == (summary["length"], model_config.num_layers, model_config.num_heads, att.top_k)
    read = distance[np.isfinite(distance)]
    assert read.size and read.min() >= att.cell / 2  # only complete cells before the query's block
    assert np.all(np.isnan(distance[:att.block]))  # the first block reads nothing
    eta = np.asarray(summary["eta_per_layer_head"])
    if kind == "fs":
      np.testing.assert_array_equal(eta, 1.0)
      assert summary["needle_retained_rate"] == 1.0
    else:
      eligible = ((summary["length"] - 1) // att.block) * (att.block // att.cell)
      assert np.all(eta <= (att.retain_top + att.retain_recent) / eligible)
    assert 0.0 <= summary["needle_selected_rate"] <= 1.0


def test_cli_writes_numbers_and_plots(micro_workdir, tmp_path, capsys):
  assert probe.main(["--checkpoint", str(micro_workdir), "--length", "384", "--task", "niah_single_1",
                     "--out", str(tmp_path)]) == 0
  assert json.loads((tmp_path / "probe.json").read_text())["task"] == "niah_single_1"
  assert (tmp_path / "distances.png").stat().st_size > 0 and (tmp_path / "heatmap.png").stat().st_size > 0
  assert "| layer | η per head" in capsys.readouterr().out


def test_a_dense_model_is_refused_with_a_clear_error(micro_workdir):
  config, params, frozen, _ = checkpoint.load(micro_workdir)
  dense = dataclasses.replace(config.model, attention=dataclasses.replace(config.model.attention, kind="tfpp"))
  with pytest.raises(ConfigError, match="routing probes need a FreeSolo model"):
    probe.probe(Transformer(dense), {"params": params}, load_tokenizer(), task="niah_single_1", length=384, seed=0)
