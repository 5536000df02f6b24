"""Every command line documents each option and shows its default (the first-hour probes of issue #36)."""

import argparse
import importlib

import pytest

from fsjax import cli

CLIS = [
  "train",
  "fsjax.generate",
  "fsjax.calibrate",
  "fsjax.eval.ruler",
  "fsjax.eval.perplexity",
  "fsjax.eval.copy_recall",
  "fsjax.eval.probe",
  "fsjax.eval.make_data",
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
