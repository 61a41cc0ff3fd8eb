"""pallax.batching_rules."""
