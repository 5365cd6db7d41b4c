"""The planner (``epgen.codegen.planner``): one enumeration of a config's kernels, pure data."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from epgen.codegen import planner
from epgen.codegen.arch import ARCHES
from epgen.codegen.config import EpConfig
from epgen.codegen.spec import Op, ops_where

CONFIGS = {
    "auto rank": EpConfig.for_model("deepseek-v3", world_size=8, max_tokens_per_rank=4096),
    "normal expert fp8 wire pull": EpConfig.for_model("deepseek-v3", world_size=4, max_tokens_per_rank=2048,
                                                      kernel_family="normal", layout="expert", expert_alignment=16,
                                                      combine_quant="fp8_blockwise", dispatch_transport="pull"),
    "low_latency fp8": EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=96,
                                dtype="fp8", scale_bytes=32, kernel_family="low_latency"),
}


def test_planning_imports_neither_torch_nor_the_runtime():
    code = ("import sys, epgen.codegen.planner as p; from epgen.codegen.config import EpConfig; "
            "p.plan(EpConfig.for_model('deepseek-v3', world_size=8, max_tokens_per_rank=4096), 'gfx942'); "
            "print(sorted(m for m in sys.modules if m in ('torch', 'cupy') or m.startswith('epgen.') "
            "and not m.startswith('epgen.codegen')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("arch", ARCHES)
def test_every_consumer_takes_the_planners_kernels(name, arch):
    from epgen.aot import config_specs
    from epgen.plan import Plan

    cfg = CONFIGS[name]
    kernels = planner.plan(cfg, arch)
    assert config_specs(cfg, arch) == list(kernels.specs())  # epgen build, the op's construction
    assert Plan.build(cfg, arch).variants == kernels.variants  # the op's launches
    assert planner.specs(cfg, arch) == list(kernels.specs_at())  # catalogue, check, demo
    assert set(kernels.specs_at()) <= set(kernels.specs())
    for (op, transport), buckets in kernels.variants.items():
        assert [t for t, _ in buckets] == sorted(t for t, _ in buckets)
        assert all(s.op is op and s.transport == transport and s.arch == arch for _, s in buckets)


def test_the_kinds_a_config_builds_follow_the_table_rows():
    cfg = CONFIGS["normal expert fp8 wire pull"]
    assert planner.ops(cfg) == (Op.DISPATCH, Op.COMBINE, Op.DISPATCH_PULL, Op.EXPAND_PLAN, Op.EXPAND, Op.FOLD)
    rank = attrs.evolve(cfg, layout="rank", expert_alignment=1)
    assert Op.COMBINE_QUANTIZE in planner.ops(rank) and Op.FOLD not in planner.ops(rank)
    assert planner.ops(attrs.evolve(rank, world_size=1, num_experts=256)) == (Op.DISPATCH, Op.COMBINE, Op.DISPATCH_PULL)
    assert planner.ops(CONFIGS["low_latency fp8"]) == ops_where(family="low_latency")


def test_a_layer_across_nodes_plans_its_node_config():
    cfg = attrs.evolve(CONFIGS["auto rank"], world_size=16, num_experts=256, nodes=2)
    with pytest.raises(ValueError, match=r"EpConfig.nodes=2: .*plan its node_config\(\)"):
        planner.plan(cfg, "sm_90")
    assert planner.plan(cfg.node_config(), "sm_90").config.world_size == 8


def test_every_bucket_says_where_its_numbers_came_from():
    for arch in ARCHES:
        sched = planner.plan(CONFIGS["auto rank"], arch).schedule
        assert all(b.source.kind in ("measured", "published", "derived") and b.source.detail
                   for bs in sched.entries.values() for b in bs)
    gfx942 = planner.plan(CONFIGS["auto rank"], "gfx942")
    assert {b.source.kind for bs in gfx942.schedule.entries.values() for b in bs} == {"derived"}
    assert gfx942.variant(Op.DISPATCH, 4096).blocks == 2 * 304 and gfx942.variant(Op.COMBINE, 4096).blocks == 304 // 8
