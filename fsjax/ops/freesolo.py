"""FreeSolo attention reference: selection, long-range readout and the branch mix (FS Eq. 2, 5-9).

This is the specification every faster path (Pallas kernels, caches, tree searches) is tested against:
obvious jnp, at least float32 math (float64 stays float64), shapes in docstrings, equation numbers in comments.
"""

import math

import jax
import jax.numpy as jnp

from fsjax.ops import cells, forest
from fsjax.ops.common import PRECISION, check_qkv, compute_dtype
from fsjax.ops.cudnn import causal_rope_attention_cudnn, cudnn_usable
from fsjax.ops.local import local_attention
from fsjax.ops.softmax import masked_softmax
from pallas_kernels.common import compilable, default_interpret

READOUT_NORM_EPS = 1e-8  # FS App. D.2
IMPLS = ("reference", "auto", "pallas")


def _check_variant_and_impl(variant, impl, tau=None):
  if variant not in cells.VARIANTS:
    raise ValueError(f"variant must be one of {cells.VARIANTS}, got {variant!r}")
  if variant == "fsb" and tau is None:
    raise ValueError("tau must be given for variant 'fsb': the per-head median cell norm (python -m "
                     "fsjax.calibrate)")
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def use_kernels(impl, *, cell, head_dim):
  """Whether `impl` runs the Pallas kernels: "pallas" always (interpreted off GPU), "auto" on a GPU when
  Triton can tile the geometry (cell a power of two >= 16, head_dim >= 16), "reference" never."""
  if impl == "auto":
    return not default_interpret() and compilable(cell=cell, head_dim=head_dim)
  return impl == "pallas"


def _per_head(value, heads, name, dtype):
  value = jnp.asarray(value, dtype)
  if value.ndim > 1 or (value.ndim == 1 and value.shape[0] != heads):
    raise ValueError(f"{name} must be a scalar or have shape [heads]=[{heads}], got {value.shape}")
  return jnp.broadcast_to(value, (heads,))


def select_cells(q, k, *, variant="fs", lam=1.0, sigma=4.0, cell=32, block=128, top_k=4, retain_top=64,
                 retain_recent=8, tau=None, beam=16, bound_c=8.0):
  """Per query and head, the cells read by the long-range branch (FS Eq. 5-8, FS-B Eq. 10-12). No gradient.

  Args:
    q, k: `[batch, T, heads, d]` unrotated queries and keys.
    variant: "fs" (all eligible cells), "fsl" (norm-pruned, Eq. 8) or "fsb" (two-forest beam search and token
      rerank, `fsjax.ops.forest`).
    lam, sigma: scalars or `[heads]`; routing prior of Eq. 7.
    cell, block, top_k, retain_top, retain_recent: `s`, `B`, `K`, `P`, `W`.
    tau, beam, bound_c: FS-B's τ (scalar or `[heads]`, inclusive), beam width W_b and c of Eq. 11.

  Returns:
    `[batch, T, heads, K]` int32 cell indices, best first, -1 where fewer than K cells are available.
  """
  batch, seq, heads, _ = q.shape
  dtype = compute_dtype(q.dtype)
  q, k = jax.lax.stop_gradient(q.astype(dtype)), jax.lax.stop_gradient(k.astype(dtype))
  lam = jax.lax.stop_gradient(_per_head(lam, heads, "lam", dtype))
  sigma = jax.lax.stop_gradient(_per_head(sigma, heads, "sigma", dtype))
  if seq < cell:
    return jnp.full((batch, seq, heads, top_k), -1, jnp.int32)
  if variant == "fsb":
    tau = jax.lax.stop_gradient(_per_head(tau, heads, "tau", dtype))
    return forest.fsb_select_cells(q, k, tau=tau, lam=lam, sigma=sigma, cell=cell, block=block, top_k=top_k,
                                   beam=beam, bound_c=bound_c)
  mean_keys, max_norms, centers = cells.cell_summaries(k, cell)  # Eq. 5
  available = cells.available_cells(max_norms, seq, variant=variant, cell=cell, block=block,
                                    retain_top=retain_top, retain_recent=retain_recent)  # Eq. 6, 8
  scores = cells.cell_scores(q, mean_keys, max_norms, centers, lam=lam, sigma=sigma)  # Eq. 7
  return cells.top_k_cells(scores, available, top_k)


def gather_cells(x, cell_idx, cell):
  """Tokens of the selected cells.

  Args:
    x: `[batch, T, heads, d]` keys or values.
    cell_idx: `[batch, T, heads, K]` cell indices, -1 for none (gathers cell 0; mask it out).
    cell: cell size `s`.

  Returns:
    `[batch, heads, T, K, s, d]`.
  """
  batch, seq, heads, head_dim = x.shape
  num_cells = seq // cell
  x_cells = x[:, : num_cells * cell].reshape(batch, num_cells, cell, heads, head_dim)
  x_cells = jnp.transpose(x_cells, (0, 3, 1, 2, 4))  # [batch, heads, M, s, d]
  idx = jnp.transpose(jnp.maximum(cell_idx, 0), (0, 2, 1, 3))  # [batch, heads, T, K]
  return jax.vmap(jax.vmap(lambda cells_of_head, ix: cells_of_head[ix]))(x_cells, idx)


def sparse_readout(q, k, v, cell_idx, *, cell):
  """Eq. 9 before the norm: `u_i = softmax(q_i·k_j/√d over S_i) V_S`, jointly over all selected tokens.

  Args:
    q, k, v: `[batch, T, heads, d]` unrotated (NoPE readout).
    cell_idx: `[batch, T, heads, K]` from `select_cells`.
    cell: cell size `s`.

  Returns:
    `u`: `[batch, T, heads, d]`, zero where no cell is selected.
  """
  head_dim = q.shape[-1]
  k_sel = gather_cells(k, cell_idx, cell)  # [batch, heads, T, K, s, d]
  v_sel = gather_cells(v, cell_idx, cell)
  logits = jnp.einsum("bthd,bhtksd->bhtks", q, k_sel, precision=PRECISION) / math.sqrt(head_dim)
  selected = jnp.transpose(cell_idx >= 0, (0, 2, 1, 3))[..., None]  # [batch, heads, T, K, 1]
  probs = masked_softmax(logits, selected, axis=(-2, -1))
  return jnp.einsum("bhtks,bhtksd->bthd", probs, v_sel, precision=PRECISION)


def rms_norm(x, gain, eps=READOUT_NORM_EPS):
  """RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) * gain`; zero stays zero."""
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def freesolo_long_range(q, k, v, *, variant="fs", lam=1.0, sigma=4.0, lr_gain=1.0, cell=32, block=128,
                        top_k=4, retain_top=64, retain_recent=8, tau=None, beam=16, bound_c=8.0, window=512,
                        impl="reference"):
  """Long-range branch `o_lr = RMSNorm(u)` (FS Eq. 5-9), before the α mix.

  Args:
    q, k, v: `[batch, T, heads, d]` unrotated; any T (cells past the last complete one are never eligible).
    variant: "fs", "fsl" or "fsb".
    lam, sigma: scalars or `[heads]`; λ ≥ 0, σ > 0 (Eq. 7). No gradient reaches them.
    lr_gain: readout RMSNorm gain, scalar or `[d]`.
    cell, block, top_k, retain_top, retain_recent: `s`, `B`, `K`, `P`, `W`.
    window: only validated here (the local radius must cover a block: `w >= B - 1`).
    tau, beam, bound_c: FS-B forest arguments (τ per head, beam width, c of Eq. 11); unused by fs/fsl.
    impl: "reference" | "auto" | "pallas" (see `use_kernels`); the kernels read q, k, v in their own dtype
      (bf16 on tensor cores) and score cells in float32. FS-B selects with the reference forests and reads with
      the readout kernel.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`; zero where nothing is available (e.g. the first block).
  """
  check_qkv(q, k, v)
  _check_variant_and_impl(variant, impl, tau)
  cells.validate_routing(cell=cell, block=block, window=window, top_k=top_k, retain_top=retain_top,
                         retain_recent=retain_recent)
  dtype = compute_dtype(q.dtype)
  routing = dict(variant=variant, lam=lam, sigma=sigma, cell=cell, block=block, top_k=top_k,
                 retain_top=retain_top, retain_recent=retain_recent)
  kernels = use_kernels(impl, cell=cell, head_dim=q.shape[-1])
  if variant == "fsb":
    cell_idx = select_cells(q, k, tau=tau, beam=beam, bound_c=bound_c, **routing)
  elif kernels:
    from pallas_kernels import cell_scoring  # lazy: the kernels import ops
    cell_idx = cell_scoring.select_cells(q, k, **routing)
  else:
    cell_idx = select_cells(q, k, **routing)
  if kernels:
    from pallas_kernels import sparse_readout as readout_kernel
    u = readout_kernel.sparse_readout(q, k, v, cell_idx, cell=cell).astype(dtype)
  else:
    u = sparse_readout(q.astype(dtype), k.astype(dtype), v.astype(dtype), cell_idx, cell=cell)
  return rms_norm(u, jnp.asarray(lr_gain, dtype)).astype(q.dtype)


def freesolo_attention(q, k, v, *, variant="fs", alpha, lam=1.0, sigma=4.0, lr_gain=1.0, window=512, cell=32,
                       block=128, top_k=4, retain_top=64, retain_recent=8, tau=None, beam=16, bound_c=8.0,
                       rope_theta=10000.0, impl="reference"):
  """FreeSolo attention `o_i = o_sr_i + α_h o_lr_i` (FS Eq. 2).

  Args:
    q, k, v: `[batch, T, heads, d]` unrotated projections; d even.
    variant: "fs" | "fsl" | "fsb".
    alpha: scalar or `[heads]` branch mix.
    lam, sigma, lr_gain, cell, block, top_k, retain_top, retain_recent: see `freesolo_long_range`.
    window: local radius `w` (Eq. 3-4), `w >= B - 1`.
    tau, beam, bound_c: FS-B forest arguments (τ per head, beam width, bound constant c of Eq. 11).
    rope_theta: RoPE base of the local branch.
    impl: "reference" | "auto" | "pallas"; with kernels, a half-precision local branch on GPU runs on cuDNN.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`.
  """
  check_qkv(q, k, v)
  long_range = freesolo_long_range(q, k, v, variant=variant, lam=lam, sigma=sigma, lr_gain=lr_gain, cell=cell,
                                   block=block, top_k=top_k, retain_top=retain_top, retain_recent=retain_recent,
                                   window=window, impl=impl, tau=tau, beam=beam, bound_c=bound_c)
  if use_kernels(impl, cell=cell, head_dim=q.shape[-1]) and cudnn_usable(q.dtype):
    local = causal_rope_attention_cudnn(q, k, v, window=window, rope_theta=rope_theta)
  else:
    local = local_attention(q, k, v, window=window, rope_theta=rope_theta)
  dtype = compute_dtype(q.dtype)
  alpha = _per_head(alpha, q.shape[2], "alpha", dtype)
  return (local.astype(dtype) + alpha[:, None] * long_range.astype(dtype)).astype(q.dtype)
