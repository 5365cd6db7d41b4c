"""The hierarchical op on the host emulation: two processes play two nodes, each driving its node's
two ranks as virtual ranks of ``EpDispatchCombine(cfg.node_config(), device="cpu", arch=...)``,
the network leg on gloo (tests/gpu/test_hierarchical_gpu.py with the host in place of cuda:0).
Every case of ``epgen.harness.hierarchical_verify.CASES`` (uniform, skewed to one node, -1 rows,
duplicate ids, zero-token ranks and nodes, no tokens at all) of its ``VARIANTS`` (fp8 payload with
scales and the fp8 blockwise wire; capped receive rows with the fp8 direct-cast wire; the normal
family alone; not the plain bf16 one, see ``LAYERS``), bit for bit against the reference, on gfx942 (its
e4m3fnuz payload and wire; the hierarchical layer above the node-local op is the same for every arch).

The node-local configs name the host's geometry (``host_cases.cfg``'s rule), so the kernels that
run are the ones the config states.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from epgen.harness.hierarchical_verify import CASES, VARIANTS, small_config
from epgen.host import GEOMETRY

sys.path.insert(0, str(Path(__file__).parent))
from host_cases import host_module, seed_of, warm  # noqa: E402

PROCS_TIMEOUT_S = 150.0
LAYERS = [("gfx942", v) for v in sorted(VARIANTS) if v != "bf16"]
"""The layers run: every variant but "bf16", whose path (bf16 payload and wire, kernel_family "auto")
"capped-recv-direct-cast" runs with a cap and a quantized wire on top (8 fewer kernels to compile)."""


@pytest.fixture(scope="module", autouse=True)
def _host():
    with host_module():
        yield


def _config(fields: dict):
    geo = {"dispatch_geometry": GEOMETRY, "combine_geometry": GEOMETRY}
    if fields.get("kernel_family", "auto") != "normal":
        geo["low_latency_geometry"] = GEOMETRY
    return small_config(hidden=128, **geo, **fields)


def _worker(rank, world_size, store, layers, seed):
    from epgen.harness.hierarchical_verify import check_round, make_inputs
    from epgen.layers.hierarchical import HierarchicalEp
    from epgen.op import EpDispatchCombine

    sys.path.insert(0, str(Path(__file__).parent))
    from host_cases import seeded

    from epgen.host import Schedule

    torch.set_num_threads(1)  # host_cases.host_module's setting, for this process's life
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for i, (arch, variant) in enumerate(layers):
            took = []
            cfg = _config(VARIANTS[variant])
            node = EpDispatchCombine(cfg.node_config(), virtual=True, device="cpu", arch=arch, validate=True,
                                     schedule=Schedule(seed=seed + 100_000 * i + 1000 * rank))
            try:
                op = HierarchicalEp(cfg, node)
                assert op.wire_device == torch.device("cpu") and op.device == torch.device("cpu")
                with seeded(node, f"node {rank}, layer {variant}"):
                    for k, (tokens, kind) in enumerate(CASES):
                        inputs = make_inputs(cfg, tokens, kind, 100 + k)
                        want = node.payload.torch_dtype  # gfx942's fp8 is e4m3fnuz: the same values
                        inputs = [attrs.evolve(x, x=x.x.float().to(want)) if x.x.dtype != want else x for x in inputs]
                        start = time.monotonic()
                        stats = check_round(op, inputs)
                        took.append(time.monotonic() - start)
                        if sum(tokens) == 0:
                            assert stats["recv"] == [0, 0]
            finally:
                dist.barrier()
                node.close()
            if rank == 0:
                print(f"{arch} {variant}: {sum(took):.1f} s", flush=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_nodes_of_two_ranks_match_the_reference(tmp_path, request):
    from epgen.harness.ranks import start_and_join

    warm([(_config(VARIANTS[v]).node_config(), arch, 2) for arch, v in LAYERS])
    start_and_join(_worker, (2, os.path.join(tmp_path, "store"), LAYERS, seed_of(request.node.name)), 2,
                   timeout_s=PROCS_TIMEOUT_S)
