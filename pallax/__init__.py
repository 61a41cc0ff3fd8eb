"""pallax: JAX kernel library.

Performance-critical ops written as Pallas kernels (GPU/TPU) with a tuned XLA
program as the CPU path, each one a real JAX primitive so that jit, grad, jvp,
vmap, pmap and shard_map all work.
"""
from pallax.interpret import interpret
from pallax.primitives.norm import RmsNormConfig, rms_norm

__version__ = "0.1.0"

__all__ = ["interpret", "rms_norm", "RmsNormConfig"]
