"""The instruction stream of an AMD compile's assembly, and the memory-order scans over it.

``instructions`` reads clang's AMDGPU assembly (``compile_assembly``) into ``(line, mnemonic,
operands)`` tuples, ``functions`` splits it into kernels, ``blocks`` into basic blocks with their
successors; tests/codegen/test_amd_assembly.py builds its release and cache-operation scans on
them, and ``order_violations`` checks, on every path through every kernel, that the signal
protocol's releases and acquires come in the order LLVM's AMDGPU memory model prescribes.

The code sequences are those of LLVM AMDGPUUsage's memory-model tables: "Memory Model GFX942"
(``GFX942``, which gfx942 and gfx950 follow) and "Memory Model GFX125x" (``GFX125X``, gfx1250).

* A system-scope release ("fence release" / "store atomic release", system): GFX942
  ``buffer_wbl2 sc0=1 sc1=1``, then ``s_waitcnt vmcnt(0)`` (the table's ``lgkmcnt(0) &
  vmcnt(0)``; vmcnt is the one that covers the writeback and the wave's stores), then the
  releasing store or atomic; GFX125x ``global_wb scope:SCOPE_SYS``, then ``s_wait_storecnt 0``,
  then the store.
* A system-scope acquire after a relaxed load that saw a release ("fence acquire", system):
  GFX942 ``s_waitcnt vmcnt(0)`` (the load has completed), then ``buffer_inv sc0=1 sc1=1``, which
  "must happen before any following global/generic load" (the L1 and the L2's MTYPE NC lines
  would be stale); GFX125x the load's ``s_wait_loadcnt 0``, ``global_inv scope:SCOPE_SYS``, then
  ``s_wait_loadcnt 0`` before any later access.
* The cache bits that say "system scope": GFX942 stores and loads carry ``sc0 sc1``; its
  read-modify-write atomics bypass the L1 and use ``sc1`` alone for system scope, ``sc0`` saying
  that the atomic returns the old value (AMDGPUUsage, GFX942 memory-model notes; reviews.llvm.org
  D121397). GFX125x writes the scope out (``scope:SCOPE_SYS``) and marks a returning atomic
  ``th:TH_ATOMIC_RETURN``.
* A block barrier is ``s_barrier`` (GFX942) or ``s_barrier_signal`` / ``s_barrier_wait``
  (GFX125x); ``__builtin_amdgcn_wave_barrier`` (``ep_sync_warp``) emits no instruction, only
  the comment ``; wave barrier``, which ``instructions`` keeps as the pseudo-mnemonic
  ``wave_barrier``.

``order_scan`` states its three rules (``release``, ``block``, ``acquire``) and why each is
drawn where it is; ``GFX942`` and ``GFX125X`` say how each table spells the instructions they
read. A scan reads vector memory only: scalar loads (kernel arguments, through the scalar cache,
which the tables use for constant data only) and LDS accesses take no part.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import attrs

__all__ = [
    "GFX125X", "GFX942", "VMEM", "VMEM_STORE_OR_ATOMIC", "Instruction", "MemoryModel", "OrderScan", "Violation",
    "blocks", "functions", "gfx9_vmcnt_zero", "gfx12_loadcnt_zero", "gfx12_storecnt_zero", "instructions",
    "order_scan", "order_violations",
]

Instruction = tuple[int, str, str]
"""``(line number, mnemonic, operands)``; a label is ``(line, "name:", "")``."""

WAVE_BARRIER = "wave_barrier"
"""The pseudo-mnemonic ``instructions`` gives clang's ``; wave barrier`` comment."""

VMEM = re.compile(r"^(?:global|flat|buffer|scratch)_(?:load|store|atomic)\w*$")
"""A vector memory access (load, store or atomic)."""
VMEM_STORE_OR_ATOMIC = re.compile(r"^(?:global|flat|buffer|scratch)_(?:store|atomic)\w*$")
VMEM_STORE = re.compile(r"^(?:global|flat|buffer|scratch)_store\w*$")
VMEM_LOAD = re.compile(r"^(?:global|flat|buffer|scratch)_load\w*$")
VMEM_ATOMIC = re.compile(r"^(?:global|flat|buffer|scratch)_atomic\w*$")
_NO_FALL_THROUGH = ("s_branch", "s_endpgm", "s_setpc_b64")


def instructions(asm: str) -> Iterator[Instruction]:
    """``(line number, mnemonic, operands)`` of each instruction of ``asm``, ``(n, label, "")`` of
    each label (mnemonic ending in ``:``) and ``(n, "wave_barrier", "")`` of each ``; wave
    barrier`` comment; other comments and directives dropped."""
    for n, raw in enumerate(asm.splitlines(), 1):
        text, _, comment = raw.partition(";")
        text = text.strip()
        if not text:
            if comment.strip() == "wave barrier":
                yield n, WAVE_BARRIER, ""
            continue
        if text.endswith(":"):
            yield n, text, ""
            continue
        if text.startswith("."):
            continue
        mnemonic, _, operands = text.partition(" ")
        yield n, mnemonic, operands.strip()


def functions(asm: str) -> list[tuple[str, list[Instruction]]]:
    """``(name, instructions)`` of each function (kernel) of ``asm``: from its symbol's label
    (``name:``, declared ``.type name,@function``) to the end of its code (``.Lfunc_end*:``)."""
    declared = set(re.findall(r"^\s*\.type\s+([\w.$]+)\s*,\s*@function", asm, re.M))
    out, current = [], None
    for ins in instructions(asm):
        mnemonic = ins[1]
        if mnemonic.endswith(":") and mnemonic[:-1] in declared:
            current = (mnemonic[:-1], [])
            out.append(current)
        elif mnemonic.startswith(".Lfunc_end"):
            current = None
        elif current is not None:
            current[1].append(ins)
    return out


def blocks(items: list[Instruction]) -> tuple[list[list[Instruction]], list[list[int]]]:
    """The basic blocks of ``items`` as laid out and each one's successors (indices): a block
    starts at a label and ends before the next label or after a branch; ``s_branch``,
    ``s_endpgm`` and ``s_setpc_b64`` do not fall through. Block 0 is what precedes the first
    label (the entry)."""
    out, names, current = [], {}, []
    for n, mnemonic, operands in items:
        if mnemonic.endswith(":"):
            out.append(current)
            names[mnemonic[:-1]] = len(out)
            current = []
            continue
        current.append((n, mnemonic, operands))
        if mnemonic in _NO_FALL_THROUGH or mnemonic.startswith("s_cbranch_"):
            out.append(current)
            current = []
    out.append(current)
    succ = []
    for i, block in enumerate(out):
        last = block[-1][1] if block else ""
        targets = []
        if last == "s_branch" or last.startswith("s_cbranch_"):
            target = block[-1][2].split()[0]
            if target in names:
                targets.append(names[target])
        if last not in _NO_FALL_THROUGH and i + 1 < len(out):
            targets.append(i + 1)
        succ.append(targets)
    return out, succ


def gfx9_vmcnt_zero(mnemonic: str, operands: str) -> bool:
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


def gfx12_storecnt_zero(mnemonic: str, operands: str) -> bool:
    """``s_wait_storecnt 0`` or ``s_wait_storecnt_dscnt`` whose storecnt field (bits 13:8) is 0."""
    if mnemonic not in ("s_wait_storecnt", "s_wait_storecnt_dscnt"):
        return False
    imm = int(operands.strip(), 0)
    return imm == 0 if mnemonic == "s_wait_storecnt" else (imm >> 8) & 0x3F == 0


def gfx12_loadcnt_zero(mnemonic: str, operands: str) -> bool:
    """``s_wait_loadcnt 0`` or ``s_wait_loadcnt_dscnt`` whose loadcnt field (bits 13:8) is 0."""
    if mnemonic not in ("s_wait_loadcnt", "s_wait_loadcnt_dscnt"):
        return False
    imm = int(operands.strip(), 0)
    return imm == 0 if mnemonic == "s_wait_loadcnt" else (imm >> 8) & 0x3F == 0


def _tokens(operands: str) -> list[str]:
    return operands.replace(",", " ").split()


@attrs.frozen
class MemoryModel:
    """How one AMDGPUUsage memory-model table spells the operations ``order_violations`` reads.

    Attributes:
        name: the table ("GFX942", "GFX125x").
        system: ``(mnemonic, operands) -> bool``: a VMEM access at system scope.
        returns: ``(mnemonic, operands) -> bool``: an atomic that returns the old value.
        writeback: ``(mnemonic, operands) -> bool``: the release's system-scope L2 writeback.
        invalidate: ``(mnemonic, operands) -> bool``: the acquire's system-scope invalidate.
        stores_done: ``(mnemonic, operands) -> bool``: a wait after which the wave's stores (and
            a writeback) have completed.
        loads_done: ``(mnemonic, operands) -> bool``: a wait after which the wave's loads (and
            returning atomics, and an invalidate) have completed.
        barriers: the block barrier's mnemonics.
        invalidate_waits: the acquire also waits after its invalidate (GFX125x: ``s_wait_loadcnt
            0`` before any later access).
    """

    name: str
    system: Callable[[str, str], bool]
    returns: Callable[[str, str], bool]
    writeback: Callable[[str, str], bool]
    invalidate: Callable[[str, str], bool]
    stores_done: Callable[[str, str], bool]
    loads_done: Callable[[str, str], bool]
    barriers: tuple[str, ...]
    invalidate_waits: bool


def _gfx9_system(mnemonic: str, operands: str) -> bool:
    tokens = _tokens(operands)
    if VMEM_ATOMIC.match(mnemonic):
        return "sc1" in tokens
    return bool(VMEM.match(mnemonic)) and "sc0" in tokens and "sc1" in tokens


GFX942 = MemoryModel(
    name="GFX942",
    system=_gfx9_system,
    returns=lambda m, o: bool(VMEM_ATOMIC.match(m)) and "sc0" in _tokens(o),
    writeback=lambda m, o: m == "buffer_wbl2" and {"sc0", "sc1"} <= set(_tokens(o)),
    invalidate=lambda m, o: m == "buffer_inv" and {"sc0", "sc1"} <= set(_tokens(o)),
    stores_done=gfx9_vmcnt_zero,
    loads_done=gfx9_vmcnt_zero,
    barriers=("s_barrier",),
    invalidate_waits=False,
)
"""gfx942 and gfx950 (AMDGPUUsage "Memory Model GFX942"): one counter, vmcnt, for loads, stores
and the cache operations."""

GFX125X = MemoryModel(
    name="GFX125x",
    system=lambda m, o: bool(VMEM.match(m)) and "scope:SCOPE_SYS" in _tokens(o),
    returns=lambda m, o: bool(VMEM_ATOMIC.match(m)) and "th:TH_ATOMIC_RETURN" in _tokens(o),
    writeback=lambda m, o: m == "global_wb" and "scope:SCOPE_SYS" in _tokens(o),
    invalidate=lambda m, o: m == "global_inv" and "scope:SCOPE_SYS" in _tokens(o),
    stores_done=gfx12_storecnt_zero,
    loads_done=gfx12_loadcnt_zero,
    barriers=("s_barrier", "s_barrier_signal", "s_barrier_wait"),
    invalidate_waits=True,
)
"""gfx1250 (AMDGPUUsage "Memory Model GFX125x"): storecnt for stores and ``global_wb``, loadcnt
for loads, returning atomics and ``global_inv``."""


@attrs.frozen
class Violation:
    """One instruction that breaks a rule of ``order_violations``.

    Attributes:
        kernel: the function it is in.
        line: its line in the assembly.
        instruction: mnemonic and operands.
        rule: ``release``, ``block`` or ``acquire`` (``order_violations`` states them).
        since: the line the rule measures from: the barrier (``release``), the plain store
            (``block``), the poll loop's system-scope load (``acquire``).
    """

    kernel: str
    line: int
    instruction: str
    rule: str
    since: int

    def __str__(self) -> str:
        if self.rule == "release":
            what = f"flag store with no waited system-scope writeback since the barrier at line {self.since}"
        elif self.rule == "block":
            what = (f"system-scope writeback that the plain store at line {self.since} reaches with no store wait "
                    "and block barrier between")
        else:
            first = "block barrier" if self.instruction.startswith("s_barrier") else "non-signal load"
            what = (f"{first} after the poll loop of line {self.since}, which no path from the loop precedes with "
                    "the system-scope invalidate and its wait")
        return f"{self.kernel}:{self.line}: {self.instruction}: {what}"


# What an instruction does, for the scans (``_effects``): bits.
_BLOCK_BARRIER = 1      # s_barrier, s_barrier_signal: the block synchronizes
_ARM = 2                # any barrier, the wave barrier and s_barrier_wait too: a flag may follow
_WRITEBACK = 4          # the release's system-scope writeback
_STORES_DONE = 8        # a wait that completes the wave's stores and writebacks
_LOADS_DONE = 16        # a wait that completes the wave's loads, returning atomics and invalidates
_DISARM = 32            # a plain store or atomic, or a read of a signal word (load, returning atomic)
_DATA = 64              # a plain (not system-scope) store
_CLAIM = 128            # a returning system-scope atomic
_FLAG = 256             # a system-scope store or non-returning system-scope atomic
_VMEM = 512             # any vector memory access
_DATA_LOAD = 1024       # a load that is not system-scope
_LOAD_ISSUE = 2048      # a load or returning atomic (counted until a loads-done wait)
_INVALIDATE = 4096      # the acquire's system-scope invalidate
_SIGNAL_LOAD = 8192     # a system-scope load


def _effects(mnemonic: str, operands: str, model: MemoryModel) -> int:
    if mnemonic == WAVE_BARRIER or mnemonic == "s_barrier_wait" and mnemonic in model.barriers:
        return _ARM
    if mnemonic in model.barriers:
        return _ARM | _BLOCK_BARRIER
    bits = 0
    if model.writeback(mnemonic, operands):
        bits |= _WRITEBACK
    if model.invalidate(mnemonic, operands):
        bits |= _INVALIDATE
    if model.stores_done(mnemonic, operands):
        bits |= _STORES_DONE
    if model.loads_done(mnemonic, operands):
        bits |= _LOADS_DONE
    if VMEM.match(mnemonic):
        bits |= _VMEM
        system = model.system(mnemonic, operands)
        if VMEM_LOAD.match(mnemonic):
            bits |= _LOAD_ISSUE | (_SIGNAL_LOAD | _DISARM if system else _DATA_LOAD)
        elif VMEM_ATOMIC.match(mnemonic) and model.returns(mnemonic, operands):
            bits |= _LOAD_ISSUE | _DISARM | (_CLAIM if system else 0)
        elif system:
            bits |= _FLAG
        else:
            bits |= _DISARM | (_DATA if VMEM_STORE.match(mnemonic) else 0)
    return bits


def _ops(block: list[Instruction], model: MemoryModel) -> list[tuple[Instruction, int]]:
    """The instructions of ``block`` that the scans read, with their ``_effects``."""
    out = []
    for ins in block:
        bits = _effects(ins[1], ins[2], model)
        if bits:
            out.append((ins, bits))
    return out


# The path state of the release and block rules: (barrier line while armed else 0, released since
# that barrier, writeback issued and not yet waited, line of a plain store not yet waited for and
# followed by a block barrier else 0, plain store not yet waited for).
_START = (0, False, False, 0, False)


def _step(s: tuple, n: int, bits: int) -> tuple:
    armed, released, wb_pending, data_at, data_out = s
    if bits & _ARM:
        if bits & _BLOCK_BARRIER and not data_out:
            data_at = 0
        return n, False, False, data_at, data_out  # a writeback before the barrier releases nothing after it
    if bits & _WRITEBACK:
        wb_pending = True
    if bits & _STORES_DONE:
        released, wb_pending, data_out = released or wb_pending, False, False
    if bits & _DISARM:
        armed = 0
    if bits & _DATA:
        data_at, data_out = n, True
    if bits & _CLAIM:  # the wave writes its own record next (ep_report)
        data_at, data_out = 0, False
    return armed, released, wb_pending, data_at, data_out


def _reaches_vmem(ops: list[list[tuple[Instruction, int]]], succ: list[list[int]]) -> list[bool]:
    """Per block: a vector memory access lies in it or on some path after it."""
    out = [any(bits & _VMEM for _, bits in block) for block in ops]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops)):
            if not out[i] and any(out[j] for j in succ[i]):
                out[i] = changed = True
    return out


def _dominators(succ: list[list[int]]) -> tuple[set[int], dict[int, set[int]], list[list[int]]]:
    """The blocks reachable from the entry, each one's dominators, and each block's predecessors."""
    preds = [[] for _ in succ]
    for i, targets in enumerate(succ):
        for j in targets:
            preds[j].append(i)
    reachable, todo = {0}, [0]
    while todo:
        for j in succ[todo.pop()]:
            if j not in reachable:
                reachable.add(j)
                todo.append(j)
    dom = {i: set(reachable) for i in reachable}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for i in sorted(reachable - {0}):
            new = set.intersection(*(dom[p] for p in preds[i] if p in reachable)) | {i}
            if new != dom[i]:
                dom[i], changed = new, True
    return reachable, dom, preds


def _poll_loops(ops: list[list[tuple[Instruction, int]]], succ: list[list[int]]) -> list[tuple[int, set[int]]]:
    """``(line of its first system-scope load, blocks)`` of each natural loop of the CFG (a back
    edge goes to a block that dominates its source) whose blocks hold a system-scope load."""
    reachable, dom, preds = _dominators(succ)
    out = []
    for i in sorted(reachable):
        for h in succ[i]:
            if h not in dom[i]:
                continue
            body, todo = {h, i}, [i] if i != h else []
            while todo:
                for p in preds[todo.pop()]:
                    if p not in body and p in reachable:
                        body.add(p)
                        todo.append(p)
            polls = [ins[0] for b in body for ins, bits in ops[b] if bits & _SIGNAL_LOAD]
            if polls:
                out.append((min(polls), body))
    return out


def _load_out(load_out: bool, bits: int) -> bool:
    """Whether a load or returning atomic of the wave may be outstanding after an instruction."""
    return (load_out and not bits & _LOADS_DONE) or bool(bits & _LOAD_ISSUE)


def _loads_out(ops: list[list[tuple[Instruction, int]]], succ: list[list[int]]) -> list[bool]:
    """Per block: a load may be outstanding at its end, on some path from the entry."""
    entry, out = [False] * len(ops), [False] * len(ops)
    changed = True
    while changed:
        changed = False
        for i, block in enumerate(ops):
            state = entry[i]
            for _, bits in block:
                state = _load_out(state, bits)
            out[i] = state
            for j in succ[i]:
                if state and not entry[j]:
                    entry[j] = changed = True
    return out


def _unacquired_loads(ops, succ, loop: set[int], loads_out: list[bool], invalidate_waits: bool) -> list[Instruction]:
    """From the exits of ``loop``: [] when some path completes the system-scope acquire (the
    invalidate, issued once the wave's loads completed, and, with ``invalidate_waits``, the wait
    after it) before any non-signal load and any block barrier; else the loads and barriers those
    paths reach first."""
    start = {(j, False, loads_out[i]) for i in loop for j in succ[i] if j not in loop}  # (block, invalidated, load out)
    seen, todo, first = set(start), list(start), []
    while todo:
        b, invalidated, load_out = todo.pop()
        stopped = False
        for ins, bits in ops[b]:
            if bits & (_DATA_LOAD | _BLOCK_BARRIER):
                first.append(ins)
                stopped = True
                break
            if invalidated and bits & _LOADS_DONE:
                return []
            if bits & _INVALIDATE and not load_out:
                if not invalidate_waits:
                    return []
                invalidated = True
            load_out = _load_out(load_out, bits)
        if stopped:
            continue
        for j in succ[b]:
            key = (j, invalidated, load_out)
            if key not in seen:
                seen.add(key)
                todo.append(key)
    return sorted(set(first))


@attrs.frozen
class OrderScan:
    """What ``order_scan`` found in one assembly text.

    Attributes:
        violations: the instructions that break a rule, by line.
        flag_stores: how many flag stores the ``release`` rule checked.
        writebacks: how many system-scope writebacks the ``block`` rule checked.
        poll_loops: how many poll loops the ``acquire`` rule checked.
    """

    violations: tuple[Violation, ...]
    flag_stores: int
    writebacks: int
    poll_loops: int


def order_violations(asm: str, model: MemoryModel) -> list[Violation]:
    """The violations of ``order_scan``."""
    return list(order_scan(asm, model).violations)


def order_scan(asm: str, model: MemoryModel) -> OrderScan:
    """Check the order of the signal protocol's releases and acquires in ``asm``, on every path
    through each function's basic blocks (``blocks``; the whole text when it declares no
    function). The release and block rules run a forward analysis over the set of path states
    reaching each block, so one path's condition never mixes with another's; ``model`` spells
    the instructions.

    ``release``: a flag is released. A *flag store* is a system-scope store or non-returning
        system-scope atomic that every path reaches from a barrier (a block barrier, or the wave
        barrier of ``ep_sync_warp``) with no plain vector store or atomic and no read of a signal
        word (a system-scope load or returning atomic) between, and that some path follows with
        another vector memory access. Every path from that barrier must issue a system-scope
        writeback and the wait that completes it (GFX942 ``buffer_wbl2 sc0 sc1``, ``s_waitcnt
        vmcnt(0)``; GFX125x ``global_wb scope:SCOPE_SYS``, ``s_wait_storecnt 0``) before the flag
        store. Drawn there because every flag a peer polls is written right after a barrier:
        ``ep_release_to_ranks`` (``ep_sync_warp``, the fence, lane d's store), the done and pulled
        flags (the departure's barrier, then ``ep_store_release_system``), the low-latency flags
        (``ep_sync_block_for_release``, then ``ep_store_release_system``); and none is its
        kernel's last access (the spin-wait, the next phase or the ``calls`` word follows). The
        system-scope writes that need no release of their own are not flag stores, for one of
        these reasons: some path since their barrier reads a signal word or writes data first (a
        fault record after the claim's compare-and-swap, ``ep_report``'s words after its claim, a
        consumed record's zeroes after its reads, the receive counter and overflow atomics after
        the ready polls, ``num_recv`` after the received rows, the expand plan's reset after its
        offsets, the combine's closing resets after its consumed records); no barrier precedes
        them (the combine's fault record, before the ready fan-out whose release covers it); or
        nothing follows them in the kernel (a reset that only the next kernel on the stream reads,
        ordered by the kernel's end: the pull kernel's departure counter). The claim itself
        returns its old value and is not a flag store.

    ``block``: a release covers the block's stores only after the block's barrier. No path may
        reach a system-scope writeback from a plain (not system-scope) vector store of the wave
        unless, between them, the wave waited for its stores (GFX942 ``s_waitcnt vmcnt(0)``,
        GFX125x ``s_wait_storecnt 0``) and then passed a block barrier, or made a claim (a
        returning system-scope atomic). ``ep_sync_block_for_release`` is that wait and barrier:
        one thread's writeback covers every wave's stores once they completed before the barrier
        (the GFX942 "fence release - workgroup" row waits for lgkmcnt alone, so a bare block
        barrier leaves other waves' stores in flight). The claim: ``ep_report`` releases the error
        record the wave writes after its compare-and-swap, not the block's rows, so a report after
        a phase's stores needs no barrier.

    ``acquire``: data after a poll is read after the acquire. A *poll loop* is a natural loop of
        the CFG (a back edge targets a block that dominates its source) holding a system-scope
        load (``ep_poll_flag``'s spin). From its exits, some path must complete the system-scope
        acquire (GFX942 ``buffer_inv sc0 sc1`` issued once the wave's loads completed, i.e. after
        ``s_waitcnt vmcnt(0)``; GFX125x ``global_inv scope:SCOPE_SYS``, issued likewise, then
        ``s_wait_loadcnt 0``) before any vector load that is not system-scope and before any block
        barrier (the barrier hands what the wave acquired to the block: ``ep_wait_generation``
        and the low-latency ``ep_fence_after_poll`` both acquire before it). Signal-word loads (the
        next flag's poll, a fault record's words) may come first. "Some path", not every path: a
        wave whose polls all timed out skips the acquire (``ep_wait_generation`` returns false,
        the caller's exec-masked branch is empty) and reads nothing of the peer. The violation
        names the first load or barrier those paths reach.

    Returns:
        The violations and how much each rule checked.
    """
    found: list[Violation] = []
    flag_stores = writebacks = poll_loops = 0
    for kernel, items in functions(asm) or [("", list(instructions(asm)))]:
        blks, succ = blocks(items)
        ops = [_ops(block, model) for block in blks]
        entry: list[set[tuple]] = [set() for _ in ops]
        entry[0].add(_START)
        todo = [0]
        while todo:
            i = todo.pop()
            outs = set()
            for s in entry[i]:
                for ins, bits in ops[i]:
                    s = _step(s, ins[0], bits)
                outs.add(s)
            for j in succ[i]:
                if not outs <= entry[j]:
                    entry[j] |= outs
                    todo.append(j)
        reaches = _reaches_vmem(ops, succ)
        for i, states in enumerate(entry):
            for k, (ins, bits) in enumerate(ops[i]):
                text = f"{ins[1]} {ins[2]}".strip()
                if bits & _WRITEBACK and states:
                    writebacks += 1
                    late = [s[3] for s in states if s[3]]
                    if late:
                        found.append(Violation(kernel, ins[0], text, "block", min(late)))
                if bits & _FLAG and states and all(s[0] for s in states) and (
                        any(b & _VMEM for _, b in ops[i][k + 1:]) or any(reaches[j] for j in succ[i])):
                    flag_stores += 1
                    late = [s[0] for s in states if not s[1]]
                    if late:
                        found.append(Violation(kernel, ins[0], text, "release", max(late)))
                states = {_step(s, ins[0], bits) for s in states}
        loads_out = _loads_out(ops, succ)
        for poll, loop in _poll_loops(ops, succ):
            poll_loops += 1
            for ins in _unacquired_loads(ops, succ, loop, loads_out, model.invalidate_waits)[:1]:
                found.append(Violation(kernel, ins[0], f"{ins[1]} {ins[2]}".strip(), "acquire", poll))
    return OrderScan(tuple(sorted(found, key=lambda v: (v.line, v.rule))), flag_stores, writebacks, poll_loops)
