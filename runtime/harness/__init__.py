"""``epgen.harness``: what proves and measures the op, on top of the core and the layers.

``verify`` builds inputs of each routing kind and checks an op's rows against ``epgen.reference``
(bit-exact where the arithmetic allows); ``hierarchical_verify`` does the same for the multi-node
op; ``timing`` times pairs of launches (events around replays, queued behind a GPU-side delay);
``measure`` records a result's environment and times one verified (dispatch, combine) point;
``moe_verify`` builds the MoE layer's inputs and checks it against the dense reference; ``ranks``
runs a function as W processes (one a GPU, or all sharing cuda:0). The GPU tests, the command
line's verbs (bench, tune, stress, demo) and the scripts under ``tools/`` use them; a serving
process does not.

Rule (``tests/codegen/test_imports.py``): the harness imports the core, the references and the
layers, never the command line.
"""

ROUTINGS = ("uniform", "invalid", "duplicates", "skewed", "one_rank", "shared")
"""Routing kinds of ``epgen.harness.verify.make_inputs`` (kept here, torch-free, for the command
line's help)."""
