"""pallax.kernels"""
