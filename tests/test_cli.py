"""Every command line documents each option and shows its default (the first-hour probes of issue #36)."""

import argparse
import importlib
import re
import time

import pytest

from fsjax import cli

CLIS = [
  "train",
  "fsjax.generate",
  "fsjax.calibrate",
  "fsjax.eval.ruler",
  "fsjax.eval.perplexity",
  "fsjax.eval.copy_recall",
  "fsjax.eval.recall",
  "fsjax.eval.probe",
  "fsjax.eval.make_data",
  "fsjax.eval.harness",
]


class _Parsed(Exception):
  pass


def _parser(module, monkeypatch):
  """The ArgumentParser a CLI module's parse_args builds, caught before it parses anything."""
  caught = {}

  def catch(self, args=None, namespace=None):
    caught["parser"] = self
    raise _Parsed

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
  with pytest.raises(_Parsed):
    importlib.import_module(module).parse_args([])
  return caught["parser"]


@pytest.mark.parametrize("module", CLIS)
def test_every_option_has_help_and_shows_its_default(module, monkeypatch):
  parser = _parser(module, monkeypatch)
  assert parser.formatter_class is cli.HelpFormatter
  undocumented = [a.option_strings for a in parser._actions if not isinstance(a, argparse._HelpAction) and not a.help]
  assert undocumented == []
  text = "".join(parser.format_help().split())  # wrapping may break a long default anywhere
  for action in parser._actions:
    if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
      shown = str(action.default)
      assert f"default:{shown}".replace(" ", "") in text or "default" in action.help, (action.option_strings, shown)


def test_stage_says_what_starts_that_it_still_runs_and_how_long_it_took(capsys):
  with cli.stage("prefill of 3 x 4096 tokens", every=0.05):
    time.sleep(0.25)
  lines = capsys.readouterr().err.splitlines()
  assert lines[0] == "prefill of 3 x 4096 tokens ..."
  assert lines[1:-1] and all(line == "prefill of 3 x 4096 tokens: still running, 0 s" for line in lines[1:-1])
  assert len(lines) - 2 <= 5 and re.fullmatch(r"prefill of 3 x 4096 tokens: (0\.[2-9]|\d\.\d) s", lines[-1])
  with pytest.raises(KeyError), cli.stage("failing", every=10):
    raise KeyError("x")
  assert capsys.readouterr().err == "failing ...\n"  # the caller's error line says the rest
