"""fsjax.memory's chunk fitting on programs whose bytes are known functions of the chunk (no device needed)."""

import types

import pytest

from fsjax import memory


class _Jitted:
  """Stands for a `jax.jit` function: compiling for `size` yields a program needing `bytes_at(size)`."""

  def __init__(self, bytes_at):
    self.bytes_at, self.compiled = bytes_at, []

  def lower(self, size):
    def compile():
      self.compiled.append(size)
      need = self.bytes_at(size)
      analysis = types.SimpleNamespace(temp_size_in_bytes=need, output_size_in_bytes=0, alias_size_in_bytes=0)
      return types.SimpleNamespace(memory_analysis=lambda: analysis)

    return types.SimpleNamespace(compile=compile)


def _plain_halving(bytes_at, size, unit, budget):
  while bytes_at(size) > budget and size > unit:
    size = max(unit, size // 2 // unit * unit)
  return size


@pytest.mark.parametrize(
  "name,bytes_at",
  [
    ("quadratic", lambda s: 1000 * s * s),
    ("linear", lambda s: 4_000_000 + 60_000 * s),
    ("mixed", lambda s: 2_000_000 + 30_000 * s + 40 * s * s),
  ],
)
@pytest.mark.parametrize("free", [80_000_000, 300_000_000, 5_000_000_000])
def test_fitting_finds_what_plain_halving_finds_with_fewer_compiles(monkeypatch, name, bytes_at, free):
  monkeypatch.setattr(memory, "free_bytes", lambda: free)
  monkeypatch.setattr(memory, "_PROGRAMS", type(memory._PROGRAMS)())
  jitted = _Jitted(bytes_at)
  size, program = memory.fitted_program(jitted, name, 4096, 64, lambda s: ((s,), {}), "test")
  expected = _plain_halving(bytes_at, 4096, 64, memory.FIT_MARGIN * free)
  assert size == expected and memory.program_bytes(program) == bytes_at(size)
  halvings = [4096 >> i for i in range(7) if 4096 >> i >= expected]
  assert jitted.compiled[0] == 4096 and jitted.compiled[-1] == size and set(jitted.compiled) <= set(halvings)
  if name == "quadratic":  # exactly quadratic: the skip lands on the fitting size at once
    assert jitted.compiled == [4096, size]
  assert memory.fitted_program(jitted, name, 4096, 64, lambda s: ((s,), {}), "test")[0] == size  # remembered
  assert jitted.compiled.count(size) == 1


def test_not_even_one_unit_fitting_is_a_device_memory_error_naming_the_sizes(monkeypatch):
  monkeypatch.setattr(memory, "free_bytes", lambda: 1_000_000)
  monkeypatch.setattr(memory, "_PROGRAMS", type(memory._PROGRAMS)())
  with pytest.raises(memory.DeviceMemoryError, match=r"prefill at batch 9: a chunk of 64 tokens needs 0.0\d GiB"):
    memory.fitted_program(_Jitted(lambda s: 1000 * s * s), "k", 4096, 64, lambda s: ((s,), {}), "prefill at batch 9")


@pytest.mark.parametrize(
  "stats,expected",
  [
    # Preallocated: the whole limit is one pool, so its largest free block is what a buffer can take.
    (dict(bytes_limit=100, bytes_in_use=40, pool_bytes=100, largest_free_block_bytes=25), 25),
    # Growing as it goes (XLA_PYTHON_CLIENT_PREALLOCATE=false): beyond its small pool lies unreserved memory.
    (dict(bytes_limit=100, bytes_in_use=40, pool_bytes=45, largest_free_block_bytes=5), 55),
    (dict(bytes_limit=100, bytes_in_use=40, pool_bytes=70, largest_free_block_bytes=28), 30),
    # No pool size reported: the free block alone; no free block reported: what is free.
    (dict(bytes_limit=100, bytes_in_use=40, largest_free_block_bytes=25), 25),
    (dict(bytes_limit=100, bytes_in_use=40), 60),
    ({}, None),
  ],
)
def test_the_largest_free_buffer_counts_memory_the_allocator_has_not_reserved(monkeypatch, stats, expected):
  monkeypatch.setattr(memory, "_stats", lambda: stats)
  assert memory.free_block_bytes() == expected
