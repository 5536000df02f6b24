"""RULER's QA tasks (scripts/data/synthetic/qa.py): a real question over its gold paragraphs hidden among
distractor documents. qa_1 reads SQuAD v2 (dev json), qa_2 HotpotQA (distractor dev json); neither ships with
fsjax or can be downloaded at run time, so their paths must be given.
"""

import functools
import json
import random
from pathlib import Path

from fsjax.eval.synthetic import split_prefix

TEMPLATE = (
  "Answer the question based on the given documents. Only give me the answer and do not output any other "
  "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
  "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"


@functools.lru_cache(maxsize=4)
def load(path, kind):
  """`(questions, documents)` as RULER reads them: documents deduplicated and sorted; each question with its
  answers, gold document indices and (SQuAD) the other paragraphs of its article as preferred distractors.

  Args:
    path: the dataset json; kind: "squad" or "hotpotqa".
  """
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"QA dataset not found: {path}")
  data = json.loads(path.read_text(encoding="utf-8"))
  if kind == "squad":
    docs = sorted({p["context"] for article in data["data"] for p in article["paragraphs"]})
    index = {d: i for i, d in enumerate(docs)}
    questions = []
    for article in data["data"]:
      article_docs = [index[p["context"]] for p in article["paragraphs"]]
      for p in article["paragraphs"]:
        gold = index[p["context"]]
        questions += [
          dict(
            query=q["question"],
            outputs=[a["text"] for a in q["answers"]],
            gold=[gold],
            near=[i for i in article_docs if i != gold],
          )
          for q in p["qas"]
          if not q.get("is_impossible", False)
        ]
  elif kind == "hotpotqa":
    text = lambda title, sentences: f"{title}\n{''.join(sentences)}"
    docs = sorted({text(t, s) for d in data for t, s in d["context"]})
    index = {d: i for i, d in enumerate(docs)}
    questions = [
      dict(query=d["question"], outputs=[d["answer"]], gold=[index[text(t, s)] for t, s in d["context"]], near=[])
      for d in data
    ]
  else:
    raise ValueError(f"QA kind must be 'squad' or 'hotpotqa', got {kind!r}")
  if not questions:
    raise ValueError(f"{path} holds no answerable questions")
  return tuple(questions), tuple(docs)


def sample(dataset, size, seed, length, count_tokens):
  """A question (chosen by the seed) with `size` documents: its gold ones, then its article's other paragraphs,
  then random others, shuffled. Distractors are drawn in one fixed order so more documents extend fewer."""
  del length, count_tokens
  questions, docs = dataset
  rng = random.Random(seed)
  question = questions[rng.randrange(len(questions))]
  others = [i for i in range(len(docs)) if i not in question["gold"] and i not in question["near"]]
  near = list(question["near"])
  rng.shuffle(near)
  rng.shuffle(others)
  chosen = (question["gold"] + near + others)[: max(size, len(question["gold"]))]
  documents = [docs[i] for i in chosen]
  random.Random(seed).shuffle(documents)
  context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(documents))
  return (
    *split_prefix((TEMPLATE + PREFIX).format(context=context, query=question["query"]), PREFIX),
    question["outputs"],
  )
