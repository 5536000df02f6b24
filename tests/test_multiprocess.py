"""train.py as several processes on this machine (issue #39): `jax.distributed` over localhost, CPU devices with
gloo collectives, one global ("data", "fsdp") mesh across the processes, one workdir. The same global batches as
one process (`data.shards`), one checkpoint written by all processes and resumed on another process count,
SIGTERM to one process stopping all at one saved step, and kill -9 of one process ending the others with an
error instead of a hang."""

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from fsjax.config import ConfigError, load_config
from fsjax.data import pipeline
from fsjax.data.tokenizer import load_tokenizer
from fsjax.train import checkpoint as ckpt_lib
from fsjax.train import loop, sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(ROOT, "tests", "micro_fs.yaml")
# Four devices in every layout: 1 process x 4, 2 x 2, 4 x 1; the batch of 8 rows comes from 4 shards of random
# rows with copies (through grain like text, without packing a window of books per shard at the start; the text
# stream's shards are checked in-process below).
COMMON = (
  "data.shards=4",
  "data.source=random",
  "data.copy_rate=0.02",
  "data.copy_span=[4,8]",
  "data.copy_distance=[8,40]",
  "mesh.data=2",
  "mesh.fsdp=2",
  "checkpoint.every=2",
  "checkpoint.keep=3",
)
RTOL = 2e-5  # the layouts reduce in different orders
# The kill -9 test's heartbeat: a survivor that leaves at once takes seconds, even on a loaded 2-core runner.
KILL_HEARTBEAT_S = 60


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_RUNNING = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
  yield
  while _RUNNING:
    proc = _RUNNING.pop()
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    proc.log.close()


def _launch(workdir, processes, *overrides):
  """`processes` train.py processes of one run (4 devices in all), started at once; their Popen objects."""
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", MICRO, "--workdir", str(workdir)]
  cmd += ["--set", *COMMON, *overrides]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // processes}"}
  if processes > 1:
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES=str(processes))
  procs = []
  for index in range(processes):  # output to files: a full pipe would stall a process, and with it the others
    log = open(f"{workdir}.{len(_RUNNING)}.log", "w+")
    procs.append(
      subprocess.Popen(
        cmd, env={**env, "JAX_PROCESS_ID": str(index)}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
      )
    )
    procs[-1].log = log
    _RUNNING.append(procs[-1])
  return procs


def _finish(procs, timeout=300):
  """(return codes, outputs) once every process has ended; kills them all after `timeout` seconds."""
  deadline, outputs = time.time() + timeout, []
  for proc in procs:
    try:
      proc.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
      raise AssertionError(f"the processes did not end within {timeout} s") from None
    proc.log.seek(0)
    outputs.append(proc.log.read())
    proc.log.close()
  return [proc.returncode for proc in procs], outputs


def _train(workdir, processes, *overrides):
  codes, outputs = _finish(_launch(workdir, processes, *overrides))
  assert codes == [0] * processes, "\n".join(outputs)
  return outputs


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _assert_same_losses(run, reference, steps):
  actual, expected = _losses(run), _losses(reference)
  assert sorted(actual) == list(steps), actual
  np.testing.assert_allclose([actual[s] for s in steps], [expected[s] for s in steps], rtol=RTOL)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The reference: one process, four devices, four steps (checkpoints 2 and 4)."""
  workdir = tmp_path_factory.mktemp("one")
  _train(workdir, 1, "train.steps=4")
  return workdir


def _checkpoint_at_step_2(run, workdir):
  """A copy of `run`'s workdir as it was after step 2: its checkpoints after 2 and records past 2 dropped."""
  shutil.copytree(run, workdir)
  for step in os.listdir(workdir / "checkpoints"):
    if int(step) > 2:
      shutil.rmtree(workdir / "checkpoints" / step)
  with open(workdir / "metrics.jsonl") as f:
    kept = [line for line in f if json.loads(line)["step"] <= 2]
  with open(workdir / "metrics.jsonl", "w") as f:
    f.writelines(kept)


def test_two_processes_train_as_one_and_resume_on_the_other_count(one_process, tmp_path):
  """2 processes x 2 devices give the one-process losses; the 2-process checkpoint of step 2 resumes in one
  process, and the one-process checkpoint of step 2 in two, both continuing with the reference's steps 3-4."""
  two = tmp_path / "two"
  outputs = _train(two, 2, "train.steps=2")
  assert "mesh {'data': 2, 'fsdp': 2}" in outputs[0]
  _assert_same_losses(two, one_process, [1, 2])
  assert ckpt_lib.resolve(str(two))[1] == 2
  state = two / "checkpoints" / "2" / "state"
  assert {p.name for p in state.glob("ocdbt.process_*")} == {"ocdbt.process_0", "ocdbt.process_1"}  # both wrote

  _train(two, 1, "train.steps=4")  # 2 -> 1
  _assert_same_losses(two, one_process, [1, 2, 3, 4])

  one_to_two = tmp_path / "one_to_two"
  _checkpoint_at_step_2(one_process, one_to_two)
  _train(one_to_two, 2, "train.steps=4")  # 1 -> 2
  _assert_same_losses(one_to_two, one_process, [1, 2, 3, 4])


def test_the_final_evaluations_run_in_every_process_and_process_0_writes_them(tmp_path):
  """S-NIAH after a 2-process run: the parameters span both processes, so each evaluates a whole copy."""
  outputs = _train(tmp_path / "run", 2, "train.steps=1", "data.seq_len=256", "eval.niah_samples=1")
  with open(tmp_path / "run" / "eval.json") as f:
    assert {"s_niah_1@256", "s_niah_1@1024", "heldout_loss"} <= set(json.load(f))
  assert all("final evaluation niah_scores done" in out for out in outputs), outputs


def test_four_processes_train_as_one(one_process, tmp_path):
  _train(tmp_path / "four", 4, "train.steps=2")
  _assert_same_losses(tmp_path / "four", one_process, [1, 2])


def _wait_for_checkpoint(workdir, step, procs, timeout=300):
  deadline = time.time() + timeout
  while not (workdir / "checkpoints" / str(step)).is_dir():
    assert time.time() < deadline and all(p.poll() is None for p in procs), "no checkpoint appeared"
    time.sleep(0.05)


def test_sigterm_to_one_process_stops_all_at_one_saved_step_and_the_rerun_resumes_exactly(tmp_path):
  run = tmp_path / "run"
  procs = _launch(run, 2, "train.steps=400")
  _wait_for_checkpoint(run, 2, procs)
  procs[1].send_signal(signal.SIGTERM)
  codes, outputs = _finish(procs, timeout=120)
  assert codes == [143, 143], "\n".join(outputs)
  steps = {int(out.split("stopped by SIGTERM after step ")[1].split(";")[0]) for out in outputs}
  assert len(steps) == 1, outputs
  (stopped,) = steps
  assert ckpt_lib.resolve(str(run))[1] == stopped >= 2

  _train(run, 2, f"train.steps={stopped + 1}")
  reference = tmp_path / "reference"
  _train(reference, 1, f"train.steps={stopped + 1}", "log.every=1")
  _assert_same_losses(run, reference, range(1, stopped + 2))


def _marked_corpus(path, count):
  """`count` documents, document i the word `doc{i}z` repeated: a row's text names the documents it holds."""
  with open(path, "w") as f:
    for i in range(count):
      f.write(json.dumps({"text": " ".join([f"doc{i}z"] * (40 + 7 * i))}) + "\n")
  return path


def test_processes_read_disjoint_shares_of_one_stream_and_resume_it_on_another_count(tmp_path, monkeypatch):
  """The global batches (each process's rows in process order) are the same for 1, 2 and 4 processes reading
  4 shards; no document is read by two processes and none is skipped; every shard's state, saved under one
  process count, continues the same stream under another."""
  small_windows = functools.partial(pipeline.make_train_iterator, shuffle_window_tokens=64 * 33)  # 64 rows
  monkeypatch.setattr(loop, "make_train_iterator", small_windows)
  documents = 16
  corpus = _marked_corpus(tmp_path / "docs.jsonl", documents)
  config = load_config(MICRO, [f"data.train_path={corpus}", "data.seq_len=32", "train.batch_size=8"])
  tokenizer = load_tokenizer(None)
  doc_ids = lambda rows: {int(m) for row in rows for m in re.findall(r"doc(\d+)z", tokenizer.decode(list(row)))}

  def run(count, steps, states=None):
    streams = [loop.train_iterator(config, 4, index, count) for index in range(count)]
    if states is not None:
      for index, stream in enumerate(streams):
        loop.restore_stream(stream, states, index, count)
    batches = [[next(stream)["tokens"] for _ in range(steps)] for stream in streams]
    states = [state for stream in streams for state in json.loads(json.dumps(stream.get_state()))["parts"]]
    return batches, states

  one, _ = run(1, 30)
  for count in (2, 4):
    local, _ = run(count, 30)
    for step in range(30):
      np.testing.assert_array_equal(np.concatenate([batches[step] for batches in local]), one[0][step])
    read = [doc_ids(np.concatenate(batches)) for batches in local]
    assert sum(len(ids) for ids in read) == documents and set().union(*read) == set(range(documents)), read

  _, states = run(2, 5)  # saved by two processes after step 5
  for count in (1, 4):
    resumed, _ = run(count, 3, states)
    for step in range(3):
      np.testing.assert_array_equal(np.concatenate([batches[step] for batches in resumed]), one[0][5 + step])


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "coordinator"])
def test_kill_9_of_one_process_ends_the_other_with_an_error_and_keeps_the_last_checkpoint(
  monkeypatch, tmp_path, victim
):
  """A peer killed mid-run: the survivor does not hang, and the newest checkpoint still loads. Either its next
  collective fails and it exits 1 at once with one line naming the failure, instead of waiting in the shutdown
  barrier; or, where no collective fails (a gloo collective whose peer died may wait without a timeout, and
  Orbax's save barriers are the coordination service's), the coordination service declares the peer dead at the
  heartbeat timeout and JAX ends the survivor with its own message. A survivor that printed the line and then
  waited in the shutdown barrier would take the heartbeat timeout: it must have left well within it."""
  monkeypatch.setenv("FSJAX_HEARTBEAT_TIMEOUT", str(KILL_HEARTBEAT_S))
  run = tmp_path / "run"
  procs = _launch(run, 2, "train.steps=400", "checkpoint.every=20")
  _wait_for_checkpoint(run, 20, procs)
  procs[victim].kill()
  killed = time.time()
  codes, outputs = _finish(procs, timeout=KILL_HEARTBEAT_S + 240)
  elapsed = time.time() - killed
  survivor = 1 - victim
  assert codes[victim] == -signal.SIGKILL and codes[survivor] != 0, outputs[survivor]
  line = f"error: process {survivor} of 2 stopped: " in outputs[survivor] and "Rerun every process" in outputs[survivor]
  assert line or "JAX distributed service" in outputs[survivor], outputs[survivor]
  if line:
    assert codes[survivor] == 1 and elapsed < KILL_HEARTBEAT_S, (elapsed, outputs[survivor])
  directory, step = ckpt_lib.resolve(str(run))
  assert step >= 20
  _, params, _, loaded = ckpt_lib.load(str(run))
  assert loaded == step and params


@pytest.mark.parametrize(
  "overrides,saved,processes,message",
  [
    (["data.shards=3"], None, 1, "train.batch_size - data.tiled_rows (8) must be a multiple of data.shards (3)"),
    ([], [{}] * 3, 1, "(8) must be a multiple of the checkpoint's data stream's 3 shards (data.shards 0)"),
    (["data.shards=2"], [{}] * 4, 1, "data.shards (2) differs from the 4 shards of the checkpoint's data stream"),
    (["data.shards=2"], None, 4, "data.shards (2) must be a multiple of the process count (4)"),
    ([], [{}] * 2, 4, "the checkpoint's data stream's 2 shards (data.shards 0) must be a multiple of the process"),
    (
      ["train.batch_size=10", "data.tiled_rows=2", "data.random_period=[4,8]"],
      None,
      4,
      "data.tiled_rows (2) must be a multiple of data.shards (0: one per process, 4)",
    ),
  ],
)
def test_a_stream_the_processes_cannot_share_is_one_clear_line(monkeypatch, overrides, saved, processes, message):
  monkeypatch.setattr(loop.jax, "process_count", lambda: processes)
  with pytest.raises(ConfigError) as error:
    loop._stream_shards(load_config(MICRO, overrides), saved)
  assert message in str(error.value)


@pytest.mark.parametrize(
  "env,message",
  [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID must be an integer"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES must be an integer"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID (2) must be in [0, JAX_NUM_PROCESSES=2)"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "FSJAX_HEARTBEAT_TIMEOUT": "soon"}, "FSJAX_HEARTBEAT_TIMEOUT"),
  ],
)
def test_bad_process_variables_are_one_clear_line(monkeypatch, env, message):
  for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "FSJAX_HEARTBEAT_TIMEOUT"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ConfigError) as error:
    sharding.initialize_distributed()
  assert message in str(error.value)
