"""A few rows times weight matrices read where they lie: `x [rows, K] @ W_j [K, N_j]` for decode, where each
projection of a batch-1 step is a matrix-vector product (rows ≤ `MAX_ROWS`).

Why a kernel: XLA's GPU compiler rewrites a dot with a vector operand (operands under 10M elements together)
into a multiply and a reduction. For W_o, W_gate/W_up and W_down it writes the elementwise product to memory and
reads it back; the products ran at about 0.6 TB/s of an H200's 4.8 (docs/notes.md). This kernel reads each
weight once.

The weights are read where they lie: a scanned model's parameter stacks `[layers, K, N]` with the layer index,
as `bounded_decode` reads the caches. A custom call handed `W[layer]` would get a copy of the slice.

Grid: (column block, contraction split). Program (c, s) reads rows `s·K/S ..` of the `BN` columns of block c
in steps of `BK` rows, and writes its partial sums `[rows, BN]` (float32) to `partials[s]`. The launcher adds
the S partials; XLA fuses that sum into the consumer. Weights that share the input (W_q, W_k, W_v; W_gate, W_up)
go in one launch: their column blocks follow one another on the grid's first axis, so the grid is as wide as
their columns together. The jnp specification is `matvec_reference`.

Rows: below `DOT_ROWS`, float32 elementwise products and sums per row, since `tl.dot` needs 16 rows. From
`DOT_ROWS` on, the rows are padded to 16 and each tile is one `tl.dot`.

An RMSNorm of `x` (`norm_scale`, flax's `nn.RMSNorm`: `x * (rsqrt(mean(x²) + ε) · scale)` in float32, rounded to
the products' dtype) can run in the prologue: each program reads its rows whole (a few KB), forms their norms and
scales its chunk of them. In XLA that norm was two launches (the reduction, then the scaling) before the kernel.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import MIN_DOT_DIM, default_interpret, layer_stack

MAX_ROWS = 16  # the kernel's rows: a batch-1 step's 1, up to a small batch's 16
DOT_ROWS = 4  # from this many rows on, each tile is one tl.dot over 16 padded rows
TARGET_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)
NORM_CHUNK = 4096  # features of x per load when a program forms its rows' norms


def compilable(*, rows, k, ns):
  """Whether the kernel takes `rows` rows against weights `[k, n]` for each n in `ns`: tiles of at least 16
  rows and columns must divide them."""
  return 0 < rows <= MAX_ROWS and k % MIN_DOT_DIM == 0 and all(n % MIN_DOT_DIM == 0 for n in ns)


def _power_of_two_divisor(n, cap):
  """The largest power of two that divides `n`, at most `cap`."""
  size = cap
  while n % size:
    size //= 2
  return size


def tiling(rows, k, ns):
  """(block_k, block_n, splits) for `rows` rows against weights `[k, n]`, `n` in `ns`: column tiles of up to 64,
  contraction tiles of up to 128 (elementwise rows) or 256 (tl.dot), and the fewest splits of the contraction
  (a divisor of its tiles) that give `TARGET_PROGRAMS` programs, all of them where even that is too few."""
  block_n = _power_of_two_divisor(math.gcd(*ns), 64)
  block_k = _power_of_two_divisor(k, 128 if rows < DOT_ROWS else 256)
  columns = sum(n // block_n for n in ns)
  tiles = k // block_k
  splits = next((s for s in range(1, tiles + 1) if tiles % s == 0 and columns * s >= TARGET_PROGRAMS), tiles)
  return block_k, block_n, splits


def _matvec_kernel(layer_ref, x_ref, *refs, starts, block_k, steps, rows, dot_precision, dtype, norm_eps, gated):
  """Program (c, s): its weight is the one whose column blocks `[starts[j], starts[j+1])` hold c. layer_ref
  `[1]`; x_ref `[rows', K/S]` in the products' `dtype` (rows' = 16 on the tl.dot path), or with a norm (`norm_eps`
  set) `[rows', K]` in x's own dtype, and then scale_ref `[layers, K]` first among `refs`; each weight ref
  `[layers, K/S, BN]` read at layer `layer_ref[0]`; o_ref `[rows', BN]` float32, this split's partial sums.
  `gated`: x_ref is `[S', rows', 2K]` float32, a gate/up launch's partial sums, and x is SwiGLU's hidden vector
  formed from them (`_swiglu`)."""
  normed = norm_eps is not None
  scale_ref, *w_refs, o_ref = refs if normed else (None, *refs)
  layer = layer_ref[0]
  column = pl.program_id(0)
  if normed:
    # Each program forms the norms of its rows from the whole rows (a few KB) in a few wide loads, straight-line
    # code rather than a loop over block_k: a program's weights are one or two tiles, so a chain of small loads
    # before them would cost more latency than their bytes.
    width = x_ref.shape[1]
    norm_chunk = _power_of_two_divisor(width, NORM_CHUNK)

    def inverse(row=None):  # 1 / RMS of one row (a scalar) or of all (`[16]`)
      total = 0.0
      for start in range(0, width, norm_chunk):
        at = pl.ds(start, norm_chunk)
        x = (x_ref[:, at] if row is None else x_ref[row, at]).astype(jnp.float32)
        total = total + jnp.sum(x * x, axis=-1)
      return jax.lax.rsqrt(total / width + norm_eps)

    inverses = inverse() if dot_precision is not None else [inverse(r) for r in range(rows)]
  first = pl.program_id(1) * (steps * block_k)  # this split's first feature of x

  def x_at(k):
    """x at contraction slice `k` of this split, in the products' dtype (normed first): `[rows', BK]` on the
    tl.dot path, else a list of the rows `[BK]`."""
    rows_at = lambda at: x_ref[:, at] if dot_precision is not None else [x_ref[r, at] for r in range(rows)]
    if gated:
      at, width = first + k.start, x_ref.shape[2] // 2
      summed = lambda row, at: sum(x_ref[s, row, pl.ds(at, k.size)] for s in range(x_ref.shape[0]))
      if dot_precision is not None:  # `[16, BK]`
        return _swiglu(summed(slice(None), at), summed(slice(None), width + at), dtype)
      return [_swiglu(summed(r, at), summed(r, width + at), dtype) for r in range(rows)]
    if not normed:
      return rows_at(k)
    at = pl.ds(first + k.start, k.size)
    scale = scale_ref[layer, at].astype(jnp.float32)  # once per step, for every row
    if dot_precision is not None:
      return (rows_at(at).astype(jnp.float32) * (inverses[:, None] * scale[None, :])).astype(dtype)
    return [(x.astype(jnp.float32) * (inverse * scale)).astype(dtype) for x, inverse in zip(rows_at(at), inverses)]

  def product(w_ref):
    def step(i, acc):
      k = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
      w = w_ref[layer, k, :].astype(dtype)
      if dot_precision is not None:
        return acc + jax.lax.dot(x_at(k), w, precision=dot_precision, preferred_element_type=jnp.float32)
      w = w.astype(jnp.float32)
      return tuple(a + jnp.sum(x.astype(jnp.float32)[:, None] * w, axis=0) for x, a in zip(x_at(k), acc))

    block_n = o_ref.shape[-1]
    if dot_precision is not None:
      o_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros((MIN_DOT_DIM, block_n), jnp.float32))
      return
    sums = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(rows)))
    for r, total in enumerate(sums):
      o_ref[r, :] = total

  if len(w_refs) == 1:
    product(w_refs[0])
    return
  for j, w_ref in enumerate(w_refs):
    pl.when((column >= starts[j]) & (column < starts[j + 1]))(functools.partial(product, w_ref))


@functools.partial(
  jax.jit,
  static_argnames=(
    "dtype",
    "norm_eps",
    "gated",
    "partial_sums",
    "tiles",
    "num_warps",
    "num_stages",
    "interpret",
  ),
)
def matvec(
  x,
  weights,
  *,
  layer=None,
  dtype=None,
  norm_scale=None,
  norm_eps=1e-6,
  gated=False,
  partial_sums=False,
  tiles=None,
  num_warps=4,
  num_stages=2,
  interpret=None,
):
  """`x [rows, K]` (RMS-normed first with `norm_scale`) times each of `weights` → a tuple of `[rows, N_j]` float32
  sums, the products in `dtype`.

  Args:
    x: `[rows, K]`, rows ≤ `MAX_ROWS`; with `gated`, the partial sums `[S, rows, 2K]` float32 of a SwiGLU's
      gate and up products (a launch with `partial_sums`, the gate's columns first), from which each program
      forms its part of the hidden vector `silu(gate) · up` (rounded as `nn.silu(gate) * up` in `dtype`).
    weights: a sequence of `[K, N_j]` matrices, or with `layer`, of a scanned model's stacks `[layers, K, N_j]`
      (read at `layer` where they lie).
    layer: int32 scalar, the layer of the stacks; None for plain matrices.
    dtype: the products' dtype (`x` and the weights are cast to it before multiplying, as `nn.Dense` promotes
      them); default `x.dtype`. The sums are float32 whatever it is.
    norm_scale: None, or the scale `[K]` (with `layer`, a stack `[layers, K]` read there) of an RMSNorm of each
      row of `x` before the products, as flax's `nn.RMSNorm(epsilon=norm_eps)` computes it (float32, then
      rounded to `dtype`); norm_eps: its ε.
    gated: see x. SwiGLU's down projection then takes its input straight from the gate/up launch, without a
      launch of XLA's between them to sum the partial sums and form the product.
    partial_sums: return the launch's partial sums `[splits, rows, ΣN_j]` float32 (the weights' columns one
      after another; their sum over axis 0 is the products), unsummed, for a `gated` launch to read.
    tiles: (block_k, block_n, splits) overriding `tiling`'s choice (powers of two dividing K and every N_j;
      splits dividing K / block_k).
    num_warps, num_stages: Triton's launch parameters.
    interpret: Pallas interpret mode; default: compiled on a GPU only.

  Jitted, like the other kernels' launchers: a bare `pallas_call` is never dead-code eliminated (JAX's rule for
  it keeps every input). flax's constancy check for `nn.scan` (in the GPU machine's flax) eliminates dead code
  from the body and raises "broadcasted variable has a data dependency on the scan body" if the carried x or the
  layer index is still used then. A jitted call whose outputs are unused is dropped whole.
  """
  interpret = default_interpret() if interpret is None else interpret
  dtype = jnp.dtype(dtype or x.dtype)
  if gated:
    if norm_scale is not None or x.ndim != 3 or x.shape[2] % 2:
      raise ValueError(f"a gated input is a gate/up launch's partial sums [S, rows, 2K], without a norm; got {x.shape}")
    rows, k = x.shape[1], x.shape[2] // 2
  else:
    rows, k = x.shape
  stacks, layer_index = zip(*(layer_stack(w, layer, 2) for w in weights))
  layer_index = layer_index[0]
  ns = [w.shape[2] for w in stacks]
  if any(w.shape[1] != k for w in stacks):
    raise ValueError(f"every weight must have x's {k} rows, got {[w.shape[1:] for w in stacks]}")
  if not compilable(rows=rows, k=k, ns=ns):
    raise ValueError(
      f"matvec takes 1..{MAX_ROWS} rows and weights whose sizes are multiples of {MIN_DOT_DIM}; got x {x.shape}, "
      f"weights {[w.shape[1:] for w in stacks]}"
    )
  block_k, block_n, splits = tiles or tiling(rows, k, ns)
  if k % (block_k * splits) or any(n % block_n for n in ns):
    raise ValueError(f"tiles {(block_k, block_n, splits)} must divide K = {k} and every N in {ns}")
  on_dot = rows >= DOT_ROWS
  x_rows = MIN_DOT_DIM if on_dot else rows
  normed = norm_scale is not None
  if normed:
    scale, _ = layer_stack(norm_scale, layer, 1)
    if scale.shape[1] != k:
      raise ValueError(f"norm_scale must hold x's {k} features, got shape {norm_scale.shape}")
  # The norm reads x as it is (flax's RMSNorm forms it in float32 from the unrounded input); padded rows are 0.
  if gated:
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, x_rows - rows), (0, 0)))
  else:
    x = jnp.pad(x if normed else x.astype(dtype), ((0, x_rows - rows), (0, 0)))
  dot_precision = None
  if on_dot:
    dot_precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
  starts = [0]
  for n in ns:
    starts.append(starts[-1] + n // block_n)
  chunk = k // splits

  def weight_spec(j):
    last = starts[j + 1] - starts[j] - 1
    return pl.BlockSpec((stacks[j].shape[0], chunk, block_n), lambda c, s: (0, s, jnp.clip(c - starts[j], 0, last)))

  if gated:  # every program sums its features of the gate and the up from all of the input's partial sums
    x_spec = pl.BlockSpec(x.shape, lambda c, s: (0, 0, 0))
  elif normed:  # every program reads the rows whole to form their norms
    x_spec = pl.BlockSpec((x_rows, k), lambda c, s: (0, 0))
  else:
    x_spec = pl.BlockSpec((x_rows, chunk), lambda c, s: (0, s))
  partials = pl.pallas_call(
    functools.partial(
      _matvec_kernel,
      starts=tuple(starts),
      block_k=block_k,
      steps=chunk // block_k,
      rows=rows,
      dot_precision=dot_precision,
      dtype=dtype,
      norm_eps=norm_eps if normed else None,
      gated=gated,
    ),
    grid=(starts[-1], splits),
    in_specs=[
      pl.BlockSpec((1,), lambda c, s: (0,)),
      x_spec,
      *([pl.BlockSpec((scale.shape[0], k), lambda c, s: (0, 0))] if normed else []),
      *(weight_spec(j) for j in range(len(stacks))),
    ],
    out_specs=pl.BlockSpec((None, x_rows, block_n), lambda c, s: (s, 0, c)),
    out_shape=jax.ShapeDtypeStruct((splits, x_rows, starts[-1] * block_n), jnp.float32),
    compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    interpret=interpret,
    name="matvec",
  )(layer_index, x, *([scale] if normed else []), *stacks)
  if partial_sums:
    return partials[:, :rows]
  sums = jnp.sum(partials[:, :rows], axis=0)
  offsets = [start * block_n for start in starts]
  return tuple(sums[:, offsets[j] : offsets[j + 1]] for j in range(len(stacks)))


def _swiglu(gate, up, dtype):
  """SwiGLU's hidden vector from float32 sums as `nn.silu(gate) * up` forms it from the products' outputs in
  `dtype`: each input rounded to `dtype`, and each operation's result (the sigmoid, its product with the gate, the
  product with up)."""
  rounded = lambda v: v.astype(dtype).astype(jnp.float32)
  gate, up = rounded(gate), rounded(up)
  return rounded(rounded(gate * rounded(jax.nn.sigmoid(gate))) * up).astype(dtype)


def rms_normed(x, scale, eps, dtype):
  """flax's `nn.RMSNorm(epsilon=eps, dtype=dtype)` of `x [..., K]` with its `scale` `[K]`: the mean of squares and
  the scaling in float32, the result rounded to `dtype`."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  multiplier = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale
  return (x * multiplier).astype(dtype)


def matvec_reference(x, weights, *, layer=None, dtype=None, norm_scale=None, norm_eps=1e-6, gated=False):
  """The specification of `matvec`: `x @ W_j` (or `x @ W_j[layer]`) in `dtype` with float32 sums, per weight;
  with `norm_scale` (`[K]`, or a stack read at `layer`), `rms_normed(x)` in place of x; `gated`: x is a gate/up
  launch's partial sums `[S, rows, 2K]`, and what is multiplied is `nn.silu(gate) * up` of their sums, each
  rounded to `dtype`, as SwiGLU forms it."""
  dtype = jnp.dtype(dtype or x.dtype)
  if gated:
    gate, up = jnp.split(jnp.sum(x.astype(jnp.float32), axis=0).astype(dtype), 2, axis=-1)
    x = jax.nn.silu(gate) * up
  pick = (lambda w: w) if layer is None else (lambda w: w[layer])
  if norm_scale is not None:
    x = rms_normed(x, pick(norm_scale), norm_eps, dtype)
  return tuple(jnp.matmul(x.astype(dtype), pick(w).astype(dtype), preferred_element_type=jnp.float32) for w in weights)
