"""Independent per-query NumPy loops (float64) for the attention references. Written from the paper, not from
fsjax.ops: the FS-L pool is recomputed per block by sorting (no death blocks), cells and tokens by Python sets.
The RoPE of Hugging Face checkpoints (`hf_*`) is written from `transformers`' formulas.
"""

import math

import numpy as np


def rope(x, pos, theta=10000.0):
  """Rotate-half RoPE of one vector `x` [d] at position `pos`."""
  half = x.shape[-1] // 2
  freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
  cos, sin = np.cos(pos * freq), np.sin(pos * freq)
  x1, x2 = x[:half], x[half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def softmax_readout(logits, values):
  w = np.exp(logits - logits.max())
  return (w / w.sum()) @ values


def local(q, k, v, window, theta=10000.0):
  """Eq. 3-4 for every (batch, position, head); q, k, v `[B, T, H, d]`."""
  batch, seq, heads, d = q.shape
  out = np.zeros_like(q, dtype=np.float64)
  for b in range(batch):
    for h in range(heads):
      k_rot = np.stack([rope(k[b, j, h], j, theta) for j in range(seq)])
      for i in range(seq):
        js = np.arange(max(0, i - window), i + 1)
        logits = k_rot[js] @ rope(q[b, i, h], i, theta) / math.sqrt(d)
        out[b, i, h] = softmax_readout(logits, v[b, js, h])
  return out


def fs_available(a, i, *, variant, cell, block, retain_top, retain_recent):
  """Sorted list of cells query i may score (Eq. 6, and Eq. 8 for fsl), from the cells' max key norms `a`."""
  block_start = block * (i // block)
  eligible = [c for c in range(len(a)) if (c + 1) * cell <= block_start]
  if variant == "fs":
    return eligible
  recent = eligible[len(eligible) - retain_recent :] if retain_recent else []
  by_norm = sorted(eligible, key=lambda c: (-a[c], c))[:retain_top]
  return sorted(set(recent) | set(by_norm))


def fs_long_range(q, k, v, *, variant, lam, sigma, gain, cell, block, top_k, retain_top, retain_recent):
  """Eq. 5-9 per query. Returns (o_lr `[B, T, H, d]`, selected cells `{(b, i, h): set}`)."""
  batch, seq, heads, d = q.shape
  num_cells = seq // cell
  out = np.zeros((batch, seq, heads, d))
  selected = {}
  for b in range(batch):
    for h in range(heads):
      cells_k = [k[b, c * cell : (c + 1) * cell, h] for c in range(num_cells)]
      mean = [ck.mean(axis=0) for ck in cells_k]
      a = [np.linalg.norm(ck, axis=-1).max() for ck in cells_k]
      for i in range(seq):
        avail = fs_available(
          a, i, variant=variant, cell=cell, block=block, retain_top=retain_top, retain_recent=retain_recent
        )
        score = {
          c: q[b, i, h] @ mean[c] / math.sqrt(d) + lam[h] * a[c] * math.erf((i - (c + 0.5) * cell) / (2 * sigma[h]))
          for c in avail
        }
        chosen = sorted(avail, key=lambda c: (-score[c], c))[:top_k]
        selected[(b, i, h)] = set(chosen)
        if not chosen:
          continue
        js = np.concatenate([np.arange(c * cell, (c + 1) * cell) for c in chosen])
        u = softmax_readout(k[b, js, h] @ q[b, i, h] / math.sqrt(d), v[b, js, h])
        out[b, i, h] = u / math.sqrt(np.mean(u * u) + 1e-8) * gain
  return out, selected


def moba(q, k, v, *, moba_block, moba_top_k, theta=10000.0):
  """MoBA per query: own block (causal) + top (moba_top_k - 1) fully past blocks by rotated mean key."""
  batch, seq, heads, d = q.shape
  out = np.zeros((batch, seq, heads, d))
  for b in range(batch):
    for h in range(heads):
      q_rot = np.stack([rope(q[b, i, h], i, theta) for i in range(seq)])
      k_rot = np.stack([rope(k[b, j, h], j, theta) for j in range(seq)])
      for i in range(seq):
        own = i // moba_block
        gate = {n: q_rot[i] @ k_rot[n * moba_block : (n + 1) * moba_block].mean(axis=0) for n in range(own)}
        blocks = sorted(gate, key=lambda n: (-gate[n], n))[: moba_top_k - 1] + [own]
        js = np.array(sorted(j for n in blocks for j in range(n * moba_block, (n + 1) * moba_block) if j <= i))
        out[b, i, h] = softmax_readout(k_rot[js] @ q_rot[i] / math.sqrt(d), v[b, js, h])
  return out


def zha_tree(k_rot, refs, *, chunk, levels, theta):
  """ZHA III-A per head: `{(level, node): (keys [R, d], biases [R])}`, from the paper's wording: level 1 attends
  raw keys with each reference query rotated to the node's last key; a parent evaluates each child's tangent at
  its own rotated reference query by adding the III-B correction <k̂_c, q̂_P − q̂_c>/√d, then summarizes."""
  seq, d = k_rot.shape
  rot = (lambda x, p: x) if theta is None else (lambda x, p: rope(x, p, theta))
  tree = {}
  for level in range(1, levels + 1):
    span = chunk**level
    for m in range((seq - 1) // span):
      last = (m + 1) * span
      q_hat = np.stack([rot(r, last) for r in refs])  # [R, d]
      if level == 1:
        members = k_rot[1 + m * span : 1 + (m + 1) * span]  # [C, d]
        logits = q_hat @ members.T / math.sqrt(d)  # [R, C]
        values = np.broadcast_to(members, (len(refs),) + members.shape)
      else:
        children = [tree[(level - 1, m * chunk + c)] for c in range(chunk)]
        child_q = [np.stack([rot(r, (m * chunk + c + 1) * chunk ** (level - 1)) for r in refs]) for c in range(chunk)]
        logits = np.stack(
          [
            [
              (bias[r] + child_q[c][r] @ keys[r] / math.sqrt(d)) + keys[r] @ (q_hat[r] - child_q[c][r]) / math.sqrt(d)
              for c, (keys, bias) in enumerate(children)
            ]
            for r in range(len(refs))
          ]
        )  # [R, C]
        values = np.stack([[keys[r] for keys, _ in children] for r in range(len(refs))])  # [R, C, d]
      top = logits.max(axis=1, keepdims=True)
      w = np.exp(logits - top)
      lse = np.log(w.sum(axis=1)) + top[:, 0]
      w /= w.sum(axis=1, keepdims=True)
      keys = np.einsum("rc,rcd->rd", w, values)
      tree[(level, m)] = (keys, lse - np.einsum("rd,rd->r", q_hat, keys) / math.sqrt(d))
  return tree


def zha_keys(q_rot_i, i, tree, *, chunk, levels, top_p, max_nodes=None):
  """The index set I(q) of ZHA III-C for the query at position i, by explicit candidate lists."""
  d = q_rot_i.shape[0]
  score = lambda node: max(q_rot_i @ k / math.sqrt(d) + b for k, b in zip(*tree[node]))
  complete = lambda level, m: (level, m) in tree and (m + 1) * chunk**level <= i
  count = lambda level: sum(1 for (lv, _) in tree if lv == level)
  candidates = [(levels, m) for m in range(count(levels)) if complete(levels, m)]
  for level in range(levels, 0, -1):
    ranked = sorted(candidates, key=lambda node: (-score(node), node[1]))
    p = top_p[level - 1]
    selected = ranked
    if p < 1 and ranked:
      scores = np.array([score(n) for n in ranked])
      mass = np.exp(scores - scores.max())
      cumulative = np.cumsum(mass) / mass.sum()
      selected = ranked[: int(np.argmax(cumulative >= p)) + 1] if cumulative[-1] >= p else ranked
    selected = selected[:max_nodes]
    if level == 1:
      break
    candidates = [(level - 1, m * chunk + c) for (_, m) in selected for c in range(chunk)]
    candidates += [
      (level - 1, m) for m in range(count(level - 1)) if complete(level - 1, m) and not complete(level, m // chunk)
    ]
  keys = {0} | set(range(1 + chunk * (i // chunk), i + 1))
  for _, m in selected:
    keys |= set(range(1 + m * chunk, 1 + (m + 1) * chunk))
  return sorted(keys)


def zha(q, k, v, refs, *, chunk, levels, top_p, theta=10000.0, max_nodes=None):
  """ZHA attention for every (batch, position, head): (outputs `[B, T, H, d]`, attended fractions `[B, T, H]`).

  k, v `[B, T, H_kv, d]` and refs `[H_kv, R, d]` may have fewer heads than q (ZHA III-A's GQA): one tree per
  key/value head g, built once; each query head `h` with `h // (H // H_kv) = g` routes through it and attends
  on its own."""
  batch, seq, heads, d = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  rot = (lambda x, p: x) if theta is None else (lambda x, p: rope(x, p, theta))
  out = np.zeros_like(q, dtype=np.float64)
  fraction = np.zeros((batch, seq, heads))
  for b in range(batch):
    for g in range(kv_heads):
      k_rot = np.stack([rot(k[b, j, g], j) for j in range(seq)])
      tree = zha_tree(k_rot, refs[g], chunk=chunk, levels=levels, theta=theta)
      for h in range(g * group, (g + 1) * group):
        for i in range(seq):
          q_rot = rot(q[b, i, h], i)
          js = zha_keys(q_rot, i, tree, chunk=chunk, levels=levels, top_p=top_p, max_nodes=max_nodes)
          out[b, i, h] = softmax_readout(k_rot[js] @ q_rot / math.sqrt(d), v[b, js, g])
          fraction[b, i, h] = len(js) / (i + 1)
  return out, fraction


def _fsb_node(cells, means, norms, centers, children=()):
  """A forest node (FS Eq. 20) over `cells`, as a dict."""
  mu = means[cells].mean(axis=0)
  return dict(
    cells=list(cells),
    children=list(children),
    mu=mu,
    rho=max(np.linalg.norm(means[c] - mu) for c in cells),
    amax=max(norms[c] for c in cells),
    pmin=min(centers[c] for c in cells),
    first=min(cells),
  )


def fsb_chunk_tree(cells, means, norms, centers):
  """FS Eq. 19: split at the median projection on the principal direction (two power iterations from the
  farthest cell), recursively; ties to the lower cell index."""
  if len(cells) == 1:
    return _fsb_node(cells, means, norms, centers)
  x = {c: means[c] - means[cells].mean(axis=0) for c in cells}
  farthest = min(cells, key=lambda c: (-np.linalg.norm(x[c]), c))
  unit = lambda u: u / np.linalg.norm(u) if np.linalg.norm(u) > 0 else np.zeros_like(u)
  u = unit(x[farthest])
  for _ in range(2):
    u = unit(sum((x[c] @ u) * x[c] for c in cells))
  ordered = sorted(cells, key=lambda c: (x[c] @ u, c))
  half = (len(cells) + 1) // 2
  children = [
    fsb_chunk_tree(ordered[:half], means, norms, centers),
    fsb_chunk_tree(ordered[half:], means, norms, centers),
  ]
  return _fsb_node(cells, means, norms, centers, children)


def fsb_forest(admitted, means, norms, centers):
  """Chunks of the binary digits of M in arrival order (Eq. 18), joined smallest-first (Eq. 21)."""
  chunks, offset = [], 0
  for k in reversed(range(len(admitted).bit_length())):
    if len(admitted) >> k & 1:
      chunks.append(fsb_chunk_tree(admitted[offset : offset + 2**k], means, norms, centers))
      offset += 2**k
  if not chunks:
    return None
  join = chunks[-1]
  for root in reversed(chunks[:-1]):
    size = len(root["cells"]) + len(join["cells"])
    mu = (len(root["cells"]) * root["mu"] + len(join["cells"]) * join["mu"]) / size
    join = dict(
      cells=root["cells"] + join["cells"],
      children=[root, join],
      mu=mu,
      rho=max(u["rho"] + np.linalg.norm(u["mu"] - mu) for u in (root, join)),
      amax=max(root["amax"], join["amax"]),
      pmin=min(root["pmin"], join["pmin"]),
      first=min(root["first"], join["first"]),
    )
  return join


def fsb_beam(root, q, i, *, beam, bound_c, lam, sigma):
  """Eq. 11 beam search: leaves keep their slots, the rest go to the highest-U children (ties: lower first cell)."""
  if root is None:
    return []
  d = q.shape[0]
  bound = lambda v: (
    (q @ v["mu"] + bound_c * np.linalg.norm(q) * v["rho"]) / math.sqrt(d)
    + lam * v["amax"] * math.erf((i - v["pmin"]) / (2 * sigma))
  )
  current = [root]
  while any(v["children"] for v in current):
    leaves = [v for v in current if not v["children"]]
    children = sorted((c for v in current for c in v["children"]), key=lambda v: (-bound(v), v["first"]))
    current = leaves + children[: beam - len(leaves)]
  return [v["cells"][0] for v in current]


def fsb_cells(q, k, *, tau, lam, sigma, cell, block, top_k, beam, bound_c):
  """FS-B selected cells `[B, T, H, K]` (-1 pad): two forests per block, beam search, Eq. 12 rerank."""
  batch, seq, heads, d = q.shape
  num_cells = seq // cell
  out = np.full((batch, seq, heads, top_k), -1)
  for b in range(batch):
    for h in range(heads):
      cells_k = k[b, : num_cells * cell, h].reshape(num_cells, cell, d)
      means, norms = cells_k.mean(axis=1), np.linalg.norm(cells_k, axis=-1).max(axis=1)
      centers = (np.arange(num_cells) + 0.5) * cell
      for n in range(-(-seq // block)):
        eligible = list(range(n * block // cell))
        roots = [
          fsb_forest(admitted, means, norms, centers)
          for admitted in (eligible, [c for c in eligible if norms[c] >= tau[h]])
        ]
        for i in range(n * block, min((n + 1) * block, seq)):
          found = set()
          for root in roots:
            found |= set(fsb_beam(root, q[b, i, h], i, beam=beam, bound_c=bound_c, lam=lam[h], sigma=sigma[h]))
          score = {}
          for c in found:
            logits = cells_k[c] @ q[b, i, h] / math.sqrt(d)
            top = logits.max()
            score[c] = (
              top
              + math.log(np.exp(logits - top).sum())
              + lam[h] * norms[c] * math.erf((i - centers[c]) / (2 * sigma[h]))
            )
          chosen = sorted(found, key=lambda c: (-score[c], c))[:top_k]
          out[b, i, h, : len(chosen)] = chosen
  return out


def hf_inverse_frequencies(theta, rotary_dim, scaling=None):
  """`transformers`' `_compute_default_rope_parameters`, then `_compute_llama3_parameters` when scaled:

  inv_freq = 1 / theta^(arange(0, dim, 2) / dim)
  wavelen = 2π / inv_freq;  low_freq_wavelen = old_context_len / low_freq_factor;
  high_freq_wavelen = old_context_len / high_freq_factor
  inv_freq_llama = where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
  is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
  inv_freq_llama = where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
  """
  inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)
  if scaling is None:
    return inv_freq
  old_context_len = scaling.original_max_position_embeddings
  low_freq_wavelen = old_context_len / scaling.low_freq_factor
  high_freq_wavelen = old_context_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth_factor = (old_context_len / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth_factor) * inv_freq_llama / scaling.factor + smooth_factor * inv_freq_llama
  is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium_freq, smoothed, inv_freq_llama)


def hf_apply_rope(x, positions, theta, rotary_dim, scaling=None):
  """`transformers`' rotary embedding with partial rotation (`apply_rotary_pos_emb` of its partial-rotary
  models): emb = cat(freqs, freqs), q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:],
  q_embed = cat(q_rot * cos + rotate_half(q_rot) * sin, q_pass), rotate_half(x) = cat(-x2, x1).

  x: `[batch, seq, heads, d]`; positions: `[seq]`."""
  freqs = positions[:, None] * hf_inverse_frequencies(theta, rotary_dim, scaling)[None]  # [seq, r/2]
  emb = np.concatenate([freqs, freqs], axis=-1)[None, :, None]  # [1, seq, 1, r]
  x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
  x1, x2 = x_rot[..., : rotary_dim // 2], x_rot[..., rotary_dim // 2 :]
  rotated_half = np.concatenate([-x2, x1], axis=-1)
  return np.concatenate([x_rot * np.cos(emb) + rotated_half * np.sin(emb), x_pass], axis=-1)
