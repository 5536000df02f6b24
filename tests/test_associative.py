"""Multi-query associative recall (`fsjax.data.associative`): rows, their config, the answers-only loss, the
held-out evaluation of a recall run, and `python -m fsjax.eval.recall` on a model that learned the task on CPU."""

import csv
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import calibrate, generate
from fsjax.cache import init_cache
from fsjax.config import AssociativeConfig, ConfigError, DataConfig, load_config
from fsjax.data.associative import (
  TEST,
  TRAIN,
  associative_row,
  held_out_batches,
  make_associative_iterator,
  recall_row,
)
from fsjax.decode import extend
from fsjax.eval import perplexity
from fsjax.eval import recall as recall_eval
from fsjax.eval.probe import availability_at
from fsjax.loading import load_model
from fsjax.model import Transformer, init_variables
from fsjax.reference import zha as zha_ref
from fsjax.train import loop
from fsjax.train.objectives import loss_weights

from helpers import stack_layers, tiny_model

TASK = dict(pairs=5, keys=(3, 35), values=(35, 67), filler_ids=(67, 256))


def _check_row(row, length, task, distance=None):
  tokens, q, p = row.tokens, row.query_positions, row.pair_positions
  assert tokens.shape == (length,) and tokens.dtype == np.int32
  keys = (tokens >= task["keys"][0]) & (tokens < task["keys"][1])
  pairs = np.setdiff1d(np.flatnonzero(keys), q)  # every pair's key position, asked or not
  assert pairs.size == task["pairs"] and len(set(tokens[pairs].tolist())) == task["pairs"]  # distinct keys
  assert np.all((row.values >= task["values"][0]) & (row.values < task["values"][1]))
  for key, value, pair, query in zip(row.keys, row.values, p, q):
    # The key occurs at its pair and at the queries that ask it, nowhere else.
    assert np.flatnonzero(tokens == key).tolist() == sorted([pair] + q[row.keys == key].tolist())
    assert tokens[pair + 1] == value and tokens[query + 1] == value
    assert pair + 1 < query
    if distance is not None:
      assert distance[0] <= query - pair <= distance[1]
  assert np.flatnonzero(row.loss_mask).tolist() == sorted((q + 1).tolist())  # the answers, nothing else
  slots = np.concatenate([pairs, pairs + 1, q, q + 1])
  assert len(set(slots.tolist())) == slots.size  # no pair or query overlaps another
  filler = np.delete(tokens, slots)
  assert np.all((filler >= task["filler_ids"][0]) & (filler < task["filler_ids"][1]))
  assert sorted(row.pair_values.tolist()) == sorted(tokens[pairs + 1].tolist())
  for j in range(q.size):  # a first ask: no earlier query asked its key
    assert row.first_asks[j] == (not np.any((q < q[j]) & (row.keys == row.keys[j])))
  if task.get("query_keys") == "each":
    assert sorted(p.tolist()) == pairs.tolist() and row.first_asks.all()  # every pair asked once


@pytest.mark.parametrize("query_keys", ["sampled", "each"])
@pytest.mark.parametrize("queries", ["end", "interleaved"])
@pytest.mark.parametrize("distance", [None, (6, 20)])
def test_rows_hold_their_pairs_and_queries_with_answers_marked(queries, distance, query_keys):
  task = dict(TASK, queries=queries, distance=distance, query_keys=query_keys)
  for index in range(20):
    row = recall_row(index, seed=3, stream=TRAIN, length=97, **task)
    _check_row(row, 97, task, distance)
    if queries == "end":
      assert sorted(row.query_positions.tolist()) == list(range(97 - 10, 97, 2))


def test_more_queries_than_pairs_fill_the_end_of_the_row():
  """Sampled keys allow more queries than pairs: more answers per row to learn binding from."""
  task = dict(TASK, query_count=12)
  for index in range(20):
    row = recall_row(index, seed=1, stream=TRAIN, length=97, **task)
    _check_row(row, 97, task)
    assert row.query_positions.tolist() == list(range(97 - 24, 97, 2)) and row.loss_mask.sum() == 12
  with pytest.raises(ValueError, match="12 queries of 5 pairs need sampled query keys at the end"):
    recall_row(0, seed=0, stream=TRAIN, length=97, **dict(task, query_keys="each"))
  with pytest.raises(ConfigError, match="cannot hold data.associative.pairs=5 pairs and 40 queries"):
    AssociativeConfig(pairs=5, query_count=40).check_length(89, "data.seq_len + 1")


def _eliminate(row):
  """The answers of a model that does not bind keys to values: each query answered with a value of the row that
  no earlier query has answered (the first such, in the pairs' order), seeing the earlier answers as a row shows
  them."""
  keys = (row.tokens >= TASK["keys"][0]) & (row.tokens < TASK["keys"][1])
  values = row.tokens[np.setdiff1d(np.flatnonzero(keys), row.query_positions) + 1]
  answers, given = np.zeros(len(row.query_positions), np.int64), []
  for j in np.argsort(row.query_positions):
    left = [v for v in values if v not in given] or list(values)
    answers[j] = left[0]
    given.append(row.values[j])
  return answers


def test_sampled_query_keys_cannot_be_answered_by_elimination():
  """With every pair asked once, the earlier answers give the later ones away (the last query always, H(5)/5 =
  46% of all for 5 pairs); with sampled keys elimination scores 1/pairs, what copying any value of the row scores."""
  rate = {}
  for query_keys in ("each", "sampled"):
    rows = [recall_row(i, seed=0, stream=TEST, length=64, **dict(TASK, query_keys=query_keys)) for i in range(400)]
    rate[query_keys] = np.mean([_eliminate(r) == r.values for r in rows])
  assert rate["each"] > 0.42 and rate["sampled"] < 0.25, rate
  repeated = [recall_row(i, seed=0, stream=TEST, length=64, **TASK).keys for i in range(50)]
  assert any(len(set(k.tolist())) < TASK["pairs"] for k in repeated)  # keys drawn with replacement


def test_rows_are_pure_functions_of_seed_stream_and_index():
  same = [recall_row(7, seed=1, stream=TRAIN, length=64, **TASK) for _ in range(2)]
  np.testing.assert_array_equal(same[0].tokens, same[1].tokens)
  test = recall_row(7, seed=1, stream=TEST, length=64, **TASK)
  other_seed = recall_row(7, seed=2, stream=TRAIN, length=64, **TASK)
  assert not np.array_equal(test.tokens, same[0].tokens) and not np.array_equal(other_seed.tokens, same[0].tokens)
  # No test row of a seed is a training row of it: the streams are different generators.
  train_rows = {recall_row(i, seed=1, stream=TRAIN, length=64, **TASK).tokens.tobytes() for i in range(200)}
  assert not train_rows & {recall_row(i, seed=1, stream=TEST, length=64, **TASK).tokens.tobytes() for i in range(200)}


def test_text_filler_is_a_window_of_the_text_without_the_rows_keys():
  text = np.random.default_rng(0).integers(3, 300, 5000).astype(np.int32)  # holds key ids too
  task = dict(TASK, filler_ids=(67, 300))
  row = recall_row(4, seed=0, stream=TRAIN, length=200, filler_tokens=text, **task)
  slots = np.concatenate([row.pair_positions + d for d in (0, 1)] + [row.query_positions + d for d in (0, 1)])
  for key in row.keys:
    assert np.flatnonzero(row.tokens == key).size == 1 + np.sum(row.keys == key)
  kept = np.delete(np.arange(200), slots)
  windows = np.lib.stride_tricks.sliding_window_view(text, 200)
  agreement = (windows[:, kept] == row.tokens[kept]).mean(axis=1)
  assert agreement.max() > 0.9  # the filler is one window of the text, a few key ids replaced


def test_rows_that_cannot_be_placed_are_one_clear_error():
  with pytest.raises(ValueError, match="could not place 5 pairs"):
    recall_row(0, seed=0, stream=TRAIN, length=64, **dict(TASK, distance=(100, 200)))
  with pytest.raises(ValueError, match="text filler of 50 tokens is shorter than a row of 64"):
    recall_row(0, seed=0, stream=TRAIN, length=64, filler_tokens=np.arange(50), **TASK)


def test_queries_at_the_end_fit_whenever_the_row_holds_four_tokens_a_pair():
  """With queries at the end and no distance bound, the pairs are placed in one draw that cannot fail."""
  for index in range(200):
    _check_row(recall_row(index, seed=0, stream=TRAIN, length=20, **TASK), 20, TASK)


def test_the_iterator_yields_answer_masks_and_resumes():
  make = lambda: make_associative_iterator(seq_len=63, batch_size=4, seed=5, task=TASK)
  data = make()
  first = next(data)
  assert first["tokens"].shape == (4, 64) and first["loss_mask"].shape == (4, 64)
  assert first["loss_mask"].sum() == 4 * TASK["pairs"]
  np.testing.assert_array_equal(
    first["tokens"][1], associative_row(1, seed=5, stream=TRAIN, length=64, **TASK)["tokens"]
  )
  state = json.loads(json.dumps(data.get_state()))
  expected = next(data)
  resumed = make()
  resumed.set_state(state)
  np.testing.assert_array_equal(next(resumed)["tokens"], expected["tokens"])


def test_the_loss_counts_only_the_answers():
  tokens = np.arange(12).reshape(2, 6)
  mask = np.zeros((2, 6), bool)
  mask[0, 3] = mask[1, 5] = True
  weights = np.asarray(loss_weights({"tokens": tokens, "loss_mask": mask}, 0.0, 0.0))
  np.testing.assert_array_equal(weights, mask[:, 1:].astype(np.float32))


@pytest.mark.parametrize(
  "fields,message",
  [
    (dict(keys=(3, 40), values=(35, 67)), "keys .* and values .* must not overlap"),
    (dict(values=(35, 300)), "values .* and filler_ids .* must not overlap"),
    (dict(pairs=40), "keys holds 32 ids, fewer than pairs=40"),
    (dict(distance=(1, 5)), "distance must be"),
    (dict(queries="middle"), "queries must be one of"),
    (dict(filler="noise"), "filler must be one of"),
    (dict(query_keys="all"), "query_keys must be one of"),
    (dict(query_count=12, queries="interleaved"), r"query_count \(12\) other than pairs \(8\) needs query_keys"),
    (dict(query_count=0), "query_count must be"),
  ],
)
def test_bad_tasks_are_one_line_naming_the_field(fields, message):
  with pytest.raises(ConfigError, match=message):
    AssociativeConfig(**{**dict(keys=(3, 35), values=(35, 67), filler_ids=(67, 256)), **fields})


def test_recall_data_config_rules():
  with pytest.raises(ConfigError, match="cannot hold data.associative.pairs=20"):
    DataConfig(source="associative", seq_len=63, associative=AssociativeConfig(pairs=20))
  with pytest.raises(ConfigError, match="its rows are recall tasks only"):
    DataConfig(source="associative", seq_len=64, copy_rate=0.01)
  with pytest.raises(ConfigError, match=r"distance max \(8\) must be >= 2 \* pairs = 16"):
    DataConfig(source="associative", seq_len=64, associative=AssociativeConfig(distance=(2, 8)))
  with pytest.raises(ConfigError, match=r"data.associative at data.seq_len \+ 1 = 65: could not place 8 pairs"):
    DataConfig(source="associative", seq_len=64, associative=AssociativeConfig(distance=(60, 70)))
  with pytest.raises(ConfigError, match="eval.niah_samples must be 0 with data.source associative"):
    load_config(RECALL_CONFIG, ["eval.niah_samples=4"])
  with pytest.raises(ConfigError, match="data.associative id ranges must lie below model.vocab_size=256"):
    load_config(RECALL_CONFIG, ["data.associative.filler_ids=[67,512]"])


RECALL_CONFIG = "tests/micro_recall.yaml"


@pytest.fixture(scope="module")
def recall_workdir(tmp_path_factory):
  """The micro recall config trained until it binds values to keys (about a minute on 2 cores)."""
  path = tmp_path_factory.mktemp("recall_run")
  summary = loop.train(load_config(RECALL_CONFIG, ["checkpoint.async_save=false"]), str(path))
  return path, summary


def test_a_small_model_learns_recall_and_is_scored_on_test_rows(recall_workdir):
  path, summary = recall_workdir
  assert summary["heldout_loss"] < 0.5 * np.log(32)  # answers-only loss on test-stream rows; chance is ln 32
  rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
  assert rows[-1]["step"] == 400


def test_the_recall_cli_answers_through_prefill_as_a_full_forward_pass_does(recall_workdir, tmp_path, capsys):
  path, _ = recall_workdir
  out = tmp_path / "recall"
  assert (
    recall_eval.main(
      ["--checkpoint", str(path), "--lengths", "64,160", "--samples", "24", "--batch-size", "8", "--out", str(out)]
    )
    == 0
  )
  table = capsys.readouterr().out
  assert "| model | train length | length | pairs | accuracy | a value of its row | chance |" in table
  with open(f"{out}.csv") as f:
    rows = list(csv.DictReader(f))
  overall = {int(r["length"]): float(r["accuracy"]) for r in rows if r["bucket"] == "all"}
  in_row = {int(r["length"]): float(r["in_row"]) for r in rows if r["bucket"] == "all"}
  # Binding, not copying: a model that copies some value of its row answers about in_row / 4 of 4 pairs' asks.
  assert overall[64] > max(0.8, 2 * in_row[64] / 4)
  buckets = [r for r in rows if r["bucket"] != "all" and r["length"] == "160"]
  assert (tmp_path / "recall.png").stat().st_size > 0

  # The same accuracy from the full forward pass of the training model.
  loaded = load_model(str(path))
  associative, task = recall_eval.task_for(loaded.config)
  samples = recall_eval.recall_rows(task, 160, 24, seed=0)
  logits = loaded.model.apply(loaded.variables, jnp.asarray(np.stack([r.tokens for r in samples])))
  answers = [np.argmax(np.asarray(logits)[i, r.query_positions], -1) for i, r in enumerate(samples)]
  first = np.concatenate([r.first_asks for r in samples])
  assert sum(int(r["queries"]) for r in buckets) == first.sum() <= 24 * 4 < 24 * 12  # repeated asks are not scored
  correct = np.concatenate([a == r.values for a, r in zip(answers, samples)])
  assert np.mean(correct[first]) == pytest.approx(overall[160])
  copied = np.concatenate([np.isin(a, r.pair_values) for a, r in zip(answers, samples)])
  assert np.mean(copied[first]) == pytest.approx(in_row[160])
  assert in_row[160] >= overall[160]


def test_the_recall_cli_scores_a_kind_without_routing_unprobed(recall_workdir, tmp_path, capsys):
  """`--probe` over several checkpoints (e.g. `runs/recall_*`) probes the kinds that route and scores the rest."""
  path, _ = recall_workdir
  out = tmp_path / "recall"
  args = ["--checkpoint", str(path), "--lengths", "64", "--samples", "2", "--batch-size", "2", "--probe"]
  assert recall_eval.main([*args, "--out", str(out)]) == 0
  assert "no routing probe for kind tfpp" in capsys.readouterr().err
  assert (tmp_path / "recall.csv").exists() and not (tmp_path / "recall_probe.json").exists()


def test_text_tools_refuse_a_recall_model_whose_vocabulary_is_smaller_than_the_tokenizer(recall_workdir, capsys):
  """A recall model of 256 ids would embed the tokenizer's other ids as NaN: every text tool says so instead."""
  path, _ = recall_workdir
  assert perplexity.main(["--checkpoint", str(path), "--length", "64"]) == 2
  assert generate.main(["--checkpoint", str(path), "--prompt", "Once upon a time"]) == 2
  err = capsys.readouterr().err
  assert err.count("reads no text: its model.vocab_size is 256, its tokenizer has 32000 ids") == 2


def test_the_recall_cli_refuses_a_checkpoint_not_trained_on_recall(micro_workdir, capsys):
  assert recall_eval.main(["--checkpoint", str(micro_workdir), "--lengths", "64"]) == 2
  assert "not associative recall" in capsys.readouterr().err
  assert recall_eval.main(["--checkpoint", str(micro_workdir), "--lengths", "64", "--distance", "1,4"]) == 2


PROBE_TASK = dict(pairs=3, keys=(3, 35), values=(35, 67), filler_ids=(67, 512))


def _probe_rows(length=200, count=2):
  return recall_eval.recall_rows(PROBE_TASK, length, count, seed=1)


def test_the_fsl_probe_retains_what_the_masked_operator_makes_available():
  """FS-L's `pool ∪ recent` when the queries begin (the bounded cache the probe reads) is the set of cells the
  masked operator leaves available at that position (FS Eq. 8, 15), so both give the same retained rate."""
  config, model, variables = tiny_model("fsl")
  rows = _probe_rows()
  summary = recall_eval.probe_rows(model, variables, rows, chunk=64)
  att = config.attention
  split = rows[0].query_positions.min() // att.block * att.block
  held = []
  for row in rows:  # the masked operator's availability, through the full archive, one row at a time
    cache = init_cache(config, 1, split, bounded=False)
    positions = jnp.arange(split, dtype=jnp.int32)[None]
    _, cache, _ = extend(model, variables, jnp.asarray(row.tokens[None, :split]), cache, positions, positions >= 0)
    available = availability_at(cache, config, split)  # [layers, heads, M]
    held.append(available[:, :, (row.pair_positions[row.first_asks] + 1) // att.cell])  # [layers, heads, asks]
  np.testing.assert_allclose(summary["retained"], np.concatenate(held, axis=-1).mean(axis=(1, 2)), atol=1e-4)
  assert 0 < summary["random_pool"] < 1


def test_the_probe_finds_every_eligible_value_when_a_query_reads_all_cells():
  """With K above the cell count an FS query selects every eligible cell (FS Eq. 6-8), so the selected rate is
  the share of values whose cell lies in a block before the query's."""
  config, _, variables = tiny_model("fs")
  model = Transformer(dataclasses.replace(config, attention=dataclasses.replace(config.attention, top_k=32)))
  rows = _probe_rows()
  summary = recall_eval.probe_rows(model, variables, rows, chunk=64)
  att = config.attention
  eligible = [
    ((row.pair_positions + 1) // att.cell + 1) * att.cell <= row.query_positions // att.block * att.block
    for row in rows
  ]
  first_asks = np.concatenate([row.first_asks for row in rows])
  assert not first_asks.all()  # a repeated ask, which the rates leave out
  rate = float(np.concatenate(eligible)[first_asks].mean())
  assert summary["selected"] == [pytest.approx(rate)] * config.num_layers
  assert "retained" not in summary
  with pytest.raises(ConfigError, match="needs an FS, FS-L, FS-B or ZHA model"):
    recall_eval.probe_rows(*tiny_model("tfpp")[1:], rows)
  interleaved = recall_eval.recall_rows(dict(PROBE_TASK, queries="interleaved"), 200, 2, seed=1)
  with pytest.raises(ConfigError, match="queries at the end"):
    recall_eval.probe_rows(model, variables, interleaved)


def _zha_with_qk_norm_and_partial_rope():
  """The tiny ZHA model with q/k RMSNorm and half the features rotated; its query gains doubled, so that routing
  the projection's queries instead of the normed ones would read other keys."""
  config, _, _ = tiny_model("zha")
  config = dataclasses.replace(config, qk_norm=True, attention=dataclasses.replace(config.attention, rope_fraction=0.5))
  variables = init_variables(config, jax.random.PRNGKey(0), 64)
  for i in range(config.num_layers):
    norm = variables["params"][f"layer_{i}"]["attention"]["q_norm"]
    norm["scale"] = 2 * norm["scale"]
  return config, Transformer(config), variables


def _zha_grouped():
  """The tiny ZHA model with 2 key/value heads for its 4 query heads: one tree per key/value head (ZHA III-A)."""
  config, _, _ = tiny_model("zha")
  config = dataclasses.replace(config, num_kv_heads=2)
  return config, Transformer(config), init_variables(config, jax.random.PRNGKey(0), 64)


@pytest.mark.parametrize("options", [None, "qk-norm-partial-rope", "gqa"], ids=lambda o: o or "default")
def test_the_zha_probe_reads_the_fraction_of_keys_the_full_forward_attends(options):
  """ZHA's keys read at the query keys, through the decode cache chunk by chunk, equal the attended fractions
  the training form sows over the whole row (ZHA III-C); also where queries and keys leave their projection
  through q/k RMSNorm and rotate with a partial RoPE, and where query heads share key/value heads and trees."""
  make = {None: lambda: tiny_model("zha"), "qk-norm-partial-rope": _zha_with_qk_norm_and_partial_rope}
  config, model, variables = {**make, "gqa": _zha_grouped}[options]()
  rows = _probe_rows()
  summary = recall_eval.probe_rows(model, variables, rows, chunk=64)
  tokens = jnp.asarray(np.stack([r.tokens for r in rows]))
  names = ("q_norm", "k_norm") if config.qk_norm else ("q_proj", "k_proj")
  capture = lambda module, method: module.name in names
  # One jitted forward gives the sown fractions and the captured queries and keys (op by op, this test compiled
  # some 300 small programs per case).
  _, state = jax.jit(lambda v, t: model.apply(v, t, capture_intermediates=capture, mutable=["intermediates"]))(
    variables, tokens
  )
  fraction = np.stack(
    [np.asarray(state["intermediates"][f"layer_{i}"]["attention"]["attended_fraction"][0]) for i in range(2)], axis=2
  )  # [batch, T, layers, heads]
  queries = np.stack([r.query_positions for r in rows])
  expected = np.take_along_axis(fraction, queries[:, :, None, None], axis=1).mean(axis=(0, 1, 3))
  np.testing.assert_allclose(summary["keys_read"], expected, atol=1e-4)
  assert 0 < min(summary["keys_read"]) and max(summary["keys_read"]) < 1

  # Whether a query reads its value: the training form's key sets over the whole row (tree built from every key,
  # the descent from every query) at (query key, value position).
  tree, theta = config.attention.zha.tree, config.attention.rope
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  values = np.stack([r.pair_positions + 1 for r in rows])

  @jax.jit  # every layer's shapes are the same: compiled once
  def key_mask(q, k, refs):
    q, k = (zha_ref.rotate(x, positions, theta) for x in (q, k))
    nodes = zha_ref.build_tree(k, refs, chunk=tree.chunk, levels=tree.levels, rope_theta=theta)
    scores = [zha_ref.node_scores(q, *level) for level in nodes]
    leaves = zha_ref.route(scores, positions, chunk=tree.chunk, top_p=tree.level_top_p)
    return zha_ref.key_mask(leaves, positions, positions, tree.chunk)  # [batch, heads, T, T]

  value_read = []
  for i in range(config.num_layers):
    attention = state["intermediates"][f"layer_{i}"]["attention"]
    q, k = (attention[n]["__call__"][0] for n in names)
    mask = np.asarray(key_mask(q, k, variables["params"][f"layer_{i}"]["attention"]["ref_queries"]))
    b = np.arange(len(rows))[:, None]
    first_asks = np.stack([r.first_asks for r in rows])
    value_read.append(mask[b, :, queries, values][first_asks].mean())  # [batch, Q, heads] at first asks
  np.testing.assert_allclose(summary["value_read"], value_read, atol=1e-4)
  assert 0 < min(summary["value_read"]) and max(summary["value_read"]) < 1
  if options is not None:
    return
  # A scanned model (the recall configs') with the same weights reads the same keys.
  scanned = Transformer(dataclasses.replace(config, scan_layers=True))
  stacked = recall_eval.probe_rows(scanned, stack_layers(variables, config.num_layers), rows, chunk=64)
  np.testing.assert_allclose(stacked["keys_read"], summary["keys_read"], atol=1e-4)
  np.testing.assert_allclose(stacked["value_read"], summary["value_read"], atol=1e-4)


def test_fsb_tau_of_a_recall_checkpoint_is_calibrated_on_its_own_task(tmp_path):
  fs = ["model.attention.kind=fs", "model.attention.window=32", "model.attention.cell=8", "model.attention.block=32"]
  fs += ["model.attention.top_k=2", "train.steps=2", "checkpoint.every=2", "checkpoint.async_save=false"]
  config = load_config(RECALL_CONFIG, fs)
  loop.train(config, str(tmp_path))
  assert calibrate.main(["--checkpoint", str(tmp_path), "--length", "64", "--batches", "2", "--batch-size", "4"]) == 0
  saved = json.loads((tmp_path / "calibration.json").read_text())
  loaded = load_model(str(tmp_path))
  rows = held_out_batches(task=config.data.associative.task(), length=65, batch_size=4, batches=2, seed=0)
  expected = calibrate.calibrate(loaded.model, loaded.variables, [b["tokens"][:, :-1] for b in rows])
  np.testing.assert_allclose(saved["tau"], expected, rtol=1e-6)
  # Text has ids past this model's 256: refused, not a NaN τ.
  text = tmp_path / "text.txt"
  text.write_text("Some held-out text. " * 200)
  assert calibrate.main(["--checkpoint", str(tmp_path), "--length", "64", "--data", str(text)]) == 2


def test_filler_loss_marks_the_text_and_the_answers_and_held_out_rows_mark_answers_only():
  text = np.random.default_rng(0).integers(3, 300, 5000).astype(np.int32)
  task = dict(TASK, filler_ids=(67, 300), filler_loss=True, query_keys="each")  # every pair's position known
  row = recall_row(2, seed=0, stream=TRAIN, length=120, filler_tokens=text, **task)
  p, q = row.pair_positions, row.query_positions
  own = np.concatenate([p, p + 1, q])  # what the row cannot predict: the pairs, the query keys
  expected = np.ones(120, bool)
  expected[own] = False
  expected[0] = False
  expected[q + 1] = True
  np.testing.assert_array_equal(row.loss_mask, expected)
  plain = recall_row(2, seed=0, stream=TRAIN, length=120, filler_tokens=text, **dict(task, filler_loss=False))
  np.testing.assert_array_equal(plain.tokens, row.tokens)  # the same row, only the mask differs
  held = held_out_batches(task=dict(task, filler_tokens=text), length=120, batch_size=2, batches=1, seed=0)[0]
  assert held["loss_mask"].sum() == 2 * TASK["pairs"]  # the held-out loss is the answers'
  with pytest.raises(ConfigError, match="filler_loss needs filler: text"):
    AssociativeConfig(filler_loss=True)
