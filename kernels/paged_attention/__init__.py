"""Paged attention (decoding against a paged KV cache): the XLA program and the kernels.

* ``common.py``: the operands' layout, the call's static facts, the logits
  and the reduction over splits;
* ``config.py``: ``PagedAttentionConfig``, its heuristic, autotuning space
  and legality;
* ``xla.py``: the blockwise XLA program (the CPU path);
* ``triton.py`` (flash-decoding), ``mosaic_tpu.py``: the Pallas kernels.

The online softmax and the block products are attention's
(``kernels/attention/common.py``).
"""

from __future__ import annotations

from pallax.kernels.paged_attention import config, mosaic_tpu, triton
from pallax.kernels.paged_attention.config import PagedAttentionConfig
from pallax.op import Kernel

__all__ = ["KERNEL", "PagedAttentionConfig"]

KERNEL = Kernel.of_family(
  "paged_attention",
  config=config,
  backends={"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu},
)
