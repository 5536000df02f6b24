"""Typed configs with strict validation and YAML loading.

Every rule raises `ConfigError` naming the field and the rule (e.g. "attention.block must be a multiple of
attention.cell"), before anything is traced or compiled. Unknown YAML keys are errors, never ignored.
"""

import dataclasses
import os
import types
import typing

import yaml

from fsjax import kinds
from fsjax.data.associative import TRAIN, recall_row
from fsjax.data.copies import validate_copies
from fsjax.reference.rope import Llama3Scaling, RoPE
from fsjax.reference.routing import Routing
from fsjax.reference.zha import ZHATree

FREESOLO_KINDS = kinds.names("freesolo")
DENSE_KINDS = kinds.names("dense")
ATTENTION_KINDS = kinds.names()

IMPLS = ("reference", "auto", "pallas")
DTYPES = ("float32", "bfloat16", "float16", "float64")
SCHEDULES = ("cosine", "wsd")
OBJECTIVES = ("lm", "zha_kl")


class ConfigError(ValueError):
  """A config value breaks a rule; the message names the field."""


def _positive(obj, prefix, *names):
  for name in names:
    value = getattr(obj, name)
    if value <= 0:
      raise ConfigError(f"{prefix}{name} must be positive, got {value}")


def _one_of(obj, prefix, name, allowed):
  value = getattr(obj, name)
  if value not in allowed:
    raise ConfigError(f"{prefix}{name} must be one of {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MoBAConfig:
  """MoBA's block routing (`fsjax.reference.dense.moba_attention`).

  Attributes:
    block: block size in tokens.
    top_k: blocks read per query, the current one included.
  """

  block: int = 512
  top_k: int = 3

  def __post_init__(self):
    _positive(self, "attention.moba.", "block", "top_k")


@dataclasses.dataclass(frozen=True)
class ZHAConfig:
  """ZHA's tree (ZHA Sec. III; `fsjax.reference.zha`).

  Attributes:
    refs: reference queries R per head.
    chunk: chunk C: children per node, keys per leaf.
    levels: tree levels L.
    top_p: routing threshold p: one value for every level, or one per level (level 1, the raw-key chunks,
      first); >= 1 reads every key.
    max_nodes: cap on the nodes a query keeps per level (ours; null = the paper's routing). Decode then reads only
      the routed candidate lists and keys, a cost independent of the context length below the top level.
    distill: run the frozen dense (TF++) attention and sow each layer's ZHA KL loss instead of routing; set by the
      ZHA objective (`train.objective: zha_kl`).
  """

  refs: int = 16
  chunk: int = 8
  levels: int = 2
  top_p: tuple[float, ...] = (0.9,)
  max_nodes: int | None = None
  distill: bool = False

  @property
  def tree(self):
    """The tree's geometry and routing as one frozen `ZHATree`."""
    return ZHATree(refs=self.refs, chunk=self.chunk, levels=self.levels, top_p=self.top_p, max_nodes=self.max_nodes)


ROPE_SCALINGS = ("llama3",)


@dataclasses.dataclass(frozen=True)
class RoPEScalingConfig:
  """RoPE frequency scaling (`attention.rope_scaling`), as Hugging Face configs write it; `fsjax.reference.rope`.

  Attributes:
    type: "llama3" (Llama 3.1-3.3's `rope_type`; HF's older configs call it `type`); required.
    factor: frequencies of wavelength above `original_max_position_embeddings / low_freq_factor` are divided
      by it; >= 1.
    low_freq_factor, high_freq_factor: the band between the two wavelengths blends the two; 0 < low < high.
    original_max_position_embeddings: the pre-training context the bands are measured against.

  The numeric defaults are Llama 3.1's (8, 1, 4, 8192).
  """

  type: str | None = None
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    p = "attention.rope_scaling."
    _one_of(self, p, "type", ROPE_SCALINGS)
    _positive(self, p, "low_freq_factor", "original_max_position_embeddings")
    if self.factor < 1:
      raise ConfigError(f"{p}factor must be >= 1, got {self.factor}")
    if self.high_freq_factor <= self.low_freq_factor:
      raise ConfigError(
        f"{p}high_freq_factor must be greater than {p}low_freq_factor, got {self.high_freq_factor} <= "
        f"{self.low_freq_factor}"
      )

  @property
  def scaling(self):
    """The scaling rule for `fsjax.reference.rope.RoPE`."""
    return Llama3Scaling(
      factor=self.factor,
      low_freq_factor=self.low_freq_factor,
      high_freq_factor=self.high_freq_factor,
      original_max_position_embeddings=self.original_max_position_embeddings,
    )


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Which attention a model uses and its geometry (FS App. A defaults).

  Attributes:
    kind: an attention kind of `fsjax.kinds`: "fs" | "fsl" | "fsb" (FreeSolo variants), "tfpp" | "swa" | "moba"
      (baselines) or "zha" (TF++ weights read through a ZHA tree, ZHA Sec. III).
    window: local radius w (FS Eq. 3-4) for FreeSolo; the window of SWA. Must be >= block - 1 for FreeSolo.
    cell: cell size s in tokens (FS Eq. 5).
    block: query block B in tokens, a multiple of cell (FS Eq. 6).
    top_k: cells read per query, K (FS Sec. 3.3).
    retain_top: FS-L norm-ranked pool size P (FS Eq. 8).
    retain_recent: FS-L recent cells W (FS Eq. 8).
    beam: FS-B beam width W_b per forest and level (FS Eq. 11).
    bound_c: FS-B radius factor c of the node bound U_v (FS Eq. 11).
    lam: initial λ_h of the norm prior (Eq. 7), a buffer without gradient; >= 0.
    sigma: initial σ_h of the erf prior (Eq. 7), a buffer without gradient; > 0.
    rope_theta: RoPE base θ.
    rope_fraction: share of each head's features that RoPE rotates (HF's `partial_rotary_factor`): the first
      `rope_fraction * model.head_dim` features, which must be an even whole number; the rest pass unrotated.
    rope_scaling: null, or the frequency scaling of a Hugging Face checkpoint (`{type: llama3, factor: 8, ...}`,
      `RoPEScalingConfig`).
    impl: "reference" | "auto" | "pallas": kernel dispatch (`fsjax.ops.dispatch`; auto: Pallas kernels and
      cuDNN on GPU).
    moba: MoBA's section (`attention.moba.block`, `attention.moba.top_k`).
    zha: ZHA's section (`attention.zha.refs`, `.chunk`, `.levels`, `.top_p`, `.max_nodes`, `.distill`).

  The flat keys of earlier configs (`moba_block`, `moba_top_k`, `zha_refs`, `zha_chunk`, `zha_levels`,
  `zha_top_p`, `zha_max_nodes`, `zha_distill`) still load, into their sections.
  """

  kind: str = "fs"
  window: int = 512
  cell: int = 32
  block: int = 128
  top_k: int = 4
  retain_top: int = 64
  retain_recent: int = 8
  beam: int = 16
  bound_c: float = 8.0
  lam: float = 1.0
  sigma: float = 4.0
  rope_theta: float = 10000.0
  rope_fraction: float = 1.0
  rope_scaling: RoPEScalingConfig | None = None
  impl: str = "auto"
  moba: MoBAConfig = dataclasses.field(default_factory=MoBAConfig)
  zha: ZHAConfig = dataclasses.field(default_factory=ZHAConfig)

  def __post_init__(self):
    p = "attention."
    _one_of(self, p, "kind", ATTENTION_KINDS)
    _one_of(self, p, "impl", IMPLS)
    _positive(self, p, "window", "sigma", "rope_theta", "beam")
    if not 0 < self.rope_fraction <= 1:
      raise ConfigError(f"{p}rope_fraction must be in (0, 1], got {self.rope_fraction}")
    if self.bound_c < 1:
      raise ConfigError(f"{p}bound_c must be >= 1 (U_v then bounds Eq. 7 for every cell below), got {self.bound_c}")
    if self.lam < 0:
      raise ConfigError(f"{p}lam must be >= 0, got {self.lam}")
    if self.kind == "fsb" and self.top_k > 2 * self.beam:
      raise ConfigError(
        f"{p}top_k ({self.top_k}) exceeds the {2 * self.beam} candidate cells FS-B's two beams of {p}beam "
        f"({self.beam}) can offer"
      )
    if self.zha.distill and self.kind != "zha":
      raise ConfigError(f"{p}zha.distill needs {p}kind zha, got {self.kind!r}")
    try:
      kinds.get(self.kind).validate(self, p)
    except ValueError as e:
      raise ConfigError(str(e)) from None

  @property
  def rope(self):
    """The RoPE every kind rotates with, as one frozen `RoPE` (the same rotation as the float `rope_theta` when
    `rope_fraction` is 1 and `rope_scaling` null)."""
    scaling = None if self.rope_scaling is None else self.rope_scaling.scaling
    return RoPE(theta=self.rope_theta, fraction=self.rope_fraction, scaling=scaling)

  @property
  def routing(self):
    """The FreeSolo routing geometry as one frozen `Routing` (variant: the kind for FreeSolo kinds, else "fs";
    the cell and block still size every kind's decode cache)."""
    return Routing(
      variant=self.kind if self.kind in FREESOLO_KINDS else "fs",
      window=self.window,
      cell=self.cell,
      block=self.block,
      top_k=self.top_k,
      retain_top=self.retain_top,
      retain_recent=self.retain_recent,
      beam=self.beam,
      bound_c=self.bound_c,
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """LLaMA-style decoder shape (FS App. A).

  Attributes:
    vocab_size: tokenizer vocabulary size.
    num_layers: decoder layers.
    d_model: residual width.
    num_heads: attention (query) heads.
    num_kv_heads: key/value heads (grouped-query attention, Llama 3 / Qwen); null = num_heads. It must divide
      num_heads: query head h reads key/value head `h // (num_heads // num_kv_heads)` (Hugging Face's
      `repeat_kv` layout), and decode caches hold num_kv_heads heads; every kind takes it (`fsjax.kinds`,
      `grouped_kv`).
    head_dim: width per head; even (RoPE rotates pairs).
    qk_norm: RMSNorm over head_dim (epsilon norm_eps, one gain `[head_dim]` each, params `q_norm`, `k_norm`) on
      every head's query and key after projection, before RoPE (Qwen3).
    qkv_bias: biases `[heads, head_dim]` on the query, key and value projections, none on the output (Qwen2.5).
    ffn_hidden: SwiGLU hidden width; None means 256·⌈(8/3)·d_model/256⌉.
    tie_embeddings: share the input embedding with the output projection.
    norm_eps: RMSNorm epsilon of the decoder norms.
    dtype: activation dtype ("float32" | "bfloat16" | "float16" | "float64").
    param_dtype: parameter dtype.
    remat: recompute each layer's activations in the backward pass (less memory, ~1/3 more compute).
    scan_layers: run the layers with `nn.scan` over parameters stacked `[num_layers, ...]` (under
      "layers/layer/..."): one compiled layer body instead of num_layers, so GPU compile time (and each Pallas
      kernel's Triton compile) does not grow with depth. Checkpoints of the two layouts do not mix.
    short_conv: kernel of a causal depthwise convolution over each layer's attention input (`fsjax.short_conv`,
      Zoology's hybrid: it hands attention the previous tokens); 0, the default, is the papers' architecture.
    attention: the attention config.
  """

  vocab_size: int = 32000
  num_layers: int = 24
  d_model: int = 1024
  num_heads: int = 16
  num_kv_heads: int | None = None
  head_dim: int = 64
  qk_norm: bool = False
  qkv_bias: bool = False
  ffn_hidden: int | None = None
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  scan_layers: bool = False
  short_conv: int = 0
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)

  def __post_init__(self):
    p = "model."
    if self.short_conv == 1 or self.short_conv < 0:
      raise ConfigError(f"{p}short_conv must be 0 (none) or a kernel of at least 2 taps, got {self.short_conv}")
    _positive(self, p, "vocab_size", "num_layers", "d_model", "num_heads", "head_dim", "norm_eps")
    if self.ffn_hidden is not None:
      _positive(self, p, "ffn_hidden")
    if self.head_dim % 2:
      raise ConfigError(f"{p}head_dim must be even (RoPE rotates pairs of features), got {self.head_dim}")
    self._check_kv_heads(p)
    try:
      self.attention.rope.rotary_dim(self.head_dim)
    except ValueError:
      raise ConfigError(
        f"{p}attention.rope_fraction ({self.attention.rope_fraction}) times {p}head_dim ({self.head_dim}) must be "
        f"an even whole number of rotated features, got {self.attention.rope_fraction * self.head_dim:g}"
      ) from None
    _one_of(self, p, "dtype", DTYPES)
    _one_of(self, p, "param_dtype", DTYPES)

  def _check_kv_heads(self, p):
    if self.num_kv_heads is None:
      return
    if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f"{p}num_kv_heads must be positive and divide {p}num_heads ({self.num_heads}), got {self.num_kv_heads}"
      )
    kind = kinds.get(self.attention.kind)
    if self.num_kv_heads < self.num_heads and not kind.grouped_kv:
      grouped = ", ".join(kinds.names(grouped_kv=True))
      raise ConfigError(
        f"{p}num_kv_heads ({self.num_kv_heads}) below {p}num_heads ({self.num_heads}) is grouped-query attention, "
        f"which attention.kind {kind.name} does not support (only {grouped})"
      )

  @property
  def kv_heads(self):
    """Key/value heads: `num_kv_heads`, or `num_heads` when null."""
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def ffn_hidden_size(self):
    """SwiGLU hidden width: `ffn_hidden`, or 256·⌈(8/3)·d_model/256⌉ (LLaMA rounding)."""
    if self.ffn_hidden is not None:
      return self.ffn_hidden
    return 256 * -(-(8 * self.d_model) // (3 * 256))


ROWS_CHECKED = 16  # rows a random recall placement must manage before a run starts


@dataclasses.dataclass(frozen=True)
class AssociativeConfig:
  """Multi-query associative recall rows (`data.source: associative`; `fsjax.data.associative.recall_row`).

  Attributes:
    pairs: key-value pairs per row.
    keys, values, filler_ids: `[min, max)` id ranges of keys, values and uniform filler; disjoint.
    filler: "random" (uniform ids from filler_ids) or "text" (windows of the training corpus; the held-out one
      at evaluation).
    queries: "end" (all queries after the context) or "interleaved" (each somewhere after its pair).
    distance: `[min, max]` tokens from a pair's key to its query's key; null = anywhere before the query.
    query_keys: "sampled" (each query asks a pair drawn with replacement from those before it within distance)
      or "each" (every pair asked once, as in Zoology, which the answers already given let a model answer by
      elimination without binding keys to values: `fsjax.data.associative`).
    query_count: queries per row; null = pairs. Another count needs query_keys sampled, queries at the end and
      no distance bound.
    filler_loss: train on the filler text too (the language-model loss; needs filler text), not on the answers
      alone: text rewards previous-token heads, the first half of the circuit that binds a value to its key.
      Held-out losses stay the answers'.
  """

  pairs: int = 8
  keys: tuple[int, ...] = (3, 1027)
  values: tuple[int, ...] = (1027, 2051)
  filler_ids: tuple[int, ...] = (2051, 32000)
  filler: str = "random"
  queries: str = "end"
  distance: tuple[int, ...] | None = None
  query_keys: str = "sampled"
  query_count: int | None = None
  filler_loss: bool = False

  def __post_init__(self):
    _positive(self, "data.associative.", "pairs")
    _one_of(self, "data.associative.", "query_keys", ("sampled", "each"))
    _one_of(self, "data.associative.", "filler", ("random", "text"))
    _one_of(self, "data.associative.", "queries", ("end", "interleaved"))
    ranges = {name: getattr(self, name) for name in ("keys", "values", "filler_ids")}
    for name, (low, high) in ((n, r) for n, r in ranges.items() if len(r) == 2):
      if not 0 <= low < high:
        raise ConfigError(f"data.associative.{name} must be [min, max) with 0 <= min < max, got {[low, high]}")
    if any(len(r) != 2 for r in ranges.values()):
      raise ConfigError(f"data.associative id ranges must be [min, max) pairs, got {ranges}")
    names = list(ranges)
    for i, a in enumerate(names):
      for b in names[i + 1 :]:
        if ranges[a][0] < ranges[b][1] and ranges[b][0] < ranges[a][1]:
          raise ConfigError(f"data.associative.{a} {list(ranges[a])} and {b} {list(ranges[b])} must not overlap")
    if self.keys[1] - self.keys[0] < self.pairs:
      raise ConfigError(f"data.associative.keys holds {self.keys[1] - self.keys[0]} ids, fewer than pairs={self.pairs}")
    if self.query_count is not None:
      _positive(self, "data.associative.", "query_count")
      if self.query_count != self.pairs and (
        self.query_keys != "sampled" or self.queries != "end" or self.distance is not None
      ):
        raise ConfigError(
          f"data.associative.query_count ({self.query_count}) other than pairs ({self.pairs}) needs query_keys "
          "sampled, queries end and no distance"
        )
    if self.filler_loss and self.filler != "text":
      raise ConfigError("data.associative.filler_loss needs filler: text (uniform random filler predicts nothing)")
    if self.distance is not None and (len(self.distance) != 2 or not 2 <= self.distance[0] <= self.distance[1]):
      raise ConfigError(f"data.associative.distance must be [min, max] with 2 <= min <= max, got {self.distance}")

  def task(self, filler_tokens=None):
    """Keyword arguments of `recall_row` (all but index, seed, stream and length)."""
    return dict(
      pairs=self.pairs,
      keys=self.keys,
      values=self.values,
      filler_ids=self.filler_ids,
      queries=self.queries,
      distance=self.distance,
      query_keys=self.query_keys,
      query_count=self.query_count,
      filler_loss=self.filler_loss,
      filler_tokens=filler_tokens,
    )

  def check_length(self, length, field):
    """ConfigError unless rows of `length` tokens hold the pairs and their queries. Queries at the end with no
    distance bound always fit in `2 * (pairs + queries)` tokens; other placements are random, so the first rows
    are drawn."""
    if 2 * self.pairs + 2 * (self.query_count or self.pairs) > length:
      raise ConfigError(
        f"{field} ({length}) cannot hold data.associative.pairs={self.pairs} pairs and "
        f"{self.query_count or self.pairs} queries"
      )
    if self.queries == "end" and self.distance is not None and self.distance[1] < 2 * self.pairs:
      raise ConfigError(
        f"data.associative.distance max ({self.distance[1]}) must be >= 2 * pairs = {2 * self.pairs}: the last "
        "query ends the row, 2 * pairs tokens after the last slot a pair can take"
      )
    if self.queries == "interleaved" or self.distance is not None:
      try:
        for index in range(ROWS_CHECKED):
          recall_row(index, seed=0, stream=TRAIN, length=length, **self.task())
      except ValueError as error:
        raise ConfigError(f"data.associative at {field} = {length}: {error}") from None


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training and held-out text, tokenizer and sequence length.

  Attributes:
    train_path: jsonl / jsonl.gz (field "text"), .txt file or a directory of them; null = the packaged corpus.
    eval_path: held-out text in the same formats; null = the packaged held-out books.
    tokenizer: a tokenizer.json; null = the packaged 32k byte-level BPE.
    seq_len: training context in tokens.
    recall_masks: compute the recall/switch masks of FS Eq. 13 per document (needed when recall_beta > 0).
    recall_distance: a recall match lies more than this many tokens back (paper: 512, its local radius at a
      4k context; scale it with the radius for smaller models).
    recall_switch_window: a new recall start within this many tokens of the previous one can be a switch (64).
    copy_rate: copy curriculum (`fsjax.data.copies`): expected re-inserted earlier spans per training token;
      0 = off. Held-out text never gets copies.
    copy_span: [min, max] tokens per copy.
    copy_distance: [min, max] tokens from a copy's source to its insertion point.
    source: "text" (the documents of train_path), "associative" (multi-query associative recall rows as
      `associative` sets them; the loss is taken on the answers only) or "random": rows of uniformly random ids
      into which the copy curriculum splices its copies, or which tile one random sequence
      (`fsjax.data.random_rows`, a copying warm-up; needs copy_rate > 0 or random_period, not both, unless
      tiled_rows mixes the two).
    associative: the recall task of `source: associative` (`AssociativeConfig`).
    random_ids: the ids random rows draw from, `[min, max)`; the default is the packaged tokenizer's
      vocabulary without its three special tokens.
    random_period: [min, max] length of the random sequence a tiled random row repeats (drawn per row); null =
      rows with copies instead.
    tiled_rows: this many rows of every training batch are tiled random rows (random_period, random_ids); the
      others are text (source "text"), so the copying a tiled warm-up formed stays in use while the model learns
      text (a CPU pilot lost it within 120 text steps without them; docs/results.md), or random rows with the
      copy curriculum's copies (source "random", copy_rate > 0): tiled rows start copying, the copies ask for it
      at the curriculum's distances. Those tiled rows draw from seed + 1, so they are not the copy rows' ids.
    shards: the training stream is this many shards (documents `s::shards` for text, rows `s::shards` for random
      rows), each giving `batch_size / shards` rows of every batch in shard order; process p of P reads the
      contiguous shards `p·shards/P ..`. A global batch is then the same under every process count that divides
      `shards`, so a run can resume on another count. 0 = one per process at the first start; a resumed run
      keeps the checkpoint's.
  """

  train_path: str | None = None
  eval_path: str | None = None
  tokenizer: str | None = None
  seq_len: int = 4096
  recall_masks: bool = False
  recall_distance: int = 512
  recall_switch_window: int = 64
  copy_rate: float = 0.0
  copy_span: tuple[int, ...] = (8, 32)
  copy_distance: tuple[int, ...] = (160, 960)
  source: str = "text"
  random_ids: tuple[int, ...] = (3, 32000)
  random_period: tuple[int, ...] | None = None
  tiled_rows: int = 0
  shards: int = 0
  associative: AssociativeConfig = dataclasses.field(default_factory=AssociativeConfig)

  def __post_init__(self):
    _positive(self, "data.", "seq_len", "recall_distance", "recall_switch_window")
    if self.shards < 0:
      raise ConfigError(f"data.shards must be >= 0 (0: one per process), got {self.shards}")
    _one_of(self, "data.", "source", ("text", "random", "associative"))
    if self.source == "associative":
      self.associative.check_length(self.seq_len + 1, "data.seq_len + 1")
      if self.copy_rate or self.tiled_rows or self.recall_masks or self.random_period is not None:
        raise ConfigError(
          "data.source associative takes none of data.copy_rate, data.tiled_rows, data.recall_masks and "
          "data.random_period: its rows are recall tasks only"
        )
    if self.tiled_rows < 0:
      raise ConfigError(f"data.tiled_rows must be >= 0, got {self.tiled_rows}")
    if self.source == "random" or self.tiled_rows:
      if len(self.random_ids) != 2 or not 0 <= self.random_ids[0] < self.random_ids[1]:
        raise ConfigError(f"data.random_ids must be [min, max) with 0 <= min < max, got {list(self.random_ids)}")
      if self.random_period is not None and (
        len(self.random_period) != 2 or not 1 <= self.random_period[0] <= self.random_period[1] < self.seq_len
      ):
        raise ConfigError(
          f"data.random_period must be [min, max] with 1 <= min <= max < data.seq_len={self.seq_len} "
          f"(a row repeats its sequence at least once), got {list(self.random_period)}"
        )
      if self.recall_masks:
        raise ConfigError(
          "data.recall_masks must be false with random rows (data.source random or "
          "data.tiled_rows > 0): they have no masks"
        )
    if self.tiled_rows:
      if self.random_period is None:
        raise ConfigError("data.tiled_rows needs data.random_period (the tiled rows' period range)")
      if self.source == "random" and not self.copy_rate:
        raise ConfigError(
          "data.tiled_rows with data.source random needs data.copy_rate > 0 (the other rows are "
          "random rows with copies; for tiled rows only, leave tiled_rows at 0)"
        )
    elif self.source == "random":
      if bool(self.copy_rate) == (self.random_period is not None):
        raise ConfigError(
          "data.source random needs exactly one of data.copy_rate > 0 and data.random_period: "
          "its copies or its repeats are all there is to learn"
        )
    elif self.random_period is not None:
      raise ConfigError("data.random_period needs data.source random or data.tiled_rows > 0")
    if self.source == "random" and self.copy_rate and self.copy_distance[0] >= self.seq_len:
      raise ConfigError(
        f"data.copy_distance min must be < data.seq_len={self.seq_len} with data.source random "
        f"(a row holds no copy otherwise), got {self.copy_distance[0]}"
      )
    try:
      validate_copies(rate=self.copy_rate, span=self.copy_span, distance=self.copy_distance, prefix="data.")
    except ValueError as e:
      raise ConfigError(str(e)) from None

  @property
  def recall(self):
    """Keyword arguments of `fsjax.data.recall.recall_masks`, or None when the masks are off."""
    if not self.recall_masks:
      return None
    return dict(min_distance=self.recall_distance, switch_window=self.recall_switch_window)

  @property
  def reads_train_path(self):
    """Whether training reads the documents of `train_path` (text rows, or text filler of recall rows)."""
    return self.source == "text" or (self.source == "associative" and self.associative.filler == "text")

  @property
  def copies(self):
    """Keyword arguments of `fsjax.data.copies.insert_copies`, or None when the curriculum is off."""
    if not self.copy_rate:
      return None
    return dict(rate=self.copy_rate, span=self.copy_span, distance=self.copy_distance)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation (FS App. A defaults: AdamW, weight decay 0.1, clip 1.0, cosine with warmup and floor).

  Attributes:
    steps: optimizer steps to run (the loop stops there; resuming continues up to it).
    batch_size: global sequences per step (524,288 tokens = 128 x 4096 in the paper).
    seed: parameter initialisation and data order.
    learning_rate: peak learning rate.
    lr_floor: final learning rate of the decay.
    warmup_steps: linear warmup from 0 to the peak.
    schedule: "cosine" (warmup, cosine decay to the floor) or "wsd" (warmup, stable, linear decay to the
      floor over the last `decay_fraction` of `decay_steps`, ZHA App. B-A).
    decay_steps: schedule horizon in steps, warmup included; null = `steps`.
    decay_fraction: WSD's share of the horizon spent decaying.
    weight_decay: AdamW decoupled weight decay, applied to matrices only (not to norms, gains, α, biases).
    beta1, beta2, eps: AdamW moments.
    clip_norm: global gradient-norm clip.
    recall_beta, recall_switch_beta: β and β_sw of the recall-weighted loss (FS Eq. 13); 0 = plain loss.
    max_bad_steps: consecutive non-finite steps (skipped) after which the run stops.
    max_abs_param: the largest parameter magnitude a checkpoint may hold: a run whose parameters grow beyond it
      has diverged, so it stops without saving, and loaders warn about a checkpoint beyond it. Trained LLM weights
      stay within about 10^2; the default leaves two orders of magnitude.
    init_from: parent checkpoint (workdir or step dir) whose params start this run with a fresh optimizer and
      schedule (continued pretraining, FS Sec. 3.3); null = random init. A ZHA model may start from a TF++
      checkpoint: its reference queries are the only arrays the parent lacks.
    objective: "lm" (next-token loss) or "zha_kl" (ZHA III-B: the backbone is frozen and runs dense attention;
      only the reference queries train, on the sum over levels of the chunk-mass KL, averaged over layers).
  """

  steps: int = 1000
  batch_size: int = 128
  seed: int = 0
  learning_rate: float = 3e-4
  lr_floor: float = 3e-5
  warmup_steps: int = 1000
  schedule: str = "cosine"
  decay_steps: int | None = None
  decay_fraction: float = 0.2
  weight_decay: float = 0.1
  beta1: float = 0.9
  beta2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0
  recall_beta: float = 0.0
  recall_switch_beta: float = 0.0
  max_bad_steps: int = 5
  max_abs_param: float = 1e4
  init_from: str | None = None
  objective: str = "lm"

  def __post_init__(self):
    p = "train."
    _one_of(self, p, "objective", OBJECTIVES)
    _positive(self, p, "steps", "batch_size", "learning_rate", "clip_norm", "max_bad_steps", "eps", "max_abs_param")
    _one_of(self, p, "schedule", SCHEDULES)
    if self.decay_steps is not None:
      _positive(self, p, "decay_steps")
    for name in ("warmup_steps", "lr_floor", "weight_decay", "recall_beta", "recall_switch_beta"):
      if getattr(self, name) < 0:
        raise ConfigError(f"{p}{name} must be >= 0, got {getattr(self, name)}")
    if self.lr_floor > self.learning_rate:
      raise ConfigError(f"{p}lr_floor must be <= {p}learning_rate, got {self.lr_floor} > {self.learning_rate}")
    if not 0 < self.decay_fraction <= 1:
      raise ConfigError(f"{p}decay_fraction must be in (0, 1], got {self.decay_fraction}")
    if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
      raise ConfigError(f"{p}beta1 and {p}beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints under `<workdir>/checkpoints`.

  Attributes:
    every: save every this many steps (and always at the last step).
    keep: keep the newest this many checkpoints.
    async_save: write in the background while training continues.
  """

  every: int = 1000
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    _positive(self, "checkpoint.", "every", "keep")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh: the batch is sharded over both axes, parameters over `fsdp`.

  Attributes:
    data: data-parallel axis size; -1 = all devices not used by fsdp.
    fsdp: parameter-sharding axis size; -1 = all devices not used by data.
  """

  data: int = -1
  fsdp: int = 1

  def __post_init__(self):
    for name in ("data", "fsdp"):
      if getattr(self, name) == 0 or getattr(self, name) < -1:
        raise ConfigError(f"mesh.{name} must be positive or -1 (all remaining devices), got {getattr(self, name)}")
    if self.data == -1 and self.fsdp == -1:
      raise ConfigError("mesh.data and mesh.fsdp cannot both be -1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation run at the end of training (and every `every` steps when set).

  Attributes:
    batches: held-out batches of `batch_size` sequences of `data.seq_len` tokens.
    batch_size: sequences per evaluation batch.
    every: evaluate every this many steps; null = only at the end.
    niah_samples: at the end, also score RULER's S-NIAH-1 (fsjax.eval) on this many generated samples at 1x
      and 4x `data.seq_len`, greedy; 0 = off.
  """

  batches: int = 8
  batch_size: int = 8
  every: int | None = None
  niah_samples: int = 0

  def __post_init__(self):
    _positive(self, "eval.", "batches", "batch_size")
    if self.niah_samples < 0:
      raise ConfigError(f"eval.niah_samples must be >= 0, got {self.niah_samples}")
    if self.every is not None:
      _positive(self, "eval.", "every")


NIAH_MIN_LENGTH = 256  # S-NIAH-1: 128 generated tokens + the template, a needle and some haystack


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """Progress output.

  Attributes:
    every: print progress and append to metrics.jsonl every this many steps.
  """

  every: int = 10

  def __post_init__(self):
    _positive(self, "log.", "every")


@dataclasses.dataclass(frozen=True)
class Config:
  """A config file: `model`, `data`, `train`, `checkpoint`, `mesh`, `eval`, `log` sections."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  log: LogConfig = dataclasses.field(default_factory=LogConfig)

  def __post_init__(self):
    if (self.data.source == "random" or self.data.tiled_rows) and self.data.random_ids[1] > self.model.vocab_size:
      raise ConfigError(
        f"data.random_ids must lie below model.vocab_size={self.model.vocab_size}, got {list(self.data.random_ids)}"
      )
    if self.data.source == "associative":
      if self.eval.niah_samples:
        raise ConfigError(
          "eval.niah_samples must be 0 with data.source associative: a recall model is scored on recall rows "
          "(python -m fsjax.eval.recall), not on RULER's text"
        )
      highest = max(r[1] for r in (self.data.associative.keys, self.data.associative.values))
      highest = max(highest, self.data.associative.filler_ids[1])
      if highest > self.model.vocab_size:
        raise ConfigError(
          f"data.associative id ranges must lie below model.vocab_size={self.model.vocab_size}, got ids up to {highest}"
        )
    if self.data.tiled_rows >= self.train.batch_size:
      raise ConfigError(
        f"data.tiled_rows ({self.data.tiled_rows}) must be below train.batch_size "
        f"({self.train.batch_size}): the rest of each batch is text"
      )
    if self.train.objective == "zha_kl" and self.model.attention.kind != "zha":
      raise ConfigError(f"train.objective zha_kl needs model.attention.kind zha, got {self.model.attention.kind!r}")
    if self.train.recall_beta + self.train.recall_switch_beta > 0 and not self.data.recall_masks:
      raise ConfigError("data.recall_masks must be true when train.recall_beta or train.recall_switch_beta > 0")
    att = self.model.attention
    if kinds.get(att.kind).family == "freesolo" and att.top_k > self.data.seq_len // att.cell:
      raise ConfigError(
        f"model.attention.top_k ({att.top_k}) exceeds the {self.data.seq_len // att.cell} cells a training context "
        f"holds (data.seq_len {self.data.seq_len} / attention.cell {att.cell}): every query would pay for cells "
        "that do not exist"
      )
    if self.eval.niah_samples and self.data.seq_len < NIAH_MIN_LENGTH:
      raise ConfigError(
        f"eval.niah_samples needs data.seq_len >= {NIAH_MIN_LENGTH} (S-NIAH's 128-token "
        f"generation budget plus its prompt), got {self.data.seq_len}"
      )

  def warnings(self):
    """One line per setting that is legal but buys nothing at the training length (`train.py` prints them): an
    FS-L pool or an FS-B beam that holds every cell of a training context prunes nothing while training."""
    att = self.model.attention
    cells = self.data.seq_len // att.cell
    context = f"the {cells} cells of a training context (data.seq_len {self.data.seq_len} / attention.cell {att.cell})"
    lines = []
    if att.kind == "fsl" and att.retain_top + att.retain_recent >= cells:
      lines.append(
        f"model.attention.retain_top + retain_recent ({att.retain_top} + {att.retain_recent}) hold all {context}: "
        "FS-L prunes nothing while training, so it trains as FS"
      )
    if att.kind == "fsb" and att.beam >= cells:
      lines.append(
        f"model.attention.beam ({att.beam}) reaches all {context}: the beam search prunes nothing while training, "
        "at FS-B's cost"
      )
    return lines


def _check_type(value, annotation, path):
  """Returns `value` converted to `annotation` or raises ConfigError naming `path`."""
  if typing.get_origin(annotation) in (typing.Union, types.UnionType):
    args = typing.get_args(annotation)
    if value is None and type(None) in args:
      return None
    (annotation,) = [a for a in args if a is not type(None)]
  if typing.get_origin(annotation) is tuple:  # tuple[X, ...]: a list, or one scalar meaning a 1-tuple
    (item, _) = typing.get_args(annotation)
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(_check_type(v, item, f"{path}[{i}]") for i, v in enumerate(values))
  if annotation is bool:
    if isinstance(value, bool):
      return value
  elif annotation is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif annotation is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
      try:
        return float(value)
      except ValueError:
        pass
  elif annotation is str:
    if isinstance(value, str):
      return value
  raise ConfigError(f"{path} must be of type {annotation.__name__}, got {value!r}")


def from_dict(cls, data, path=""):
  """Builds dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError.

  `path` is the dotted location of `data` in the file (e.g. "model.attention"), used in messages.
  """
  if not isinstance(data, dict):
    raise ConfigError(f"{path or 'config'} must be a mapping, got {data!r}")
  if cls is AttentionConfig:
    data = _nest_flat_sections(data, path)
  fields = {f.name for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(data) - fields)
  if unknown:
    where = f"{path}.{unknown[0]}" if path else unknown[0]
    raise ConfigError(f"unknown key {where} (known: {', '.join(sorted(fields))})")
  kwargs = {}
  for name, value in data.items():
    where = f"{path}.{name}" if path else name
    hint = hints[name]
    section = _section(hint)
    if section is not None and not (value is None and section is not hint):  # a null optional section stays null
      kwargs[name] = from_dict(section, value, where)
    else:
      kwargs[name] = _check_type(value, hint, where)
  return cls(**kwargs)


def _section(hint):
  """The dataclass of a section field annotated `X` or `X | None` (a null optional section), else None."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
  return hint if dataclasses.is_dataclass(hint) else None


# Flat attention keys of earlier configs (and of checkpoints' config.json) and the section field they now fill.
_FLAT_SECTION_KEYS = {
  "moba_block": ("moba", "block"),
  "moba_top_k": ("moba", "top_k"),
  **{f"zha_{name}": ("zha", name) for name in ("refs", "chunk", "levels", "top_p", "max_nodes", "distill")},
}


def _nest_flat_sections(data, path):
  """`data` with flat keys such as `zha_top_p` moved into their sections (`zha: {top_p: ...}`)."""
  nested = {key: value for key, value in data.items() if key not in _FLAT_SECTION_KEYS}
  for key, (section, name) in _FLAT_SECTION_KEYS.items():
    if key not in data:
      continue
    target = nested.setdefault(section, {})
    if not isinstance(target, dict):
      raise ConfigError(f"{path}.{section} must be a mapping, got {target!r}")
    if name in target:
      raise ConfigError(f"{path}.{key} and {path}.{section}.{name} both set: keep {path}.{section}.{name}")
    nested[section] = {**target, name: data[key]}
  return nested


def override_model(model_config, assignments):
  """`model_config` with `key.sub=value` overrides (e.g. "attention.kind=fsb") applied and validated."""
  data = to_dict(model_config)
  for assignment in assignments:
    apply_override(data, assignment)
  return from_dict(ModelConfig, data, "model")


def apply_override(data, assignment):
  """Applies one `key.sub=value` override (value parsed as YAML) to a nested dict, in place."""
  if "=" not in assignment:
    raise ConfigError(f"override {assignment!r} must look like key.sub=value")
  key, raw = assignment.split("=", 1)
  *parents, leaf = key.strip().split(".")
  if parents and parents[-1] == "attention" and leaf in _FLAT_SECTION_KEYS:  # e.g. attention.zha_top_p
    section, leaf = _FLAT_SECTION_KEYS[leaf]
    parents.append(section)
  node = data
  for part in parents:
    if node.get(part) is None:  # a null optional section (e.g. attention.rope_scaling) starts empty
      node[part] = {}
    node = node[part]
    if not isinstance(node, dict):
      raise ConfigError(f"override {key}: {part} is not a section")
  node[leaf] = yaml.safe_load(raw)


def _merge(base, override):
  """Deep merge of two config dicts: `override` wins, sections merge key by key."""
  merged = dict(base)
  for key, value in override.items():
    merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
  return merged


def read_yaml(path):
  """A config file as a dict, with `base: other.yaml` (relative to the file) merged underneath."""
  try:
    with open(path) as f:
      data = yaml.safe_load(f) or {}
  except FileNotFoundError:
    raise ConfigError(f"config file not found: {path}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
  base = data.pop("base", None)
  if base is None:
    return data
  return _merge(read_yaml(os.path.join(os.path.dirname(path), base)), data)


def load_config(path=None, overrides=()):
  """Loads a YAML config file (or the defaults when `path` is None) and applies `key=value` overrides."""
  data = read_yaml(path) if path is not None else {}
  for assignment in overrides:
    apply_override(data, assignment)
  return from_dict(Config, data)


def to_dict(config):
  """Plain nested dict of a config (tuples as lists), ready for `yaml.safe_dump`."""
  return dataclasses.asdict(
    config, dict_factory=lambda items: {k: list(v) if isinstance(v, tuple) else v for k, v in items}
  )


# Model shapes of FS App. A and a tiny one for CPU tests.
MODEL_PRESETS = {
  "fs_341m": dict(num_layers=24, d_model=1024, num_heads=16, head_dim=64),
  "fs_743m": dict(num_layers=24, d_model=1536, num_heads=16, head_dim=96),
  # configs/repro/repro_fs.yaml's shape, for benchmarks/decode.py --preset repro_43m.
  "repro_43m": dict(
    num_layers=8,
    d_model=512,
    num_heads=8,
    head_dim=64,
    attention=AttentionConfig(window=128, cell=16, block=64, top_k=4, retain_top=32, retain_recent=4),
  ),
  "tiny": dict(
    vocab_size=512,
    num_layers=2,
    d_model=64,
    num_heads=4,
    head_dim=16,
    attention=AttentionConfig(window=64, cell=8, block=32, top_k=2, retain_top=4, retain_recent=2),
  ),
}


def model_preset(name, kind=None, **overrides):
  """A `ModelConfig` for a preset in MODEL_PRESETS, its attention switched to `kind`, fields overridden."""
  if name not in MODEL_PRESETS:
    raise ConfigError(f"preset must be one of {sorted(MODEL_PRESETS)}, got {name!r}")
  config = ModelConfig(**{**MODEL_PRESETS[name], **overrides})
  if kind is not None:
    config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, kind=kind))
  return config
