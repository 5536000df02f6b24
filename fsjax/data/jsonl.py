"""JSON-lines files read one record at a time, each bad line reported by file and line number."""

import json


def json_lines(file, error=ValueError, opener=open):
  """`(line number, value)` for every non-blank line of a JSON-lines file, in order.

  A line that is not JSON, or not UTF-8 text, raises `error` (an exception class) with a message that starts
  `<file>:<line>:`; what a record must hold is the caller's to check, with the line number given here.
  `opener` opens the file (`open`, or `gzip.open` for `.gz`).
  """
  number = 0
  try:
    with opener(file, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          value = json.loads(line)
        except json.JSONDecodeError as e:
          raise error(f"{file}:{number}: not JSON ({e.msg} at column {e.colno})") from None
        yield number, value
  except UnicodeDecodeError:
    raise error(f"{file}:{number + 1}: not UTF-8 text") from None
