"""train.py end to end on CPU: CLI errors, kill-and-resume equality, 8-device equality, CPT, stopping."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train as train_cli
from fsjax import generate, loading
from fsjax.config import ConfigError, load_config
from fsjax.eval import perplexity, ruler
from fsjax.train import checkpoint as ckpt_lib
from fsjax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(ROOT, "tests", "micro_fs.yaml")


def _run(workdir, *overrides, env=None, wait=True):
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", MICRO, "--workdir", str(workdir)]
  for o in overrides:
    cmd += ["--set", o]
  full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
  if not wait:
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  result = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def _wait_for_checkpoint(proc, workdir, step):
  """Returns once `workdir` holds checkpoint `step` (or the run ended, or 300 s passed)."""
  deadline = time.time() + 300
  while not os.path.isdir(workdir / "checkpoints" / str(step)) and time.time() < deadline and proc.poll() is None:
    time.sleep(0.02)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.parametrize(
  "args,message",
  [
    (["--config", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
    (["--config", MICRO, "--set", "model.widht=3"], "unknown key model.widht"),
    (["--config", MICRO, "--set", "train.steps=abc"], "train.steps must be of type int"),
    (["--config", MICRO, "--set", "data.train_path=/no/such/corpus.jsonl"], "data.train_path: path does not exist"),
    (["--config", MICRO, "--set", "train.init_from=/no/such/run"], "train.init_from: path does not exist"),
    (["--config", MICRO, "--set", "model.vocab_size=512"], "model.vocab_size (512) must hold every id"),
    (["--config", MICRO, "--set", "model.attention.top_k=1000"], "top_k (1000) exceeds the 8 cells a training"),
    (
      ["--config", MICRO, "--set", "model.attention.kind=fsb", "model.attention.beam=1", "model.attention.top_k=3"],
      "top_k (3) exceeds the 2 candidate cells FS-B's two beams",
    ),
  ],
)
def test_cli_errors_are_one_clear_line(capsys, tmp_path, args, message):
  assert train_cli.main(args + ["--workdir", str(tmp_path / "w")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
  "settings,warning",
  [
    (["model.attention.kind=fsl", "model.attention.retain_top=7"], "(7 + 1) hold all the 8 cells"),
    (["model.attention.kind=fsb", "model.attention.beam=8"], "beam (8) reaches all the 8 cells"),
    (["model.attention.kind=fsl"], None),  # a pool of 2 + 1 of 8 cells prunes
  ],
)
def test_a_pool_or_beam_that_holds_every_training_cell_is_one_warning_line(
  monkeypatch, capsys, tmp_path, settings, warning
):
  monkeypatch.setattr(train_cli, "train", lambda *args, **kwargs: None)
  assert train_cli.main(["--config", MICRO, "--workdir", str(tmp_path / "w"), "--set", *settings]) == 0
  err = capsys.readouterr().err
  if warning is None:
    assert err == ""
  else:
    assert err.startswith("warning: model.attention.") and warning in err and err.count("\n") == 1


@pytest.mark.parametrize(
  "field,content,message",
  [
    ("data.train_path", "", "holds no documents"),
    ("data.train_path", '{"text": ""}\n\n', "holds no documents"),
    ("data.train_path", '{"text": "one"}\n{"text": oops}\n', "docs.jsonl:2: not JSON"),
    ("data.train_path", '{"text": "one"}\n\n{"body": "two"}\n', 'docs.jsonl:3: no "text" field'),
    ("data.train_path", '{"text": 3}\n', 'docs.jsonl:1: "text" must be a string'),
    ("data.eval_path", "", "too short for one eval batch"),
    ("data.eval_path", '{"text": "The sea was calm."}\n', "too short for one eval batch (eval.batch_size 8 rows"),
    ("data.eval_path", "[1, 2]\n", 'docs.jsonl:1: no "text" field'),
  ],
)
def test_bad_data_files_are_one_clear_line_before_anything_compiles(capsys, tmp_path, field, content, message):
  """Each data file problem the issue found (tracebacks, a ZeroDivisionError after training) is one line that names
  the file, and the run stops before its workdir is made, so before any compile."""
  path = tmp_path / "docs.jsonl"
  path.write_text(content)
  workdir = tmp_path / "w"
  assert train_cli.main(["--config", MICRO, "--set", f"{field}={path}", "--workdir", str(workdir)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and message in err and str(path) in err and err.count("\n") == 1, err
  assert not workdir.exists()


def test_set_takes_several_pairs_and_repeats_as_the_readme_shows():
  """README: `--set mesh.data=4 mesh.fsdp=2`; an argparse error before. Every CLI shares the option."""
  pairs = ["--set", "mesh.data=4", "mesh.fsdp=2", "--set", "train.steps=3"]
  assert train_cli.parse_args(["--config", MICRO, *pairs]).set == ["mesh.data=4", "mesh.fsdp=2", "train.steps=3"]
  config = load_config(MICRO, train_cli.parse_args(["--config", MICRO, *pairs]).set)
  assert (config.mesh.data, config.mesh.fsdp, config.train.steps) == (4, 2, 3)
  models = ["--set", "attention.kind=fsb", "attention.top_k=3"]
  assert generate.parse_args(["--checkpoint", "w", "--prompt", "x", *models]).set == models[1:]
  assert ruler.parse_args(["--checkpoint", "a", "b", *models, "--tasks", "niah_single_1"]).set == models[1:]
  assert perplexity.parse_args(["--checkpoint", "w", "--length", "64", *models]).set == models[1:]


def test_random_rows_do_not_need_a_train_path():
  """Random rows read no documents, so a config inherited from a text run may name a corpus that is not there."""
  missing = "data.train_path=/no/such/corpus.jsonl"
  loop.check_paths(load_config(MICRO, [missing, "data.source=random", "data.random_period=[4,8]"]))
  with pytest.raises(ConfigError, match="data.train_path: path does not exist"):
    loop.check_paths(load_config(MICRO, [missing]))


def test_kill_after_checkpoint_then_resume_equals_uninterrupted_run(tmp_path):
  reference = tmp_path / "reference"
  _run(reference, "train.steps=8")
  killed = tmp_path / "killed"
  proc = _run(killed, "train.steps=400", wait=False)  # long enough to still be running when killed
  _wait_for_checkpoint(proc, killed, 4)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
  resumed_from = ckpt_lib.resolve(str(killed))[1]
  assert 4 <= resumed_from < 8
  out = _run(killed, "train.steps=8")
  assert f"resumed from {killed}/checkpoints/{resumed_from}" in out
  expected, actual = _losses(reference), _losses(killed)
  assert sorted(actual) == list(range(1, 9))
  assert [actual[s] for s in range(1, 9)] == [expected[s] for s in range(1, 9)]  # bit-exact


def test_a_run_killed_before_its_first_checkpoint_does_not_keep_its_records_twice(tmp_path, capsys):
  """kill -9 while the first checkpoint was written left steps 1-10 in metrics.jsonl, and the rerun, which starts
  over, appended steps 1-10 again. Here the state such a kill leaves: records of steps 1-3, the last one torn by
  the kill, and no checkpoint."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 99.0}\n{"step": 2, "loss": 98.0}\n{"step": 3, "lo')
  assert train_cli.main(["--config", MICRO, "--workdir", str(workdir), "--set", "train.steps=2"]) == 0
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 20 for r in records)
  out = capsys.readouterr().out  # the silent stretches (compile, evaluations) say what they are doing
  assert "compiling the train step (step 1 includes it)" in out and "held-out evaluation done in" in out
  assert "final evaluation niah_scores done in" in out


def test_sigterm_saves_the_step_in_flight_and_resuming_equals_the_uninterrupted_run(tmp_path, monkeypatch):
  """SIGTERM during step 5 (between checkpoints 4 and 6) ends the run after step 5 with step 5 saved; resuming
  from it gives the uninterrupted run's losses bit for bit, and the previous SIGTERM handler is back."""
  config = load_config(MICRO, ["train.steps=8"])
  loop.train(config, str(tmp_path / "reference"))
  real_iterator = loop.train_iterator

  class SignalsAtBatch5:
    def __init__(self, *args):
      self.data, self.batches = real_iterator(*args), 0

    def __next__(self):
      self.batches += 1
      if self.batches == 5:
        os.kill(os.getpid(), signal.SIGTERM)
      return next(self.data)

    def get_state(self):
      return self.data.get_state()

    def set_state(self, state):
      self.data.set_state(state)

  handler = signal.getsignal(signal.SIGTERM)
  with monkeypatch.context() as patch:
    patch.setattr(loop, "train_iterator", SignalsAtBatch5)
    with pytest.raises(loop.TrainingInterrupted, match="after step 5; the latest checkpoint is step 5"):
      loop.train(config, str(tmp_path / "run"))
  assert signal.getsignal(signal.SIGTERM) is handler
  assert ckpt_lib.resolve(str(tmp_path / "run"))[1] == 5
  loop.train(config, str(tmp_path / "run"))
  expected, actual = _losses(tmp_path / "reference"), _losses(tmp_path / "run")
  assert sorted(actual) == list(range(1, 9)) and actual == expected


def test_train_cli_exits_143_on_sigterm_with_the_reported_step_saved(tmp_path):
  workdir = tmp_path / "run"
  proc = _run(workdir, "train.steps=400", wait=False)
  _wait_for_checkpoint(proc, workdir, 2)
  proc.send_signal(signal.SIGTERM)
  output = proc.communicate(timeout=120)[0]
  assert proc.returncode == 143, output
  stopped_at = int(output.split("stopped by SIGTERM after step ")[1].split(";")[0])
  assert ckpt_lib.resolve(str(workdir))[1] == stopped_at >= 2


def test_eight_simulated_devices_give_the_same_losses_as_one(tmp_path):
  _run(tmp_path / "one", "train.steps=3")
  _run(
    tmp_path / "eight",
    "train.steps=3",
    "mesh.data=4",
    "mesh.fsdp=2",
    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
  )
  one, eight = _losses(tmp_path / "one"), _losses(tmp_path / "eight")
  np.testing.assert_allclose([eight[s] for s in (1, 2, 3)], [one[s] for s in (1, 2, 3)], rtol=2e-5)


def test_continued_pretraining_switches_variant_with_fresh_optimizer(micro_workdir, tmp_path):
  parent = micro_workdir  # a 2-step FS run: read, not written
  _, parent_params, _, _ = ckpt_lib.load(str(parent))
  config = load_config(
    MICRO, ["model.attention.kind=fsl", f"train.init_from={parent}", "train.steps=1", "checkpoint.async_save=false"]
  )
  loop.train(config, str(tmp_path / "child"))
  child_config, child_params, frozen, step = ckpt_lib.load(str(tmp_path / "child" / "checkpoints" / "1"))
  assert child_config.model.attention.kind == "fsl" and step == 1
  assert set(frozen["routing"]["layer_0"]["attention"]) == {"lam", "sigma"}
  # Step 1 runs at the warmup learning rate 0, so the params are exactly the parent's: loaded, not re-initialised.
  jax.tree_util.tree_map(np.testing.assert_array_equal, child_params, parent_params)


def test_checkpoint_with_other_shapes_is_rejected_before_compiling(micro_workdir, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(micro_workdir, workdir)  # a 2-step FS run
  args = ["--config", MICRO, "--workdir", str(workdir), "--set", "model.d_model=48"]
  assert train_cli.main(args) == 2
  assert "model.d_model: 32 -> 48" in capsys.readouterr().err  # the config check comes first
  assert train_cli.main([*args, "--allow-config-change"]) == 2
  err = capsys.readouterr().err
  assert "has shape" in err and "but the config gives" in err
  assert not (workdir / "config_changes.jsonl").exists()  # a resume that failed records no change


def test_consecutive_non_finite_steps_stop_without_touching_the_last_good_checkpoint(tmp_path, monkeypatch):
  real = loop.make_train_step

  def poisoned_after_two(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def poisoned(state, batch):
      nan_if_late = jnp.where(state.step >= 2, jnp.nan, 1.0)
      return step_fn(state.replace(params=jax.tree_util.tree_map(lambda p: p * nan_if_late, state.params)), batch)

    return poisoned

  monkeypatch.setattr(loop, "make_train_step", poisoned_after_two)
  config = load_config(MICRO, ["train.max_bad_steps=2", "checkpoint.every=1", "checkpoint.async_save=false"])
  with pytest.raises(loop.TrainingStopped, match="2 consecutive non-finite"):
    loop.train(config, str(tmp_path / "run"))
  _, params, _, step = ckpt_lib.load(str(tmp_path / "run"))
  assert step == 2
  assert all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves(params))


def _poisoned_step(monkeypatch, poison):
  """Makes every train step pass its output through `poison(new_state)` (a traced function of the state)."""
  real = loop.make_train_step

  def poisoned(*args, **kwargs):
    step_fn = real(*args, **kwargs)

    def step(state, batch):
      new_state, metrics = step_fn(state, batch)
      return poison(new_state), metrics

    return step

  monkeypatch.setattr(loop, "make_train_step", poisoned)


def test_non_finite_parameters_are_never_saved(tmp_path, monkeypatch):
  """Parameters that turn infinite while the loss stays finite (bad_steps stays 0) are refused before the save:
  the run stops at that step and the checkpoint before it is the newest and finite."""
  _poisoned_step(
    monkeypatch,
    lambda s: s.replace(params=jax.tree_util.tree_map(lambda p: p * jnp.where(s.step >= 3, jnp.inf, 1.0), s.params)),
  )
  config = load_config(MICRO, ["checkpoint.every=1", "checkpoint.async_save=false"])
  with pytest.raises(
    loop.TrainingStopped, match="step 3: non-finite parameters, not saved; the last good checkpoint \\(step 2\\)"
  ):
    loop.train(config, str(tmp_path / "run"))
  _, params, _, step = ckpt_lib.load(str(tmp_path / "run"))
  assert step == 2 and all(np.all(np.isfinite(p)) for p in jax.tree_util.tree_leaves(params))


def test_blown_up_parameters_stop_the_run_unsaved_and_loaders_warn_about_them(tmp_path, monkeypatch, capsys):
  """A diverging run kept a finite but blown-up checkpoint (max |p| ~ 1e6) that generated without a warning.
  Now the run stops before saving it; a checkpoint beyond the limit that was written anyway (by an fsjax without
  the limit, simulated by removing it from the saved config) loads with one warning line."""
  blow_up = lambda s: s.replace(params=jax.tree_util.tree_map(lambda p: p * jnp.where(s.step >= 3, 1e6, 1.0), s.params))
  _poisoned_step(monkeypatch, blow_up)
  config = load_config(MICRO, ["checkpoint.every=1", "checkpoint.async_save=false"])
  with pytest.raises(
    loop.TrainingStopped,
    match=r"step 3: parameters of magnitude [\d.e+]+, beyond train.max_abs_param 10000 \(the run diverged\), not "
    r"saved; the last good checkpoint \(step 2\)",
  ):
    loop.train(config, str(tmp_path / "run"))
  assert ckpt_lib.load(str(tmp_path / "run"))[3] == 2
  allowed = load_config(MICRO, ["checkpoint.every=1", "checkpoint.async_save=false", "train.max_abs_param=1e12"])
  loop.train(dataclasses.replace(allowed, train=dataclasses.replace(allowed.train, steps=3)), str(tmp_path / "old"))
  (saved,) = (tmp_path / "old" / "checkpoints" / "3" / "config").glob("*metadata")
  written = json.loads(saved.read_text())
  del written["train"]["max_abs_param"]
  saved.write_text(json.dumps(written))
  capsys.readouterr()
  loading.load_model(str(tmp_path / "old"))
  err = capsys.readouterr().err
  assert re.fullmatch(r"warning: \S+ \(step 3\) holds parameters of magnitude [\d.e+]+, beyond .*diverged\)\n", err)


def test_a_run_that_stops_before_any_checkpoint_says_so(tmp_path, monkeypatch):
  """The stop message said "the last good checkpoint (step None)" when there was none."""
  _poisoned_step(monkeypatch, lambda s: s.replace(bad_steps=jnp.full_like(s.bad_steps, 2)))
  config = load_config(MICRO, ["train.max_bad_steps=2", "checkpoint.every=100"])
  with pytest.raises(loop.TrainingStopped, match="no checkpoint was saved before it, so a rerun starts over"):
    loop.train(config, str(tmp_path / "run"))


def test_resuming_under_another_config_is_refused_unless_allowed_then_recorded(tmp_path, capsys):
  """A finished run resumed with another train.batch_size rewrote config.json silently and reported
  tokens_seen as if every step had the new size. Now: refused by default naming the field (config.json
  untouched); running longer is not a change; with --allow-config-change the change is recorded and
  tokens_seen sums what each step really saw."""
  workdir = tmp_path / "w"
  run = lambda *extra: train_cli.main(["--config", MICRO, "--workdir", str(workdir), "--set", *extra])
  assert run("train.steps=2", "checkpoint.every=2") == 0
  config_json = (workdir / "config.json").read_text()
  capsys.readouterr()
  assert run("train.steps=4", "train.batch_size=16") == 2
  err = capsys.readouterr().err
  assert "train.batch_size: 8 -> 16" in err and "--allow-config-change" in err and err.count("\n") == 1, err
  assert (workdir / "config.json").read_text() == config_json
  longer = load_config(MICRO, ["train.steps=3", "checkpoint.every=3", "log.every=1", "eval.every=1"])
  assert loop.config_changes(json.loads(config_json), longer) == {}  # runs longer, logs and saves otherwise
  older = json.loads(config_json)  # a checkpoint of an fsjax that had no data.associative or data.shards yet
  del older["data"]["associative"], older["data"]["shards"]
  assert loop.config_changes(older, longer) == {}
  older["data"]["seq_len"] = 32
  assert loop.config_changes(older, longer) == {"data.seq_len": (32, longer.data.seq_len)}
  assert (
    train_cli.main(
      ["--config", MICRO, "--workdir", str(workdir), "--set", "train.steps=5", "train.batch_size=16"]
      + ["--allow-config-change"]
    )
    == 0
  )
  assert json.loads((workdir / "eval.json").read_text())["tokens_seen"] == 2 * 8 * 64 + 3 * 16 * 64
  changes = [json.loads(line) for line in (workdir / "config_changes.jsonl").read_text().splitlines()]
  assert changes == [{"step": 2, "changes": {"train.batch_size": [8, 16]}}]
  assert json.loads((workdir / "config.json").read_text())["train"]["batch_size"] == 16


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  """A micro run with checkpoints at steps 2 and 4."""
  workdir = tmp_path_factory.mktemp("four_steps") / "w"
  sets = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=3", "checkpoint.async_save=false"]
  assert train_cli.main(["--config", MICRO, "--workdir", str(workdir), "--set", *sets]) == 0
  return workdir


def _damage(workdir, step, how):
  """Damages one step as a full disk, a bad copy or a stray `rm` would."""
  root = workdir / "checkpoints" / str(step)
  if how == "state metadata deleted":
    (root / "state" / "_METADATA").unlink()
  elif how == "config deleted":
    (root / "config" / "metadata").unlink()
  elif how == "array file truncated":
    largest = max((p for p in (root / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:1000])


@pytest.mark.parametrize("how", ["state metadata deleted", "array file truncated"])
def test_training_resumes_from_the_newest_intact_checkpoint(four_steps, tmp_path, capfd, how):
  """A damaged latest checkpoint gave 150-685-line tracebacks, or "config mismatch" for a missing _METADATA. Now
  one line names the step and the damaged item, the step is moved aside (kept), and training resumes from the
  step before, its records kept once."""
  workdir = tmp_path / "w"
  shutil.copytree(four_steps, workdir)
  _damage(workdir, 4, how)
  capfd.readouterr()
  assert train_cli.main(["--config", MICRO, "--workdir", str(workdir), "--set", "train.steps=6"]) == 0
  out, err = capfd.readouterr()
  warnings = [line for line in err.splitlines() if line.startswith("warning: checkpoint")]
  assert len(warnings) == 1 and f"{workdir}/checkpoints/4 is damaged (state: " in warnings[0], err
  assert "mismatch" not in err and f"resumed from {workdir}/checkpoints/2" in out
  assert (workdir / "checkpoints" / "4.damaged" / "state").is_dir()
  assert [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()] == [*range(1, 7)]


def test_a_truncated_array_file_costs_one_line_not_a_thousand(four_steps, tmp_path):
  """Loading past a truncated array file printed 300-3,000 lines: TensorStore's abandoned reads reporting into
  Orbax's closed event loop. Now stderr holds the damage line (naming the array TensorStore could not read) and
  generate's own progress lines; the process also exits without a report."""
  workdir = tmp_path / "w"
  shutil.copytree(four_steps, workdir)
  _damage(workdir, 4, "array file truncated")
  cmd = [sys.executable, "-m", "fsjax.generate", "--checkpoint", str(workdir), "--prompt", "The sea"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  run = subprocess.run([*cmd, "--max-new-tokens", "2"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stderr.splitlines()
  assert len(lines) == 3, run.stderr[-3000:]
  assert lines[0].startswith(f"warning: checkpoint {workdir}/checkpoints/4 is damaged (state: OUT_OF_RANGE: Error")
  assert lines[0].endswith("trying the one before") and lines[1].startswith("prefill of 2 tokens")


def test_loaders_skip_a_damaged_step_without_changing_it_and_name_it_when_none_is_left(four_steps, tmp_path, capsys):
  workdir = tmp_path / "w"
  shutil.copytree(four_steps, workdir)
  _damage(workdir, 4, "config deleted")
  assert ckpt_lib.load(str(workdir))[3] == 2
  assert "checkpoints/4 is damaged (config: " in capsys.readouterr().err
  assert (workdir / "checkpoints" / "4" / "state").is_dir()  # a loader only reads
  with pytest.raises(ckpt_lib.CheckpointError, match="checkpoints/4 holds|no intact checkpoint"):
    ckpt_lib.load(str(workdir / "checkpoints" / "4"))
  _damage(workdir, 2, "state metadata deleted")
  with pytest.raises(
    ckpt_lib.CheckpointError, match=r"no intact checkpoint in .*: damaged steps 4 \(config: .*\), 2 \(state: "
  ):
    ckpt_lib.load(str(workdir))


def test_a_step_directory_loads_under_its_workdirs_name(micro_workdir):
  """Evaluations name a model `workdir@step`, whether given the workdir or one of its step directories."""
  by_workdir = loading.load_model(str(micro_workdir))
  by_step = loading.load_model(str(micro_workdir / "checkpoints" / "2"))
  assert by_step.name == by_workdir.name == f"{micro_workdir.name}@2"
