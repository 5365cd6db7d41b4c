"""``epgen.hierarchical``: the public path of the multi-node op, defined in ``epgen.layers.hierarchical``."""
from epgen.layers.hierarchical import *  # noqa: F401,F403
