"""fsjax: sparse long-context attention that extrapolates (FreeSolo, ZHA and baselines) in JAX."""

__version__ = "0.1.0"
