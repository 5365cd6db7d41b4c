"""Tuning tables: lookup rules, the 3% pick rule, the shipped tables."""

import json

import pytest

from epgen.codegen import tuning
from epgen.codegen.arch import ARCHES
from epgen.codegen.spec import KernelSpec, Op
from epgen.codegen.tuning import Geometry, TuningKey, default_geometry, lookup, pick_fewest_blocks
from epgen.codegen.config import EpConfig

KEY = TuningKey(arch="sm_90", world_size=2, row_bytes=14336, topk=8, dtype="bf16", op="dispatch")


def test_lookup_takes_smallest_bucket_not_below_and_clamps(table_dir):
    rows = [(128, Geometry(8, 32, 4)), (4096, Geometry(64, 32, 4)), (1024, Geometry(48, 32, 2))]
    tuning.write_entry(KEY, rows, "test", {})
    assert lookup(KEY, 1) == Geometry(8, 32, 4)
    assert lookup(KEY, 128) == Geometry(8, 32, 4)
    assert lookup(KEY, 129) == Geometry(48, 32, 2)
    assert lookup(KEY, 4096) == Geometry(64, 32, 4)
    assert lookup(KEY, 100_000) == Geometry(64, 32, 4)  # clamped to the largest bucket


def test_unknown_shape_gets_documented_default(table_dir):
    other = TuningKey(arch="gfx950", world_size=3, row_bytes=1024, topk=2, dtype="bf16", op="combine")
    assert lookup(other, 7) == default_geometry("gfx950") == Geometry(24, 16, 4)  # 1024 threads of wave64
    assert default_geometry("sm_90") == Geometry(24, 32, 4)


def test_write_entry_replaces_and_records_provenance(table_dir):
    tuning.write_entry(KEY, [(128, Geometry(8, 32, 4))], "first", {})
    tuning.write_entry(KEY, [(128, Geometry(16, 32, 4))], "second", {"128": {"16x32u4": 1.0}})
    doc = json.loads((table_dir / "sm_90.json").read_text())
    assert len(doc["entries"]) == 1 and doc["entries"][0]["provenance"] == "second"
    assert lookup(KEY, 5) == Geometry(16, 32, 4)


def test_explicit_geometry_overrides_table():
    geo = Geometry(7, 4, 2)
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, dispatch_geometry=geo)
    d, c = cfg.kernel_specs("sm_90", tokens=4096)
    assert (d.blocks, d.warps_per_block, d.unroll) == (7, 4, 2)
    assert (c.blocks, c.warps_per_block, c.unroll) != (7, 4, 2)


def test_variants_are_the_buckets_an_op_compiles(table_dir):
    """EpConfig.variants, what EpDispatchCombine compiles and epgen build builds: the table's
    buckets up to the first that holds max_tokens_per_rank, or the explicit geometry alone."""
    rows = [(128, Geometry(8, 32, 4)), (1024, Geometry(48, 32, 2)), (4096, Geometry(64, 32, 4)),
            (8192, Geometry(64, 32, 4))]
    tuning.write_entry(KEY, rows, "test", {})

    def variants(tmax, **kw):
        cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=tmax, **kw)
        return [(t, (s.blocks, s.warps_per_block, s.unroll), s.max_tokens_per_rank)
                for t, s in cfg.variants("sm_90", Op.DISPATCH)]

    assert variants(8192) == [(128, (8, 32, 4), 8192), (1024, (48, 32, 2), 8192), (4096, (64, 32, 4), 8192),
                              (8192, (64, 32, 4), 8192)]
    assert variants(1000) == [(128, (8, 32, 4), 1000), (1024, (48, 32, 2), 1000)]
    assert variants(20000)[-1][0] == 8192  # above the last bucket: the last one serves
    assert variants(8192, dispatch_geometry=Geometry(16, 16, 2)) == [(8192, (16, 16, 2), 8192)]
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=8192)
    assert [t for t, _ in cfg.variants("sm_90", Op.COMBINE)] == [1 << 30]  # no entry: the default alone


def test_pick_fewest_blocks_within_three_percent():
    times = {Geometry(24, 32, 4): 101.5, Geometry(64, 32, 4): 100.0, Geometry(132, 32, 4): 99.0,
             Geometry(16, 32, 4): 110.0}
    assert pick_fewest_blocks(times) == Geometry(24, 32, 4)  # 101.5 <= 99 * 1.03
    assert pick_fewest_blocks(times, tolerance=0.0) == Geometry(132, 32, 4)


@pytest.mark.parametrize("arch", ARCHES)
def test_shipped_tables_are_valid(arch):
    for key, rows in tuning._table(arch).items():
        assert rows, key
        for max_tokens, geo in rows:
            assert max_tokens >= 1
            KernelSpec(op=Op(key.op), arch=arch, dtype=key.dtype, world_size=key.world_size,
                       hidden=key.row_bytes // 2, topk=key.topk, experts_per_rank=1, max_tokens_per_rank=max_tokens,
                       blocks=geo.blocks, warps_per_block=geo.warps_per_block, unroll=geo.unroll)
    path = tuning.TABLE_DIR / f"{arch}.json"
    if path.exists():
        assert all(e["provenance"] for e in json.loads(path.read_text())["entries"])


@pytest.mark.parametrize("arch", ARCHES)
def test_tune_default_candidates_build_on_every_arch(arch):
    from epgen.tune import default_candidates

    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    for geo in default_candidates(arch):
        d, c = cfg.spec(arch, Op.DISPATCH, geo), cfg.spec(arch, Op.COMBINE, geo)
        assert d.threads == c.threads == 1024


def test_a_low_latency_threshold_of_0_builds_no_low_latency_kernels_for_auto(table_dir):
    """tune writes a threshold of 0 when the normal family won at every count: "auto" then never
    takes the low-latency family on that arch (no variants, no specs: nothing sized for 0 tokens),
    other arches keep theirs, and kernel_family="low_latency" still builds with the entry's geometry."""
    from epgen.codegen.spec import LOW_LATENCY_OPS

    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    for op in (Op.DISPATCH_LL_SEND, Op.COMBINE_LL_SEND):
        tuning.write_entry(cfg.tuning_key("sm_90", op), [(0, Geometry(16, 16, 2))], "test", {})
    assert cfg.low_latency_tokens("sm_90") == 0
    assert [s.op for s in cfg.kernel_specs("sm_90")] == [Op.DISPATCH, Op.COMBINE]
    assert [cfg.variants("sm_90", op) for op in LOW_LATENCY_OPS] == [()] * 4
    assert cfg.low_latency_tokens("gfx950") == tuning.LOW_LATENCY_MAX_TOKENS  # no entry there: the default
    assert [s.ll_tokens for s in cfg.kernel_specs("gfx950")] == [tuning.LOW_LATENCY_MAX_TOKENS] * 6
    ll = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, kernel_family="low_latency")
    specs = ll.kernel_specs("sm_90")
    assert [s.op for s in specs] == list(LOW_LATENCY_OPS)
    assert {(s.blocks, s.warps_per_block, s.unroll, s.ll_tokens) for s in specs} == {(16, 16, 2, 4096)}
