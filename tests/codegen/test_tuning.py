"""Tuning tables: lookup rules, the 3% pick rule, the shipped tables."""

import json

import attrs

import pytest

from epgen.codegen import planner
from epgen.codegen import tuning
from epgen.codegen.arch import ARCHES
from epgen.codegen.spec import KernelSpec, Op
from epgen.codegen.tuning import Geometry, ShapeKey, TuningKey, pick_fewest_blocks, schedule
from epgen.codegen.config import EpConfig
from epgen.codegen.spec import QUANTIZED_COMBINE_THREADS
from epgen.codegen.dtypes import COMBINE_QUANTS

KEY = TuningKey(arch="sm_90", world_size=2, row_bytes=14336, topk=8, dtype="bf16", op="dispatch")
SHAPE = ShapeKey(arch="sm_90", world_size=2, hidden=7168, topk=8, dtype="bf16")
"""The shape whose dispatch entry is ``KEY``."""


def lookup(shape: ShapeKey, tokens: int, entry: str = "dispatch") -> Geometry:
    return schedule(shape).bucket(entry, tokens).geometry


def test_lookup_takes_smallest_bucket_not_below_and_clamps(table_dir):
    rows = [(128, Geometry(8, 32, 4)), (4096, Geometry(64, 32, 4)), (1024, Geometry(48, 32, 2))]
    tuning.write_entry(KEY, rows, "test", {})
    assert lookup(SHAPE, 1) == Geometry(8, 32, 4)
    assert lookup(SHAPE, 128) == Geometry(8, 32, 4)
    assert lookup(SHAPE, 129) == Geometry(48, 32, 2)
    assert lookup(SHAPE, 4096) == Geometry(64, 32, 4)
    assert lookup(SHAPE, 100_000) == Geometry(64, 32, 4)  # clamped to the largest bucket


def test_unknown_shape_gets_the_arch_default_measured_there_else_derived_from_its_facts(table_dir):
    h200 = schedule(ShapeKey(arch="sm_90", world_size=3, hidden=512, topk=2, dtype="bf16"))
    assert [(b.max_tokens, b.geometry, b.source.kind) for b in h200.entries["combine"]] == [
        (tuning.NO_LIMIT, Geometry(24, 32, 4), "measured")]  # MEASURED_DEFAULTS: the H200's
    for arch, cus in (("gfx942", 304), ("gfx950", 256)):
        s = schedule(ShapeKey(arch=arch, world_size=3, hidden=512, topk=2, dtype="bf16"))
        assert {b.source.kind for bs in s.entries.values() for b in bs} == {"derived"}
        # a normal-family kernel on 256 or 304 CUs never defaults to the H200's 24 blocks
        assert [b.geometry.blocks for b in s.entries["dispatch"]] == [cus // 2, cus, 2 * cus]
        assert [b.geometry.blocks for b in s.entries["combine"]] == [cus // 4, cus // 8]
        assert {b.geometry.warps_per_block for b in s.entries["dispatch"] + s.entries["combine"]} == {16}  # 1024 threads
        assert s.low_latency_tokens == tuning.LOW_LATENCY_MAX_TOKENS


@pytest.mark.parametrize("arch, row_bytes, unroll", [
    ("gfx950", 14336, 2),  # deepseek-v3 bf16: 7 steps of 2048 bytes (mori's unroll 2 on wave64)
    ("gfx950", 4096, 4),   # divides at unroll 4
    ("gfx950", 3072, 1),   # 1024 divides it; 2048 and 4096 do not
    ("gfx950", 512, 1),    # shorter than any step: unroll 1
    ("gfx1250", 14336, 4),  # wave32: 2048-byte steps at unroll 4
])
def test_a_derived_unroll_divides_the_row(arch, row_bytes, unroll):
    assert {b.geometry.unroll for b in tuning.derived(arch, "dispatch", row_bytes)} == {unroll}


def test_one_schedule_answers_every_entry_with_its_source(table_dir):
    tuning.write_entry(KEY, [(128, Geometry(8, 32, 4))], "measured on 2x H200 by epgen tune", {})
    s = schedule(SHAPE)
    assert set(s.entries) == set(tuning.ENTRIES) and s.keys["dispatch"] == KEY
    assert {(e, b.source.kind) for e, bs in s.entries.items() for b in bs} == {(e, "measured") for e in tuning.ENTRIES}
    assert s.entries["dispatch"][0].source.detail == "measured on 2x H200 by epgen tune"


def test_a_shipped_entry_transcribed_from_a_peer_says_published():
    published = schedule(ShapeKey(arch="gfx950", world_size=8, hidden=7168, topk=8, dtype="bf16"))
    assert published.entries["dispatch"][0].source.kind == "published"  # mori's MI350X geometry
    assert "mori" in published.entries["dispatch"][0].source.detail
    assert published.entries["fold"][0].source.kind == "derived"
    assert {r["entry"] for r in published.rows()} == set(tuning.ENTRIES)


def test_write_entry_replaces_and_records_provenance(table_dir):
    tuning.write_entry(KEY, [(128, Geometry(8, 32, 4))], "first", {})
    tuning.write_entry(KEY, [(128, Geometry(16, 32, 4))], "second", {"128": {"16x32u4": 1.0}})
    doc = json.loads((table_dir / "sm_90.json").read_text())
    assert len(doc["entries"]) == 1 and doc["entries"][0]["provenance"] == "second"
    assert lookup(SHAPE, 5) == Geometry(16, 32, 4)


def test_explicit_geometry_overrides_table():
    geo = Geometry(7, 4, 2)
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, dispatch_geometry=geo)
    specs = {s.op: s for s in planner.specs(cfg, "sm_90", tokens=4096)}
    d = specs.pop(Op.DISPATCH)
    assert (d.blocks, d.warps_per_block, d.unroll) == (7, 4, 2)
    for s in specs.values():  # combine and the low-latency halves keep theirs
        assert (s.blocks, s.warps_per_block, s.unroll) != (7, 4, 2), s.op


def test_variants_are_the_buckets_an_op_compiles(table_dir):
    """KernelPlan.variants, what EpDispatchCombine compiles and epgen build builds: the table's
    buckets up to the first that holds max_tokens_per_rank, or the explicit geometry alone."""
    rows = [(128, Geometry(8, 32, 4)), (1024, Geometry(48, 32, 2)), (4096, Geometry(64, 32, 4)),
            (8192, Geometry(64, 32, 4))]
    tuning.write_entry(KEY, rows, "test", {})

    def variants(tmax, **kw):
        cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=tmax, **kw)
        return [(t, (s.blocks, s.warps_per_block, s.unroll), s.max_tokens_per_rank)
                for t, s in planner.plan(cfg, "sm_90").variants.get((Op.DISPATCH, "push"), ())]

    assert variants(8192) == [(128, (8, 32, 4), 8192), (1024, (48, 32, 2), 8192), (4096, (64, 32, 4), 8192),
                              (8192, (64, 32, 4), 8192)]
    assert variants(1000) == [(128, (8, 32, 4), 1000), (1024, (48, 32, 2), 1000)]
    assert variants(20000)[-1][0] == 8192  # above the last bucket: the last one serves
    assert variants(8192, dispatch_geometry=Geometry(16, 16, 2)) == [(8192, (16, 16, 2), 8192)]
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=8192)
    assert [t for t, _ in planner.plan(cfg, "sm_90").variants.get((Op.COMBINE, "push"), ())] == [1 << 30]  # no entry: the default alone


def test_pick_fewest_blocks_within_three_percent():
    times = {Geometry(24, 32, 4): 101.5, Geometry(64, 32, 4): 100.0, Geometry(132, 32, 4): 99.0,
             Geometry(16, 32, 4): 110.0}
    assert pick_fewest_blocks(times) == Geometry(24, 32, 4)  # 101.5 <= 99 * 1.03
    assert pick_fewest_blocks(times, tolerance=0.0) == Geometry(132, 32, 4)


@pytest.mark.parametrize("arch", ARCHES)
def test_shipped_tables_are_valid(arch):
    for key, rows in tuning._table(arch).items():
        assert rows, key
        op = next(op for op in Op if op.template == key.op)  # a low-latency entry: its sending half
        assert not op.low_latency or len(rows) == 1, f"{key}: a low-latency entry has one bucket, its threshold"
        wire = key.dtype in COMBINE_QUANTS  # a quantized wire's combine entry: dtype names the wire
        for max_tokens, geo, transport in ((b.max_tokens, b.geometry, b.transport) for b in rows):
            assert transport in tuning.TRANSPORTS and (transport == "push" or op is Op.DISPATCH)
            assert max_tokens >= 1
            s = KernelSpec(op=op, arch=arch, dtype="bf16" if wire else key.dtype, world_size=key.world_size,
                           hidden=key.row_bytes // 2, topk=key.topk, experts_per_rank=1, max_tokens_per_rank=max_tokens,
                           blocks=geo.blocks, warps_per_block=geo.warps_per_block, unroll=geo.unroll,
                           ll_tokens=max_tokens if op.low_latency else 0, combine_quant=key.dtype if wire else "none")
            assert not wire or (op is Op.COMBINE and s.threads <= QUANTIZED_COMBINE_THREADS), key
    path = tuning.TABLE_DIR / f"{arch}.json"
    if path.exists():
        assert all(e["provenance"] for e in json.loads(path.read_text())["entries"])


@pytest.mark.parametrize("arch", ARCHES)
def test_tune_default_candidates_build_on_every_arch(arch):
    from epgen.cli.tune import default_candidates

    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    for geo in default_candidates(arch):
        d, c = planner.explicit_spec(cfg, arch, Op.DISPATCH, geo), planner.explicit_spec(cfg, arch, Op.COMBINE, geo)
        assert d.threads == c.threads == 1024


def test_a_low_latency_threshold_of_0_builds_no_low_latency_kernels_for_auto(table_dir):
    """tune writes a threshold of 0 when the normal family won at every count: "auto" then never
    takes the low-latency family on that arch (no variants, no specs: nothing sized for 0 tokens),
    other arches keep theirs, and kernel_family="low_latency" still builds with the entry's geometry."""
    from epgen.codegen.spec import LOW_LATENCY_OPS

    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    for op in (Op.DISPATCH_LL_SEND, Op.COMBINE_LL_SEND):
        tuning.write_entry(planner.tuning_key(cfg, "sm_90", op), [(0, Geometry(16, 16, 2))], "test", {})
    assert planner.plan(cfg, "sm_90").low_latency_tokens == 0
    assert [s.op for s in planner.specs(cfg, "sm_90")] == [Op.DISPATCH, Op.COMBINE]
    assert [planner.plan(cfg, "sm_90").variants.get((op, "push"), ()) for op in LOW_LATENCY_OPS] == [()] * len(LOW_LATENCY_OPS)
    assert planner.plan(cfg, "gfx950").low_latency_tokens == tuning.LOW_LATENCY_MAX_TOKENS  # no entry there: the default
    gfx950 = planner.plan(cfg, "gfx950")
    assert [s.ll_tokens for s in gfx950.specs_at()] == [tuning.LOW_LATENCY_MAX_TOKENS] * len(gfx950.ops)
    ll = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, kernel_family="low_latency")
    specs = planner.specs(ll, "sm_90")
    assert [s.op for s in specs] == list(LOW_LATENCY_OPS)
    assert {(s.blocks, s.warps_per_block, s.unroll, s.ll_tokens) for s in specs} == {(16, 16, 2, 4096)}


def _ll_key(cfg: EpConfig, arch: str, op: Op) -> TuningKey:
    key = planner.tuning_key(cfg, arch, op)
    assert key.op == op.template  # both halves (and the whole op) share their template's entry
    return key


def test_low_latency_tokens_per_family_and_from_the_table(table_dir):
    base = dict(world_size=4, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=1000)
    auto = EpConfig(**base)
    for arch in ARCHES:  # no entry: tuning.LOW_LATENCY_MAX_TOKENS
        assert planner.plan(auto, arch).low_latency_tokens == tuning.LOW_LATENCY_MAX_TOKENS == 128
    assert planner.plan(EpConfig(**base, kernel_family="normal"), "sm_90").low_latency_tokens == 0
    assert planner.plan(EpConfig(**base, kernel_family="low_latency"), "sm_90").low_latency_tokens == 1000
    assert planner.plan(EpConfig(**{**base, "max_tokens_per_rank": 50}), "sm_90").low_latency_tokens == 50  # auto: at most Tmax

    tuning.write_entry(_ll_key(auto, "sm_90", Op.DISPATCH_LL_SEND), [(96, Geometry(16, 8, 2))], "test", {})
    assert _ll_key(auto, "sm_90", Op.DISPATCH_LL_RECV).op == "dispatch_ll"
    assert planner.plan(auto, "sm_90").low_latency_tokens == 96  # the dispatch entry's bucket; combine's default 128
    assert planner.plan(auto, "gfx950").low_latency_tokens == 128  # another arch's table
    tuning.write_entry(_ll_key(auto, "sm_90", Op.COMBINE_LL), [(40, Geometry(8, 4, 1))], "test", {})
    assert planner.plan(auto, "sm_90").low_latency_tokens == 40  # the smaller of the two
    specs = {s.op: s for s in planner.specs(auto, "sm_90")}
    assert {s.ll_tokens for s in specs.values()} == {40}
    for op in (Op.DISPATCH_LL, Op.DISPATCH_LL_SEND, Op.DISPATCH_LL_RECV):
        assert (specs[op].blocks, specs[op].warps_per_block, specs[op].unroll) == (16, 8, 2)
    for op in (Op.COMBINE_LL, Op.COMBINE_LL_SEND, Op.COMBINE_LL_RECV):
        assert (specs[op].blocks, specs[op].warps_per_block, specs[op].unroll) == (8, 4, 1)
    assert [t for t, _ in planner.plan(auto, "sm_90").variants.get((Op.DISPATCH_LL_SEND, "push"), ())] == [1000]  # one variant, whatever T
    assert planner.plan(EpConfig(**base, kernel_family="low_latency"), "sm_90").low_latency_tokens == 1000  # the table: auto only
    explicit = EpConfig(**base, low_latency_geometry=Geometry(4, 2, 1))
    assert {(s.blocks, s.warps_per_block, s.unroll) for s in planner.specs(explicit, "sm_90") if s.op.low_latency} \
        == {(4, 2, 1)}


def test_the_table_geometry_of_a_low_latency_op_is_clamped_to_its_flags(table_dir):
    """W x blocks <= abi.LL_FLAG_SLOTS: a table or default geometry takes at most 1024 // W blocks."""
    from epgen.codegen.abi import LL_FLAG_SLOTS

    wide = EpConfig(world_size=64, hidden=2048, topk=4, num_experts=64, max_tokens_per_rank=64)  # wave 64: gfx950
    default_blocks = tuning.defaults("gfx950", "dispatch_ll", 4096)[0].geometry.blocks
    assert default_blocks * 64 > LL_FLAG_SLOTS
    assert {s.blocks for s in planner.specs(wide, "gfx950") if s.op.low_latency} == {LL_FLAG_SLOTS // 64}
    cfg = EpConfig(world_size=8, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=64)
    tuning.write_entry(_ll_key(cfg, "gfx950", Op.COMBINE_LL_SEND), [(64, Geometry(300, 4, 2))], "test", {})
    assert planner.plan(cfg, "gfx950").geometry(Op.COMBINE_LL_RECV, 1) == Geometry(128, 4, 2)
    assert planner.plan(cfg, "gfx950").geometry(Op.DISPATCH_LL, 1).blocks == min(default_blocks, 128)



def test_a_quantized_wires_combine_has_its_own_entry_else_takes_the_bf16_ones(table_dir):
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=8192, combine_quant="fp8_blockwise")
    key = planner.tuning_key(cfg, "sm_90", Op.COMBINE)
    assert key == attrs.evolve(KEY, op="combine", dtype="fp8_blockwise")
    assert planner.tuning_key(cfg, "sm_90", Op.DISPATCH) == KEY  # the payload's key, whatever the wire
    bf16 = attrs.evolve(KEY, op="combine")
    tuning.write_entry(bf16, [(4096, Geometry(16, 32, 4)), (8192, Geometry(24, 32, 4))], "bf16", {})
    # no entry of its own: the bf16 combine's buckets, its warps cut to 512 threads
    def combine():
        return [(t, s.blocks, s.warps_per_block) for t, s in planner.plan(cfg, "sm_90").variants[(Op.COMBINE, "push")]]

    assert combine() == [(4096, 16, 16), (8192, 24, 16)]
    tuning.write_entry(key, [(8192, Geometry(64, 16, 4))], "fp8", {})
    assert combine() == [(8192, 64, 16)]
    assert planner.plan(cfg, "sm_90").geometry(Op.COMBINE, 100) == Geometry(64, 16, 4)
    assert planner.plan(attrs.evolve(cfg, combine_quant="none"), "sm_90").geometry(Op.COMBINE, 100) == Geometry(16, 32, 4)


def test_a_pull_bucket_makes_auto_pull_there_and_build_only_that_buckets_pull_kernels(table_dir):
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    key = planner.tuning_key(cfg, "sm_90", Op.DISPATCH)
    rows = [(128, Geometry(16, 32, 4)), (4096, Geometry(24, 32, 4))]
    tuning.write_entry(key, rows, "test", {}, transports={128: "push", 4096: "pull"})
    doc = json.loads((table_dir / "sm_90.json").read_text())
    entry = next(e for e in doc["entries"] if e["op"] == "dispatch" and e["world_size"] == 2)
    assert [b["transport"] for b in entry["buckets"]] == ["push", "pull"]
    assert [(b.max_tokens, b.transport) for b in schedule(planner.shape_key(cfg, "sm_90")).entries["dispatch"]] == [
        (128, "push"), (4096, "pull")]
    assert [planner.dispatch_transport(cfg, "sm_90", t) for t in (1, 128, 129, 4096, 10**6)] == ["push", "push", "pull", "pull", "pull"]
    assert planner.plan(cfg, "sm_90").transports(Op.DISPATCH) == ("push", "pull")
    variants = planner.plan(cfg, "sm_90").variants
    assert [(t, s.blocks, s.transport) for t, s in variants[(Op.DISPATCH, "pull")]] == [(4096, 24, "pull")]
    assert [(t, s.blocks, s.op) for t, s in variants[(Op.DISPATCH_PULL, "push")]] == [(4096, 24, Op.DISPATCH_PULL)]
    assert planner.plan(cfg, "gfx950").transports(Op.DISPATCH) == ("push",)  # other arches keep theirs
    push = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, dispatch_transport="push")
    assert planner.dispatch_transport(push, "sm_90", 4096) == "push"
    assert Op.DISPATCH_PULL not in planner.ops(push) and planner.plan(push, "sm_90").variants[(Op.DISPATCH, "pull")] == ()
    small = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=128)  # never reaches the pull bucket
    assert planner.plan(small, "sm_90").transports(Op.DISPATCH) == ("push",)


def test_a_transport_on_a_bucket_of_another_op_or_an_unknown_one_is_refused(table_dir):
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    for op, transport in ((Op.COMBINE, "pull"), (Op.DISPATCH, "sideways")):
        tuning.write_entry(planner.tuning_key(cfg, "sm_90", op), [(4096, Geometry(16, 32, 4))], "test", {},
                           transports={4096: transport})
        with pytest.raises(ValueError, match=r"only 'dispatch' buckets carry a transport, one of push, pull"):
            schedule(planner.shape_key(cfg, "sm_90"))
        tuning.write_entry(planner.tuning_key(cfg, "sm_90", op), [(4096, Geometry(16, 32, 4))], "test", {})
