"""Pallas GPU (Triton) kernels; each one is tested against the jnp specification it speeds up.

- `cell_scoring`, `sparse_readout`: FreeSolo selection (FS Eq. 6-8) and readout (Eq. 9), `fsjax.ops.freesolo`.
- `tree_routing`: ZHA capped decode, node scoring and the attention over reached keys, `fsjax.cache.zha`.
"""
