"""pallax: JAX kernel library.

Performance-critical ops written as Pallas kernels (GPU/TPU) with a tuned XLA
program as the CPU path, each one a real JAX primitive so that jit, grad, jvp,
vmap, pmap and shard_map all work.
"""

from pallax import _jax_private
from pallax.autobatch import autobatch
from pallax.custom_op import ConfigSpace, CustomOp, KernelStage, ResidualJVP, custom_op
from pallax.executor import Executor, KernelConfig, default_executor, set_default_executor
from pallax.executor.tools import (
  autotune,
  explain,
  explain_on,
  pmap_with_config,
  vmap_with_config,
)
from pallax.interpret import interpret
from pallax.kv_cache import kv_cache_slots, update_kv_cache
from pallax.moe import RouterStats, Routing, moe, route
from pallax.primitives.attention import (
  AttentionConfig,
  MosaicGpuAttentionConfig,
  dot_product_attention,
)
from pallax.primitives.cross_entropy import (
  CrossEntropyConfig,
  cross_entropy,
  linear_cross_entropy,
  linear_softmax_cross_entropy_loss,
)
from pallax.primitives.matmul import MatmulConfig, MosaicGpuMatmulConfig, matmul
from pallax.primitives.norm import NormConfig, fused_add_rms_norm, layer_norm, rms_norm
from pallax.primitives.paged_attention import PagedAttentionConfig, paged_attention
from pallax.primitives.ragged_dot import MosaicGpuRaggedDotConfig, RaggedDotConfig, ragged_dot
from pallax.primitives.ragged_dot_general import ragged_dot_general
from pallax.primitives.ragged_paged_attention import (
  MosaicGpuRaggedPagedAttentionConfig,
  RaggedPagedAttentionConfig,
  ragged_paged_attention,
)
from pallax.primitives.softmax import SoftmaxConfig, log_softmax, softmax
from pallax.rotary import apply_rotary
from pallax.sequence_layout import SequenceLayout, context_parallel

__version__ = "0.1.0"

# No CUDA plugin traceback on a machine without a GPU (the verify extra installs the plugin).
_jax_private.quiet_cuda_plugin_without_gpu()

__all__ = [
  "rms_norm",
  "layer_norm",
  "fused_add_rms_norm",
  "NormConfig",
  "softmax",
  "log_softmax",
  "SoftmaxConfig",
  "matmul",
  "MatmulConfig",
  "MosaicGpuMatmulConfig",
  "dot_product_attention",
  "AttentionConfig",
  "MosaicGpuAttentionConfig",
  "SequenceLayout",
  "context_parallel",
  "paged_attention",
  "ragged_dot",
  "ragged_dot_general",
  "RaggedDotConfig",
  "MosaicGpuRaggedDotConfig",
  "MosaicGpuRaggedPagedAttentionConfig",
  "moe",
  "route",
  "Routing",
  "RouterStats",
  "PagedAttentionConfig",
  "ragged_paged_attention",
  "RaggedPagedAttentionConfig",
  "update_kv_cache",
  "kv_cache_slots",
  "apply_rotary",
  "cross_entropy",
  "linear_cross_entropy",
  "linear_softmax_cross_entropy_loss",
  "CrossEntropyConfig",
  "autobatch",
  "custom_op",
  "CustomOp",
  "ConfigSpace",
  "KernelStage",
  "ResidualJVP",
  "interpret",
  "Executor",
  "KernelConfig",
  "default_executor",
  "set_default_executor",
  "autotune",
  "explain",
  "explain_on",
  "vmap_with_config",
  "pmap_with_config",
]
