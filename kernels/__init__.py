"""pallax.kernels."""
