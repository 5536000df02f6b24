"""Pallas GPU (Triton) kernels; one kernel family per module, each tested against the jnp specification it speeds
up. Nothing here imports fsjax: what a kernel needs from the maths it takes as arguments or keeps in `common`.

- `cell_scoring`: FreeSolo cell scoring and top-K (FS Eq. 6-8), `fsjax.reference.cells`.
- `sparse_readout`: FreeSolo's readout over the selected cells (Eq. 9) and its gradient, `fsjax.reference.freesolo`.
- `forest_search`: FS-B's beam search over streaming forests (Eq. 11), `fsjax.reference.forest.beam_search`.
- `zha_routing`: ZHA's capped decode step: candidate scoring, top-p selection and the attention over the reached
  keys (ZHA III-C), `fsjax.reference.zha_decode`.
- `common`: what the families share: interpret-mode default, padding, geometry checks, an in-kernel erf.
"""
