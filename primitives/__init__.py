"""pallax.primitives."""
