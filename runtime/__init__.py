"""epgen: generated MoE expert-parallel dispatch/combine kernels on torch tensors.

Public names: ``EpConfig``, ``EpDispatchCombine``, ``KernelSpec``, ``MODELS``; the pure-torch
reference lives in ``epgen.reference``.
"""

from .codegen.spec import KernelSpec, Op  # noqa: F401

__version__ = "0.1.0"
