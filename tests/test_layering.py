"""The import graph points down only (docs/design.md §2): scripts and benchmarks → fsjax → pallas_kernels; the
reference imports nothing of ours but itself; training knows no evaluation; and project imports sit at module
top unless a comment says which cycle or optional dependency keeps one inside a function."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = ("fsjax", "pallas_kernels")


def _imports(path):
  """(module imported, line, inside a function?) for every import statement of a file."""
  tree = ast.parse(path.read_text(), str(path))
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        found.extend((alias.name, child.lineno, in_function) for alias in child.names)
      elif isinstance(child, ast.ImportFrom) and child.level == 0:
        found.extend((f"{child.module}.{alias.name}", child.lineno, in_function) for alias in child.names)
      visit(child, inner)

  visit(tree, False)
  return found


def _files(*folders):
  return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _violations(files, forbidden):
  return [
    f"{p.relative_to(ROOT)}:{line} imports {name}"
    for p in files
    for name, line, _ in _imports(p)
    if name.startswith(forbidden)
  ]


def test_kernels_import_nothing_from_fsjax():
  assert _violations(_files("pallas_kernels"), ("fsjax",)) == []


def test_the_reference_imports_no_kernels_no_cudnn_and_nothing_above_it():
  files = _files("fsjax/reference")
  assert (
    _violations(
      files,
      (
        "pallas_kernels",
        "fsjax.ops",
        "fsjax.attention",
        "fsjax.cache",
        "fsjax.model",
        "fsjax.config",
        "fsjax.kinds",
        "fsjax.train",
        "fsjax.eval",
      ),
    )
    == []
  )
  assert [p.name for p in files if "cudnn" in p.read_text()] == []


def test_training_imports_no_evaluation():
  assert _violations(_files("fsjax/train"), ("fsjax.eval",)) == []


def test_caches_make_no_kernel_decisions():
  """Caches are state and update rules: the kernels are reached through `fsjax.ops`, never from a cache."""
  assert _violations(_files("fsjax/cache"), ("pallas_kernels", "fsjax.ops", "fsjax.attention")) == []


@pytest.mark.parametrize("folder", ["fsjax", "pallas_kernels", "tests", "benchmarks", "scripts"])
def test_project_imports_inside_functions_say_why(folder):
  unexplained = []
  for path in _files(folder):
    lines = path.read_text().splitlines()
    for name, line, in_function in _imports(path):
      local = name.split(".")[0] in (*PROJECT, "helpers", "brute_force", "timing", "cases")
      if in_function and local and "#" not in lines[line - 1]:
        unexplained.append(f"{path.relative_to(ROOT)}:{line} {name}")
  assert unexplained == []
