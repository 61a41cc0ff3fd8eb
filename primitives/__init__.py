"""pallax.primitives"""
