"""CPU tests of KernelSpec (validation, derived values, arena layout, entry names), the arch table
discipline and the specs the planner derives from an EpConfig (geometry, families, transports).
EpConfig itself (validation, constructors, derived fields): test_config.py."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import attrs
import pytest

import epgen
import epgen.codegen
from epgen.codegen import planner
from epgen.codegen.arch import ARCH_TRAITS, ARCHES, traits
from epgen.codegen.dtypes import DTYPES
from epgen.codegen.abi import LL_FLAG_SLOTS
from epgen.codegen.errors import FieldError
from epgen.codegen.spec import (ALIGN, EXPERT_OPS, LOW_LATENCY_OPS, MAX_TOKENS_LIMIT, PLAN_BLOCKS, SIGNAL_WORDS,
                                CALLS, ARENA_REGIONS, KernelSpec, Op)
from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen import tuning
from epgen.codegen.render import render

FIELDS = [f.name for f in attrs.fields(KernelSpec)]

BASE = dict(
    op="dispatch", arch="gfx950", dtype="bf16", hidden=7168, topk=8, experts_per_rank=32, world_size=8,
    max_tokens_per_rank=4096, blocks=32, warps_per_block=16, unroll=4,
)


def spec(**changes) -> KernelSpec:
    return KernelSpec(**{**BASE, **changes})


def _raises(match_parts, **changes) -> str:
    with pytest.raises(ValueError) as info:
        spec(**changes)
    msg = str(info.value)
    for part in match_parts:
        assert part in msg, f"{part!r} not in error message {msg!r}"
    return msg


# --------------------------------------------------------------------------------------------------
# KernelSpec validation
# --------------------------------------------------------------------------------------------------

# (changes, substrings the message must contain: field=value, then the rule)
BAD_FIELDS = [
    # hidden: row must be a multiple of the vector width (16 bytes -> 8 bf16 elements)
    (dict(hidden=7), ["KernelSpec.hidden=7", "multiple of 16 bytes", "multiple of 8", "14 bytes"]),
    (dict(hidden=7172), ["KernelSpec.hidden=7172", "multiple of 16 bytes", "multiple of 8"]),
    (dict(hidden=7172, arch="sm_90"), ["KernelSpec.hidden=7172", "multiple of 16 bytes"]),
    (dict(hidden=0), ["KernelSpec.hidden=0", "[1, 65536]"]),
    (dict(hidden=(1 << 16) + 8), ["KernelSpec.hidden=65544", "[1, 65536]"]),
    (dict(hidden=7168.0), ["KernelSpec.hidden=7168.0", "must be an int"]),
    (dict(hidden=True), ["KernelSpec.hidden=True", "must be an int"]),
    (dict(hidden="7168"), ["KernelSpec.hidden='7168'", "must be an int"]),
    (dict(hidden=None), ["KernelSpec.hidden=None", "must be an int"]),
    # topk: range and wave size
    (dict(topk=0), ["KernelSpec.topk=0", "[1, 16]"]),
    (dict(topk=17), ["KernelSpec.topk=17", "[1, 16]"]),
    (dict(topk=65), ["KernelSpec.topk=65", "[1, 16]"]),
    (dict(topk=8.0), ["KernelSpec.topk=8.0", "must be an int"]),
    (dict(topk=False), ["KernelSpec.topk=False", "must be an int"]),
    # world_size: range and wave size
    (dict(world_size=0), ["KernelSpec.world_size=0", "[1, 64]"]),
    (dict(world_size=65), ["KernelSpec.world_size=65", "[1, 64]"]),
    (dict(world_size=33, arch="sm_90"), ["KernelSpec.world_size=33", "wave size 32", "sm_90"]),
    (dict(world_size=33, arch="gfx1250"), ["KernelSpec.world_size=33", "wave size 32", "gfx1250"]),
    (dict(world_size=8.0), ["KernelSpec.world_size=8.0", "must be an int"]),
    # warps_per_block: range and threads per block
    (dict(warps_per_block=17), ["KernelSpec.warps_per_block=17", "1088 threads", "1024"]),
    (dict(warps_per_block=32), ["KernelSpec.warps_per_block=32", "2048 threads", "1024"]),
    (dict(warps_per_block=0), ["KernelSpec.warps_per_block=0", "[1, 32]"]),
    (dict(warps_per_block=33, arch="sm_90"), ["KernelSpec.warps_per_block=33", "[1, 32]"]),
    # the rest of the integer fields
    (dict(experts_per_rank=0), ["KernelSpec.experts_per_rank=0", "[1, 65536]"]),
    (dict(experts_per_rank=32.0), ["KernelSpec.experts_per_rank=32.0", "must be an int"]),
    (dict(max_tokens_per_rank=0), ["KernelSpec.max_tokens_per_rank=0", f"[1, {MAX_TOKENS_LIMIT}]"]),
    (dict(max_tokens_per_rank=MAX_TOKENS_LIMIT + 1),
     [f"KernelSpec.max_tokens_per_rank={MAX_TOKENS_LIMIT + 1}", f"[1, {MAX_TOKENS_LIMIT}]"]),
    (dict(scale_bytes=-1), ["KernelSpec.scale_bytes=-1", "[0, 4096]"]),
    (dict(scale_bytes=4097), ["KernelSpec.scale_bytes=4097", "[0, 4096]"]),
    (dict(scale_bytes=True), ["KernelSpec.scale_bytes=True", "must be an int"]),
    (dict(blocks=0), ["KernelSpec.blocks=0", "[1, 65535]"]),
    (dict(blocks=65536), ["KernelSpec.blocks=65536", "[1, 65535]"]),
    (dict(unroll=0), ["KernelSpec.unroll=0", "[1, 16]"]),
    (dict(unroll=17), ["KernelSpec.unroll=17", "[1, 16]"]),
    (dict(unroll=4.0), ["KernelSpec.unroll=4.0", "must be an int"]),
    # names
    (dict(arch="gfx90a"), ["KernelSpec.arch='gfx90a'", *ARCHES]),
    (dict(arch="sm90"), ["KernelSpec.arch='sm90'", *ARCHES]),
    (dict(arch="GFX950"), ["KernelSpec.arch='GFX950'"]),
    (dict(dtype="fp16"), ["KernelSpec.dtype='fp16'", *DTYPES]),
    (dict(dtype="bfloat16"), ["KernelSpec.dtype='bfloat16'"]),
]


@pytest.mark.parametrize("changes,parts", BAD_FIELDS, ids=[repr(c) for c, _ in BAD_FIELDS])
def test_bad_field_message_names_field_value_and_rule(changes, parts):
    _raises(parts, **changes)


@pytest.mark.parametrize("op", ["gather", "DISPATCH", "", 1, None])
def test_unknown_op_message_names_field(op):
    _raises([f"KernelSpec.op={op!r}", "dispatch", "combine"], op=op)


def test_unknown_op_raises_value_error():
    # Whatever the message, an unknown op must be a ValueError (not a TypeError/KeyError).
    for op in ("gather", "DISPATCH", "", 1, None):
        with pytest.raises(ValueError):
            spec(op=op)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bf16"] or [None])
def test_combine_rejects_non_bf16(dtype):
    if dtype is None:
        pytest.skip("only bf16 is in DTYPES: a non-bf16 combine spec cannot be expressed")
    _raises([f"KernelSpec.dtype={dtype!r}", "bf16"], op="combine", dtype=dtype)


def test_replace_revalidates():
    s = spec()
    assert s.replace(hidden=2048).hidden == 2048
    with pytest.raises(ValueError, match=r"KernelSpec\.hidden=7\b"):
        s.replace(hidden=7)
    with pytest.raises(ValueError, match=r"KernelSpec\.warps_per_block=17"):
        s.replace(warps_per_block=17)
    with pytest.raises(ValueError, match=r"KernelSpec\.world_size=33"):
        spec(world_size=33).replace(arch="sm_90")  # valid on wave64 gfx950, not on warp32 sm_90


def test_frozen_hashable_and_equal():
    a, b = spec(), spec()
    assert a == b and hash(a) == hash(b)
    assert a != spec(unroll=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.hidden = 2048  # type: ignore[misc]


def test_op_accepts_enum_and_string():
    assert spec(op=Op.COMBINE) == spec(op="combine")
    assert spec(op="combine").op is Op.COMBINE


def test_as_dict_is_json_and_round_trips():
    s = spec(op="combine", arch="sm_90", scale_bytes=16, blocks=7, warps_per_block=4, unroll=2)
    d = s.as_dict()
    assert list(d) == FIELDS
    assert json.loads(json.dumps(d)) == d
    assert KernelSpec(**d) == s


def _extreme_specs(arch):
    t = traits(arch)
    yield spec(arch=arch)
    yield spec(arch=arch, op="combine")
    yield spec(arch=arch, hidden=8, topk=1, experts_per_rank=1, world_size=1, max_tokens_per_rank=1,
               blocks=1, warps_per_block=1, unroll=1)
    yield spec(arch=arch, hidden=1 << 16, topk=16, world_size=t.wave_size,
               max_tokens_per_rank=MAX_TOKENS_LIMIT, experts_per_rank=1 << 16, scale_bytes=4096,
               blocks=65535, warps_per_block=t.max_threads_per_block // t.wave_size, unroll=16)


@pytest.mark.parametrize("arch", ARCHES)
def test_valid_specs_build_for_every_arch(arch):
    for s in _extreme_specs(arch):
        assert s.arch == arch
        assert s.traits is ARCH_TRAITS[arch]
        assert s.threads <= s.traits.max_threads_per_block
        assert s.topk <= s.traits.wave_size and s.world_size <= s.traits.wave_size


def test_arch_table_rows_are_consistent():
    assert set(ARCHES) == set(ARCH_TRAITS)
    for name, t in ARCH_TRAITS.items():
        assert t.name == name
        assert t.vendor in ("amd", "nvidia")
        assert t.wave_size in (32, 64)
        assert t.max_threads_per_block % t.wave_size == 0
        assert 1_000_000_000 % t.steady_clock_hz == 0, "clock_ns_per_tick must be exact"
        assert t.clock_ns_per_tick * t.steady_clock_hz == 1_000_000_000
        assert t.suffix == {"amd": ".hip", "nvidia": ".cu"}[t.vendor]
    with pytest.raises(ValueError, match=r"gfx90a.*gfx942.*gfx950"):
        traits("gfx90a")


# --------------------------------------------------------------------------------------------------
# Derived values and arena layout
# --------------------------------------------------------------------------------------------------

SHAPES = [
    dict(),
    dict(hidden=8, topk=1, experts_per_rank=1, world_size=1, max_tokens_per_rank=1),
    dict(hidden=2880, topk=4, experts_per_rank=16, world_size=8, max_tokens_per_rank=4096),
    dict(hidden=4096, topk=3, experts_per_rank=5, world_size=3, max_tokens_per_rank=77, scale_bytes=56),
    dict(hidden=2048, topk=8, experts_per_rank=1, world_size=32, max_tokens_per_rank=1000, scale_bytes=1),
    dict(hidden=2880, topk=8, experts_per_rank=16, world_size=8, max_tokens_per_rank=64, combine_quant="fp8_blockwise"),
    dict(hidden=8, topk=1, experts_per_rank=1, world_size=2, max_tokens_per_rank=3, combine_quant="fp4_blockwise"),
    dict(hidden=7168, topk=8, experts_per_rank=32, world_size=8, max_tokens_per_rank=5, combine_quant="fp8_direct_cast"),
    dict(hidden=1 << 16, topk=16, experts_per_rank=4, world_size=64, max_tokens_per_rank=MAX_TOKENS_LIMIT,
         scale_bytes=4096),
]


ARCH_SHAPES = [(a, i) for a in ARCHES for i, sh in enumerate(SHAPES)
               if max(sh.get("topk", 8), sh.get("world_size", 8)) <= traits(a).wave_size]


@pytest.mark.parametrize("arch,i", ARCH_SHAPES)
def test_derived_values(arch, i):
    t, shape = traits(arch), SHAPES[i]
    for warps in (1, 4, t.max_threads_per_block // t.wave_size):
        s = spec(arch=arch, warps_per_block=warps, **shape)
        assert s.threads == warps * t.wave_size
        assert s.row_bytes == s.hidden * 2  # bf16
        assert s.row_vectors == s.row_bytes // 16
        assert s.row_vectors * 16 == s.row_bytes
        assert s.capacity_rows == s.world_size * s.max_tokens_per_rank
        assert s.num_experts == s.world_size * s.experts_per_rank


REGIONS = ["signals", "send_slot", "send_pos", "recv_src", "recv_weights", "recv_indices", "recv_scales", "combine_in",
           "combine_wire", "slot_row", "expert_counts", "expert_offsets", "expert_weights", "expert_src",
           "expert_block_base", "expert_scales", "expert_y", "ll_calls", "ll_combine_stage", "recv_x", "expert_x",
           "dispatch_in", "ll_dispatch_stage"]
SHARED_REGIONS = REGIONS[: REGIONS.index("recv_x") + 1]
"""The regions before the payload-sized ones: every spec of one config places them alike."""


def _documented_sizes(s: KernelSpec) -> dict[str, int]:
    """Region sizes as the shapes of ARENA_REGIONS state them, computed apart from their ``size``."""
    cap, tmax, w, t_ll = s.capacity_rows, s.max_tokens_per_rank, s.world_size, s.ll_tokens
    stage_row = -(-(s.quant.wire_row_bytes(s.hidden) if s.quant.quantized else s.hidden * 2) // 16) * 16
    meta = -(-(8 + 8 * s.topk + s.scale_bytes) // 16) * 16  # (source rank, token), K weights, K ids, S bytes
    return {
        "signals": SIGNAL_WORDS * 4,
        "send_slot": tmax * w * 4,
        "send_pos": tmax * w * 4,
        "recv_src": cap * 2 * 4,
        "recv_weights": cap * s.topk * 4,
        "recv_indices": cap * s.topk * 4,
        "recv_scales": cap * s.scale_bytes,
        "combine_in": cap * s.hidden * 2,
        "combine_wire": cap * s.quant.wire_row_bytes(s.hidden) if s.quant.quantized else 0,
        "slot_row": cap * s.topk * 4 if s.expert_alignment else 0,
        "expert_counts": s.experts_per_rank * 4 if s.expert_alignment else 0,
        "expert_offsets": (s.experts_per_rank + 1) * 4 if s.expert_alignment else 0,
        "expert_weights": s.expert_rows * 4,
        "expert_src": s.expert_rows * 3 * 4,
        "expert_block_base": PLAN_BLOCKS * s.experts_per_rank * 4 if s.expert_alignment else 0,
        "expert_scales": s.expert_rows * s.scale_bytes,
        "expert_y": s.expert_rows * s.hidden * 2,
        "recv_x": cap * s.row_bytes if s.op.payload else 0,
        "expert_x": s.expert_rows * s.row_bytes if s.op.payload else 0,
        "dispatch_in": tmax * s.row_bytes if s.op.payload else 0,
        "ll_calls": 4 * LL_FLAG_SLOTS * 4 if t_ll else 0,
        "ll_combine_stage": 2 * w * t_ll * stage_row,
        "ll_dispatch_stage": 2 * w * t_ll * (s.row_bytes + meta) if s.op.payload else 0,
    }


def test_arena_regions_are_declared_once_in_order():
    """ARENA_REGIONS is the one list: the layout's offsets, the prelude's constants (``c_name``) and
    their shapes come from it; an unknown region name raises naming the known ones."""
    assert [r.name for r in ARENA_REGIONS] == REGIONS
    assert [r.c_name for r in ARENA_REGIONS][:3] == ["kOffSignals", "kOffSendSlot", "kOffSendPos"]
    assert len({r.c_name for r in ARENA_REGIONS}) == len(REGIONS) and all(r.shape and r.doc for r in ARENA_REGIONS)
    lay = spec().arena_layout
    assert [name for name, _ in lay.offsets] == REGIONS
    with pytest.raises(AttributeError, match="no region or attribute 'recv_y'; regions: signals, send_slot"):
        lay.recv_y


@pytest.mark.parametrize("ll", [0, 37], ids=["normal", "ll"])
@pytest.mark.parametrize("expert", [0, 16], ids=["rank", "expert"])
@pytest.mark.parametrize("op", ["dispatch", "combine", "dispatch_ll"])
def test_the_prelude_declares_the_regions_its_layout_has(op, expert, ll):
    """Every region is declared as ``constexpr ep_u64 kOff<Name> = <offset>ull;  // <shape>`` where
    the spec's layout has what it needs (the expert layout, the payload rows, the low-latency
    family), and nowhere else."""
    if op == "dispatch_ll" and not ll:
        pytest.skip("a low-latency kernel needs ll_tokens >= 1")
    s = spec(op=op, warps_per_block=8, expert_alignment=expert, ll_tokens=ll)
    text = render(s).text
    declared = dict(re.findall(r"constexpr ep_u64 (kOff\w+) = (\d+)ull;", text))
    lay = s.arena_layout
    want = {r.c_name: str(getattr(lay, r.name)) for r in ARENA_REGIONS
            if (expert or "expert" not in r.needs) and (ll or "low_latency" not in r.needs)
            and (s.op.payload or "payload" not in r.needs)}
    assert {k: v for k, v in declared.items() if k != "kOffCombineSrc"} == want
    for r in ARENA_REGIONS:
        if r.c_name in want:
            assert re.search(rf"{r.c_name} = \d+ull; +// {re.escape(r.shape)}\n", text), r.c_name


@pytest.mark.parametrize("ll", [0, 37], ids=["normal", "ll"])
@pytest.mark.parametrize("expert", [0, 16], ids=["rank", "expert"])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("shape", SHAPES, ids=range(len(SHAPES)))
def test_layout_aligned_monotonic_non_overlapping(op, shape, expert, ll):
    s = spec(op=op, **shape, warps_per_block=8).replace(expert_alignment=expert)  # 512 threads: any wire's combine
    s = s.replace(ll_tokens=min(ll, s.max_tokens_per_rank))
    lay = s.arena_layout
    sizes = _documented_sizes(s)
    offs = [getattr(lay, r) for r in REGIONS]
    assert lay.signals == 0
    assert lay.capacity_rows == s.capacity_rows
    assert all(o % ALIGN == 0 for o in offs), offs
    assert ALIGN == 256
    assert offs == sorted(offs), "offsets must be monotonic"
    for a, b in zip(REGIONS, REGIONS[1:]):
        end = getattr(lay, a) + sizes[a]
        assert getattr(lay, b) >= end, f"{a} [{getattr(lay, a)}, {end}) overlaps {b} at {getattr(lay, b)}"
        assert getattr(lay, b) - end < ALIGN, f"gap after {a} larger than the alignment"
    if s.scale_bytes == 0:
        assert lay.recv_scales == lay.combine_in, "recv_scales is absent when S = 0"
    if not s.ll_tokens:
        assert lay.ll_calls == lay.ll_combine_stage == lay.recv_x, "the low-latency regions are absent at T_ll = 0"
        assert lay.ll_dispatch_stage == lay.total_bytes
    else:  # the combine stage's rows as the kernels index them; the dispatch stage's records
        assert 2 * s.world_size * s.ll_tokens * lay.ll_stage_row_bytes == sizes["ll_combine_stage"]
        assert lay.ll_stage_row_bytes % 16 == 0
        if s.op.payload:
            assert lay.ll_record_bytes == s.row_bytes + lay.ll_meta_bytes and lay.ll_record_bytes % 16 == 0
            assert lay.ll_meta_bytes >= 8 + 8 * s.topk + s.scale_bytes
        else:
            assert lay.ll_record_bytes == lay.ll_meta_bytes == 0, "combine specs know no payload rows"
    end = lay.ll_dispatch_stage + sizes["ll_dispatch_stage"]
    assert end == lay.ll_dispatch_stage + 2 * s.world_size * s.ll_tokens * lay.ll_record_bytes
    assert lay.total_bytes % ALIGN == 0
    assert end <= lay.total_bytes < end + ALIGN


@pytest.mark.parametrize("arch", ARCHES)
def test_dispatch_and_combine_share_layout(arch):
    configs = [
        EpConfig(world_size=8, hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=4096),
        EpConfig(world_size=3, hidden=2880, topk=4, num_experts=9, max_tokens_per_rank=77, scale_bytes=56,
                 dispatch_geometry=Geometry(blocks=8, warps_per_block=4, unroll=2),
                 combine_geometry=Geometry(blocks=64, warps_per_block=8, unroll=8)),
        EpConfig(world_size=1, hidden=8, topk=1, num_experts=1, max_tokens_per_rank=1, scale_bytes=1),
        EpConfig(world_size=4, hidden=256, topk=6, num_experts=12, max_tokens_per_rank=40, scale_bytes=8, dtype="fp8",
                 layout="expert", expert_alignment=16, max_recv_tokens=100),
        EpConfig(world_size=8, hidden=2880, topk=4, num_experts=32, max_tokens_per_rank=300, kernel_family="normal"),
        EpConfig(world_size=8, hidden=2880, topk=4, num_experts=32, max_tokens_per_rank=300, dtype="fp8",
                 scale_bytes=24, kernel_family="low_latency", combine_quant="fp8_blockwise"),
        EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=64, layout="expert",
                 kernel_family="low_latency"),
    ]
    for cfg in configs:
        specs = dict(zip(planner.plan(cfg, arch).ops, planner.specs(cfg, arch)))
        assert [s.op for s in specs.values()] == list(planner.plan(cfg, arch).ops)
        payload = [s for s in specs.values() if s.op.payload]  # the dispatch kernels, expand_plan, expand
        local = [s for s in specs.values() if not s.op.payload]  # the combine kernels, fold
        d, c = payload[0], local[0]
        assert d.op in (Op.DISPATCH, Op.DISPATCH_LL) and c.op in (Op.COMBINE, Op.COMBINE_LL)
        dl, cl = d.arena_layout, c.arena_layout
        assert all(s.arena_layout == dl for s in payload) and all(s.arena_layout == cl for s in local)
        for r in SHARED_REGIONS:  # every region before the payload-sized ones (expert_x, ll_dispatch_stage)
            assert getattr(dl, r) == getattr(cl, r), r
        assert dl.ll_tokens == cl.ll_tokens == planner.plan(cfg, arch).low_latency_tokens
        assert dl.ll_stage_row_bytes == cl.ll_stage_row_bytes
        assert dl.capacity_rows == cl.capacity_rows == (cfg.max_recv_tokens or cfg.world_size * cfg.max_tokens_per_rank)
        # only the payload ops' total includes recv_x, expert_x and the low-latency dispatch stage
        assert dl.total_bytes >= dl.recv_x + dl.capacity_rows * d.row_bytes > dl.recv_x
        assert dl.total_bytes >= dl.ll_dispatch_stage + 2 * cfg.world_size * dl.ll_tokens * (d.row_bytes + dl.ll_meta_bytes)
        assert cl.total_bytes == cl.recv_x
        assert cl.total_bytes < dl.total_bytes


# --------------------------------------------------------------------------------------------------
# Entry names
# --------------------------------------------------------------------------------------------------

C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

VARIANTS = {
    "op": ["dispatch", "combine"],
    "arch": ["gfx950", "sm_90"],
    "dtype": ["bf16"],
    "world_size": [8, 1],
    "hidden": [7168, 2048],
    "topk": [8, 1],
    "experts_per_rank": [32, 1],
    "max_tokens_per_rank": [4096, 128],
    "blocks": [32, 64],
    "warps_per_block": [8, 4],  # at most 512 threads on gfx950 (a quantized wire's combine's most)
    "unroll": [4, 2],
    "scale_bytes": [0, 16],
    "combine_quant": ["none", "fp4_blockwise"],
    "recv_tokens": [0, 128],  # at least W x ll_tokens: the low-latency family places every row it receives
    "expert_alignment": [0, 16],
    "ll_tokens": [0, 16],
    "transport": ["push"],  # "pull" takes op dispatch only: test_pull_names_and_rules
}


def test_variants_cover_every_field():
    assert list(VARIANTS) == FIELDS


def test_names_are_c_identifiers_and_unique_over_product():
    names = {}
    for values in itertools.product(*VARIANTS.values()):
        s = KernelSpec(**dict(zip(VARIANTS, values)))
        n = s.name
        assert C_IDENT.match(n), n
        assert n not in names, f"{s} and {names[n]} share the entry name {n}"
        names[n] = s
    assert len(names) == math.prod(len(v) for v in VARIANTS.values())


ONE_FIELD_CHANGES = {
    "op": "combine", "arch": "gfx1250", "hidden": 2048, "topk": 4, "experts_per_rank": 16, "world_size": 4,
    "max_tokens_per_rank": 128, "scale_bytes": 16, "blocks": 31, "warps_per_block": 8, "unroll": 2,
    "ll_tokens": 128,
}


@pytest.mark.parametrize("field", list(ONE_FIELD_CHANGES))
def test_changing_one_field_changes_name(field):
    base = spec()
    assert base.replace(**{field: ONE_FIELD_CHANGES[field]}).name != base.name


@pytest.mark.parametrize("a,b", [
    (dict(experts_per_rank=1, max_tokens_per_rank=12), dict(experts_per_rank=11, max_tokens_per_rank=2)),
    (dict(blocks=1, warps_per_block=12), dict(blocks=11, warps_per_block=2)),
    (dict(world_size=1, hidden=18 * 8), dict(world_size=11, hidden=8 * 8)),
    (dict(max_tokens_per_rank=1, scale_bytes=16), dict(max_tokens_per_rank=116)),
    (dict(arch="gfx950"), dict(arch="gfx1250")),
])
def test_adjacent_numbers_do_not_collide(a, b):
    assert spec(**a).name != spec(**b).name


def test_arch_names_stay_distinct_in_entry_names():
    squashed = [a.replace("_", "") for a in ARCHES]
    assert len(set(squashed)) == len(ARCHES)
    for a in ARCHES:
        assert a.replace("_", "") in spec(arch=a).name


# Where each field's value shows in the name (the name's own spelling of it).
def _name_tokens(s: KernelSpec) -> dict[str, str]:
    toks = {
        "op": f"_{s.op.value}_",
        "arch": f"_{s.arch.replace('_', '')}_",
        "dtype": f"_{s.dtype}_",
        "hidden": f"_h{s.hidden}_",
        "topk": f"_k{s.topk}_",
        "experts_per_rank": f"_l{s.experts_per_rank}_",
        "world_size": f"_w{s.world_size}_",
        "max_tokens_per_rank": f"_t{s.max_tokens_per_rank}_",
        "blocks": f"_{s.blocks}x",
        "warps_per_block": f"x{s.warps_per_block}_",
        "unroll": f"_u{s.unroll}",
    }
    if s.scale_bytes:
        toks["scale_bytes"] = f"_s{s.scale_bytes}_"
    if s.quant.quantized:
        toks["combine_quant"] = f"_{s.quant.tag}_"
    if s.recv_tokens:
        toks["recv_tokens"] = f"_r{s.recv_tokens}_"
    if s.expert_alignment:
        toks["expert_alignment"] = f"_a{s.expert_alignment}_"
    if s.ll_tokens:
        toks["ll_tokens"] = f"_ll{s.ll_tokens}_"
    if s.transport == "pull":
        toks["transport"] = "_pull_"
    return toks


def test_name_contains_every_field():
    for s in (spec(scale_bytes=16, blocks=7, warps_per_block=3, unroll=5, combine_quant="fp8_blockwise",
                   recv_tokens=97, expert_alignment=64, ll_tokens=12, transport="pull"),
              spec(op="combine", arch="sm_90")):
        n = s.name
        assert n.startswith("epgen_")
        toks = _name_tokens(s)
        for field, tok in toks.items():
            assert tok in n + "_", f"{field}: {tok!r} not in {n!r}"
        optional = ({"scale_bytes"} if not s.scale_bytes else set()) | ({"combine_quant"} if not s.quant.quantized else set())
        optional |= ({"recv_tokens"} if not s.recv_tokens else set()) | ({"expert_alignment"} if not s.expert_alignment else set())
        optional |= ({"ll_tokens"} if not s.ll_tokens else set()) | ({"transport"} if s.transport == "push" else set())
        assert set(toks) | optional == set(FIELDS)


def test_name_fields_in_declaration_order():
    s = spec(scale_bytes=16, blocks=7, warps_per_block=3, unroll=5, recv_tokens=25, expert_alignment=4, ll_tokens=3)
    n = s.name + "_"
    toks = _name_tokens(s)
    order = sorted(toks, key=lambda f: n.index(toks[f]))
    assert order == [f for f in FIELDS if f in toks], n


def test_describe_lists_every_field_in_order():
    s = spec(op="combine", scale_bytes=16)
    line = s.describe()
    assert line.split() == [f"{f}={s.as_dict()[f]}" for f in FIELDS]


# --------------------------------------------------------------------------------------------------
# Arch table discipline: only codegen/arch.py compares arch names
# --------------------------------------------------------------------------------------------------

ARCH_COMPARISONS = ['== "gfx', "== 'gfx", '== "sm_', "== 'sm_", 'arch ==',
                    '!= "gfx', "!= 'gfx", '!= "sm_', "!= 'sm_", 'arch !=']


def test_no_arch_comparisons_outside_arch_table():
    roots = [Path(epgen.__file__).resolve().parent, Path(epgen.codegen.__file__).resolve().parent]
    arch_py = Path(epgen.codegen.arch.__file__).resolve()
    files = sorted({p.resolve() for r in roots for p in r.rglob("*.py")} - {arch_py})
    assert len(files) >= 5, files
    hits = []
    for p in files:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for pat in ARCH_COMPARISONS:
                if pat in line:
                    hits.append(f"{p}:{i}: {line.strip()}")
    assert not hits, "arch-name comparisons outside codegen/arch.py:\n" + "\n".join(hits)


# --------------------------------------------------------------------------------------------------
# The specs the planner derives from an EpConfig (EpConfig itself: test_config.py)
# --------------------------------------------------------------------------------------------------

CFG = dict(world_size=8, hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=4096)


def cfg(**changes) -> EpConfig:
    return EpConfig(**{**CFG, **changes})


def test_config_geometry_reaches_specs():
    c = cfg(dispatch_geometry=Geometry(blocks=8, warps_per_block=4, unroll=2),
            combine_geometry=Geometry(blocks=64, warps_per_block=8, unroll=8), scale_bytes=32)
    specs = {s.op: s for s in planner.specs(c, "gfx950")}
    d, k = specs[Op.DISPATCH], specs[Op.COMBINE]
    assert (d.blocks, d.warps_per_block, d.unroll, d.scale_bytes) == (8, 4, 2, 32)
    assert (k.blocks, k.warps_per_block, k.unroll, k.scale_bytes) == (64, 8, 8, 32)
    ll = planner.plan(c, "gfx950").geometry(Op.DISPATCH_LL_SEND, 1)  # the low-latency halves take their own geometry
    for op in LOW_LATENCY_OPS:
        assert (specs[op].blocks, specs[op].warps_per_block, specs[op].unroll) == (ll.blocks, ll.warps_per_block, ll.unroll)
        assert specs[op].scale_bytes == 32
    stated = cfg(low_latency_geometry=Geometry(blocks=16, warps_per_block=2, unroll=1))
    specs = {s.op: s for s in planner.specs(stated, "gfx950")}
    for op in LOW_LATENCY_OPS:
        assert (specs[op].blocks, specs[op].warps_per_block, specs[op].unroll) == (16, 2, 1)


@pytest.mark.parametrize("mode,hidden,wire", [("fp8_blockwise", 7168, 7168 + 224), ("fp8_blockwise", 2880, 2880 + 96),
                                              ("fp4_blockwise", 2880, 1440 + 368), ("fp4_blockwise", 7168, 3584 + 896),
                                              ("fp8_direct_cast", 2880, 2880), ("fp4_blockwise", 8, 16 + 16)])
def test_combine_wire_rows(mode, hidden, wire):
    from epgen.codegen.dtypes import combine_quant

    q = combine_quant(mode)
    assert q.wire_row_bytes(hidden) == wire and q.scale_offset(hidden) % 16 == 0 and wire % 16 == 0


def test_combine_quant_names_layout_and_errors():
    base = spec(op="combine", hidden=2880, warps_per_block=8)  # 512 threads on gfx950: the quantized combine's most
    quantized = base.replace(combine_quant="fp8_blockwise")
    assert quantized.name == base.name + "_qfp8b" and quantized.fan_in == 1 and base.fan_in == 2
    assert base.arena_layout.combine_wire == base.arena_layout.recv_x  # no wire region without quantization
    assert quantized.arena_layout.recv_x - quantized.arena_layout.combine_wire >= quantized.capacity_rows * (2880 + 96)
    d = spec(op="dispatch", hidden=2880)
    assert d.replace(combine_quant="fp4_blockwise").arena_layout.recv_x > d.arena_layout.recv_x  # both ops share one layout
    with pytest.raises(ValueError, match=r"KernelSpec.combine_quant='fp16': must be one of none, fp8_direct_cast"):
        base.replace(combine_quant="fp16")


@pytest.mark.parametrize("value", [0, 3, 512, 16.0, True, "16"])
def test_expert_alignment_must_be_a_power_of_two_int(value):
    with pytest.raises(ValueError, match=rf"EpConfig.expert_alignment={value!r}: must be a power of two from 1 to 256"):
        EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=8, layout="expert",
                 expert_alignment=value)
    with pytest.raises(ValueError, match="KernelSpec.expert_alignment"):
        spec().replace(expert_alignment=value if value != 0 else -1)


# --------------------------------------------------------------------------------------------------
# The low-latency family: KernelSpec.ll_tokens, its flag limit, EpConfig.kernel_family
# --------------------------------------------------------------------------------------------------

LL = dict(op="dispatch_ll_send", world_size=8, blocks=32, warps_per_block=8, max_tokens_per_rank=256, ll_tokens=128)


def test_the_low_latency_receive_rows_hold_every_row_a_call_can_send():
    """The low-latency family never overflows: KernelSpec refuses receive rows below W x ll_tokens
    (any op of the layer: they share the arena), and EpConfig's "auto" lowers T_ll to fit them."""
    _raises(["KernelSpec.recv_tokens=1000", "world_size x ll_tokens = 1024", "ll_tokens at most 125"],
            **{**LL, "op": "dispatch", "recv_tokens": 1000})
    spec(**{**LL, "recv_tokens": 1024})
    cfg = EpConfig(world_size=8, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=256, max_recv_tokens=400)
    assert [planner.plan(cfg, a).low_latency_tokens for a in ARCHES] == [50] * len(ARCHES)
    with pytest.raises(ValueError, match=r"EpConfig.max_recv_tokens=400.*kernel_family='low_latency' receives up to "
                                         r"world_size x max_tokens_per_rank = 2048 rows"):
        EpConfig(world_size=8, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=256, max_recv_tokens=400,
                 kernel_family="low_latency")


@pytest.mark.parametrize("op", [op.value for op in LOW_LATENCY_OPS])
def test_a_low_latency_op_needs_ll_tokens(op):
    _raises(["KernelSpec.ll_tokens=0", repr(op), "low-latency", "ll_tokens >= 1"], **{**LL, "op": op, "ll_tokens": 0})
    assert spec(**{**LL, "op": op}).ll_tokens == 128


@pytest.mark.parametrize("op", ["dispatch", "combine", "dispatch_ll", "combine_ll_recv"])
def test_ll_tokens_at_most_max_tokens_and_65535(op):
    _raises(["KernelSpec.ll_tokens=257", "at most max_tokens_per_rank = 256"], **{**LL, "op": op, "ll_tokens": 257})
    _raises(["KernelSpec.ll_tokens=65536", "[0, 65535]"],
            **{**LL, "op": op, "max_tokens_per_rank": 70000, "ll_tokens": 65536})
    _raises(["KernelSpec.ll_tokens=-1", "[0, 65535]"], **{**LL, "op": op, "ll_tokens": -1})
    _raises(["KernelSpec.ll_tokens=8.0", "must be an int"], **{**LL, "op": op, "ll_tokens": 8.0})
    assert spec(**{**LL, "op": op, "max_tokens_per_rank": 70000, "ll_tokens": 65535, "blocks": 128}).ll_tokens == 65535


def test_the_low_latency_dispatch_positions_fit_in_shared_memory():
    # ceil(T_ll / blocks) x W int32 positions a block: 65535 tokens over 32 blocks at W = 8 is 64 KiB
    big = {**LL, "max_tokens_per_rank": 65535, "ll_tokens": 65535}
    for op in ("dispatch_ll", "dispatch_ll_send"):
        _raises(["KernelSpec.blocks=32", "= 65536 bytes, more than 49152", "use more blocks or fewer ll_tokens"],
                **{**big, "op": op})
        assert spec(**{**big, "op": op, "blocks": 128}).ll_shared_bytes == 512 * 8 * 4
    for op in ("dispatch_ll_recv", "combine_ll", "combine_ll_send", "combine_ll_recv", "dispatch"):
        assert spec(**{**big, "op": op}).blocks == 32  # they keep no positions


@pytest.mark.parametrize("op", [op.value for op in LOW_LATENCY_OPS])
def test_low_latency_flags_hold_world_size_x_blocks_at_most_1024(op):
    assert spec(**{**LL, "op": op, "blocks": 128}).blocks == 128  # 8 x 128 = LL_FLAG_SLOTS
    msg = _raises(["KernelSpec.blocks=129", "world_size x blocks = 1032", f"at most {LL_FLAG_SLOTS}",
                   "at most 128 blocks"], **{**LL, "op": op, "blocks": 129})
    assert msg.startswith("KernelSpec.blocks=129")
    _raises(["KernelSpec.blocks=17", "world_size x blocks = 1088"], **{**LL, "op": op, "world_size": 64, "blocks": 17})
    assert spec(**{**LL, "op": "dispatch", "blocks": 129}).blocks == 129  # the normal family has no such flags


def test_the_field_named_by_a_low_latency_error():
    with pytest.raises(FieldError) as e:
        spec(**{**LL, "blocks": 200})
    assert e.value.field == "blocks"
    with pytest.raises(FieldError) as e:
        spec(**{**LL, "ll_tokens": 0})
    assert e.value.field == "ll_tokens"


def test_op_templates_and_families():
    assert [op.template for op in LOW_LATENCY_OPS] == ["dispatch_ll"] * 3 + ["combine_ll"] * 3
    assert all(op.low_latency and op.remote for op in LOW_LATENCY_OPS)
    assert [op.call for op in LOW_LATENCY_OPS] == [Op.DISPATCH] * 3 + [Op.COMBINE] * 3
    assert [op.payload for op in LOW_LATENCY_OPS] == [True] * 3 + [False] * 3
    assert not any(op.low_latency for op in Op if op not in LOW_LATENCY_OPS)
    assert Op.COMBINE_QUANTIZE.call is Op.COMBINE and not Op.COMBINE_QUANTIZE.remote
    assert all(op.template == op.value for op in Op if op not in LOW_LATENCY_OPS)
    assert [op.call for op in EXPERT_OPS] == [Op.DISPATCH, Op.DISPATCH, Op.COMBINE]
    assert Op.DISPATCH.call is Op.DISPATCH and Op.COMBINE.call is Op.COMBINE
    assert Op.DISPATCH_PULL.template == "dispatch_pull" and Op.DISPATCH_PULL.call is Op.DISPATCH
    assert Op.DISPATCH_PULL.payload and Op.DISPATCH_PULL.remote and not Op.DISPATCH_PULL.low_latency


@pytest.mark.parametrize("world_size,layout,family,built", [
    (2, "rank", "auto", True), (8, "rank", "normal", True), (1, "rank", "auto", False),
    (2, "expert", "normal", False), (2, "rank", "low_latency", False),
])
def test_the_quantize_kernel_serves_the_normal_rank_layout_combine_with_peers(world_size, layout, family, built):
    # W = 1 sends nothing; the expert layout's fold writes the wire rows; the low-latency family
    # encodes the rows it sends
    c = EpConfig(world_size=world_size, hidden=512, topk=2, num_experts=8, max_tokens_per_rank=256, layout=layout,
                 kernel_family=family, combine_quant="fp8_blockwise")
    assert (Op.COMBINE_QUANTIZE in planner.ops(c)) is built
    assert Op.COMBINE_QUANTIZE not in planner.ops(cfg(kernel_family=family, layout=layout))  # the bf16 wire never needs one
    if built:
        (max_tokens, s), = planner.plan(c, "sm_90").variants.get((Op.COMBINE_QUANTIZE, "push"), ())
        assert (s.blocks, s.threads, s.unroll) == tuning.MEASURED_DEFAULTS["sm_90"]["combine_quantize"][0][1:]


def test_the_quantize_op_needs_a_quantized_wire():
    with pytest.raises(ValueError, match=r"^KernelSpec.combine_quant='none': op 'combine_quantize' writes a quantized"):
        spec(op="combine_quantize")
    assert spec(op="combine_quantize", combine_quant="fp4_blockwise").name.startswith("epgen_combine_quantize_")


def test_a_quantized_combine_runs_at_most_512_threads_a_block():
    # 512 threads leave the own-row encoding its registers on every target (16 warps on sm_90,
    # 8 waves on gfx950, 16 on gfx1250); a table geometry keeps its blocks, an explicit one is refused
    c = EpConfig.for_model("deepseek-v3", world_size=4, max_tokens_per_rank=4096, combine_quant="fp8_blockwise")
    bf16 = EpConfig.for_model("deepseek-v3", world_size=4, max_tokens_per_rank=4096)  # no table entries: defaults
    table = {arch: tuning.schedule(planner.shape_key(bf16, arch)).bucket("combine", 4096).geometry
             for arch in ("sm_90", "gfx950", "gfx1250")}
    for arch, want in (("sm_90", 16), ("gfx950", 8), ("gfx1250", 16)):
        g = planner.plan(c, arch).geometry(Op.COMBINE, 4096)
        assert (g.blocks, g.warps_per_block, g.unroll) == (table[arch].blocks, min(want, table[arch].warps_per_block),
                                                           table[arch].unroll)
        assert all(s.threads <= 512 for _, s in planner.plan(c, arch).variants.get((Op.COMBINE, "push"), ()))
    assert planner.plan(bf16, "sm_90").geometry(Op.COMBINE, 4096) == table["sm_90"]  # the bf16 wire keeps 32 warps
    with pytest.raises(ValueError, match=r"^EpConfig.combine_geometry=16x32u4: .* a combine with a quantized wire "
                                         r"\(fp8_blockwise\) runs at most 512 threads a block .*: warps at most 8 on "
                                         r"gfx942, 8 on gfx950, 16 on gfx1250, 16 on sm_90$"):
        attrs.evolve(c, combine_geometry=Geometry(blocks=16, warps_per_block=32, unroll=4))  # on no arch
    fits = attrs.evolve(c, combine_geometry=Geometry(blocks=16, warps_per_block=16, unroll=4))  # sm_90, gfx1250
    with pytest.raises(ValueError, match=r"^EpConfig.combine_geometry=16x16u4: 16 warps of 64 lanes are 1024 threads "
                                         r"on gfx950; .* warps at most 8 on gfx942, 8 on gfx950"):
        planner.plan(fits, "gfx950").variants.get((Op.COMBINE, "push"), ())
    assert planner.plan(fits, "sm_90").variants.get((Op.COMBINE, "push"), ())[0][1].warps_per_block == 16
    # the kernel's own rule: a spec built by hand (epgen diff --a/--b) cannot hold more either
    with pytest.raises(ValueError, match=r"^KernelSpec.warps_per_block=32: 1024 threads; a combine with a quantized "
                                         r"wire \(fp8_blockwise\) runs at most 512 threads a block$"):
        spec(op="combine", arch="sm_90", warps_per_block=32, combine_quant="fp8_blockwise")
    assert spec(op="combine", arch="sm_90", warps_per_block=16, combine_quant="fp8_blockwise").threads == 512
    assert spec(op="combine", arch="sm_90", warps_per_block=32).threads == 1024  # the bf16 wire: any block


def test_an_explicit_low_latency_geometry_is_not_clamped_but_refused():
    with pytest.raises(ValueError, match=r"^KernelSpec.blocks=129: the low-latency family raises one flag per"):
        cfg(low_latency_geometry=Geometry(blocks=129, warps_per_block=8, unroll=2))  # W = 8: at most 128
    with pytest.raises(ValueError, match=r"^EpConfig.low_latency_geometry=.*: applies to kernel_family 'auto' or "):
        cfg(low_latency_geometry=Geometry(blocks=64, warps_per_block=8, unroll=2), kernel_family="normal")
    explicit = cfg(low_latency_geometry=Geometry(blocks=128, warps_per_block=8, unroll=2))
    assert planner.plan(explicit, "sm_90").geometry(Op.COMBINE_LL, 1).blocks == 128


@pytest.mark.parametrize("family,layout,ops", [
    ("auto", "rank", CALLS + (Op.DISPATCH_PULL,) + LOW_LATENCY_OPS),
    ("normal", "rank", CALLS + (Op.DISPATCH_PULL,)),
    ("low_latency", "rank", LOW_LATENCY_OPS),
    ("auto", "expert", CALLS + (Op.DISPATCH_PULL,) + LOW_LATENCY_OPS + EXPERT_OPS),
    ("normal", "expert", CALLS + (Op.DISPATCH_PULL,) + EXPERT_OPS),
    ("low_latency", "expert", LOW_LATENCY_OPS + EXPERT_OPS),
])
def test_config_ops_per_family(family, layout, ops):
    c = cfg(kernel_family=family, layout=layout, max_tokens_per_rank=512)
    assert planner.ops(c) == ops
    # no gfx950 table bucket says "pull": "auto" builds no pull kernels there
    assert [s.op for s in planner.specs(c, "gfx950")] == [op for op in ops if op is not Op.DISPATCH_PULL]
    want = {"normal": 0, "low_latency": 512, "auto": 128}[family]  # auto: tuning.LOW_LATENCY_MAX_TOKENS
    assert planner.plan(c, "gfx950").low_latency_tokens == want
    assert all(s.ll_tokens == want for s in planner.specs(c, "gfx950"))  # every spec of the layer: one arena layout


# --------------------------------------------------------------------------------------------------
# The pull dispatch (KernelSpec.transport, Op.DISPATCH_PULL, EpConfig.dispatch_transport)
# --------------------------------------------------------------------------------------------------

def test_pull_names_and_rules():
    push, pull = spec(), spec(transport="pull")
    assert pull.name == push.name + "_pull" and push.transport == "push"
    assert spec(op="dispatch_pull").name.startswith("epgen_dispatch_pull_gfx950_bf16_")
    assert pull.arena_layout == push.arena_layout == spec(op="dispatch_pull").arena_layout  # one arena for every payload kernel
    with pytest.raises(ValueError, match=r"^KernelSpec.transport='pull': only op 'dispatch' pulls \(op 'combine'"):
        spec(op="combine", transport="pull")
    with pytest.raises(ValueError, match=r"^KernelSpec.transport='pull': only op 'dispatch' pulls \(op 'dispatch_pull'"):
        spec(op="dispatch_pull", transport="pull")
    with pytest.raises(ValueError, match=r"^KernelSpec.transport='both': must be one of push, pull"):
        spec(transport="both")


def test_dispatch_in_is_tmax_payload_rows_after_expert_x_and_absent_from_combine_specs():
    d, c = spec(dtype="fp4", scale_bytes=16), spec(op="combine", scale_bytes=16)
    assert d.arena_layout.dispatch_in - d.arena_layout.expert_x >= 0
    assert d.arena_layout.ll_dispatch_stage - d.arena_layout.dispatch_in >= d.max_tokens_per_rank * d.row_bytes
    assert d.row_bytes == 7168 // 2  # fp4: two codes a byte
    assert c.arena_layout.dispatch_in == c.arena_layout.ll_dispatch_stage == c.arena_layout.recv_x  # combine: payload regions empty


@pytest.mark.parametrize("arch", ARCHES)
def test_transport_selection_and_the_kernels_each_builds(arch):
    push, pull, auto = (cfg(dispatch_transport=t, max_tokens_per_rank=512) for t in ("push", "pull", "auto"))
    assert Op.DISPATCH_PULL not in planner.ops(push) and planner.plan(push, arch).transports(Op.DISPATCH) == ("push",)
    assert planner.dispatch_transport(push, arch, 1) == "push" and planner.dispatch_transport(pull, arch, 1) == "pull"
    assert planner.plan(pull, arch).transports(Op.DISPATCH) == ("push", "pull")
    specs = planner.specs(pull, arch)
    assert [(s.op, s.transport) for s in specs if s.op.call is Op.DISPATCH and s.op.remote and not s.op.low_latency] == [
        (Op.DISPATCH, "push"), (Op.DISPATCH, "pull"), (Op.DISPATCH_PULL, "push")]
    # the pull path's kernels take the dispatch entry's buckets and geometry
    assert planner.tuning_key(pull, arch, Op.DISPATCH_PULL) == planner.tuning_key(pull, arch, Op.DISPATCH)
    for tr, op in (("pull", Op.DISPATCH), ("push", Op.DISPATCH_PULL)):
        got = planner.plan(pull, arch).variants.get((op, tr), ())
        want = planner.plan(pull, arch).variants.get((Op.DISPATCH, "push"), ())
        assert [(t, s.blocks, s.warps_per_block, s.unroll) for t, s in got] == [
            (t, s.blocks, s.warps_per_block, s.unroll) for t, s in want]
        assert all(s.op is op and s.transport == tr for _, s in got)
    # no shipped table bucket says pull: "auto" pushes and builds no pull kernels
    assert planner.dispatch_transport(auto, arch, 1) == "push" and planner.plan(auto, arch).transports(Op.DISPATCH) == ("push",)
    assert planner.plan(auto, arch).variants[(Op.DISPATCH_PULL, "push")] == ()
    assert planner.plan(auto, arch).variants[(Op.DISPATCH, "pull")] == ()


def test_explicit_dispatch_geometry_applies_to_both_pull_kernels():
    g = Geometry(blocks=8, warps_per_block=4, unroll=2)
    c = cfg(dispatch_transport="pull", dispatch_geometry=g)
    for op, tr in ((Op.DISPATCH, "pull"), (Op.DISPATCH_PULL, "push")):
        ((t, s),) = planner.plan(c, "gfx950").variants.get((op, tr), ())
        assert (t, s.blocks, s.warps_per_block, s.unroll) == (c.max_tokens_per_rank, 8, 4, 2)
