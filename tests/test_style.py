"""The tree stays formatted and linted (ruff, configured in pyproject.toml): part of the test command, so CI
checks it on every submission."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args):
  return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint_passes():
  result = _ruff("check", "--no-cache", ".")
  assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_unchanged():
  result = _ruff("format", "--no-cache", "--check", ".")
  assert result.returncode == 0, result.stdout + result.stderr
