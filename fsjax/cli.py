"""What every fsjax command line shares: one help formatter and the `--set` option."""

import argparse


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
