"""epgen: generated MoE expert-parallel dispatch/combine kernels on torch tensors.

``EpConfig`` describes a layer, ``EpDispatchCombine`` runs it (``epgen.op``); ``epgen.reference``
is the pure-torch reference; ``epgen.codegen`` renders and checks kernels without a GPU.
"""

from .codegen.models import MODELS
from .codegen.spec import KernelSpec, Op
from .config import EpConfig
from .op import DispatchOutput, EpDispatchCombine, EpError

__all__ = ["MODELS", "DispatchOutput", "EpConfig", "EpDispatchCombine", "EpError", "KernelSpec", "Op"]
__version__ = "0.1.0"
