"""The FreeSolo routing geometry as one frozen, hashable object (FS App. A defaults).

A `Routing` is built once (from `AttentionConfig.routing`, or from an op's keyword arguments) and passed whole
to modules, ops, caches and kernel wrappers, so geometry never travels as a dozen loose scalars. Being hashable,
it can be a static argument of `jax.jit` and a field of a Flax module.
"""

import dataclasses

VARIANTS = ("fs", "fsl", "fsb")


def validate_routing(*, cell, block, window, top_k, retain_top, retain_recent, prefix=""):
  """Raises ValueError naming the first argument that breaks a FreeSolo geometry rule.

  `prefix` is prepended to argument names, so configs can report `attention.block` where ops report `block`.
  """
  for name, value in (("cell", cell), ("block", block), ("top_k", top_k), ("retain_top", retain_top)):
    if value < 1:
      raise ValueError(f"{prefix}{name} must be >= 1, got {value}")
  if retain_recent < 0:
    raise ValueError(f"{prefix}retain_recent must be >= 0, got {retain_recent}")
  if block % cell:
    raise ValueError(f"{prefix}block must be a multiple of {prefix}cell, got block={block}, cell={cell}")
  if window < block - 1:
    # Otherwise tokens between the last eligible cell and the query would be seen by neither branch (FS 3.3).
    raise ValueError(f"{prefix}window must be >= {prefix}block - 1, got window={window}, block={block}")


@dataclasses.dataclass(frozen=True)
class Routing:
  """How a FreeSolo head routes its queries to cells.

  Attributes:
    variant: "fs" (all eligible cells, Eq. 6), "fsl" (norm-pruned pool, Eq. 8) or "fsb" (two-forest beam search
      and token rerank, Eq. 10-12).
    window: local radius `w` (Eq. 3-4), `w >= B - 1`.
    cell: cell size `s` (Eq. 5).
    block: query block `B`, a multiple of `s` (Eq. 6).
    top_k: cells read per query, `K`.
    retain_top, retain_recent: FS-L's pool `P` and recent cells `W` (Eq. 8).
    beam, bound_c: FS-B's beam width `W_b` and the radius factor `c` of the node bound (Eq. 11).
  """

  variant: str = "fs"
  window: int = 512
  cell: int = 32
  block: int = 128
  top_k: int = 4
  retain_top: int = 64
  retain_recent: int = 8
  beam: int = 16
  bound_c: float = 8.0

  def validate(self, prefix=""):
    """Raises ValueError naming the first field that breaks a rule; returns self."""
    if self.variant not in VARIANTS:
      raise ValueError(f"{prefix}variant must be one of {VARIANTS}, got {self.variant!r}")
    validate_routing(
      cell=self.cell,
      block=self.block,
      window=self.window,
      top_k=self.top_k,
      retain_top=self.retain_top,
      retain_recent=self.retain_recent,
      prefix=prefix,
    )
    return self

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)

  @property
  def cells_per_block(self):
    return self.block // self.cell
