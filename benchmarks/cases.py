"""Runs each benchmark case in its own subprocess, so a device's peak-memory counter and compile caches belong to
that case alone, and a case that hangs or runs out of memory is reported instead of ending the table."""

import argparse
import json
import os
import subprocess
import sys


def case_parser(description, default_lengths):
  """An argument parser with the options every benchmark shares: lengths, kinds, preset, case timeout, and the
  hidden --case "kind:length" that a subprocess runs."""
  parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default=default_lengths, type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument("--kinds", default="tfpp,swa,fs,fsl", type=lambda s: s.split(","))
  parser.add_argument("--preset", default="fs_341m")
  parser.add_argument("--case-timeout", type=float, default=None, help="seconds per case, compile included")
  parser.add_argument("--case", type=lambda s: (s.split(":")[0], int(s.split(":")[1])), help=argparse.SUPPRESS)
  return parser


def run_cases(script, kinds, lengths, extra_args, timeout=None):
  """For every length and kind, runs `script --case kind:length *extra_args` and parses its last stdout line.

  Returns:
    list of dicts: the case's JSON, or `{"kind", "length", "error"}` when it failed or timed out.
  """
  rows = []
  for length in lengths:
    for kind in kinds:
      cmd = [sys.executable, script, "--case", f"{kind}:{length}", *map(str, extra_args)]
      try:
        result = subprocess.run(
          cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        row = (
          json.loads(result.stdout.strip().splitlines()[-1])
          if result.returncode == 0
          else dict(kind=kind, length=length, error=(result.stderr.strip().splitlines() or ["?"])[-1][:100])
        )
      except subprocess.TimeoutExpired as timed_out:
        done = timed_out.stderr or b""  # what the case printed before it was stopped (bytes, even with text=True)
        done = (done.decode(errors="replace") if isinstance(done, bytes) else done).strip().splitlines()
        row = dict(
          kind=kind,
          length=length,
          error=f"not done after {timeout:.0f} s" + (f"; last: {done[-1][:100]}" if done else ""),
        )
      rows.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  return rows
