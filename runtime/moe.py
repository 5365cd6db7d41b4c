"""``epgen.moe``: the public path of the MoE layer, defined in ``epgen.layers.moe``."""
from epgen.layers.moe import *  # noqa: F401,F403
