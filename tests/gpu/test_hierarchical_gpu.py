"""The hierarchical op on one GPU: two processes play two nodes, each driving its node's two ranks
as virtual ranks of an ``EpDispatchCombine`` on cuda:0, the network leg on gloo over CPU tensors
(the copies to and from the GPU are part of the leg). The same cases and layers as the CPU test
(tests/runtime/layers/test_hierarchical.py, ``epgen.harness.hierarchical_verify``), bit for bit against the
reference."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from epgen.codegen.config import Geometry
from epgen.harness.hierarchical_verify import VARIANTS, run_cases, small_config
from epgen.harness.ranks import start_and_join

GEO = Geometry(16, 16, 4)
"""Explicit geometry: one variant per op, 2 x 16 blocks resident at once (virtual ranks)."""
PROCS_TIMEOUT_S = 280.0
"""Bound of one run: two processes start, compile (NVRTC) and run every case."""


def _worker(rank, world_size, store, fields):
    from epgen.layers.hierarchical import HierarchicalEp
    from epgen.op import EpDispatchCombine

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cfg = small_config(dispatch_geometry=GEO, combine_geometry=GEO, **fields)
        node = EpDispatchCombine(cfg.node_config(), virtual=True, device=0, validate=True)
        try:
            op = HierarchicalEp(cfg, node)
            assert op.wire_device == torch.device("cpu") and op.device == torch.device("cuda", 0)
            run_cases(op, seed=100)
            torch.cuda.synchronize()
        finally:
            node.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_nodes_on_one_gpu(tmp_path, variant):
    start_and_join(_worker, (2, os.path.join(tmp_path, "store"), VARIANTS[variant]), 2, timeout_s=PROCS_TIMEOUT_S)
