"""epgen tune on the CPU: what it times per family, the low-latency geometry and threshold it
derives from measured times, and the entries it writes (read back by EpConfig)."""

import json
import math

import attrs

import pytest

from epgen.codegen import planner, tuning
from epgen.cli import tune
from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.config import EpConfig
from epgen.codegen.spec import LOW_LATENCY_OPS, Op
from epgen.codegen.tuning import Geometry
from epgen.cli.options import LOW_LATENCY_SWEEP, TuneOptions, tune_counts
from epgen.cli.tune import Sweep, choose_low_latency, low_latency_threshold, plan


@pytest.mark.parametrize("ll, normal, threshold", [
    ({1: 5.0, 8: 6.0, 32: 9.0}, {1: 10.0, 8: 10.0, 32: 10.0}, 32),  # faster everywhere: the largest count
    ({1: 5.0, 8: 6.0, 32: 12.0, 128: 8.0}, {1: 10.0, 8: 10.0, 32: 10.0, 128: 20.0}, 8),  # 32 breaks the run
    ({1: 11.0, 8: 6.0}, {1: 10.0, 8: 10.0}, 0),  # slower at the smallest: never
    ({1: 10.0, 8: 6.0}, {1: 10.0, 8: 10.0}, 0),  # equal is not faster
    ({8: 6.0, 1: 5.0, 256: 1.0}, {256: 2.0, 1: 10.0, 8: 10.0}, 256),  # the order of the dicts does not matter
    ({1: 5.0, 8: math.nan, 32: 1.0}, {1: 10.0, 8: 10.0, 32: 10.0}, 1),  # NaN never wins
])
def test_the_threshold_is_the_last_count_of_a_run_of_wins_from_the_smallest(ll, normal, threshold):
    assert low_latency_threshold(ll, normal) == threshold


def test_the_threshold_needs_the_normal_time_of_every_count():
    with pytest.raises(KeyError):
        low_latency_threshold({1: 5.0, 8: 6.0}, {1: 10.0})


G8, G16, G32 = Geometry(8, 16, 2), Geometry(16, 16, 2), Geometry(32, 16, 4)
N24, N64 = Geometry(24, 32, 4), Geometry(64, 32, 4)


def _layer(world_size: int = 2, **kw) -> EpConfig:
    """The layer tune takes from the command line: deepseek-v3 at ``world_size`` ranks."""
    return EpConfig.for_model("deepseek-v3", world_size=world_size, max_tokens_per_rank=4096, **kw)


def _times(ll_scale=1.0):
    """{(family, T): {geometry: (dispatch us, combine us)}} as tune_process returns it."""
    times = {}
    for T in (1, 8, 128):
        # low-latency: dispatch fastest at 32 blocks but 16 within 3% at 128 tokens; combine: 8 blocks is best
        times[("low_latency", T)] = {G8: (12.0 * ll_scale, 4.0 * ll_scale), G16: (10.2 * ll_scale, 5.0 * ll_scale),
                                     G32: (10.0 * ll_scale, 6.0 * ll_scale)}
        # normal: dispatch best at 24 blocks, combine best at 64 (the bests may come from different geometries)
        times[("normal", T)] = {N24: (14.0 + T / 16, 12.0), N64: (15.0 + T / 16, 9.0)}
    times[("normal", 4096)] = {N24: (300.0, 200.0), N64: (250.0, 190.0)}  # a bucket only the normal family has
    return times


def test_choose_low_latency_picks_per_op_at_the_largest_count_and_compares_with_the_normal_best():
    c = choose_low_latency(_times())
    assert (c.dispatch, c.combine) == (G16, G8)  # fewest blocks within 3% at 128 tokens, per op
    assert c.low_latency_us == {1: (10.2, 4.0), 8: (10.2, 4.0), 128: (10.2, 4.0)}
    assert c.normal_us == {1: (14.0 + 1 / 16, 9.0), 8: (14.5, 9.0), 128: (22.0, 9.0)}  # min per op, not per geometry
    assert c.threshold == 128  # 14.2 < 23.06, 23.5, 31


def test_choose_low_latency_writes_0_when_the_normal_family_wins_at_the_smallest_count():
    c = choose_low_latency(_times(ll_scale=2.0))  # 28.4 us against 23.06 at one token
    assert c.threshold == 0 and (c.dispatch, c.combine) == (G16, G8)


def test_choose_low_latency_needs_low_latency_points():
    with pytest.raises(ValueError, match="no low-latency point"):
        choose_low_latency({("normal", 1): {N24: (1.0, 1.0)}})


def test_tune_counts_and_plan_per_family():
    opts = TuneOptions()
    assert tune_counts(opts) == {"normal": (1, 8, 32, 128, 256, 1024, 4096, 8192), "low_latency": LOW_LATENCY_SWEEP}
    assert tune_counts(TuneOptions(family="normal")) == {"normal": (128, 1024, 4096, 8192)}
    assert tune_counts(TuneOptions(family="low_latency", low_latency_tokens=(64, 2, 64))) == {
        "normal": (2, 64), "low_latency": (2, 64)}
    with pytest.raises(ValueError, match=r"TuneOptions.family='auto': must be one of both, normal, low_latency"):
        tune_counts(TuneOptions(family="auto"))
    normal, ll = plan(_layer(2), opts, "sm_90")
    assert normal == Sweep("normal", tune.default_candidates("sm_90"), tune_counts(opts)["normal"])
    assert ll == Sweep("low_latency", tune.default_low_latency_candidates("sm_90", 2), LOW_LATENCY_SWEEP)
    # the low-latency family alone: the normal family is its reference at the table's geometry (None) ...
    assert plan(_layer(2), TuneOptions(family="low_latency"), "sm_90")[0] == Sweep("normal", (None,), LOW_LATENCY_SWEEP)
    # ... or at the candidates given
    assert plan(_layer(2), TuneOptions(family="low_latency", geometries=(N24,)), "sm_90")[0].geometries == (N24,)
    assert [s.family for s in plan(_layer(2), TuneOptions(family="normal"), "sm_90")] == ["normal"]
    given = plan(_layer(8), TuneOptions(low_latency_geometries=(G8,)), "gfx950")[1]
    assert given.geometries == (G8,)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("world_size", [1, 2, 8, 32, 64])
def test_low_latency_candidates_fit_the_flag_slots_and_build(arch, world_size):
    if world_size > traits(arch).wave_size:
        pytest.skip(f"W={world_size} is above {arch}'s wave size ({traits(arch).wave_size}), the most ranks it takes")
    geos = tune.default_low_latency_candidates(arch, world_size)
    assert len(set(geos)) == len(geos)
    assert {g.blocks for g in geos} == {min(b, 1024 // world_size) for b in tune.LOW_LATENCY_CANDIDATE_BLOCKS}
    assert {g.unroll for g in geos} == {tune.LOW_LATENCY_CANDIDATE_UNROLL}
    cfg = EpConfig(world_size=world_size, hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=256,
                   kernel_family="low_latency")
    for g in geos:
        for op in LOW_LATENCY_OPS:
            spec = planner.explicit_spec(cfg, arch, op, g)
            assert spec.threads in tune.LOW_LATENCY_CANDIDATE_THREADS and spec.world_size * spec.blocks <= 1024


def _env():
    return {"date": "2026-12-01T00:00:00+00:00", "gpus": 1, "gpu": "Test GPU", "driver": "1", "torch": "t",
            "cupy": "c", "commit": "abc"}


def _report(opts, times, layer=None, skipped=()):
    layer = layer or _layer()
    tune._report(times, plan(layer, opts, "sm_90"), list(skipped), layer, opts, "sm_90")


def test_tune_writes_both_families_and_epconfig_reads_the_threshold(table_dir, monkeypatch, capsys):
    monkeypatch.setattr(tune, "environment", _env)
    opts = TuneOptions(tokens=(128, 4096), geometries=(N24, N64), low_latency_tokens=(1, 8, 128),
                       low_latency_geometries=(G8, G16, G32))
    _report(opts, _times())
    out = capsys.readouterr().out
    assert "threshold: 128 tokens per rank" in out and "epgen tune families" in out
    entries = {e["op"]: e for e in json.loads((table_dir / "sm_90.json").read_text())["entries"]}
    assert set(entries) == {"dispatch", "combine", "dispatch_ll", "combine_ll"}
    assert [b["max_tokens"] for b in entries["dispatch"]["buckets"]] == [128, 4096]  # the buckets only
    assert set(entries["dispatch"]["measured_us"]) == {"128", "4096"}
    for op, geo in (("dispatch_ll", G16), ("combine_ll", G8)):
        e = entries[op]
        assert e["buckets"] == [{"max_tokens": 128, "blocks": geo.blocks, "warps_per_block": geo.warps_per_block,
                                 "unroll": geo.unroll}]
        assert set(e["measured_us"]) == {"1", "8", "128"} and "normal" in e["measured_us"]["1"]
        assert "threshold 128" in e["provenance"] and "Test GPU" in e["provenance"]
    assert entries["dispatch_ll"]["measured_us"]["8"] == {"8x16u2": 12.0, "16x16u2": 10.2, "32x16u4": 10.0,
                                                          "normal": 14.5}
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    assert planner.plan(cfg, "sm_90").low_latency_tokens == 128
    assert planner.plan(cfg, "sm_90").geometry(Op.DISPATCH_LL_SEND, 1) == G16
    assert planner.plan(cfg, "sm_90").geometry(Op.COMBINE_LL_RECV, 1) == G8


def test_a_threshold_of_0_is_written_and_means_never(table_dir, monkeypatch, capsys):
    monkeypatch.setattr(tune, "environment", _env)
    opts = TuneOptions(family="low_latency", low_latency_tokens=(1, 8, 128), low_latency_geometries=(G8, G16, G32),
                       virtual=True)
    times = {k: v for k, v in _times(ll_scale=2.0).items() if k[1] != 4096}
    times.update({("normal", T): {None: min(per.values())} for (family, T), per in times.items() if family == "normal"})
    _report(opts, times)
    assert "threshold: 0 tokens per rank" in capsys.readouterr().out
    entries = {e["op"]: e for e in json.loads((table_dir / "sm_90.json").read_text())["entries"]}
    assert set(entries) == {"dispatch_ll", "combine_ll"}  # --family low_latency leaves the normal buckets alone
    assert [b["max_tokens"] for b in entries["dispatch_ll"]["buckets"]] == [0]
    assert "--virtual" in entries["dispatch_ll"]["provenance"]
    assert "tuning table's geometry" in entries["dispatch_ll"]["provenance"]
    auto = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    assert planner.plan(auto, "sm_90").low_latency_tokens == 0
    assert [s.op for s in planner.specs(auto, "sm_90")] == [Op.DISPATCH, Op.COMBINE]
    assert all(planner.plan(auto, "sm_90").variants.get((op, "push"), ()) == () for op in LOW_LATENCY_OPS)
    ll = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, kernel_family="low_latency")
    assert planner.plan(ll, "sm_90").low_latency_tokens == 4096 and [s.op for s in planner.specs(ll, "sm_90")] == list(LOW_LATENCY_OPS)


def test_dry_run_prints_and_writes_nothing(table_dir, monkeypatch, capsys):
    monkeypatch.setattr(tune, "environment", _env)
    opts = TuneOptions(tokens=(128, 4096), geometries=(N24, N64), low_latency_tokens=(1, 8, 128),
                       low_latency_geometries=(G8, G16, G32), write=False)
    _report(opts, _times(), skipped=["normal 132x32u4: does not fit"])
    out = capsys.readouterr().out
    assert "skipped candidate normal 132x32u4: does not fit" in out and "threshold: 128" in out
    assert not (table_dir / "sm_90.json").exists()


class _FakeOp:
    """Stands in for EpDispatchCombine in tune_process; ``refuse``: normal geometries whose
    construction raises ValueError (the blocks of every virtual rank do not fit)."""

    refuse = ()

    def __init__(self, cfg, virtual=False):
        if cfg.kernel_family == "normal" and cfg.dispatch_geometry in _FakeOp.refuse:
            raise ValueError(f"dispatch geometry {cfg.dispatch_geometry}: virtual ranks need all blocks resident")
        self.config, self.virtual = cfg, virtual

    def close(self):
        pass


@pytest.fixture
def fake_tune(monkeypatch):
    """tune_process on the CPU: fake ops and measure (us = blocks / 10 + tokens, low-latency half
    of that); records the reports instead of printing them."""
    import types

    import torch

    import epgen.op
    from epgen.harness.timing import PairTiming, QueueDelay, Timing

    def measure(op, cfg, tokens, routing, seed, iters):
        geo = cfg.low_latency_geometry if cfg.kernel_family == "low_latency" else cfg.dispatch_geometry
        us = ((geo.blocks / 10 if geo else 3.0) + tokens) / (2 if cfg.kernel_family == "low_latency" else 1)
        t = Timing((us,))
        d = Timing((us * 0.5,)) if cfg.dispatch_transport == "pull" else t  # the pull dispatch twice as fast
        return (PairTiming(queued=(d, t), host=(d, t), delay=QueueDelay(1.0, 1.0, True)), (0, 0),
                cfg.dispatch_transport)

    reports = []
    monkeypatch.setattr(epgen.op, "EpDispatchCombine", _FakeOp)
    monkeypatch.setattr(tune, "measure", measure)
    monkeypatch.setattr(tune, "device_arch", lambda index: "sm_90")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tune, "_report", lambda *a: reports.append(types.SimpleNamespace(
        times=a[0], sweeps=a[1], skipped=a[2])))
    _FakeOp.refuse = ()
    return reports


def test_tune_process_times_every_sweep_and_skips_what_virtual_ranks_cannot_hold(fake_tune):
    opts = TuneOptions(tokens=(128, 4096), geometries=(N24, N64), low_latency_tokens=(1, 8),
                       low_latency_geometries=(G8, G16), virtual=True)
    _FakeOp.refuse = (N64,)
    times = tune.tune_process(0, 2, _layer(), opts)
    normal = {(key, T) for key in ("normal", "pull") for T in (1, 8, 128, 4096)}  # the dispatch both ways
    assert set(times) == normal | {("low_latency", 1), ("low_latency", 8)}
    assert all(set(per) == {N24} for (key, _), per in times.items() if key != "low_latency")  # 64 blocks skipped
    assert times[("low_latency", 8)] == {G8: (4.4, 4.4), G16: (4.8, 4.8)}
    assert times[("pull", 128)] == {N24: (65.2, 130.4)} and times[("normal", 128)] == {N24: (130.4, 130.4)}
    report, = fake_tune
    assert report.skipped == [f"{key} 64x32u4: dispatch geometry 64x32u4: virtual ranks need all blocks resident"
                              for key in ("normal", "pull")]
    assert choose_low_latency(times).threshold == 8
    # without pull, with a quantized wire or the low-latency family alone, the dispatch is timed as push only
    for layer, kw in ((_layer(), dict(pull=False)), (_layer(combine_quant="fp8_blockwise"),
                                                     dict(family="normal", geometries=(Geometry(24, 16, 4),)))):
        fake_tune.clear()
        times = tune.tune_process(0, 2, layer, attrs.evolve(opts, **kw))
        assert not any(key == "pull" for key, _ in times)


def test_tune_process_raises_a_construction_error_of_real_ranks_and_when_nothing_fits(fake_tune):
    _FakeOp.refuse = (N64,)
    with pytest.raises(ValueError, match="virtual ranks need"):
        tune.tune_process(0, 2, _layer(), TuneOptions(tokens=(128,), geometries=(N24, N64), family="normal"))
    with pytest.raises(RuntimeError, match="no normal candidate could be built: normal 64x32u4"):
        tune.tune_process(0, 2, _layer(), TuneOptions(tokens=(128,), geometries=(N64,), family="normal", virtual=True))


def test_tune_process_low_latency_alone_times_the_normal_family_at_the_table_geometry(fake_tune):
    times = tune.tune_process(0, 1, _layer(1), TuneOptions(family="low_latency", low_latency_tokens=(1, 4),
                                                           low_latency_geometries=(G8,)))
    assert times == {("normal", 1): {None: (4.0, 4.0)}, ("normal", 4): {None: (7.0, 7.0)},
                     ("low_latency", 1): {G8: (0.9, 0.9)}, ("low_latency", 4): {G8: (2.4, 2.4)}}


def test_choose_transport_takes_pull_only_where_its_pick_is_faster():
    push = {N24: 100.0, N64: 99.0}
    assert tune.choose_transport(push, {}) == (N24, "push")  # pull not timed
    assert tune.choose_transport(push, {N24: 101.0, N64: 100.5}) == (N24, "push")
    assert tune.choose_transport(push, {N24: 99.9, N64: 90.0}) == (N64, "pull")  # 24 blocks not within 3% of 90
    assert tune.choose_transport(push, {N24: 92.0, N64: 90.0}) == (N24, "pull")  # the fewest blocks within 3%


def test_tune_writes_each_dispatch_buckets_transport_and_epconfig_takes_it(table_dir, monkeypatch, capsys):
    """With the pull dispatch timed, the dispatch entry's buckets carry the faster transport and its
    pick, the measured times both (pull ones as "pull <geometry>"); EpConfig reads the transport."""
    monkeypatch.setattr(tune, "environment", _env)
    opts = TuneOptions(tokens=(128, 4096), geometries=(N24, N64), family="normal")
    times = {k: v for k, v in _times().items() if k[0] == "normal" and k[1] in (128, 4096)}
    times[("pull", 128)] = {N24: (30.0, 12.0), N64: (31.0, 9.0)}  # push's pick there: 22.0 at 24 blocks
    times[("pull", 4096)] = {N24: (230.0, 200.0), N64: (200.0, 190.0)}  # push's 250.0 at 64 blocks
    _report(opts, times)
    out = capsys.readouterr().out
    assert "transport per bucket: 128: push 24x32u4, 4096: pull 64x32u4" in out and "dispatch (pull)" in out
    entries = {e["op"]: e for e in json.loads((table_dir / "sm_90.json").read_text())["entries"]}
    assert [(b["max_tokens"], b["blocks"], b.get("transport")) for b in entries["dispatch"]["buckets"]] == [
        (128, 24, "push"), (4096, 64, "pull")]
    assert "transport" not in entries["combine"]["buckets"][0]
    assert entries["dispatch"]["measured_us"]["4096"] == {"24x32u4": 300.0, "64x32u4": 250.0, "pull 24x32u4": 230.0,
                                                           "pull 64x32u4": 200.0}
    assert "pull where its pick is faster than push's" in entries["dispatch"]["provenance"]
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096)
    assert planner.dispatch_transport(cfg, "sm_90", 128) == "push" and planner.dispatch_transport(cfg, "sm_90", 4096) == "pull"


def test_tune_with_a_quantized_wire_writes_that_wires_combine_entry_alone(table_dir, monkeypatch, capsys):
    """--quant: candidates of 512 threads (the quantized combine's most), the combine entry keyed by
    the wire, the dispatch entry left alone; EpConfig of that wire then takes it."""
    monkeypatch.setattr(tune, "environment", _env)
    candidates = tune.default_candidates("sm_90", "fp4_blockwise")
    assert {g.warps_per_block * 32 for g in candidates} == {512} and {g.unroll for g in candidates} == {4, 2}
    q16, q64 = Geometry(16, 16, 4), Geometry(64, 16, 4)
    opts = TuneOptions(tokens=(4096,), family="normal", geometries=(q16, q64))
    layer = _layer(combine_quant="fp4_blockwise")
    assert plan(layer, opts, "sm_90")[0].geometries == (q16, q64)
    _report(opts, {("normal", 4096): {q16: (100.0, 400.0), q64: (90.0, 120.0)}}, layer)
    entries = json.loads((table_dir / "sm_90.json").read_text())["entries"]
    assert [(e["op"], e["dtype"]) for e in entries] == [("combine", "fp4_blockwise")]
    assert entries[0]["buckets"] == [{"max_tokens": 4096, "blocks": 64, "warps_per_block": 16, "unroll": 4}]
    assert "--family normal --quant fp4_blockwise," in entries[0]["provenance"]
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=4096, combine_quant="fp4_blockwise")
    assert planner.plan(cfg, "sm_90").geometry(Op.COMBINE, 4096) == q64
    assert planner.plan(attrs.evolve(cfg, combine_quant="fp8_blockwise"), "sm_90").geometry(Op.COMBINE, 4096) != q64


RECORDED_H200 = {
    # docs/measurements/normal-family.md#tune, epgen tune (d969dd9) on 2 x H200, deepseek-v3, us:
    # tokens: (dispatch, combine) per blocks of 32 warps, unroll 4
    128: {8: (24.7, 18.8), 16: (22.5, 16.9), 24: (44.2, 26.0), 32: (21.5, 16.7), 48: (27.8, 16.5), 64: (20.8, 16.3),
          132: (27.6, 16.7)},
    1024: {8: (91.7, 73.3), 16: (63.7, 56.4), 24: (65.8, 56.3), 32: (62.7, 55.2), 48: (61.1, 56.0), 64: (58.0, 56.4),
           132: (57.2, 55.1)},
    4096: {8: (322.2, 252.1), 16: (207.8, 188.3), 24: (216.1, 187.6), 32: (202.3, 186.4), 48: (193.9, 189.8),
           64: (186.2, 188.9), 132: (178.8, 185.8)},
    8192: {8: (633.0, 488.9), 16: (401.5, 364.1), 24: (417.8, 364.0), 32: (390.7, 362.8), 48: (375.4, 370.0),
           64: (356.6, 367.2), 132: (343.0, 361.7)},
}


def test_the_tune_verb_on_a_recorded_timing_table_writes_the_picks_the_measurement_lists(table_dir, monkeypatch,
                                                                                         capsys):
    """The tune verb's logic on the CPU (``tune_process``: candidates, timing loop, pick, table
    write) with every measurement answered from the H200 timings of
    docs/measurements/normal-family.md#tune: it writes the picks that page lists (fewest blocks
    within 3 %), and the schedule then answers them as measured."""
    import torch

    import epgen.op
    from epgen.harness.timing import PairTiming, QueueDelay, Timing

    def recorded(op, cfg, tokens, routing, seed, iters):
        d, c = (Timing((us,)) for us in RECORDED_H200[tokens][cfg.dispatch_geometry.blocks])
        return PairTiming(queued=(d, c), host=(d, c), delay=QueueDelay(1.0, 1.0, True)), (0, 0), "push"

    monkeypatch.setattr(epgen.op, "EpDispatchCombine", _FakeOp)
    monkeypatch.setattr(tune, "measure", recorded)
    monkeypatch.setattr(tune, "device_arch", lambda index: "sm_90")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tune, "environment", _env)
    opts = TuneOptions(tokens=tuple(RECORDED_H200), family="normal", pull=False,
                       geometries=tuple(Geometry(b, 32, 4) for b in RECORDED_H200[128]))
    layer = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=8192)
    tune.tune_process(0, 2, layer, opts)
    assert "wrote" in capsys.readouterr().out
    s = tuning.schedule(planner.shape_key(layer, "sm_90"))
    assert [(b.max_tokens, b.geometry.blocks) for b in s.entries["dispatch"]] == [(128, 64), (1024, 64), (4096, 132),
                                                                                  (8192, 132)]
    assert [(b.max_tokens, b.geometry.blocks) for b in s.entries["combine"]] == [(128, 32), (1024, 16), (4096, 16),
                                                                                 (8192, 16)]
    assert {b.source.kind for b in s.entries["dispatch"] + s.entries["combine"]} == {"measured"}
    assert "fewest blocks within 3%" in s.entries["dispatch"][0].source.detail
