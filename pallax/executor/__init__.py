"""Config selection for kernels (design.md section 3).

Every kernel has a ``KernelSpec`` (config class, heuristic, candidates,
support check), registered under its primitive's name by
``pallax.op.define_primitive``; the op framework asks the ``Executor`` in scope
for each kernel call's config at lowering time.
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
from pallax.executor.registry import KernelSpec, register_kernel

__all__ = [
  "KernelConfig",
  "KernelSpec",
  "register_kernel",
  "Executor",
  "Scope",
  "Selection",
  "POLICIES",
  "current_scope",
  "default_executor",
  "set_default_executor",
]
