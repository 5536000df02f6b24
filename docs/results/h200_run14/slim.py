"""Copies runs/eval to DEST with RULER's prompts dropped from the prediction records (64k prompts are MBs each)."""
import json, pathlib, shutil, sys
src, dest = pathlib.Path("runs/eval"), pathlib.Path(sys.argv[1])
for path in src.rglob("*"):
  if path.is_dir() or path.suffix == ".done":
    continue
  target = dest / path.relative_to(src)
  target.parent.mkdir(parents=True, exist_ok=True)
  if path.suffix == ".jsonl":
    with path.open() as f, target.open("w") as g:
      for line in f:
        record = json.loads(line)
        record.pop("input", None)
        g.write(json.dumps(record) + "\n")
  else:
    shutil.copy(path, target)
