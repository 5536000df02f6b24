"""docs/results.md against the raw files it was written from: `scripts/repro_results.py` regenerates its tables."""

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "docs" / "results" / "h200_run2"
NAMES = {"tfpp": "TF++", "swa": "SWA", "fs": "FS", "fsl": "FS-L", "fsb": "FS-B", "zha": "ZHA"}
WORKDIR_NAMES = {"repro_tfpp@1000": "TF++", "repro_swa@1000": "SWA", "repro_fs@1000": "FS", "repro_fsl@200": "FS-L",
                 "repro_fs@1000[kind=fsb]": "FS-B", "repro_zha@150": "ZHA"}


@pytest.fixture(scope="module")
def collector():
  spec = importlib.util.spec_from_file_location("repro_results", REPO / "scripts" / "repro_results.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _rows(table):
  return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]


def test_results_page_tables_are_the_raw_files(collector, tmp_path):
  page = (REPO / "docs" / "results.md").read_text()
  training = _rows(collector.training_table(RUN))
  assert len(training) == 5
  for row in training:
    name = row.split(" | ")[0][2:]
    expected = row.replace(f"| {name} |", f"| {NAMES[name]} |", 1)
    if name == "zha":  # the page names what ZHA's training loss is
      expected = expected.replace("| 0.033 |", "| 0.033 (per-level KL) |")
    assert expected in page
  copies = _rows(collector.copy_table(collector.copy_rows(RUN / "repro_eval")))
  assert len(copies) == 6
  for row in copies:
    name = row.split(" | ")[0][2:]
    assert row.replace(f"| {name} |", f"| {WORKDIR_NAMES[name]} |", 1) in page


RUN13 = REPO / "docs" / "results" / "h200_run13"
RUN13_NAMES = {"repro_tfpp@3500": "TF++ (run 12, 3,500 steps)", "fs7k@7000": "FS (7,000 steps)",
               "fs7k@7000[top_k=16]": "FS read with K = 16 (`--set attention.top_k=16`)",
               "fs7k@7000[kind=fsb]": "FS-B (FS weights, τ median 16.5)",
               "fsl7k@200": "FS-L (200 CPT steps, P = 32 cells)", "fsl7k800@800": "FS-L, 800 CPT steps",
               "fsl7k@200[retain_top=64]": "FS-L (200 steps) read with P = 64",
               "fsl7k@200[retain_top=128]": "FS-L (200 steps) read with P = 128"}


def test_run13_copy_table_is_the_raw_files(collector):
  """Run 13's copy-recall table on the page (its names, and − for a negative sign) is the collector's."""
  page = (REPO / "docs" / "results.md").read_text().replace("−", "-")
  rows = _rows(collector.copy_table(collector.copy_rows(RUN13 / "repro_eval")))
  assert len(rows) == len(RUN13_NAMES)
  for row in rows:
    name = row.split(" | ")[0][2:]
    assert row.replace(f"| {name} |", f"| {RUN13_NAMES[name]} |", 1) in page


RUN14 = REPO / "docs" / "results" / "h200_run14" / "repro_eval"
RUN14_NAMES = {"repro_fs@7000": "FS", "repro_fsl@200": "FS-L", "repro_fs@7000[kind=fsb]": "FS-B",
               "repro_swa@3500": "SWA"}


def test_run14_ruler_and_needle_tables_are_the_raw_files(collector):
  """Run 14's RULER table (S-NIAH-1/2/3 per cell, – where not run) and needle table on the page are its CSVs."""
  page = (REPO / "docs" / "results.md").read_text().replace("**", "")
  scores = {(r["model"], int(r["length"]), r["task"]): float(r["score"])
            for path in RUN14.glob("ruler_*/scores.csv") for r in collector.read_csv(path)}
  assert {model for model, _, _ in scores} == set(RUN14_NAMES)
  for model, name in RUN14_NAMES.items():
    cells = []
    for length in (1024 * 2 ** i for i in range(7)):
      got = [scores.get((model, length, f"niah_single_{i}")) for i in (1, 2, 3)]
      cells.append("–" if got == [None] * 3 else
                   "/".join("–" if g is None else "0" if g == 0 else f"{g:.1f}" for g in got))
    assert f"| {name} | S-NIAH-1/2/3 | " + " | ".join(cells) + " |" in page
  for model, name in (("repro_fs@7000", "FS"), ("repro_fsl@200", "FS-L")):
    rows = [r for r in collector.copy_rows(RUN14, "needles") if r["model"] == model]
    assert [r["length"] for r in rows] == [1024, 4096, 16384]
    assert f"| {name} | " + " | ".join(f"{100 * float(r['recall']):.1f}" for r in rows) + " |" in page


def test_collector_writes_both_plots(collector, tmp_path, capsys):
  collector.main(["--runs", str(RUN), "--plot", str(tmp_path / "r.png"), "--loss-plot", str(tmp_path / "l.png")])
  assert (tmp_path / "r.png").stat().st_size > 0 and (tmp_path / "l.png").stat().st_size > 0
  printed = capsys.readouterr().out
  assert "| repro_tfpp@1000 | niah_single_1 | 0.0 | 0.0 | 0.0 |" in printed


def test_needle_files_get_their_own_table_and_panel(collector, tmp_path, capsys):
  eval_dir = tmp_path / "repro_eval"
  eval_dir.mkdir()
  shutil.copy(RUN13 / "repro_eval" / "copy_fs.csv", eval_dir / "needles_fs.csv")
  collector.main(["--runs", str(tmp_path), "--plot", str(tmp_path / "r.png"), "--loss-plot", str(tmp_path / "l.png")])
  printed = capsys.readouterr().out
  assert "(no copy-recall files)" in printed
  needles = printed.split("## Needle copy recall")[1].split("##")[0]
  assert "| fs7k@7000 | **54.4** (83/28) |" in needles
  assert (tmp_path / "r.png").stat().st_size > 0
