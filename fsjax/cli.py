"""What every fsjax command line shares: one help formatter, the `--set` option, and progress lines for work
that prints nothing else while it runs (compiles, prefills, evaluations)."""

import argparse
import contextlib
import sys
import threading
import time

from tqdm import tqdm


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Keeps the module docstring's layout and appends each option's default to its help, unless the help already
  speaks of its default or there is nothing to show (no default, a flag, a required option)."""

  def _get_help_string(self, action):
    help = action.help or ""
    default = action.default
    nothing = default is None or default is False or default is argparse.SUPPRESS or default == []
    if "default" in help or action.required or nothing:
      return help
    return f"{help} (default: %(default)s)"


def parser(description):
  """An ArgumentParser with `description` (a module docstring) and `HelpFormatter`."""
  return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def add_set_argument(parser, help):
  """Adds `--set KEY=VALUE [KEY=VALUE ...]`: several pairs after one `--set`, or `--set` repeated; every pair
  lands in `args.set` in the order given (`fsjax.config.load_config` and `fsjax.loading` apply them)."""
  parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help=help)


@contextlib.contextmanager
def stage(what, every=30.0):
  """Tells stderr that `what` starts, that it is still running every `every` seconds, and how long it took:

      perplexity of tiny_fs at 4096 tokens ...
      perplexity of tiny_fs at 4096 tokens: still running, 30 s
      perplexity of tiny_fs at 4096 tokens: 41.2 s

  Lines go through `tqdm.write`, so an open progress bar is redrawn below them. Nothing is printed on an
  exception: the caller's error line says what happened."""
  say = lambda line: tqdm.write(line, file=sys.stderr)
  start, done = time.perf_counter(), threading.Event()

  def beat():
    while not done.wait(every):
      say(f"{what}: still running, {time.perf_counter() - start:.0f} s")

  say(f"{what} ...")
  beating = threading.Thread(target=beat, daemon=True)
  beating.start()
  try:
    yield
  finally:
    done.set()
    beating.join()
  say(f"{what}: {time.perf_counter() - start:.1f} s")
