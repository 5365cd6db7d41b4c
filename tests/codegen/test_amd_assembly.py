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
"""

from __future__ import annotations

import re

import attrs
import pytest

from epgen.codegen.catalogue import catalogue_specs
from epgen.codegen.offline import compile_assembly, toolchain_status
from epgen.codegen.render import render

# VMEM stores and atomics, the instructions a release orders after its writeback.
_STORE_OR_ATOMIC = re.compile(r"^(?:global|flat|buffer|scratch)_(?:store|atomic)\w*$")
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


def _gfx9_vmcnt_zero(mnemonic: str, operands: str) -> bool:
    """``s_waitcnt`` that waits for vmcnt 0: ``vmcnt(0)`` among its fields, or a raw immediate
    whose vmcnt bits (3:0 and 15:14 on GFX9) are all zero."""
    if mnemonic != "s_waitcnt":
        return False
    field = re.search(r"vmcnt\((\d+)\)", operands)
    if field is not None:
        return int(field.group(1)) == 0
    if re.fullmatch(r"\s*(?:0x[0-9a-fA-F]+|\d+)\s*", operands):
        imm = int(operands, 0)
        return (imm & 0xF) == 0 and (imm >> 14) & 0x3 == 0
    return False


def _gfx9_ordered(mnemonic: str, operands: str) -> bool:
    """A store or atomic carrying ``sc1`` (GFX942: system-scope stores are ``sc0 sc1``,
    system-scope RMW atomics ``sc1``, agent scope ``sc1`` too), or the system invalidate."""
    tokens = operands.replace(",", " ").split()
    if mnemonic == "buffer_inv":
        return "sc1" in tokens
    return bool(_STORE_OR_ATOMIC.match(mnemonic)) and "sc1" in tokens


def _gfx12_storecnt_zero(mnemonic: str, operands: str) -> bool:
    """``s_wait_storecnt 0`` or ``s_wait_storecnt_dscnt`` whose storecnt field (bits 13:8) is 0."""
    if mnemonic not in ("s_wait_storecnt", "s_wait_storecnt_dscnt"):
        return False
    imm = int(operands.strip(), 0)
    return imm == 0 if mnemonic == "s_wait_storecnt" else (imm >> 8) & 0x3F == 0


def _gfx12_ordered(mnemonic: str, operands: str) -> bool:
    """A store or atomic at ``scope:SCOPE_SYS``, or the system invalidate."""
    if "scope:SCOPE_SYS" not in operands:
        return False
    return mnemonic == "global_inv" or bool(_STORE_OR_ATOMIC.match(mnemonic))


RULES = {  # gfx942 and gfx950 both follow AMDGPUUsage's "Memory Model GFX942" table
    "gfx942": Rule("gfx942", ("buffer_wbl2", "sc0 sc1"), _gfx9_vmcnt_zero, _gfx9_ordered),
    "gfx950": Rule("gfx950", ("buffer_wbl2", "sc0 sc1"), _gfx9_vmcnt_zero, _gfx9_ordered),
    "gfx1250": Rule("gfx1250", ("global_wb", "scope:SCOPE_SYS"), _gfx12_storecnt_zero, _gfx12_ordered),
}


@attrs.frozen
class Finding:
    """One writeback whose wait is missing: its line, and the line that came first instead."""

    line: int
    instead: str


def _instructions(asm: str):
    """``(line number, mnemonic, operands)`` of each instruction, and ``(n, label, "")`` of each
    label (mnemonic ending in ``:``); comments and directives dropped."""
    for n, raw in enumerate(asm.splitlines(), 1):
        text = raw.split(";", 1)[0].strip()
        if not text or text.startswith("."):
            if text.endswith(":"):
                yield n, text, ""
            continue
        if text.endswith(":"):
            yield n, text, ""
            continue
        mnemonic, _, operands = text.partition(" ")
        yield n, mnemonic, operands.strip()


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
    for n, mnemonic, operands in _instructions(asm):
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
    (``_instructions`` tuples). A loop whose blocks lie below its back branch has another back
    branch to its header, whose body covers them."""
    items = list(_instructions(asm))
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


_VMEM = re.compile(r"^(?:global|flat|buffer|scratch)_(?:load|store|atomic)\w*$")


def _gfx12_loadcnt_zero(mnemonic: str, operands: str) -> bool:
    """``s_wait_loadcnt 0`` or ``s_wait_loadcnt_dscnt`` whose loadcnt field (bits 13:8) is 0."""
    if mnemonic not in ("s_wait_loadcnt", "s_wait_loadcnt_dscnt"):
        return False
    imm = int(operands.strip(), 0)
    return imm == 0 if mnemonic == "s_wait_loadcnt" else (imm >> 8) & 0x3F == 0


def _blocks(asm: str) -> tuple[list[list[tuple[int, str, str]]], list[list[int]]]:
    """The basic blocks of ``asm`` as laid out and each one's successors (indices): a block starts
    at a label and ends before the next label or after a branch; ``s_branch``, ``s_endpgm`` and
    ``s_setpc_b64`` do not fall through."""
    blocks, names, current = [], {}, []
    for n, mnemonic, operands in _instructions(asm):
        if mnemonic.endswith(":"):
            blocks.append(current)
            names[mnemonic[:-1]] = len(blocks)
            current = []
            continue
        current.append((n, mnemonic, operands))
        if mnemonic in ("s_branch", "s_endpgm", "s_setpc_b64") or mnemonic.startswith("s_cbranch_"):
            blocks.append(current)
            current = []
    blocks.append(current)
    succ = []
    for i, block in enumerate(blocks):
        last = block[-1][1] if block else ""
        targets = []
        if last == "s_branch" or last.startswith("s_cbranch_"):
            target = block[-1][2].split()[0]
            if target in names:
                targets.append(names[target])
        if last not in ("s_branch", "s_endpgm", "s_setpc_b64") and i + 1 < len(blocks):
            targets.append(i + 1)
        succ.append(targets)
    return blocks, succ


_STORE_OUT, _RETURN_OUT, _INV_OUT = 1, 2, 4


def gfx1250_cache_op_findings(asm: str) -> list[tuple[int, str]]:
    """Where gfx1250 code may break the GFX125x table's waits around its system-scope cache
    operations, on some path (a may-analysis over ``_blocks``): ``(line, "writeback")`` for a
    ``global_wb scope:SCOPE_SYS`` issued while a vector store or atomic of the wave may be
    outstanding (no ``s_wait_storecnt 0``, or for an atomic that returns no ``s_wait_loadcnt 0``,
    since), ``(line, "after invalidate")`` for a vector memory access issued while a ``global_inv
    scope:SCOPE_SYS`` may not have completed (no ``s_wait_loadcnt 0`` since)."""
    blocks, succ = _blocks(asm)

    def step(block, state, findings=None):
        for n, mnemonic, operands in block:
            if findings is not None:
                if mnemonic == "global_wb" and "scope:SCOPE_SYS" in operands and state & (_STORE_OUT | _RETURN_OUT):
                    findings.append((n, "writeback"))
                if _VMEM.match(mnemonic) and state & _INV_OUT:
                    findings.append((n, "after invalidate"))
            if _gfx12_storecnt_zero(mnemonic, operands):
                state &= ~_STORE_OUT
            if _gfx12_loadcnt_zero(mnemonic, operands):
                state &= ~(_RETURN_OUT | _INV_OUT)
            if mnemonic == "global_inv" and "scope:SCOPE_SYS" in operands:
                state |= _INV_OUT
            elif _STORE_OR_ATOMIC.match(mnemonic):
                state |= _RETURN_OUT if "th:TH_ATOMIC_RETURN" in operands else _STORE_OUT
        return state

    entry = [0] * len(blocks)
    changed = True
    while changed:
        changed = False
        for i, block in enumerate(blocks):
            out = step(block, entry[i])
            for j in succ[i]:
                if entry[j] | out != entry[j]:
                    entry[j] |= out
                    changed = True
    findings = []
    for i, block in enumerate(blocks):
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


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_gfx9_catalogue_releases_wait_for_their_writeback(compiles, arch):
    """Every gfx942 and gfx950 kernel of the catalogue (every template path: both kernel families,
    every payload dtype, combine wire, layout and transport)."""
    _check_catalogue(compiles, arch)


def test_gfx1250_releases_wait_for_their_writeback(compiles):
    """gfx1250's own waits, on every gfx1250 kernel of the catalogue (every template path)."""
    _check_catalogue(compiles, "gfx1250")


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
    from epgen.codegen.config import EpConfig
    from epgen.codegen.spec import Op

    reason = toolchain_status("gfx950")
    if reason:
        pytest.skip(reason)
    counts = []
    for w in (2, 8):
        cfg = EpConfig(world_size=w, hidden=2048, topk=4, num_experts=16, max_tokens_per_rank=64,
                       kernel_family="normal")
        spec = cfg.spec("gfx950", Op(op), cfg.geometry("gfx950", Op(op), 64))
        src = render(spec)
        counts.append(len(re.findall(r"^\s*buffer_wbl2\b", assembly(src.text, "gfx950", src.entry), re.M)))
    assert counts[0] == counts[1], counts
