"""Recall and switch masks of retrieval-weighted CPT (FS Eq. 13, Appendix E.4) on hand-built and random documents."""

import doctest
import itertools

import numpy as np
import pytest

from fsjax.data import recall as recall_module
from fsjax.data.recall import recall_masks, recall_weights

SMALL = dict(ngram=4, min_distance=20, switch_window=5)


class Fresh:
  """Hands out tokens never used before, so filler text creates no accidental n-gram matches."""

  def __init__(self, first=1000):
    self._next = itertools.count(first)

  def __call__(self, count):
    return [next(self._next) for _ in range(count)]


def flagged(mask):
  return np.flatnonzero(mask).tolist()


def brute_force_masks(tokens, ngram, min_distance, switch_window):
  """Direct O(L^2) transcription of the definitions in the module docstring, sharing no code with it."""
  tokens = [int(t) for t in tokens]
  length = len(tokens)

  def unique_far_source(p):
    earlier = [s for s in range(p) if tokens[s : s + ngram] == tokens[p : p + ngram]]
    if len(earlier) == 1 and p - earlier[0] > min_distance:
      return earlier[0]
    return None

  recall = [False] * length
  switch = [False] * length
  starts = []  # (target, source) in increasing target order
  for j in range(length):
    if j + ngram <= length:
      s = unique_far_source(j)
      if s is not None and (s == 0 or tokens[j - 1] != tokens[s - 1]):
        recall[j] = True
        starts.append((j, s))
    if j >= ngram:
      s = unique_far_source(j - ngram)
      if s is not None and tokens[s + ngram] == tokens[j]:
        recall[j] = True
  for (prev_j, prev_s), (j, s) in zip(starts, starts[1:]):
    if j - prev_j <= switch_window and abs(s - prev_s) > switch_window:
      switch[j] = True
  return np.array(recall, bool), np.array(switch, bool)


def test_far_repeat_gives_start_then_continuations():
  fresh = Fresh()
  span = fresh(8)
  tokens = fresh(3) + span + fresh(25) + span + fresh(3)
  copy = 3 + 8 + 25
  recall, switch = recall_masks(np.array(tokens), **SMALL)
  # Start at the copy's first token; the next n-1 targets have neither a new start (same preceding token) nor four
  # matched tokens behind them; from the n-th token on every copied target continues the span.
  assert flagged(recall) == [copy] + list(range(copy + 4, copy + 8))
  assert not switch.any()


def test_far_repeat_of_document_start_counts_as_start():
  fresh = Fresh()
  span = fresh(6)
  tokens = span + fresh(30) + span
  recall, _ = recall_masks(np.array(tokens), **SMALL)
  # The source at position 0 has no preceding token, which counts as a different one.
  assert flagged(recall) == [36, 40, 41]


def test_repeat_within_min_distance_gives_nothing():
  fresh = Fresh()
  span = fresh(8)
  for gap in (0, 5, 12):  # copy - source = 8 + gap <= 20
    tokens = fresh(3) + span + fresh(gap) + span + fresh(3)
    recall, switch = recall_masks(np.array(tokens), **SMALL)
    assert not recall.any() and not switch.any(), gap


def test_min_distance_is_strict():
  fresh = Fresh()
  span = fresh(5)
  at_limit = fresh(2) + span + fresh(15) + span  # copy starts exactly 20 tokens after the source
  beyond = fresh(2) + span + fresh(16) + span  # 21 tokens after
  assert not recall_masks(np.array(at_limit), **SMALL)[0].any()
  assert flagged(recall_masks(np.array(beyond), **SMALL)[0]) == [23, 27]


def test_non_unique_earlier_match_gives_no_start():
  fresh = Fresh()
  span = fresh(6)
  tokens = fresh(2) + span + fresh(25) + span + fresh(25) + span
  recall, _ = recall_masks(np.array(tokens), **SMALL)
  first_copy = 2 + 6 + 25
  # Only the first copy is recalled; by the second copy every n-gram of the span has occurred twice before.
  assert flagged(recall) == [first_copy, first_copy + 4, first_copy + 5]


def test_nearby_duplicate_also_breaks_uniqueness():
  fresh = Fresh()
  span = fresh(6)
  tokens = fresh(2) + span + fresh(25) + span + fresh(2) + span
  recall, _ = recall_masks(np.array(tokens), **SMALL)
  # The third copy's far source (position 2) is not unique: the second copy, too close to count, is also earlier.
  assert flagged(recall) == [33, 37, 38]


def test_start_requires_different_preceding_token():
  fresh = Fresh()
  head, span, tail = fresh(1), fresh(4), fresh(3)
  decoy = head + span[:3] + fresh(1)  # makes (head, a, b, c) non-unique while (a, b, c, d) stays unique
  source = fresh(2) + head + span + tail
  # The decoy sits within min_distance of the source, so the source's own (head, a, b, c) is no recall.
  before = decoy + fresh(5) + source + fresh(25)
  start = len(before) + 1  # position of the copied span after its preceding token

  def copy_recall(preceding):
    tokens = before + preceding + span + tail
    return flagged(recall_masks(np.array(tokens), **SMALL)[0])

  # A different preceding token makes the span's first token a start.
  assert copy_recall(fresh(1)) == [start] + [start + 4, start + 5, start + 6]
  # The same preceding token: not a start (and (head, a, b, c) is ambiguous, so nothing starts earlier either);
  # once four copied tokens lie behind a target, it is a continuation.
  assert copy_recall(head) == [start + 4, start + 5, start + 6]


def test_switch_fires_for_far_sources_within_window():
  fresh = Fresh()
  span_a, span_b = fresh(10), fresh(10)
  tokens = fresh(2) + span_a + fresh(10) + span_b + fresh(25)
  copy = len(tokens)
  # Copy the first four tokens of A, a break token, then jump to B: starts 5 tokens apart, sources 20 apart.
  tokens += span_a[:4] + fresh(1) + span_b[:6]
  recall, switch = recall_masks(np.array(tokens), **SMALL)
  assert flagged(switch) == [copy + 5]
  assert recall[copy] and recall[copy + 5]


def test_no_switch_when_returning_to_same_span():
  fresh = Fresh()
  span_a = fresh(20)
  tokens = fresh(2) + span_a + fresh(25)
  copy = len(tokens)
  # A typo replaces the copy's fifth token; copying resumes at the next source token: sources 5 apart (<= window).
  tokens += span_a[:4] + fresh(1) + span_a[5:12]
  recall, switch = recall_masks(np.array(tokens), **SMALL)
  assert recall[copy] and recall[copy + 5]
  assert not switch.any()


def test_no_switch_when_starts_are_beyond_window():
  fresh = Fresh()
  span_a, span_b = fresh(10), fresh(10)
  tokens = fresh(2) + span_a + fresh(10) + span_b + fresh(25)
  copy = len(tokens)
  tokens += span_a[:4] + fresh(2) + span_b[:6]  # starts 6 tokens apart > window 5
  recall, switch = recall_masks(np.array(tokens), **SMALL)
  assert recall[copy] and recall[copy + 6]
  assert not switch.any()


def test_switch_compares_with_most_recent_start():
  fresh = Fresh()
  span_a, span_b = fresh(10), fresh(10)
  tokens = fresh(2) + span_a + fresh(10) + span_b + fresh(25)
  copy = len(tokens)
  # A, B, A: each jump is a switch, even the return to A, because the previous start is now in B.
  tokens += span_a[:4] + fresh(1) + span_b[:4] + fresh(1) + span_a[5:10]
  _, switch = recall_masks(np.array(tokens), **SMALL)
  assert flagged(switch) == [copy + 5, copy + 10]


def test_masks_see_only_the_document_passed():
  fresh = Fresh()
  span = fresh(8)
  doc_a = fresh(3) + span + fresh(30)
  doc_b = fresh(25) + span + fresh(3)
  recall_b, switch_b = recall_masks(np.array(doc_b), **SMALL)
  assert not recall_b.any() and not switch_b.any()
  # Packed into one call, B's span would recall A's: document boundaries are the caller's split into calls.
  recall_ab, _ = recall_masks(np.array(doc_a + doc_b), **SMALL)
  assert recall_ab[len(doc_a) + 25]


def test_appending_text_keeps_earlier_masks(rng):
  tokens = rng.integers(0, 3, 300)
  full_recall, full_switch = recall_masks(tokens, ngram=3, min_distance=10, switch_window=4)
  assert full_recall.any()
  for cut in (50, 151, 299):
    recall, switch = recall_masks(tokens[:cut], ngram=3, min_distance=10, switch_window=4)
    # Targets whose n-gram ends inside the prefix only depend on the prefix (uniqueness counts earlier occurrences).
    keep = cut - 3 + 1
    np.testing.assert_array_equal(recall[:keep], full_recall[:keep])
    np.testing.assert_array_equal(switch[:keep], full_switch[:keep])


def test_documents_without_repeats_give_nothing(rng):
  tokens = rng.permutation(200_000)[:20_000]
  recall, switch = recall_masks(tokens)
  assert recall.shape == switch.shape == tokens.shape
  assert recall.dtype == switch.dtype == np.bool_
  assert not recall.any() and not switch.any()


def test_short_documents():
  for length in range(5):
    recall, switch = recall_masks(np.arange(length) % 2, ngram=4, min_distance=0, switch_window=0)
    assert recall.shape == switch.shape == (length,)
    assert not recall.any() and not switch.any()


def test_paper_defaults_on_long_document():
  fresh = Fresh()
  # Sources A, B, C at 5, 145, 485: pairwise more than 64 tokens apart.
  span_a, span_b, span_c = fresh(40), fresh(40), fresh(40)
  tokens = fresh(5) + span_a + fresh(100) + span_b + fresh(300) + span_c + fresh(600)
  copy = len(tokens)
  # Recall A, jump to B 30 tokens later (switch), then after 100 tokens jump to C (too late to switch).
  tokens += span_a[:20] + fresh(10) + span_b[:20] + fresh(80) + span_c[:40]
  start_b, start_c = copy + 30, copy + 130
  # D repeats exactly 512 tokens later (not "more than 512"), E 513 tokens later.
  span_d, span_e = fresh(10), fresh(10)
  source_d = len(tokens)
  tokens += span_d + span_e + fresh(492) + span_d + fresh(1) + span_e
  start_e = source_d + 523
  recall, switch = recall_masks(np.array(tokens))
  expected = (
    [copy]
    + list(range(copy + 4, copy + 20))
    + [start_b]
    + list(range(start_b + 4, start_b + 20))
    + [start_c]
    + list(range(start_c + 4, start_c + 40))
    + [start_e]
    + list(range(start_e + 4, start_e + 10))
  )
  assert flagged(recall) == expected
  assert flagged(switch) == [start_b]


def test_paper_defaults_match_brute_force(rng):
  # Six symbols give 1296 four-grams, so a 1200-token document has many unique matches beyond 512 tokens.
  tokens = rng.integers(0, 6, 1200)
  recall, switch = recall_masks(tokens)
  expected_recall, expected_switch = brute_force_masks(tokens, 4, 512, 64)
  assert expected_recall.sum() > 10 and expected_switch.any()
  np.testing.assert_array_equal(recall, expected_recall)
  np.testing.assert_array_equal(switch, expected_switch)


@pytest.mark.parametrize(
  "ngram,min_distance,switch_window,alphabet,length",
  [(1, 3, 2, 6, 60), (2, 5, 3, 4, 80), (3, 8, 4, 3, 120), (4, 20, 5, 3, 200), (4, 0, 1, 2, 60)],
)
def test_matches_brute_force_on_random_documents(rng, ngram, min_distance, switch_window, alphabet, length):
  recalls = switches = 0
  for trial in range(60):
    dtype = (np.int32, np.int64, np.uint16)[trial % 3]
    tokens = rng.integers(0, alphabet, rng.integers(1, length + 1)).astype(dtype)
    recall, switch = recall_masks(tokens, ngram=ngram, min_distance=min_distance, switch_window=switch_window)
    expected_recall, expected_switch = brute_force_masks(tokens, ngram, min_distance, switch_window)
    np.testing.assert_array_equal(recall, expected_recall, err_msg=str(tokens.tolist()))
    np.testing.assert_array_equal(switch, expected_switch, err_msg=str(tokens.tolist()))
    assert not (switch & ~recall).any()
    recalls += int(recall.sum())
    switches += int(switch.sum())
  # The comparison only means something if the random documents exercise both masks.
  assert recalls > 0 and switches > 0


def test_weights_follow_eq13():
  recall = np.array([False, True, True, False])
  switch = np.array([False, False, True, False])
  for beta_switch, switch_weight in ((9.0, 19.0), (49.0, 59.0)):  # the paper's two CPT stages
    weights = recall_weights(recall, switch, beta=9.0, beta_switch=beta_switch)
    assert weights.dtype == np.float32
    np.testing.assert_array_equal(weights, [1.0, 10.0, switch_weight, 1.0])
  batched = recall_weights(np.stack([recall, ~recall]), np.zeros((2, 4), bool), beta=2.0, beta_switch=5.0)
  np.testing.assert_array_equal(batched, [[1, 3, 3, 1], [3, 1, 1, 3]])


def test_rejects_bad_input():
  with pytest.raises(ValueError, match="1-D integer"):
    recall_masks(np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match="1-D integer"):
    recall_masks(np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="ngram"):
    recall_masks(np.zeros(3, np.int32), ngram=0)


def test_docstring_example():
  failures, attempted = doctest.testmod(recall_module)
  assert attempted > 0 and failures == 0
