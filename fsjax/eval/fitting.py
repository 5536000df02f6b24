"""Sizing generated text to a token budget: the largest haystack size whose prompt fits."""


def largest_fitting(fits, guess, smallest=0, largest=None):
  """The largest n in [smallest, largest] with `fits(n)`, for `fits` true up to some n and false beyond;
  galloping from `guess`. Raises ValueError when `smallest` does not fit."""
  if not fits(smallest):
    raise ValueError("the target length cannot hold the smallest prompt plus the generation budget")
  if largest is not None and fits(largest):
    return largest
  guess = max(guess, smallest) if largest is None else min(max(guess, smallest), largest)
  lo, step = smallest, max(1, guess // 32)
  if fits(guess):
    lo = guess
    while (largest is None or lo + step < largest) and fits(lo + step):
      lo, step = lo + step, 2 * step
    hi = lo + step if largest is None else min(lo + step, largest)
  else:
    hi = guess
    while hi - step > smallest and not fits(hi - step):
      hi, step = hi - step, 2 * step
    lo = max(smallest, hi - step)
  while hi - lo > 1:  # fits(lo), not fits(hi)
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo
