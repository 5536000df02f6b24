"""The pure-jnp specification of every operator in fsjax (docs/design.md §4-5): obvious code, at least float32 math
(float64 stays float64), shapes in docstrings, equation numbers in comments. Every faster path (`fsjax.ops`'
Pallas kernels and cuDNN calls, the decode caches) is tested against these functions. This package imports
nothing of fsjax but itself: no kernels, no cuDNN.
"""
