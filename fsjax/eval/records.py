"""RULER's jsonl files: read generated tasks (ours or RULER's own), write and read predictions; and the CSV
tables the retrieval evaluations write (`write_csv`).

A task record has `index`, `input`, `outputs` (expected strings), `length` and `answer_prefix`; the model's prompt
is `input + answer_prefix` (files from RULER versions that keep the prefix inside `input` have no
`answer_prefix`, which then reads as empty). In RULER's NIAH files `index` is not a sample number, so records keep
file order and carry `index` through unchanged. A prediction record (`prediction`) adds RULER's prediction fields
to the task record: `pred`, and `others` and `truncation` as RULER's `call_api.py` writes them (the task's own or
`{}` and -1), which RULER's `evaluate.py` reads.
"""

import csv
import json
from pathlib import Path

from fsjax.data.jsonl import json_lines

REQUIRED = ("index", "input", "outputs")


def prediction(record, pred):
  """The prediction record of a task record: RULER's fields added (module docstring)."""
  return {**record, "pred": pred, "others": record.get("others", {}), "truncation": record.get("truncation", -1)}


def read_jsonl(path):
  """Records of a jsonl file, in order. Raises ValueError naming the file and line of a record that lacks a
  RULER field or whose `outputs` is not a list of strings."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"RULER file not found: {path}")
  records = []
  for line_number, record in json_lines(path):
    missing = [k for k in REQUIRED if not isinstance(record, dict) or k not in record]
    if missing:
      raise ValueError(f"{path}:{line_number}: record lacks RULER field(s) {missing}")
    if not isinstance(record["outputs"], list) or not all(isinstance(o, str) for o in record["outputs"]):
      raise ValueError(f"{path}:{line_number}: outputs must be a list of strings")
    records.append({"answer_prefix": "", **record})
  return records


def write_jsonl(path, records):
  """Writes records one JSON object per line (UTF-8, non-ASCII kept), creating parent directories."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_csv(path, rows):
  """Writes `rows` (dicts with the keys of the first, in its order) as a CSV with a header, creating parent
  directories."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def prompt(record):
  """The text the model continues: `input + answer_prefix`."""
  return record["input"] + record["answer_prefix"]
