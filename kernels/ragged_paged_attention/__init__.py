"""Ragged paged attention (mixed prefill chunks and decode tokens against a paged KV cache).

* ``common.py``: the operands' layout, the call's static facts, the work
  list of query items and the masks;
* ``config.py``: ``RaggedPagedAttentionConfig``, its heuristic, autotuning
  space and legality;
* ``xla.py``: the XLA program (the CPU path);
* ``triton.py``, ``mosaic_tpu.py``: the Pallas kernels;
* ``mosaic_gpu.py``: the Hopper kernel (TMA page gathers, ``wgmma``) with a
  config class of its own, an autotuning candidate on H100/H200.

The logits and the gathers through the page table are ``paged_attention``'s,
the online softmax attention's (``kernels/attention/common.py``).
"""

from __future__ import annotations

from pallax.kernels.ragged_paged_attention import config, mosaic_gpu, mosaic_tpu, triton
from pallax.kernels.ragged_paged_attention.config import RaggedPagedAttentionConfig
from pallax.op import Kernel

__all__ = ["KERNEL", "RaggedPagedAttentionConfig"]

KERNEL = Kernel.of_family(
  "ragged_paged_attention",
  config=config,
  backends={"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu},
  own_configs={mosaic_gpu.IMPLEMENTATION: mosaic_gpu},
)
