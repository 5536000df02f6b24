"""Pure-jnp reference implementations: the specification of every faster path in fsjax."""

from fsjax.ops.cells import (available_cells, cell_scores, cell_summaries, retention_death_block, top_k_cells,
                             validate_routing)
from fsjax.ops.dense import moba_attention, swa_attention, tfpp_attention
from fsjax.ops.forest import fsb_select_cells
from fsjax.ops.freesolo import (freesolo_attention, freesolo_long_range, rms_norm, select_cells,
                                sparse_readout)
from fsjax.ops.local import local_attention
from fsjax.ops.rope import apply_rope
from fsjax.ops.zha import zha_attention, zha_kl_loss

__all__ = [
    "apply_rope", "available_cells", "cell_scores", "cell_summaries", "freesolo_attention", "fsb_select_cells",
    "freesolo_long_range", "local_attention", "moba_attention", "retention_death_block", "rms_norm",
    "select_cells", "sparse_readout", "swa_attention", "tfpp_attention", "top_k_cells", "validate_routing",
    "zha_attention", "zha_kl_loss",
]
