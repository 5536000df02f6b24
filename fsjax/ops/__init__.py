"""The public API of fsjax's operators (docs/design.md §6).

Ops that have faster implementations take `impl` ("reference" | "auto" | "pallas", see `fsjax.ops.dispatch`);
the rest are the references themselves (`fsjax.reference`), re-exported here so `fsjax.ops` is the one front
door.
"""

from fsjax.ops.dense import local_attention, moba_attention, swa_attention, tfpp_attention
from fsjax.ops.dispatch import IMPLS, UnsupportedImpl
from fsjax.ops.forest import forest_beam_search
from fsjax.ops.freesolo import (
  freesolo_attention,
  freesolo_long_range,
  select_cells,
  select_from_summaries,
  sparse_readout,
)
from fsjax.ops.zha import zha_attention, zha_decode, zha_kl_loss, zha_kl_per_level, zha_route
from fsjax.reference.cells import available_cells, cell_scores, cell_summaries, retention_death_block, top_k_cells
from fsjax.reference.forest import fsb_select_cells
from fsjax.reference.freesolo import rms_norm
from fsjax.reference.rope import apply_rope
from fsjax.reference.routing import Routing, validate_routing

__all__ = [
  "IMPLS",
  "Routing",
  "UnsupportedImpl",
  "apply_rope",
  "available_cells",
  "cell_scores",
  "cell_summaries",
  "forest_beam_search",
  "freesolo_attention",
  "freesolo_long_range",
  "fsb_select_cells",
  "local_attention",
  "moba_attention",
  "retention_death_block",
  "rms_norm",
  "select_cells",
  "select_from_summaries",
  "sparse_readout",
  "swa_attention",
  "tfpp_attention",
  "top_k_cells",
  "validate_routing",
  "zha_attention",
  "zha_decode",
  "zha_kl_loss",
  "zha_kl_per_level",
  "zha_route",
]
