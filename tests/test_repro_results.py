"""docs/results.md against the run summaries it was written from: `scripts/repro_results.py` regenerates its tables
from docs/results/<run>.json."""

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
RUN2 = RESULTS / "h200_run2.json"
NAMES = {"tfpp": "TF++", "swa": "SWA", "fs": "FS", "fsl": "FS-L", "fsb": "FS-B", "zha": "ZHA"}
WORKDIR_NAMES = {
  "repro_tfpp@1000": "TF++",
  "repro_swa@1000": "SWA",
  "repro_fs@1000": "FS",
  "repro_fsl@200": "FS-L",
  "repro_fs@1000[kind=fsb]": "FS-B",
  "repro_zha@150": "ZHA",
}


@pytest.fixture(scope="module")
def collector():
  spec = importlib.util.spec_from_file_location("repro_results", REPO / "scripts" / "repro_results.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def page():
  return (REPO / "docs" / "results.md").read_text()


def _rows(table):
  return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]


def test_results_page_tables_are_the_summaries(collector, page):
  summary = collector.load(RUN2)
  training = _rows(collector.training_table(summary))
  assert len(training) == 5
  for row in training:
    name = row.split(" | ")[0][2:]
    expected = row.replace(f"| {name} |", f"| {NAMES[name]} |", 1)
    if name == "zha":  # the page names what ZHA's training loss is
      expected = expected.replace("| 0.033 |", "| 0.033 (per-level KL) |")
    assert expected in page
  copies = _rows(collector.copy_table(collector.copy_rows(summary)))
  assert len(copies) == 6
  for row in copies:
    name = row.split(" | ")[0][2:]
    assert row.replace(f"| {name} |", f"| {WORKDIR_NAMES[name]} |", 1) in page


RUN12_NAMES = {
  "repro_tfpp@3500": "TF++",
  "repro_fs@3500": "FS",
  "repro_fsl@200": "FS-L",
  "repro_fs@3500[kind=fsb]": "FS-B (FS weights, calibrated τ)",
  "repro_zha@150": "ZHA (R16-C8-L2, p = 0.9)",
}
RUN13_NAMES = {
  "repro_tfpp@3500": "TF++ (run 12, 3,500 steps)",
  "fs7k@7000": "FS (7,000 steps)",
  "fs7k@7000[top_k=16]": "FS read with K = 16 (`--set attention.top_k=16`)",
  "fs7k@7000[kind=fsb]": "FS-B (FS weights, τ median 16.5)",
  "fsl7k@200": "FS-L (200 CPT steps, P = 32 cells)",
  "fsl7k800@800": "FS-L, 800 CPT steps",
  "fsl7k@200[retain_top=64]": "FS-L (200 steps) read with P = 64",
  "fsl7k@200[retain_top=128]": "FS-L (200 steps) read with P = 128",
}


@pytest.mark.parametrize("run, names", [("h200_run12", RUN12_NAMES), ("h200_run13", RUN13_NAMES)])
def test_copy_tables_are_the_summaries(collector, page, run, names):
  """Runs 12's and 13's copy-recall tables on the page (their names, and − for a negative sign) are the
  collector's."""
  page = page.replace("−", "-")
  rows = _rows(collector.copy_table(collector.copy_rows(collector.load(RESULTS / f"{run}.json"))))
  assert len(rows) == len(names)
  for row in rows:
    name = row.split(" | ")[0][2:]
    assert row.replace(f"| {name} |", f"| {names[name]} |", 1) in page


RUN14_NAMES = {
  "repro_fs@7000": "FS",
  "repro_fsl@200": "FS-L",
  "repro_fs@7000[kind=fsb]": "FS-B",
  "repro_swa@3500": "SWA",
}


def test_run14_ruler_and_needle_tables_are_the_summary(collector, page):
  """Run 14's RULER table (S-NIAH-1/2/3 per cell, – where not run) and needle table on the page are its summary's."""
  page = page.replace("**", "")
  summary = collector.load(RESULTS / "h200_run14.json")
  scores = {(r["model"], r["length"], r["task"]): r["score"] for r in collector.ruler_rows(summary)}
  assert {model for model, _, _ in scores} == set(RUN14_NAMES)
  for model, name in RUN14_NAMES.items():
    cells = []
    for length in (1024 * 2**i for i in range(7)):
      got = [scores.get((model, length, f"niah_single_{i}")) for i in (1, 2, 3)]
      cells.append(
        "–" if got == [None] * 3 else "/".join("–" if g is None else "0" if g == 0 else f"{g:.1f}" for g in got)
      )
    assert f"| {name} | S-NIAH-1/2/3 | " + " | ".join(cells) + " |" in page
  for model, name in (("repro_fs@7000", "FS"), ("repro_fsl@200", "FS-L")):
    rows = [r for r in collector.copy_rows(summary, "needles") if r["model"] == model]
    assert [r["length"] for r in rows] == [1024, 4096, 16384]
    assert f"| {name} | " + " | ".join(f"{100 * float(r['recall']):.1f}" for r in rows) + " |" in page


def test_collector_writes_both_plots(collector, tmp_path, capsys):
  collector.main(["--runs", str(RUN2), "--plot", str(tmp_path / "r.png"), "--loss-plot", str(tmp_path / "l.png")])
  assert (tmp_path / "r.png").stat().st_size > 0 and (tmp_path / "l.png").stat().st_size > 0
  printed = capsys.readouterr().out
  assert "| repro_tfpp@1000 | niah_single_1 | 0.0 | 0.0 | 0.0 |" in printed


def test_a_runs_directory_gives_its_summary_and_the_needle_table(collector, tmp_path, capsys):
  """What `scripts/repro.sh` leaves in runs/ (here one needles CSV) is collected like a summary, gets its own
  table and panel, and `--summary` writes it so that it loads back the same."""
  rows = [r for r in collector.copy_rows(collector.load(RESULTS / "h200_run13.json")) if r["model"] == "fs7k@7000"]
  (tmp_path / "repro_eval").mkdir()
  with open(tmp_path / "repro_eval" / "needles_fs.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  collector.main(
    [
      "--runs",
      str(tmp_path),
      "--plot",
      str(tmp_path / "r.png"),
      "--loss-plot",
      str(tmp_path / "l.png"),
      "--summary",
      str(tmp_path / "summary.json"),
    ]
  )
  printed = capsys.readouterr().out
  assert "(no copy-recall files)" in printed
  needles = printed.split("## Needle copy recall")[1].split("##")[0]
  assert "| fs7k@7000 | **54.4** (83/28) |" in needles
  assert (tmp_path / "r.png").stat().st_size > 0
  assert collector.load(tmp_path / "summary.json") == collector.summarize(tmp_path)


def test_every_results_path_the_docs_name_exists():
  """The results page and the notes name only files that are in docs/ (or, as `git show <commit>:docs/results/...`,
  in the repository's history)."""
  for doc in ("results.md", "notes.md"):
    text = (REPO / "docs" / doc).read_text()
    for path in re.findall(r"(?<![\w:])docs/results/[\w./-]+", text):
      assert (REPO / path.rstrip(".")).exists(), f"{doc} names {path}"
  for path in RESULTS.iterdir():
    assert path.suffix == ".json" and json.loads(path.read_text())["run"] == path.stem
