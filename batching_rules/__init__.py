"""pallax.batching_rules"""
