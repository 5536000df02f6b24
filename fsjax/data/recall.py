"""Recall and switch masks for retrieval-weighted CPT (FS Eq. 13, Appendix E.4).

The weighted loss is `L = -sum_t w_t log p(x_{t+1} | x_{<=t}) / sum_t w_t` with `w_t = 1 + beta f_t + beta_sw chi_t`.
Both masks are computed from token ids of ONE document (the caller splits documents, which is how the masks
"respect document boundaries"); index `j` of a mask refers to token `j` as a *target*, so a loss over targets
`tokens[1:]` uses `mask[1:]`.

Reading of the paper's text, with each choice named (`n = ngram`, `D = min_distance`, `W = switch_window`):

- Occurrences of an n-gram are its start positions. The n-gram starting at `p` has a *unique earlier match* `s`
  when `tokens[p:p+n]` starts at exactly one position `s < p` and that one is far: `p - s > D` (strict, "more
  than 512 tokens"). Uniqueness counts every earlier occurrence, near or far, so a span also repeated nearby is
  ambiguous and gives nothing.
- Start at target `j`: the n-gram starting at `j` (needs `j + n <= len`) has a unique earlier match `s`, and the
  preceding tokens differ: `tokens[j-1] != tokens[s-1]`. Choice: a source at `s == 0` has no preceding token and
  counts as different, so a span copied from the document's first token is still recalled. Its source is `s`.
  Position 0 is never a start (it has no earlier position).
- Continuation at target `j`: the n-gram ending just before `j` (`tokens[j-n:j]`, needs `j >= n`) has a unique
  earlier match `s` and its next target matches: `tokens[s+n] == tokens[j]` (always in range since `s < j - n`).
  Its source is `s + n`.
- `recall = start | continuation`. A position can be both; only starts take part in switching.
- Switch at `j`: `j` is a start, the most recent start `j' < j` (switch or not) satisfies `j - j' <= W` ("within
  64 tokens") and `|source(j) - source(j')| > W` ("more than 64 tokens"). Returning to the neighbourhood of the
  previous source therefore does not switch; jumping to another span does.

Cost: O(n L log L) for a document of `L` tokens (`n` one-dimensional sorts), no Python loop over tokens: about
0.04 s for 100k tokens.

Example (`n=2, D=3, W=2`): the bigram (1, 2) reappears 7 tokens later after a different token (7 versus 0), so
target 8 is a start with source 1. Target 9 is neither: its bigram (2, 3) repeats with the same preceding token,
and the bigram before it, (7, 1), has no match; under this reading the `n - 1` targets after a start are not
flagged by that copy. Target 10 continues ((1, 2) matched at 1, next token 3 == 3); target 11 ends the copy
(9 != 4).

>>> import numpy as np
>>> tokens = np.array([0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 9])
>>> recall, switch = recall_masks(tokens, ngram=2, min_distance=3, switch_window=2)
>>> np.flatnonzero(recall).tolist(), np.flatnonzero(switch).tolist()
([8, 10], [])
>>> recall_weights(recall, switch, beta=9.0, beta_switch=49.0)[7:].tolist()
[1.0, 10.0, 1.0, 10.0, 1.0]
"""

import numpy as np


def _unique_far_match(tokens, *, ngram, min_distance):
  """Source of the unique earlier far match of every n-gram.

  Args:
    tokens: `[L]` integer token ids, `L >= ngram`.

  Returns:
    `[L - ngram + 1]` int64: entry `p` is the single start `s < p` of `tokens[p:p+ngram]` when there is exactly one
    and `p - s > min_distance`, else -1.
  """
  # Dense n-gram ids, grown one token at a time: packing (id of the k-gram, next token id) into one int64 keeps every
  # sort one-dimensional, several times faster than np.unique(axis=0) on rows. Ids are < L, so keys stay < L^2.
  _, token_ids = np.unique(tokens, return_inverse=True)
  vocab = np.int64(token_ids.max()) + 1
  ids = token_ids
  for k in range(1, ngram):
    _, ids = np.unique(ids[:-1].astype(np.int64) * vocab + token_ids[k:], return_inverse=True)
  # Stable sort groups equal n-grams with their positions ascending, so rank within a group = earlier occurrences.
  order = np.argsort(ids, kind="stable")
  sorted_ids = ids[order]
  new_group = np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]
  group_head = np.flatnonzero(new_group)
  group_of = np.cumsum(new_group) - 1
  rank = np.arange(order.size) - group_head[group_of]
  first = order[group_head[group_of]]
  # Rank 1: exactly one earlier occurrence, which is the group's first position.
  hit = (rank == 1) & (order - first > min_distance)
  match = np.full(ids.size, -1, np.int64)
  match[order[hit]] = first[hit]
  return match


def recall_masks(tokens, *, ngram=4, min_distance=512, switch_window=64):
  """Recall mask `f` and switch mask `chi` of one document (FS Eq. 13, Appendix E.4; reading in module docstring).

  Args:
    tokens: `[L]` integer token ids of a single document.
    ngram: match length `n` (paper: 4).
    min_distance: a match must lie strictly more than this many tokens back (paper: 512).
    switch_window: start-to-start gap (<=) and source-to-source distance (>) of a switch (paper: 64).

  Returns:
    `(recall, switch)`, both `[L]` bool, indexed by target position; `switch` implies `recall`.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
  if ngram < 1:
    raise ValueError(f"ngram must be >= 1, got {ngram}")
  if min_distance < 0 or switch_window < 0:
    raise ValueError(f"min_distance and switch_window must be >= 0, got {min_distance}, {switch_window}")
  length = tokens.size
  recall = np.zeros(length, bool)
  switch = np.zeros(length, bool)
  if length < ngram:
    return recall, switch
  match = _unique_far_match(tokens, ngram=ngram, min_distance=min_distance)
  num_windows = match.size

  # Starts: target j opens the matched n-gram; its preceding token must differ from the source's (none at s == 0).
  # match[0] is always -1, so position 0 never starts and `positions - 1` is only read where it is valid.
  positions = np.arange(num_windows)
  prev_differs = (match == 0) | (tokens[np.maximum(positions - 1, 0)] != tokens[np.maximum(match - 1, 0)])
  start = (match >= 0) & prev_differs

  # Continuations: target j = p + n follows the matched n-gram at p and equals the source's next token.
  cont_pos = positions[: length - ngram] + ngram
  cont_src = match[: length - ngram]
  cont = (cont_src >= 0) & (tokens[np.maximum(cont_src, 0) + ngram] == tokens[cont_pos])

  recall[:num_windows] = start
  recall[cont_pos[cont]] = True

  # Switches: compare each start with the most recent earlier start.
  start_pos = np.flatnonzero(start)
  start_src = match[start_pos]
  near = np.diff(start_pos) <= switch_window
  far_source = np.abs(np.diff(start_src)) > switch_window
  switch[start_pos[1:][near & far_source]] = True
  return recall, switch


def recall_weights(recall, switch, beta, beta_switch):
  """Per-target loss weights `w = 1 + beta f + beta_sw chi` (FS Eq. 13).

  Args:
    recall: `[..., L]` bool recall mask `f`.
    switch: `[..., L]` bool switch mask `chi`.

  Returns:
    `[..., L]` float32 weights; every token keeps base weight 1.
  """
  recall = np.asarray(recall, np.float32)
  switch = np.asarray(switch, np.float32)
  return (1.0 + np.float32(beta) * recall + np.float32(beta_switch) * switch).astype(np.float32)
