"""The system-scope releases of the AMD catalogue kernels, read from their assembly.

LLVM's AMDGPU memory model (AMDGPUUsage, "Memory Model GFX942" table, which gfx942 and GFX950 follow,
rows "store atomic release / fence release / fence acq_rel - system") lowers a system-scope
release to ``buffer_wbl2 sc0 sc1`` then ``s_waitcnt vmcnt(0)`` and only then the releasing
store, atomic or (for an acq_rel or seq_cst fence) the ``buffer_inv sc0 sc1``; the GFX125x table,
which gfx1250 follows, to ``global_wb scope:SCOPE_SYS`` then ``s_wait_storecnt 0``. clang
22.1.8 drops the gfx950 wait when the wave has nothing else in flight (llvm-project#178316),
so the platform layer adds it (``ArchTraits.release_needs_explicit_wait``); these tests compile
every catalogue kernel of the AMD targets to assembly and check every writeback.

The scan is straight-line: after a writeback, the wait must come before the next ordered
instruction, label or branch (a wait placed in another basic block does not count).

The spin-waits poll with relaxed system-scope loads and acquire once after the loop
(``ep_wait_generation``), so no loop of a gfx942 or gfx950 kernel invalidates the caches: the loop scan
finds loops by their backward branches (``s_branch`` or ``s_cbranch_*`` to an earlier label) and
checks that no ``buffer_inv`` lies between the label and the branch.

gfx1250 has its own section, "Memory Model GFX125x", whose agent- and system-scope rows also wait
before ``global_wb`` (``s_wait_loadcnt 0`` and ``s_wait_storecnt 0``: the wave's stores are in
L2 before it is written back) and after ``global_inv`` (``s_wait_loadcnt 0`` before any later
access); clang 22.1.8 emits neither, so the platform layer writes them out and
``gfx1250_cache_op_findings`` checks them on every path through the kernel (the basic blocks and
their successors, not just straight-line text).

The order scans (``epgen.codegen.offline.amd_asm.order_scan``, whose docstring states the rules)
check what comes before what on every path: each flag store, the first signal-word write after a
barrier, follows a waited system-scope writeback since that barrier (``release``); no writeback
is reached from the wave's plain stores without their wait and a block barrier (``block``); and
from every poll loop some path completes the system-scope invalidate (and, on gfx1250, its wait)
before a non-signal load or a block barrier (``acquire``). The catalogue passes them on every
AMD arch, and each fence removal of the memory-model review, applied to a small config's rendered source,
fails them on every AMD arch (``test_a_removed_fence_fails_the_order_scans``). The instruction
stream, its basic blocks and the wait predicates come from that module; the scans here build on
them.
"""

from __future__ import annotations

import functools
import re

import attrs
import pytest

from epgen.codegen import planner
from epgen.codegen.catalogue import catalogue_specs
from epgen.codegen.config import EpConfig
from epgen.codegen.offline import compile_assembly, compile_many, toolchain_status
from epgen.codegen.offline.amd_asm import (
    GFX125X, GFX942, VMEM, VMEM_STORE_OR_ATOMIC, blocks, gfx9_vmcnt_zero, gfx12_loadcnt_zero, gfx12_storecnt_zero,
    instructions, order_scan,
)
from epgen.codegen.render import render
from epgen.codegen.spec import Op

# Control flow that ends the straight-line run a writeback's wait must sit in.
_CONTROL = re.compile(r"^s_(?:branch|cbranch_\w+|setpc_b64|swappc_b64|endpgm|trap)$")


@attrs.frozen
class Rule:
    """What one target's system-scope release looks like in assembly.

    Attributes:
        arch: target name.
        writeback: mnemonic and operands of the writeback that starts a release.
        covers: ``(mnemonic, operands) -> bool``: the instruction is a wait that completes the
            writeback.
        ordered: ``(mnemonic, operands) -> bool``: the instruction must not issue before that
            wait (a system-scope store or atomic, or the invalidate of an acq_rel fence).
    """

    arch: str
    writeback: tuple[str, str]
    covers: object
    ordered: object


def _gfx9_ordered(mnemonic: str, operands: str) -> bool:
    """A store or atomic carrying ``sc1`` (GFX942: system-scope stores are ``sc0 sc1``,
    system-scope RMW atomics ``sc1``, agent scope ``sc1`` too), or the system invalidate."""
    tokens = operands.replace(",", " ").split()
    if mnemonic == "buffer_inv":
        return "sc1" in tokens
    return bool(VMEM_STORE_OR_ATOMIC.match(mnemonic)) and "sc1" in tokens


def _gfx12_ordered(mnemonic: str, operands: str) -> bool:
    """A store or atomic at ``scope:SCOPE_SYS``, or the system invalidate."""
    if "scope:SCOPE_SYS" not in operands:
        return False
    return mnemonic == "global_inv" or bool(VMEM_STORE_OR_ATOMIC.match(mnemonic))


RULES = {  # gfx942 and gfx950 both follow AMDGPUUsage's "Memory Model GFX942" table
    "gfx942": Rule("gfx942", ("buffer_wbl2", "sc0 sc1"), gfx9_vmcnt_zero, _gfx9_ordered),
    "gfx950": Rule("gfx950", ("buffer_wbl2", "sc0 sc1"), gfx9_vmcnt_zero, _gfx9_ordered),
    "gfx1250": Rule("gfx1250", ("global_wb", "scope:SCOPE_SYS"), gfx12_storecnt_zero, _gfx12_ordered),
}


@attrs.frozen
class Finding:
    """One writeback whose wait is missing: its line, and the line that came first instead."""

    line: int
    instead: str


def scan(asm: str, rule: Rule) -> tuple[int, list[Finding]]:
    """Check every system-scope writeback of ``asm`` against ``rule``.

    Returns:
        ``(covered, findings)``: how many writebacks are followed by their wait before the next
        ordered instruction, label or branch, and a ``Finding`` for each that is not (also for a
        writeback the text ends after).
    """
    covered, findings = 0, []
    pending = None
    wb_mnemonic, wb_operands = rule.writeback
    for n, mnemonic, operands in instructions(asm):
        if pending is not None:
            if rule.covers(mnemonic, operands):
                covered, pending = covered + 1, None
            elif mnemonic.endswith(":") or _CONTROL.match(mnemonic) or rule.ordered(mnemonic, operands) \
                    or mnemonic == wb_mnemonic:
                findings.append(Finding(pending, f"{mnemonic} {operands}".strip()))
                pending = None
        if mnemonic == wb_mnemonic and operands.split() == wb_operands.split():
            pending = n
    if pending is not None:
        findings.append(Finding(pending, "end of text"))
    return covered, findings


def loops(asm: str) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """The loops of ``asm`` as laid out: ``(label, body)`` for each backward branch (``s_branch``
    or ``s_cbranch_*`` to a label above it), body the instructions from the label to the branch
    (``instructions`` tuples). A loop whose blocks lie below its back branch has another back
    branch to its header, whose body covers them."""
    items = list(instructions(asm))
    where = {mnemonic[:-1]: i for i, (_, mnemonic, _) in enumerate(items) if mnemonic.endswith(":")}
    found = []
    for i, (_, mnemonic, operands) in enumerate(items):
        if mnemonic == "s_branch" or mnemonic.startswith("s_cbranch_"):
            target = operands.split()[0] if operands else ""
            if where.get(target, i) < i:
                found.append((target, items[where[target]:i + 1]))
    return found


def invalidates_in_loops(asm: str) -> list[tuple[str, int]]:
    """``(loop label, line)`` of each ``buffer_inv`` inside a loop of ``asm`` (``loops``)."""
    return [(label, n) for label, body in loops(asm) for n, mnemonic, _ in body if mnemonic == "buffer_inv"]


_STORE_OUT, _RETURN_OUT, _INV_OUT = 1, 2, 4


def gfx1250_cache_op_findings(asm: str) -> list[tuple[int, str]]:
    """Where gfx1250 code may break the GFX125x table's waits around its system-scope cache
    operations, on some path (a may-analysis over ``blocks``): ``(line, "writeback")`` for a
    ``global_wb scope:SCOPE_SYS`` issued while a vector store or atomic of the wave may be
    outstanding (no ``s_wait_storecnt 0``, or for an atomic that returns no ``s_wait_loadcnt 0``,
    since), ``(line, "after invalidate")`` for a vector memory access issued while a ``global_inv
    scope:SCOPE_SYS`` may not have completed (no ``s_wait_loadcnt 0`` since)."""
    blks, succ = blocks(list(instructions(asm)))

    def step(block, state, findings=None):
        for n, mnemonic, operands in block:
            if findings is not None:
                if mnemonic == "global_wb" and "scope:SCOPE_SYS" in operands and state & (_STORE_OUT | _RETURN_OUT):
                    findings.append((n, "writeback"))
                if VMEM.match(mnemonic) and state & _INV_OUT:
                    findings.append((n, "after invalidate"))
            if gfx12_storecnt_zero(mnemonic, operands):
                state &= ~_STORE_OUT
            if gfx12_loadcnt_zero(mnemonic, operands):
                state &= ~(_RETURN_OUT | _INV_OUT)
            if mnemonic == "global_inv" and "scope:SCOPE_SYS" in operands:
                state |= _INV_OUT
            elif VMEM_STORE_OR_ATOMIC.match(mnemonic):
                state |= _RETURN_OUT if "th:TH_ATOMIC_RETURN" in operands else _STORE_OUT
        return state

    entry = [0] * len(blks)
    changed = True
    while changed:
        changed = False
        for i, block in enumerate(blks):
            out = step(block, entry[i])
            for j in succ[i]:
                if entry[j] | out != entry[j]:
                    entry[j] |= out
                    changed = True
    findings = []
    for i, block in enumerate(blks):
        step(block, entry[i], findings)
    return findings


def assembly(text: str, arch: str, entry: str) -> str:
    """Assembly of ``text`` for ``arch`` as the offline compile builds it (``compile_assembly``)."""
    return compile_assembly(text, arch, entry)[1]


def test_scanner_flags_a_store_before_the_wait():
    bad = """
\tbuffer_wbl2 sc0 sc1
\tflat_store_dword v[2:3], v1 sc0 sc1
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt vmcnt(0) lgkmcnt(0)
\tflat_store_dword v[2:3], v1 sc0 sc1
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt lgkmcnt(0)
\tbuffer_inv sc0 sc1
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt vmcnt(1)
\tglobal_atomic_add v0, v1, s[0:1] sc1
\tbuffer_wbl2 sc0 sc1
.LBB0_3:
\ts_waitcnt vmcnt(0)
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt 0x3f70
\ts_endpgm
"""
    covered, findings = scan(bad, RULES["gfx950"])
    assert covered == 2
    assert [(f.line, f.instead) for f in findings] == [
        (2, "flat_store_dword v[2:3], v1 sc0 sc1"),
        (7, "buffer_inv sc0 sc1"),
        (10, "global_atomic_add v0, v1, s[0:1] sc1"),
        (13, ".LBB0_3:"),
    ]


def test_scanner_gfx12_rule():
    asm = """
\tglobal_wb scope:SCOPE_SYS
\ts_wait_storecnt_dscnt 0x0
\tflat_store_b32 v1, v2, s[8:9] offset:256 scope:SCOPE_SYS
\tglobal_wb scope:SCOPE_SYS
\ts_wait_storecnt_dscnt 0x100
\tflat_store_b32 v1, v2, s[8:9] scope:SCOPE_SYS
\tglobal_wb scope:SCOPE_SYS
\ts_wait_loadcnt 0x0
\tglobal_inv scope:SCOPE_SYS
"""
    covered, findings = scan(asm, RULES["gfx1250"])
    assert covered == 1
    assert [f.line for f in findings] == [5, 8]


def test_loop_scan_finds_an_invalidate_in_a_spin_loop():
    # The shape of ep_wait_generation's loop when every poll was an acquire load (gfx950, before
    # the polls became relaxed): the back edge is an s_branch below the invalidate.
    asm = """
\tflat_load_dword v6, v[4:5] sc0 sc1
\ts_waitcnt vmcnt(0) lgkmcnt(0)
\tbuffer_inv sc0 sc1
\ts_branch .LBB0_27
.LBB0_26:
\ts_andn2_b64 exec, exec, s[8:9]
\ts_cbranch_execz .LBB0_29
.LBB0_27:
\tv_cmp_lt_i32_e32 vcc, v6, v7
\ts_cbranch_vccz .LBB0_26
\ts_sleep 1
\tflat_load_dword v6, v[4:5] sc0 sc1
\ts_waitcnt vmcnt(0) lgkmcnt(0)
\tbuffer_inv sc0 sc1
\ts_branch .LBB0_26
.LBB0_29:
\tbuffer_inv sc0 sc1
\ts_endpgm
"""
    assert [label for label, _ in loops(asm)] == [".LBB0_26", ".LBB0_26"]
    assert invalidates_in_loops(asm) == [(".LBB0_26", 15)]


def test_gfx1250_cache_op_scan():
    # clang 22.1.8's release (no wait before the writeback) and acquire (no wait after the
    # invalidate); a writeback with a returning atomic outstanding (its storecnt wait does not
    # cover it) inside a loop whose back edge brings a store round to a wait that retires it;
    # then a release and an acquire with the table's waits.
    asm = """
\tglobal_store_b32 v0, v1, s[4:5]
\tglobal_wb scope:SCOPE_SYS
\ts_wait_storecnt 0x0
\tglobal_store_b32 v0, v2, s[6:7] scope:SCOPE_SYS
\tglobal_load_b32 v1, v0, s[6:7] scope:SCOPE_SYS
\ts_wait_loadcnt 0x0
\tglobal_inv scope:SCOPE_SYS
\tglobal_load_b32 v2, v0, s[4:5]
.LBB0_1:
\ts_wait_loadcnt 0x0
\tflat_atomic_add_u32 v3, v[0:1], v2 th:TH_ATOMIC_RETURN scope:SCOPE_SYS
\ts_wait_storecnt 0x0
\tglobal_wb scope:SCOPE_SYS
\ts_wait_loadcnt 0x0
\tglobal_store_b32 v0, v1, s[4:5]
\ts_cbranch_scc1 .LBB0_1
\ts_wait_loadcnt 0x0
\ts_wait_storecnt 0x0
\tglobal_wb scope:SCOPE_SYS
\ts_wait_storecnt 0x0
\tglobal_inv scope:SCOPE_SYS
\ts_wait_loadcnt 0x0
\tglobal_load_b32 v2, v0, s[4:5]
\ts_endpgm
"""
    assert gfx1250_cache_op_findings(asm) == [(3, "writeback"), (9, "after invalidate"), (14, "writeback")]


def _catalogue_assembly(compiles, arch: str) -> list[tuple[str, str]]:
    """``(entry, assembly)`` of every catalogue kernel of ``arch`` (compiled once a run: ``compiles``)."""
    reason = toolchain_status(arch)
    if reason:
        pytest.skip(reason)
    specs = catalogue_specs(arches=(arch,))
    assert specs, arch
    return [(s.name, asm) for s, asm in zip(specs, compiles.assembly(specs))]


def _check_catalogue(compiles, arch: str) -> None:
    bad = {}
    for entry, asm in _catalogue_assembly(compiles, arch):
        covered, findings = scan(asm, RULES[arch])
        # every kernel but expand, fold and the combine's quantize kernel publishes at least one
        # flag or fault record with a release (those three run between kernels of one stream and
        # signal nothing; the fold's short y is reported by the combine after it)
        if findings or (covered == 0 and not re.match(r"epgen_(expand_(?!plan)|combine_quantize_|fold_)", entry)):
            bad[entry] = dict(covered=covered, missing=len(findings),
                                  first=[(f.line, f.instead) for f in findings[:4]])
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_gfx9_catalogue_releases_wait_for_their_writeback(compiles, arch):
    """Every gfx942 and gfx950 kernel of the catalogue (every template path: both kernel families,
    every payload dtype, combine wire, layout and transport)."""
    _check_catalogue(compiles, arch)


@pytest.mark.slow
def test_gfx1250_releases_wait_for_their_writeback(compiles):
    """gfx1250's own waits, on every gfx1250 kernel of the catalogue (every template path)."""
    _check_catalogue(compiles, "gfx1250")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_gfx9_spin_loops_never_invalidate(compiles, arch):
    """No loop of a gfx942 or gfx950 catalogue kernel holds a ``buffer_inv``: the spin-waits poll
    with relaxed loads and acquire once after the loop (every kernel has a spin-wait loop)."""
    bad = {}
    for entry, asm in _catalogue_assembly(compiles, arch):
        found = invalidates_in_loops(asm)
        if found or not loops(asm):
            bad[entry] = dict(loops=len(loops(asm)), invalidates=found[:4])
    assert not bad, bad


@pytest.mark.slow
def test_gfx1250_cache_ops_wait_as_the_table_says(compiles):
    """On every path through every gfx1250 kernel of the catalogue (every payload dtype, combine
    wire, layout, transport and both families), the wave's stores complete before each system
    writeback and each system invalidate completes before the next access
    (``gfx1250_cache_op_findings``)."""
    bad = {}
    for entry, asm in _catalogue_assembly(compiles, "gfx1250"):
        found = gfx1250_cache_op_findings(asm)
        if found:
            bad[entry] = dict(count=len(found), first=found[:4])
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("arch,acquire", [("gfx942", r"buffer_inv sc0 sc1"), ("gfx950", r"buffer_inv sc0 sc1"), ("gfx1250", r"global_inv scope:SCOPE_SYS")])
def test_the_pull_dispatch_acquires_at_system_scope_before_its_first_peer_load(compiles, arch, acquire):
    """The pull kernel reads its sources' rows, published before done flags that the kernel before
    it acquired: on AMD the kernel's start acquire is agent scope, so each wave acquires at system
    scope before its first 16-byte load (``ep_acquire_published_rows``)."""
    pulls = [(entry, asm) for entry, asm in _catalogue_assembly(compiles, arch)
             if entry.startswith("epgen_dispatch_pull_")]
    assert pulls
    for entry, asm in pulls:
        body = asm[asm.index(f"{entry}:"):]
        first_load = re.search(r"^\s*(global|flat|buffer)_load_(dwordx4|b128)\b", body, re.M)
        inv = re.search(rf"^\s*{acquire}\s*$", body, re.M)
        assert first_load and inv and inv.start() < first_load.start(), entry


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_ready_flag_fan_out_costs_one_writeback_whatever_the_world_size(op):
    """The normal family's ready flags go to every rank as one release by a warp, lane d storing
    rank d's flag (``ep_release_to_ranks``), not as W releases in sequence by one thread, each
    waiting for the store before it: the kernel holds as many ``buffer_wbl2`` at W = 8 as at W = 2."""
    reason = toolchain_status("gfx950")
    if reason:
        pytest.skip(reason)
    counts = []
    for w in (2, 8):
        cfg = EpConfig(world_size=w, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=64,
                       kernel_family="normal")
        spec = planner.plan(cfg, "gfx950").variant(Op(op), 64)
        src = render(spec)
        counts.append(len(re.findall(r"^\s*buffer_wbl2\b", assembly(src.text, "gfx950", src.entry), re.M)))
    assert counts[0] == counts[1], counts


ORDER_MODELS = {"gfx942": GFX942, "gfx950": GFX942, "gfx1250": GFX125X}
"""The AMDGPUUsage memory-model table each AMD arch follows, as ``order_scan`` reads it."""


def _violations(asm: str, model) -> list[tuple[str, int, str, int]]:
    return [(v.rule, v.line, v.instruction, v.since) for v in order_scan(asm, model).violations]


def test_order_scan_release_rule():
    """A flag store (the first signal-word write after a barrier, not the kernel's last access)
    needs a waited writeback since that barrier; a write after a claim or a data store, or one
    that ends the kernel, is not a flag store."""
    asm = """
\t; wave barrier
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt vmcnt(0)
\tglobal_load_dwordx2 v[6:7], v[2:3], off
\tflat_store_dword v[6:7], v4 sc0 sc1
\ts_barrier
\tflat_store_dword v[6:7], v4 sc0 sc1
\ts_barrier
\tflat_atomic_cmpswap v5, v[10:11], v[4:5] sc0 sc1
\tflat_store_dword v[10:11], v7 offset:4 sc0 sc1
\ts_barrier
\tbuffer_wbl2 sc0 sc1
\tflat_store_dword v[6:7], v4 sc0 sc1
\ts_waitcnt vmcnt(0)
\ts_barrier
\tflat_atomic_umax_x2 v[10:11], v[6:7] sc1
\tflat_load_dword v1, v[4:5]
\ts_barrier
\tflat_store_dword v[0:1], v2 offset:48 sc0 sc1
\ts_endpgm
"""
    found = order_scan(asm, GFX942)
    assert _violations(asm, GFX942) == [
        ("release", 8, "flat_store_dword v[6:7], v4 sc0 sc1", 7),
        ("release", 14, "flat_store_dword v[6:7], v4 sc0 sc1", 12),
        ("release", 17, "flat_atomic_umax_x2 v[10:11], v[6:7] sc1", 16),
    ]
    assert found.flag_stores == 4
    assert "flag store with no waited system-scope writeback since the barrier at line 7" in str(found.violations[0])


def test_order_scan_block_rule():
    """A writeback that the wave's plain store reaches needs the store's wait, then a block barrier
    (or a claim) between them."""
    asm = """
\tflat_store_dwordx4 v[0:1], v[2:5]
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt vmcnt(0)
\tflat_store_dwordx4 v[0:1], v[2:5]
\ts_barrier
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt vmcnt(0)
\ts_barrier
\tbuffer_wbl2 sc0 sc1
\ts_waitcnt vmcnt(0)
\tflat_store_dword v[0:1], v2
\tflat_atomic_cmpswap v5, v[10:11], v[4:5] sc0 sc1
\ts_waitcnt vmcnt(0)
\tbuffer_wbl2 sc0 sc1
\ts_endpgm
"""
    assert _violations(asm, GFX942) == [("block", 3, "buffer_wbl2 sc0 sc1", 2),
                                        ("block", 7, "buffer_wbl2 sc0 sc1", 5)]
    gfx12 = """
\tglobal_store_b128 v0, v[2:5], s[0:1]
\ts_barrier_signal -1
\ts_barrier_wait -1
\tglobal_wb scope:SCOPE_SYS
\ts_wait_storecnt 0x0
\ts_barrier_signal -1
\ts_barrier_wait -1
\tglobal_wb scope:SCOPE_SYS
\ts_endpgm
"""
    assert _violations(gfx12, GFX125X) == [("block", 5, "global_wb scope:SCOPE_SYS", 2)]


def test_order_scan_acquire_rule():
    """From a poll loop, some path completes the system-scope acquire before a non-signal load or
    a block barrier: gfx942's invalidate once the loads completed, gfx1250's invalidate and the
    wait after it."""
    def poll(after: str, gfx12: bool = False) -> str:
        load, wait = ("scope:SCOPE_SYS", "s_wait_loadcnt 0x0") if gfx12 else ("sc0 sc1", "s_waitcnt vmcnt(0)")
        return (f".LBB0_1:\n\tflat_load_dword v1, v[4:5] {load}\n\t{wait}\n\ts_cbranch_vccz .LBB0_1\n"
                f"{after}\tflat_load_dwordx4 v[6:9], v[10:11] nt\n\ts_endpgm\n")

    assert _violations(poll("\ts_waitcnt vmcnt(0)\n\tbuffer_inv sc0 sc1\n"), GFX942) == []
    assert _violations(poll(""), GFX942) == [("acquire", 5, "flat_load_dwordx4 v[6:9], v[10:11] nt", 2)]
    # an invalidate while a load is in flight does not acquire it
    assert _violations(poll("\tflat_load_dword v2, v[4:5] sc0 sc1\n\tbuffer_inv sc0 sc1\n"), GFX942) == [
        ("acquire", 7, "flat_load_dwordx4 v[6:9], v[10:11] nt", 2)]
    assert _violations(poll("\ts_barrier\n\ts_waitcnt vmcnt(0)\n\tbuffer_inv sc0 sc1\n"), GFX942) == [
        ("acquire", 5, "s_barrier", 2)]
    assert _violations(poll("\tglobal_inv scope:SCOPE_SYS\n\ts_wait_loadcnt 0x0\n", gfx12=True), GFX125X) == []
    found = order_scan(poll("\tglobal_inv scope:SCOPE_SYS\n", gfx12=True), GFX125X)
    assert [(v.rule, v.line) for v in found.violations] == [("acquire", 6)] and found.poll_loops == 1
    assert "non-signal load after the poll loop of line 2" in str(found.violations[0])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx1250"])
def test_the_catalogue_passes_the_order_scans(compiles, arch):
    """Every AMD catalogue kernel (every template path) passes ``order_scan``, and the scan checked
    something: a flag store in each kernel that raises flags, a poll loop in each that waits."""
    bad = {}
    for entry, asm in _catalogue_assembly(compiles, arch):
        found = order_scan(asm, ORDER_MODELS[arch])
        raises = re.match(r"epgen_(?:dispatch|combine)(?:_ll)?(?:_send)?_gfx|epgen_dispatch_pull_", entry)
        polls = re.match(r"epgen_(?:dispatch|combine)(?:_ll)?(?:_recv)?_gfx|epgen_dispatch_pull_", entry)
        if found.violations or (raises and not found.flag_stores) or (polls and not found.poll_loops):
            bad[entry] = dict(violations=[str(v) for v in found.violations[:4]], flag_stores=found.flag_stores,
                              poll_loops=found.poll_loops)
    assert not bad, bad


def _drop_fan_out_release(text: str) -> str:
    """Item 6 (a): no release before the fan-out's flag stores (``ep_release_to_ranks``)."""
    return re.sub(r"(EP_DEVICE void ep_release_to_ranks\([^{]*\{[^}]*?)\n[ \t]*ep_fence_release_system\(\);", r"\1",
                  text, count=1)


def _drop_low_latency_acquire(text: str) -> str:
    """Item 6 (b): no acquire after the low-latency polls."""
    return re.sub(r"\n[ \t]*if \(tid < kFlags\) ep_fence_after_poll\(\);[^\n]*", "", text, count=1)


def _drop_low_latency_barrier(text: str) -> str:
    """Item 6 (c): no block barrier before the low-latency flags."""
    return re.sub(r"\n[ \t]*ep_sync_block_for_release\(\);[^\n]*", "", text, count=1)


FENCE_REMOVALS = {  # mutation -> (edit, the ops whose code it changes, the rule it breaks, the instruction named)
    "fan_out_release": (_drop_fan_out_release, ("dispatch", "combine"), "release",
                        r"(flat|global)_store_(dword|b32)\b"),
    "low_latency_acquire": (_drop_low_latency_acquire, ("dispatch_ll", "combine_ll"), "acquire",
                            r"s_barrier(_signal)?\b|(flat|global)_load"),
    "low_latency_barrier": (_drop_low_latency_barrier, ("dispatch_ll", "combine_ll"), "block",
                            r"buffer_wbl2 sc0 sc1$|global_wb scope:SCOPE_SYS$"),
}
"""The memory-model review's fence removals, as text edits of a rendered source."""


@functools.lru_cache(maxsize=None)
def _fence_removal_assembly(arch: str) -> dict[tuple[str, str | None], str]:
    """``{(op, mutation or None): assembly}`` of a small config's kernels on ``arch``, as rendered
    and with each fence removal that applies to the op (one parallel compile)."""
    jobs, keys = [], []
    for family, ops in (("normal", ("dispatch", "combine")), ("low_latency", ("dispatch_ll", "combine_ll"))):
        cfg = EpConfig(world_size=2, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=64,
                       kernel_family=family)
        for op in ops:
            src = render(planner.plan(cfg, arch).variant(Op(op), 64))
            keys.append((op, None))
            jobs.append((src.text, arch, src.entry))
            for name, (edit, applies, _, _) in FENCE_REMOVALS.items():
                if op in applies:
                    text = edit(src.text)
                    assert len(text.splitlines()) == len(src.text.splitlines()) - 1, (name, op)  # one line removed
                    keys.append((op, name))
                    jobs.append((text, arch, src.entry))
    results = compile_many(jobs, compile_fn=compile_assembly)
    for key, result in zip(keys, results):
        if isinstance(result, Exception):
            raise result
    return {key: result[1] for key, result in zip(keys, results)}


@pytest.mark.parametrize("mutation", list(FENCE_REMOVALS))
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx1250"])
def test_a_removed_fence_fails_the_order_scans(arch, mutation):
    """Each fence removal of the memory-model review, applied to the rendered source of a small config,
    changes the assembly of every op it edits on every AMD arch and fails ``order_scan`` there
    with the rule it breaks, naming the instruction (the unedited sources pass)."""
    reason = toolchain_status(arch)
    if reason:
        pytest.skip(reason)
    asm = _fence_removal_assembly(arch)
    _, ops, rule, instruction = FENCE_REMOVALS[mutation]
    for op in ops:
        assert order_scan(asm[op, None], ORDER_MODELS[arch]).violations == (), (op, "unedited")
        assert asm[op, mutation] != asm[op, None], (op, "the edit leaves the assembly as it was")
        found = [v for v in order_scan(asm[op, mutation], ORDER_MODELS[arch]).violations if v.rule == rule]
        assert found and all(re.match(instruction, v.instruction) for v in found), (op, [str(v) for v in found])
