"""epgen: generated MoE expert-parallel dispatch/combine kernels on torch tensors.

``EpConfig`` describes a layer, ``EpDispatchCombine`` runs it (``epgen.op``), ``HierarchicalEp``
runs one spanning nodes (``epgen.hierarchical``); ``epgen.reference``
is the pure-torch reference; ``epgen.codegen`` renders and checks kernels without a GPU.

Package map (folder in the checkout -> import package), and the one-way rule:

* ``runtime/``   -> ``epgen``: the op, loader, arenas, verification, bench, CLI (torch, CuPy);
* ``codegen/``   -> ``epgen.codegen``: specs, configs, arch traits, ABI, rendering, catalogue,
  offline compile checks (no GPU, no torch at import);
* ``templates/`` -> ``epgen.templates``: the Jinja templates (package data).

``epgen`` imports ``epgen.codegen``, never the other way round; every import names its module
absolutely (``from epgen.codegen.spec import ...``). ``tests/codegen/test_imports.py`` enforces both.
The op is imported on first use, so ``import epgen`` (and ``epgen --help``) loads no torch.
"""

from epgen.codegen.config import EpConfig
from epgen.codegen.models import MODELS
from epgen.codegen.spec import KernelSpec, Op

__all__ = ["MODELS", "DispatchOutput", "EpConfig", "EpDispatchCombine", "EpError", "ExpertDispatchOutput",
           "HierarchicalEp", "HierarchicalError", "KernelSpec", "Op", "ReferenceNodeOp"]
__version__ = "0.1.0"

_FROM_OP = ("DispatchOutput", "EpDispatchCombine", "EpError", "ExpertDispatchOutput")
_FROM_HIERARCHICAL = ("HierarchicalEp", "HierarchicalError", "ReferenceNodeOp")


def __getattr__(name: str):
    if name in _FROM_OP:
        from epgen import op

        return getattr(op, name)
    if name in _FROM_HIERARCHICAL:
        from epgen import hierarchical

        return getattr(hierarchical, name)
    raise AttributeError(f"module 'epgen' has no attribute {name!r}")
