"""epgen: generated MoE expert-parallel dispatch/combine kernels on torch tensors.

``EpConfig`` describes a layer, ``EpDispatchCombine`` runs it (``epgen.op``), ``HierarchicalEp``
runs one spanning nodes (``epgen.hierarchical``); ``epgen.reference`` is the pure-torch
reference; ``epgen.codegen`` renders and checks kernels without a GPU.

Package map (folder in the checkout -> import package):

* ``codegen/``   -> ``epgen.codegen``: specs, configs, arch traits, ABI, rendering, catalogue,
  offline compile checks (no GPU, no torch at import);
* ``templates/`` -> ``epgen.templates``: the Jinja templates (package data);
* ``runtime/``   -> ``epgen``, in wings, each named for its layer:

  * ``tensors``, at the top: ``check_tensor``, the one check of a tensor argument (imports torch
    only; every other wing may use it);
  * the core, at the top: ``op`` (the op), ``plan`` (which kernels each call launches, as data),
    ``arena``, ``platform`` (its buffers, signals and error records), ``host`` (the same on the
    CPU: the kernels run by an emulation, docs/host.md), ``loader``,
    ``cache``, ``device`` (compile and load a kernel),
    ``aot`` (fill the cache ahead of time: a library call, as serving code makes it), ``config``
    (``EpConfig``'s public path);
  * the references, at the top too: ``reference`` and ``quant/`` (pure torch, no GPU);
  * ``layers/`` -> ``epgen.layers``: model layers on the op (``moe``, ``moe_a2a``,
    ``hierarchical``, ``autograd``; ``epgen.moe``, ``epgen.hierarchical`` and ``epgen.autograd``
    re-export the public three);
  * ``integrations/`` -> ``epgen.integrations``: epgen inside frameworks (``transformers``: expert
    parallelism for Hugging Face models), on the layers' footing;
  * ``harness/`` -> ``epgen.harness``: verification, timing and rank processes;
  * ``cli/`` -> ``epgen.cli``: the command line (verbs, flags, options).

The rules, one way (``tests/codegen/test_imports.py`` enforces each): ``epgen.codegen`` and
``epgen.tensors`` import nothing else of ``epgen``; the core imports codegen, tensors and the
core; the references import codegen, tensors and the references; the layers add the core and the references; the integrations and
the harness each add the layers; the command line may import everything and nothing imports it
but ``epgen.__main__``.
This module and the re-export modules (``epgen.moe``, ``epgen.hierarchical``, ``epgen.autograd``)
are the public front: no module of the package imports them but ``epgen.cli`` (``__version__``). Every import
names its module absolutely (``from epgen.codegen.spec import ...``). The op is imported on
first use, so ``import epgen`` (and ``epgen --help``) loads no torch.
"""

from epgen.codegen.config import EpConfig
from epgen.codegen.models import MODELS
from epgen.codegen.spec import KernelSpec, Op

__all__ = ["MODELS", "DispatchLayout", "DispatchOutput", "EpConfig", "EpDispatchCombine", "EpError", "ExpertDispatchOutput",
           "HierarchicalEp", "HierarchicalError", "KernelSpec", "Op", "ReferenceNodeOp"]
__version__ = "0.1.0"

_FROM_OP = ("DispatchLayout", "DispatchOutput", "EpDispatchCombine", "EpError", "ExpertDispatchOutput")
_FROM_HIERARCHICAL = ("HierarchicalEp", "HierarchicalError", "ReferenceNodeOp")


def __getattr__(name: str):
    if name in _FROM_OP:
        from epgen import op

        return getattr(op, name)
    if name in _FROM_HIERARCHICAL:
        from epgen.layers import hierarchical

        return getattr(hierarchical, name)
    raise AttributeError(f"module 'epgen' has no attribute {name!r}")
