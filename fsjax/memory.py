"""Device memory for prefill and generation: what is free, what a cache takes, and chunk programs sized to fit.

A prefill chunk's temporaries grow with batch × chunk, and for the operators that are references (MoBA, ZHA,
FS-B's forests, a later chunk attending a dense cache) with the keys each query sees as well. The size that
`fsjax.decode.prefill_chunk` estimates is therefore checked against XLA's own buffer assignment of the compiled
program, and halved until the program's temporaries fit what the device has free. XLA's GPU autotuner compiles
candidate kernels into whatever memory is left, so a failed allocation while compiling may surface as
RESOURCE_EXHAUSTED or as "All configs failed during profiling"; both count as not fitting.
"""

import collections

import jax

# What a user can do when a batch does not fit, besides a smaller batch or max_len.
MEMORY_HINT = (
  "XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) sets how much of the GPU XLA may take; "
  "XLA_PYTHON_CLIENT_PREALLOCATE=false lets other processes share it"
)
FIT_MARGIN = 0.75  # of the largest free block a program's temporaries may take: inputs and outputs move around it
_ALLOCATION_FAILURES = ("RESOURCE_EXHAUSTED", "All configs failed")
_PROGRAMS = collections.OrderedDict()  # (key, size) -> (fitted size, compiled program), most recent last
_MAX_PROGRAMS = 128  # compiled programs are small beside the caches they serve


class DeviceMemoryError(MemoryError):
  """A cache or a prefill chunk that cannot fit in the device memory left; the message names the sizes."""


def _stats():
  """Allocator statistics of this process's first device (the one a jit without shardings runs on; in a
  multi-process run, `jax.devices()[0]` is another process's)."""
  return jax.local_devices()[0].memory_stats() or {}


def free_bytes():
  """Bytes the first device has left to XLA, or None where the platform reports no memory size (CPU)."""
  stats = _stats()
  if "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def free_block_bytes():
  """The largest buffer the first device's allocator can still hand out (a program's temporaries are one
  buffer), where reported; else `free_bytes()`. That is its largest free block within the memory it has
  reserved, or the memory it has not reserved yet, whichever is larger: with XLA_PYTHON_CLIENT_PREALLOCATE=false
  the allocator reserves memory as it goes, so its largest free block alone says nothing about the rest."""
  free = free_bytes()
  stats = _stats()
  block = stats.get("largest_free_block_bytes") if free is not None else None
  if block is None:
    return free
  unreserved = stats["bytes_limit"] - stats.get("pool_bytes", stats["bytes_limit"])
  return min(free, max(block, unreserved))


def tree_bytes(tree):
  """Bytes of the arrays (or `jax.ShapeDtypeStruct`s) in a pytree."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def gib(n):
  return f"{n / 2**30:.2f} GiB"


def check_fits(what, need):
  """Raises `DeviceMemoryError` naming `what` when `need` bytes exceed what the device has free."""
  free = free_bytes()
  if free is not None and need > free:
    raise DeviceMemoryError(f"{what} needs {gib(need)}, but the device has {gib(free)} free; {MEMORY_HINT}")


def program_bytes(compiled):
  """Bytes a compiled program allocates beyond its arguments: temporaries and outputs not aliased to inputs."""
  stats = compiled.memory_analysis()
  return stats.temp_size_in_bytes + max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)


def signature(tree):
  """A hashable description of a pytree of arrays: structure, shapes, dtypes and shardings."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


def _next_size(size, unit, need, budget):
  """The next chunk size worth compiling after `size` needed `need` bytes (None: unknown) of `budget`: halved
  (whole `unit`s, at least one), and halved again while even a quadratic shrink cannot fit. A chunk's bytes are
  a constant plus terms linear in it (activations, logits) plus at most one quadratic (a reference operator's
  scores), all non-negative, so a size r times smaller needs at least r² times fewer; the sizes skipped this way
  could not have fit, and the compiles they would cost are saved."""
  smaller = max(unit, size // 2 // unit * unit)
  while need is not None and smaller > unit and need * (smaller / size) ** 2 > budget:
    smaller = max(unit, smaller // 2 // unit * unit)
  return smaller


def fitted_program(jitted, key, size, unit, lower_args, what):
  """The largest chunk size `<= size` (halved, whole `unit`s, at least one) whose compiled `jitted` fits the free
  device memory, and that compiled program: `(size, compiled)`. Remembered per `(key, size)`.

  Args:
    jitted: a `jax.jit` function; `lower_args(size)` → `(args, kwargs)` to lower it for a chunk of `size`.
    key: hashable; equal keys must mean equal programs for equal sizes.
    what: names the work in the error raised when not even `unit` fits.

  The fit is decided once per `(key, size)` and process, against the memory free at that time.
  """
  if (key, size) in _PROGRAMS:
    _PROGRAMS.move_to_end((key, size))
    return _PROGRAMS[(key, size)]
  free, asked, failure = free_block_bytes(), size, ""
  while True:
    args, kwargs = lower_args(size)
    try:
      compiled = jitted.lower(*args, **kwargs).compile()
      need = program_bytes(compiled)
    except jax.errors.JaxRuntimeError as error:
      if free is None or not any(failure in str(error) for failure in _ALLOCATION_FAILURES):
        raise
      compiled, need = None, None
      failure = f" (compiling: {(str(error).strip().splitlines() or [''])[0][:300]})"
    if compiled is not None and (free is None or need <= FIT_MARGIN * free):
      break
    if size <= unit:
      needs = "more than is free" + failure if need is None else gib(need)
      raise DeviceMemoryError(
        f"{what}: a chunk of {size} tokens needs {needs} of the {gib(free)} free in one block; {MEMORY_HINT}"
      )
    size = _next_size(size, unit, need, FIT_MARGIN * free)
  _PROGRAMS[(key, asked)] = (size, compiled)
  while len(_PROGRAMS) > _MAX_PROGRAMS:
    _PROGRAMS.popitem(last=False)
  return size, compiled
