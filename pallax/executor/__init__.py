"""Config selection for kernels (design.md section 3).

Every kernel has a ``KernelSpec`` (config class, heuristic, candidates,
support check), registered under its primitive's name by
``pallax.op.define_primitive``; the op framework asks the ``Executor`` in scope
for each kernel call's config at lowering time.

Implementations (``xla``, ``pallas_triton``, ``pallas_mosaic_tpu``,
``pallas_mosaic_gpu``, ``triton_raw``, a user's) are registered entries
(``pallax.executor.implementation``): ``implementations()`` lists them with
their platforms, ``register_implementation`` adds one, and
``register_kernel_implementation`` gives a registered kernel a kernel of it.
"""

from pallax.executor.config import KernelConfig
from pallax.executor.executor import (
  POLICIES,
  Executor,
  Scope,
  Selection,
  current_scope,
  default_executor,
  set_default_executor,
)
from pallax.executor.implementation import (
  Implementation,
  Target,
  implementations,
  register_implementation,
)
from pallax.executor.registry import (
  ConfigSpace,
  KernelSpec,
  register_kernel,
  register_kernel_implementation,
)

__all__ = [
  "ConfigSpace",
  "Implementation",
  "KernelConfig",
  "KernelSpec",
  "Target",
  "implementations",
  "register_implementation",
  "register_kernel",
  "register_kernel_implementation",
  "Executor",
  "Scope",
  "Selection",
  "POLICIES",
  "current_scope",
  "default_executor",
  "set_default_executor",
]
