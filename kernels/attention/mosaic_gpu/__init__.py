"""The attention kernels on Pallas Mosaic GPU (Hopper): FlashAttention-3's structure.

* ``config.py``: ``MosaicGpuAttentionConfig`` (a config class of its own),
  heuristic, candidates, legality, the SMEM model, the backward's kernel keys;
* ``tiles.py``: block ranges, masks, logits and the step loops the kernels share;
* ``fwd.py``: the forward (``out``, ``lse``): a TMA producer warpgroup and two
  ping-pong ``wgmma`` consumer warpgroups (one where two spill);
* ``bwd.py``: the backward from the saved ``lse``: a dq kernel and a dk/dv
  kernel of the same structure, no atomics; or (``fuse_dq``, an autotuning
  candidate unless XLA's flags ask for deterministic ops) the dk/dv kernel
  alone, adding dQ by TMA reduce-adds;
* ``jvp.py``: the tangent, one pass from the saved ``lse``;
* ``query_side.py``: the frame of the dq and tangent kernels.

Each kernel has an interpreted form for the CPU check
(``pallax.pallas_mosaic_gpu.Form``).
"""

from __future__ import annotations

from pallax.kernels.attention.mosaic_gpu.bwd import bwd
from pallax.kernels.attention.mosaic_gpu.config import (
  CONFIG_CLS,
  IMPLEMENTATION,
  MosaicGpuAttentionConfig,
  candidates,
  feature_reason,
  heuristic,
  kernel_keys,
  smem_bytes,
  supports,
)
from pallax.kernels.attention.mosaic_gpu.fwd import fwd
from pallax.kernels.attention.mosaic_gpu.jvp import jvp

__all__ = [
  "CONFIG_CLS",
  "IMPLEMENTATION",
  "MosaicGpuAttentionConfig",
  "bwd",
  "candidates",
  "feature_reason",
  "fwd",
  "heuristic",
  "jvp",
  "kernel_keys",
  "smem_bytes",
  "supports",
]
