"""FreeSolo attention reference: selection, long-range readout and the branch mix (FS Eq. 2, 5-9).

This is the specification every faster path (Pallas kernels, caches, tree searches) is tested against:
obvious jnp, at least float32 math (float64 stays float64), shapes in docstrings, equation numbers in comments.

Grouped-query attention (k, v with `kv_heads` dividing q's `heads`; query head h reads key/value head
`h // group`, `fsjax.reference.grouped`): the paper is multi-head only, so this reading is ours (docs/notes.md).
What is computed from keys alone exists once per key/value head: cell summaries and key norms (Eq. 5), FS-L's
retained pool (Eq. 8 ranks by key norms only), FS-B's τ admission and forests (Eq. 10, 18-21). What is computed
with a query stays per query head, reading its key/value head's state: cell scores with λ_h, σ_h (Eq. 7), the
top K, FS-B's beam search and rerank (Eq. 11-12), the readout (Eq. 9), the local branch and the mix α_h (Eq. 2).
So λ, σ, α are per query head (they weight a query's score or output) and τ per key/value head (it thresholds a
key norm into a forest). The result is multi-head FreeSolo over K and V repeated per group (Hugging Face's
`repeat_kv`) with τ repeated likewise, computed without the repeat.
"""

import math

import jax
import jax.numpy as jnp

from fsjax.reference import cells, forest
from fsjax.reference.common import PRECISION, compute_dtype
from fsjax.reference.grouped import check_grouped_qkv, kv_head_of
from fsjax.reference.local import local_attention
from fsjax.reference.routing import Routing
from fsjax.reference.softmax import masked_softmax

READOUT_NORM_EPS = 1e-8  # FS App. D.2


def check_routing(routing: Routing, tau=None):
  """Validates the geometry and that FS-B has its τ; raises ValueError naming the argument."""
  routing.validate()
  if routing.variant == "fsb" and tau is None:
    raise ValueError("tau must be given for variant 'fsb': the per-head median cell norm (python -m fsjax.calibrate)")


def per_head(value, heads, name, dtype, axis_name="heads"):
  value = jnp.asarray(value, dtype)
  if value.ndim > 1 or (value.ndim == 1 and value.shape[0] != heads):
    raise ValueError(f"{name} must be a scalar or have shape [{axis_name}]=[{heads}], got {value.shape}")
  return jnp.broadcast_to(value, (heads,))


def select_cells(
  q,
  k,
  *,
  variant="fs",
  lam=1.0,
  sigma=4.0,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  tau=None,
  beam=16,
  bound_c=8.0,
):
  """Per query and head, the cells read by the long-range branch (FS Eq. 5-8, FS-B Eq. 10-12). No gradient.

  Args:
    q: `[batch, T, heads, d]` unrotated queries; k: `[batch, T, kv_heads, d]` unrotated keys.
    variant: "fs" (all eligible cells), "fsl" (norm-pruned, Eq. 8) or "fsb" (two-forest beam search and token
      rerank, `fsjax.reference.forest`).
    lam, sigma: scalars or `[heads]`; routing prior of Eq. 7.
    cell, block, top_k, retain_top, retain_recent: `s`, `B`, `K`, `P`, `W`.
    tau, beam, bound_c: FS-B's τ (scalar or `[kv_heads]`, inclusive), beam width W_b and c of Eq. 11.

  Returns:
    `[batch, T, heads, K]` int32 cell indices, best first, -1 where fewer than K cells are available.
  """
  return select_cells_routed(
    q,
    k,
    Routing(
      variant=variant,
      cell=cell,
      block=block,
      top_k=top_k,
      retain_top=retain_top,
      retain_recent=retain_recent,
      beam=beam,
      bound_c=bound_c,
    ),
    lam=lam,
    sigma=sigma,
    tau=tau,
  )


def select_cells_routed(q, k, routing: Routing, *, lam=1.0, sigma=4.0, tau=None):
  """`select_cells` with its geometry as one `Routing` (the window is not used)."""
  batch, seq, heads, _ = q.shape
  dtype = compute_dtype(q.dtype)
  q, k = jax.lax.stop_gradient(q.astype(dtype)), jax.lax.stop_gradient(k.astype(dtype))
  lam = jax.lax.stop_gradient(per_head(lam, heads, "lam", dtype))
  sigma = jax.lax.stop_gradient(per_head(sigma, heads, "sigma", dtype))
  if seq < routing.cell:
    return jnp.full((batch, seq, heads, routing.top_k), -1, jnp.int32)
  if routing.variant == "fsb":
    tau = jax.lax.stop_gradient(per_head(tau, k.shape[2], "tau", dtype, "kv_heads"))
    return forest.fsb_select_cells(
      q,
      k,
      tau=tau,
      lam=lam,
      sigma=sigma,
      cell=routing.cell,
      block=routing.block,
      top_k=routing.top_k,
      beam=routing.beam,
      bound_c=routing.bound_c,
    )
  mean_keys, max_norms, _ = cells.cell_summaries(k, routing.cell)  # Eq. 5
  return cells.select_from_summaries(q, None, mean_keys, max_norms, routing=routing, lam=lam, sigma=sigma)


def gather_cells(x, cell_idx, cell):
  """Tokens of the selected cells, each query head's from the key/value head it reads.

  Args:
    x: `[batch, S, kv_heads, d]` keys or values.
    cell_idx: `[batch, T, heads, K]` cell indices, -1 for none (gathers cell 0; mask it out).
    cell: cell size `s`.

  Returns:
    `[batch, heads, T, K, s, d]`.
  """
  batch, seq, kv_heads, head_dim = x.shape
  heads = cell_idx.shape[2]
  num_cells = seq // cell
  x_cells = x[:, : num_cells * cell].reshape(batch, num_cells, cell, kv_heads, head_dim)
  x_cells = jnp.transpose(x_cells, (0, 3, 1, 2, 4))  # [batch, kv_heads, M, s, d]
  idx = jnp.transpose(jnp.maximum(cell_idx, 0), (0, 2, 1, 3))  # [batch, heads, T, K]
  rows = jnp.arange(batch)[:, None, None, None]
  return x_cells[rows, kv_head_of(heads, kv_heads)[None, :, None, None], idx]


def sparse_readout(q, k, v, cell_idx, *, cell):
  """Eq. 9 before the norm: `u_i = softmax(q_i·k_j/√d over S_i) V_S`, jointly over all selected tokens.

  Args:
    q: `[batch, T, heads, d]`; k, v: `[batch, S, kv_heads, d]`, unrotated (NoPE readout).
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


def freesolo_long_range(
  q,
  k,
  v,
  *,
  variant="fs",
  lam=1.0,
  sigma=4.0,
  lr_gain=1.0,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  tau=None,
  beam=16,
  bound_c=8.0,
  window=512,
):
  """Long-range branch `o_lr = RMSNorm(u)` (FS Eq. 5-9), before the α mix.

  Args:
    q: `[batch, T, heads, d]`; k, v: `[batch, T, kv_heads, d]`; unrotated; any T (cells past the last complete
      one are never eligible).
    variant: "fs", "fsl" or "fsb".
    lam, sigma: scalars or `[heads]`; λ ≥ 0, σ > 0 (Eq. 7). No gradient reaches them.
    lr_gain: readout RMSNorm gain, scalar or `[d]`.
    cell, block, top_k, retain_top, retain_recent: `s`, `B`, `K`, `P`, `W`.
    window: only validated here (the local radius must cover a block: `w >= B - 1`).
    tau, beam, bound_c: FS-B forest arguments (τ per key/value head, beam width, c of Eq. 11); unused by fs/fsl.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`; zero where nothing is available (e.g. the first block).
  """
  routing = Routing(
    variant=variant,
    window=window,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
    beam=beam,
    bound_c=bound_c,
  )
  check_grouped_qkv(q, k, v)
  check_routing(routing, tau)
  dtype = compute_dtype(q.dtype)
  cell_idx = select_cells_routed(q, k, routing, lam=lam, sigma=sigma, tau=tau)
  u = sparse_readout(q.astype(dtype), k.astype(dtype), v.astype(dtype), cell_idx, cell=cell)
  return rms_norm(u, jnp.asarray(lr_gain, dtype)).astype(q.dtype)


def mix_branches(local, long_range, alpha):
  """FS Eq. 2: `o = o_sr + α_h o_lr`, in at least float32, returned in the dtype of `local`.

  Args:
    local, long_range: `[batch, T, heads, d]`; alpha: scalar or `[heads]`.
  """
  dtype = compute_dtype(local.dtype)
  alpha = per_head(alpha, local.shape[2], "alpha", dtype)
  return (local.astype(dtype) + alpha[:, None] * long_range.astype(dtype)).astype(local.dtype)


def freesolo_attention(
  q,
  k,
  v,
  *,
  variant="fs",
  alpha,
  lam=1.0,
  sigma=4.0,
  lr_gain=1.0,
  window=512,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  tau=None,
  beam=16,
  bound_c=8.0,
  rope_theta=10000.0,
):
  """FreeSolo attention `o_i = o_sr_i + α_h o_lr_i` (FS Eq. 2).

  Args:
    q: `[batch, T, heads, d]`; k, v: `[batch, T, kv_heads, d]`; unrotated projections; d even.
    variant: "fs" | "fsl" | "fsb".
    alpha: scalar or `[heads]` branch mix.
    lam, sigma, lr_gain, cell, block, top_k, retain_top, retain_recent: see `freesolo_long_range`.
    window: local radius `w` (Eq. 3-4), `w >= B - 1`.
    tau, beam, bound_c: FS-B forest arguments (τ per key/value head, beam width, bound constant c of Eq. 11).
    rope_theta: RoPE base θ (or a `fsjax.reference.rope.RoPE`) of the local branch.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`.
  """
  check_grouped_qkv(q, k, v)
  long_range = freesolo_long_range(
    q,
    k,
    v,
    variant=variant,
    lam=lam,
    sigma=sigma,
    lr_gain=lr_gain,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
    window=window,
    tau=tau,
    beam=beam,
    bound_c=bound_c,
  )
  local = local_attention(q, k, v, window=window, rope_theta=rope_theta)
  return mix_branches(local.astype(q.dtype), long_range, alpha)
