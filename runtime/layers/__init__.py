"""``epgen.layers``: model layers built on the op.

``moe`` is the MoE layer (dispatch, expansion, SwiGLU expert GEMMs, fold, combine) and its dense
reference; ``autograd`` differentiable dispatch and combine on the op's kernels (public as
``epgen.autograd``); ``moe_a2a`` the same layer over ``torch.distributed.all_to_all_single`` (the
baseline); ``hierarchical`` the op across nodes (a node-local ``EpDispatchCombine`` and a network
leg); ``expert_parallel`` what every framework integration shares (token layouts, backends,
``ReferenceOp``, ``expert_rows``, ``ExpertParallel.run`` and ``.train`` around an experts stage the
integration passes). Users import them by their public paths ``epgen.moe`` and ``epgen.hierarchical``, which
re-export these modules.

Rule (``tests/codegen/test_imports.py``): a layer imports the core and the references
(``epgen.reference``, ``epgen.quant``), never the harness or the command line.
"""
