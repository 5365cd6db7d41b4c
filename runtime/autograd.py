"""``epgen.autograd``: the public path of differentiable dispatch and combine, defined in
``epgen.layers.autograd``."""
from epgen.layers.autograd import *  # noqa: F401,F403
