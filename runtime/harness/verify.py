"""Inputs and verification shared by the GPU tests, the demo, the benchmark and the stress run.

Every check compares the op against ``epgen.reference`` on fresh random data: received rows
bit-equal and the set of (source rank, source token) exactly the reference's; every combined
element within its error bound (``combine_reference``) of the exact sum of the expert outputs.
"""

from __future__ import annotations

import attrs
import torch

from epgen import quant, reference
from epgen.codegen.dtypes import dtype_info
from epgen.codegen.config import EpConfig
from epgen.harness import ROUTINGS

"""Routing kinds: uniform random distinct experts; uniform with -1 sprinkled (and some all -1
rows); uniform with repeated expert ids inside a row; skewed (half the tokens send every slot to
experts of one rank); one_rank (every token sends every slot to experts of rank 0); shared (a
DeepSeek-style shared-expert column: the last top-k slot names an expert on the token's own
rank)."""

@attrs.frozen
class RankInputs:
    """One rank's dispatch inputs on the CPU: x [T,H], weights [T,K] f32, indices [T,K] i32,
    scales [T,S] u8 or None."""

    x: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    scales: torch.Tensor | None

    def to(self, device) -> "RankInputs":
        return RankInputs(*(None if t is None else t.to(device) for t in attrs.astuple(self, recurse=False)))


def op_arg(op, per_rank: list):
    """``per_rank`` (one entry per rank ``op`` drives) in the op's calling convention: the list
    itself with virtual ranks, its only entry otherwise."""
    return list(per_rank) if op.virtual else per_rank[0]


def zero_copy_inputs(op, inputs: list[RankInputs]) -> list[RankInputs]:
    """``inputs`` with each of ``op``'s local ranks' x written into its ``op.dispatch_input`` and
    replaced by that view (``dispatch_input()[:T]``: the zero-copy call the pull dispatch reads in
    place); other ranks' entries unchanged."""
    out = list(inputs)
    for r in op.local_ranks:
        view = op.dispatch_input(r)[: inputs[r].x.shape[0]]
        view.copy_(inputs[r].x)
        out[r] = attrs.evolve(inputs[r], x=view)
    return out


def payload_view(op, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``op``'s payload type: fp8 bytes drawn as e4m3fn are the same case in the arch's
    flavour (gfx942: e4m3fnuz, ``op.payload``), since the kernels move bytes; other dtypes as they are."""
    if x.element_size() != 1:
        return x
    payload = op.payload.torch_dtype
    return x.view(payload) if x.dtype != payload else x


def op_inputs(op, inputs: list[RankInputs]) -> tuple:
    """(x, weights, indices, scales, family) of the ranks ``op`` drives, ready for ``op.dispatch``:
    ``inputs`` holds every rank's, so the family is the one the most tokens of any rank pick, the
    same on every rank (``EpDispatchCombine.dispatch``'s ``family``); fp8 payloads as the op's fp8
    type (``op.payload``), the same bytes."""
    mine = [attrs.evolve(inputs[r], x=payload_view(op, inputs[r].x)) for r in op.local_ranks]
    family = op.family(max(i.x.shape[0] for i in inputs))
    return (*(op_arg(op, [getattr(i, f) for i in mine]) for f in ("x", "weights", "indices", "scales")), family)


def routing(num_tokens: int, cfg: EpConfig, kind: str, gen: torch.Generator, rank: int = 0) -> torch.Tensor:
    """Expert ids [T, K] int32 of routing ``kind`` (see ROUTINGS) for tokens of ``rank``, on
    ``gen``'s device.

    Raises:
        ValueError: unknown kind.
    """
    E, K, T, dev = cfg.num_experts, cfg.topk, num_tokens, gen.device
    if kind not in ROUTINGS:
        raise ValueError(f"routing kind={kind!r}: must be one of {', '.join(ROUTINGS)}")
    ids = torch.rand(T, E, generator=gen, device=dev).argsort(dim=1)[:, :K].to(torch.int32)
    if kind == "invalid" and T:
        ids[torch.rand(T, K, generator=gen, device=dev) < 0.25] = -1
        ids[:: max(1, T // 4)] = -1  # some tokens reach no rank
    elif kind == "duplicates" and K > 1:
        dup = torch.rand(T, generator=gen, device=dev) < 0.5
        ids[dup, 1:] = ids[dup, :1]
    elif kind in ("skewed", "one_rank"):
        L = cfg.experts_per_rank
        hot = torch.rand(T, generator=gen, device=dev) < (0.5 if kind == "skewed" else 1.0)
        ids[hot] = torch.randint(0, L, (int(hot.sum()), K), generator=gen, dtype=torch.int32, device=dev)
    elif kind == "shared":
        L = cfg.experts_per_rank
        ids[:, -1] = rank * L + torch.randint(0, L, (T,), generator=gen, dtype=torch.int32, device=dev)
    return ids


def make_inputs(cfg: EpConfig, tokens: list[int], kind: str = "uniform", seed: int = 0,
                device=None) -> list[RankInputs]:
    """Fresh random inputs for every rank, generated on ``device`` (default CPU; a GPU is far
    faster for large T) with a generator seeded by ``seed``: the same seed and device type give
    the same inputs in every process. bf16 tokens are normal samples; fp8 and fp4 tokens are
    uniform random bytes (the kernels move bytes)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    info = dtype_info(cfg.dtype)
    out = []
    for rank, T in enumerate(tokens):
        if info.bits == 16:
            x = torch.randn(T, cfg.hidden, generator=gen, device=dev).to(info.torch_dtype)
        else:  # fp8 / fp4 payloads: every byte pattern the wire carries, NaN codes included
            x = torch.randint(0, 256, (T, info.row_bytes(cfg.hidden)), generator=gen, dtype=torch.uint8, device=dev)
            x = x.view(info.torch_dtype)
        w = torch.rand(T, cfg.topk, generator=gen, device=dev)
        s = (torch.randint(0, 256, (T, cfg.scale_bytes), generator=gen, dtype=torch.uint8, device=dev)
             if cfg.scale_bytes else None)
        out.append(RankInputs(x, w, routing(T, cfg, kind, gen, rank), s))
    return out


def reference_dispatch(cfg: EpConfig, inputs: list[RankInputs]) -> list[reference.RecvRows]:
    """The reference's receive rows of every rank."""
    return reference.dispatch([i.x for i in inputs], [i.weights for i in inputs], [i.indices for i in inputs],
                              experts_per_rank=cfg.experts_per_rank,
                              scales=[i.scales for i in inputs] if cfg.scale_bytes else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_dispatch(rank: int, out, ref: reference.RecvRows) -> torch.Tensor:
    """Check one rank's DispatchOutput against the reference rows.

    Returns:
        perm (int64 [R]) with the op's row perm[i] holding the reference's row i.

    Raises:
        AssertionError: wrong row count, wrong (source rank, token) set, or a row not bit-equal.
    """
    n = int(out.num_recv.item())
    assert n == ref.num_rows, f"rank {rank}: num_recv={n}, reference receives {ref.num_rows} rows"
    src = out.recv_src[:n].cpu()
    perm = reference.align_rows(ref.src, src)
    if n == 0:
        return perm
    pairs = [("recv_x", out.recv_x, ref.x), ("recv_weights", out.recv_weights, ref.weights),
             ("recv_indices", out.recv_indices, ref.indices)]
    if ref.scales is not None:
        pairs.append(("recv_scales", out.recv_scales, ref.scales))
    for name, got, want in pairs:
        g = got[:n].cpu()[perm]
        bad = (_bits(g) != _bits(want)).reshape(n, -1).any(dim=1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise AssertionError(f"rank {rank}: {name} row for source {tuple(ref.src[i].tolist())} differs from the "
                                 f"source row ({int(bad.sum())} of {n} rows differ)")
    return perm


def expert_outputs(n: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Random bf16 expert outputs [n, H] (never zeros) on ``gen``'s device."""
    return torch.randn(n, hidden, generator=gen, device=gen.device).to(torch.bfloat16)


@attrs.frozen
class CombineReference:
    """What one rank's combine must produce, on the device of the expert outputs.

    Attributes:
        wire: [T, H] bf16, the wire's values summed in float32 in ascending rank and rounded once:
            what a kernel that quantizes exactly like ``epgen.quant`` returns bit for bit.
        exact: [T, H] float32, the float32 sum of the unquantized expert outputs.
        bound: [T, H] float32, the allowed |out - exact| per element: the sum of the wire's
            element bounds (``quant.combine_error_bound``, 0 for "none"; an fp8 wire in the op's
            flavour) of the rows summed, plus the bf16 rounding of the output (2^-8 of the sum) and
            the float32 sum's error (W x 2^-24 of the sum of magnitudes).
    """

    wire: torch.Tensor
    exact: torch.Tensor
    bound: torch.Tensor


def wire_fp8_flavour(op) -> str:
    """The fp8 flavour of ``op``'s combine wire, which its reference must compute: its arch's
    (``epgen.quant.arch_fp8_flavour(op.arch)``: "e4m3fnuz" on gfx942, "e4m3fn" elsewhere); "e4m3fn"
    for a stand-in without ``arch`` (a CPU op that computes the reference itself).

    Raises:
        ValueError: ``op.arch`` is not a known arch.
    """
    arch = getattr(op, "arch", None)
    return "e4m3fn" if arch is None else quant.arch_fp8_flavour(arch)


def combine_reference(mode: str, ys: list[torch.Tensor], recv: list[reference.RecvRows],
                      tokens: list[int], *, fp8_flavour: str = "e4m3fn") -> list[CombineReference]:
    """Per rank, the CombineReference of combine wire ``mode`` for expert outputs ``ys`` (one [R_d, H]
    bf16 tensor per rank, on any one device), an fp8 wire in ``fp8_flavour`` (the op's arch's,
    ``wire_fp8_flavour``; a key of ``epgen.codegen.dtypes.FP8_FLAVOURS``).

    Raises:
        ValueError: as ``epgen.quant.combine_roundtrip`` (an unknown mode or fp8_flavour)."""
    world = len(ys)

    def summed(per_rank):
        return reference.combine(per_rank, recv, tokens)

    wire = [quant.combine_roundtrip(mode, y, fp8_flavour=fp8_flavour) for y in ys]
    sums = summed(wire)
    exact = summed([y.float() for y in ys])
    bounds = summed([quant.combine_error_bound(mode, y, fp8_flavour=fp8_flavour) for y in ys])
    mags = summed([w.abs() for w in wire])
    return [CombineReference(s.to(torch.bfloat16), e, b + 2.0**-8 * s.abs() + world * 2.0**-24 * m)
            for s, e, b, m in zip(sums, exact, bounds, mags)]


def check_combine(rank: int, out: torch.Tensor, ref: CombineReference) -> dict:
    """Check one rank's combine output against its reference, element by element.

    Returns:
        {"max_err": max |out - exact|, "bound_ratio": max |out - exact| / bound (<= 1),
        "wire_mismatches": elements whose bf16 bits differ from ``ref.wire``}.

    Raises:
        AssertionError: an element outside its bound, or NaN (poisoned rows left unwritten show
            up as NaN).
    """
    got = out.to(ref.exact.device).float()
    err = (got - ref.exact).abs()
    bad = ~(err <= ref.bound)  # NaN counts as bad
    if bool(bad.any()):
        t, h = (int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"rank {rank}: combine out[{t}, {h}]={float(got[t, h])!r}, exact sum "
                             f"{float(ref.exact[t, h])!r}: error {float(err[t, h]):.3g} above its bound "
                             f"{float(ref.bound[t, h]):.3g} ({int(bad.sum())} elements)")
    ratio = torch.where(ref.bound > 0, err / ref.bound, torch.zeros_like(err))
    mismatches = out.to(ref.wire.device).view(torch.int16) != ref.wire.view(torch.int16)
    return {"max_err": float(err.max()) if err.numel() else 0.0,
            "bound_ratio": float(ratio.max()) if ratio.numel() else 0.0,
            "wire_mismatches": int(mismatches.sum())}


def poison(op, rank: int) -> None:
    """Fill a rank's receive buffers with NaN bytes (0xFF) so unwritten rows cannot pass."""
    for t in attrs.astuple(op.recv_buffers(rank), recurse=False)[:-1]:
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


def run_round(op, cfg: EpConfig, tokens: list[int], kind: str, seed: int, busy=None) -> dict:
    """One verified dispatch + combine over every rank this process drives.

    ``tokens`` lists T of every rank (all W); inputs are generated for all ranks from ``seed`` so
    every process computes the same reference. ``busy`` (no arguments), when given, splits both
    calls (``async_recv``: the call must take the low-latency family) and runs between each one's
    halves (GPU work on the stream). Returns {"recv": [rows per local rank], "combine_err": worst
    |out - exact|, "bound_ratio": worst error / bound, "wire_mismatches": combined elements whose
    bits differ from the wire reference}.

    Raises:
        AssertionError: any mismatch with the reference.
    """
    device = op.device
    inputs = make_inputs(cfg, tokens, kind, seed, device=device)  # generated on the GPU: fast
    ref = reference_dispatch(cfg, [i.to("cpu") for i in inputs])
    local = op.local_ranks
    for r in local:
        poison(op, r)
    outs = _call(op.dispatch, busy, *op_inputs(op, inputs))
    outs = outs if op.virtual else [outs]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    ys_dev = [expert_outputs(ref[d].num_rows, cfg.hidden, gen) for d in range(cfg.world_size)]
    perms = [check_dispatch(r, o, ref[r]) for r, o in zip(local, outs)]
    ys = []
    for r, perm in zip(local, perms):
        y = torch.full((max(ref[r].num_rows, 1), cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device)
        y[perm.to(device)] = ys_dev[r]  # the op's row perm[i] is the reference's row i
        ys.append(y)
    poisoned = [torch.full((tokens[r], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device) for r in local]
    combined = _call(op.combine, busy, op_arg(op, ys), out=op_arg(op, poisoned))
    combined = combined if op.virtual else [combined]
    ref_out = combine_reference(cfg.combine_quant, ys_dev, ref, tokens,  # on the GPU, like the inputs
                                fp8_flavour=wire_fp8_flavour(op))
    stats = [check_combine(r, c, ref_out[r]) for r, c in zip(local, combined)]
    op.check()
    return {"recv": [ref[r].num_rows for r in local], "combine_err": max(s["max_err"] for s in stats),
            "bound_ratio": max(s["bound_ratio"] for s in stats),
            "wire_mismatches": sum(s["wire_mismatches"] for s in stats)}


def _call(method, busy, *args, **kwargs):
    """``method(*args, **kwargs)``, or with ``busy`` its two halves with ``busy()`` between them."""
    if busy is None:
        return method(*args, **kwargs)
    handle = method(*args, **kwargs, async_recv=True)
    busy()
    return handle.wait()


# ---- exact rounds: integer tokens, checked bit for bit on the op's device ---------------------
#
# The rounds above compare with the reference (combine within its error bound). The helpers below
# check a round on the device itself, cheaply enough for thousands of rounds or graph replays,
# and exactly: tokens are small integers, rank d's expert output for a received row is that row
# times (d + 1), so out[t] = x[t] * (sum of d + 1 over the ranks d token t reached): an integer of
# magnitude <= 7 * W(W+1)/2 <= 252 for W <= 8, exact in fp32 and bf16 whatever the summation order.

EXACT_MAX_VALUE = 7
"""Tokens of ``integer_inputs`` lie in [-7, 7]."""

EXACT_MAX_WORLD = 8
"""Largest W whose exact sums stay below 256 (every integer up to 256 is a bf16 value)."""


def integer_inputs(cfg: EpConfig, tokens: list[int], kind: str = "uniform", seed: int = 0,
                   device=None) -> list[RankInputs]:
    """``make_inputs`` with bf16 tokens of small integers in [-7, 7] (same seed and device type:
    the same inputs in every process), for ``run_exact_round`` / ``check_exact_*``.

    Raises:
        ValueError: ``cfg.dtype`` is not bf16, or W > 8 (the sums would leave the exact range).
    """
    if cfg.dtype != "bf16":
        raise ValueError(f"EpConfig.dtype={cfg.dtype!r}: exact rounds need bf16 tokens")
    if cfg.world_size > EXACT_MAX_WORLD:
        raise ValueError(f"EpConfig.world_size={cfg.world_size}: exact rounds need W <= {EXACT_MAX_WORLD}")
    inputs = make_inputs(cfg, tokens, kind, seed, device=device)
    dev = inputs[0].x.device
    gen = torch.Generator(device=dev).manual_seed(seed + 0x5EED)
    return [attrs.evolve(i, x=torch.randint(-EXACT_MAX_VALUE, EXACT_MAX_VALUE + 1, tuple(i.x.shape), generator=gen,
                                            device=dev).to(torch.bfloat16)) for i in inputs]


def integer_expert_stage(op, rank: int) -> torch.Tensor:
    """``rank``'s expert outputs for an exact round, written into ``op.combine_input(rank)`` (so
    combine takes them without a copy): every receive row times (rank + 1). Works on all capacity
    rows on the current stream with no host synchronization (it can sit in a captured CUDA graph);
    rows at or beyond num_recv hold garbage that combine never reads."""
    y = op.combine_input(rank)
    torch.mul(op.recv_buffers(rank).recv_x, rank + 1, out=y)
    return y


@attrs.frozen
class Expected:
    """What a round must produce, on the inputs' device (see ``expect``).

    Attributes:
        tokens: T of every rank.
        x, weights, indices, scales: [W, Tm, bytes] uint8, every rank's source rows as bytes,
            zero-padded to Tm = max(1, max T) rows (scales None when there are none).
        reached: [W, Tm, W] bool, token t of rank r reaches rank d (a valid expert on d).
    """

    tokens: tuple
    x: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    scales: torch.Tensor | None
    reached: torch.Tensor


def expect(cfg: EpConfig, inputs: list[RankInputs]) -> Expected:
    """The expectation of a round of ``inputs`` (all W ranks), computed on their device."""
    W, L = cfg.world_size, cfg.experts_per_rank
    tokens = tuple(int(i.x.shape[0]) for i in inputs)
    Tm = max(tokens + (1,))
    dev = inputs[0].x.device

    def stack(name):
        parts = [_bits(getattr(i, name)) for i in inputs]  # [T, bytes] (rows are 2-D)
        out = torch.zeros(W, Tm, parts[0].shape[1], dtype=torch.uint8, device=dev)
        for r, p in enumerate(parts):
            out[r, : p.shape[0]] = p
        return out

    ids = torch.full((W, Tm, cfg.topk), -1, dtype=torch.int64, device=dev)
    for r, i in enumerate(inputs):
        ids[r, : tokens[r]] = i.indices.to(torch.int64)
    valid = (ids >= 0) & (ids < cfg.num_experts)  # other ids are faults the kernel reports: no destination
    routed = torch.where(valid, ids, -1)  # valid ids only: the reference's routing without its checks (no host sync)
    reached = torch.stack([reference._route(routed[r], L, W) >= 0 for r in range(W)])
    return Expected(tokens=tokens, x=stack("x"), weights=stack("weights"), indices=stack("indices"),
                    scales=stack("scales") if inputs[0].scales is not None else None, reached=reached)


def check_exact_dispatch(rank: int, out, exp: Expected) -> int:
    """Check one rank's DispatchOutput against ``exp`` on the device: num_recv equals the number
    of (source rank, token) pairs that reach ``rank``, every received pair is one of them and none
    twice, and every row (payload, weights, indices, scales) is bit-equal to its source row.

    Returns:
        rows received.

    Raises:
        AssertionError: naming the rank, what differs, how often, and one example.
    """
    W, Tm = exp.reached.shape[0], exp.reached.shape[1]
    dev = exp.reached.device
    n, want = (int(v) for v in torch.stack([out.num_recv.reshape(-1)[0].to(dev, torch.int64),
                                            exp.reached[:, :, rank].sum()]).tolist())
    assert n == want, f"rank {rank}: num_recv={n}, expected {want} received rows"
    if n == 0:
        return 0
    src = out.recv_src[:n].to(dev, torch.int64)
    r, t = src[:, 0], src[:, 1]
    rc = r.clamp(0, W - 1)
    tc = t.clamp(0, Tm - 1)
    limit = torch.tensor(exp.tokens, device=dev)[rc]
    ok = (r >= 0) & (r < W) & (t >= 0) & (t < limit) & exp.reached[rc, tc, rank]
    key = torch.where(ok, rc * Tm + tc, -1 - torch.arange(n, device=dev))  # bad rows never count as duplicates
    ks = key.sort().values
    dup = ks[1:] == ks[:-1]
    fields = [("recv_x", out.recv_x, exp.x), ("recv_weights", out.recv_weights, exp.weights),
              ("recv_indices", out.recv_indices, exp.indices)]
    if exp.scales is not None:
        fields.append(("recv_scales", out.recv_scales, exp.scales))
    differ = [(_bits(got[:n]).to(dev) != want[rc, tc]).any(dim=1) & ok for _, got, want in fields]
    counts = torch.stack([(~ok).sum(), dup.sum()] + [d.sum() for d in differ]).tolist()
    problems = []
    if counts[0]:
        i = int((~ok).nonzero()[0])
        problems.append(f"{counts[0]} of {n} rows name a (source rank, token) that does not exist or does not "
                        f"route to rank {rank}, e.g. row {i} = {tuple(src[i].tolist())}")
    if counts[1]:
        problems.append(f"{counts[1]} (source rank, token) pairs received more than once, e.g. "
                        f"{divmod(int(ks[1:][dup][0]), Tm)}")
    for (name, _, _), d, c in zip(fields, differ, counts[2:]):
        if c:
            i = int(d.nonzero()[0])
            problems.append(f"{name}: {c} of {n} rows differ from their source row, e.g. row {i} from "
                            f"{tuple(src[i].tolist())}")
    assert not problems, f"rank {rank}: " + "; ".join(problems)
    return n


def check_exact_combine(rank: int, combined: torch.Tensor, exp: Expected) -> None:
    """Check one rank's combine output of an exact round (``integer_inputs`` and
    ``integer_expert_stage``) bit for bit: out[t] = x[t] * (sum of d + 1 over the ranks d that
    token t reached), +0.0 for a token that reached no rank.

    Raises:
        AssertionError: naming the rank, how many tokens differ and one example.
    """
    W, T = exp.reached.shape[0], exp.tokens[rank]
    dev = exp.reached.device
    H = exp.x.shape[2] // 2
    assert tuple(combined.shape) == (T, H), f"rank {rank}: combine output shape {tuple(combined.shape)}, expected {(T, H)}"
    if T == 0:
        return
    factor = torch.arange(1, W + 1, device=dev, dtype=torch.float32)
    s = (exp.reached[rank, :T].float() * factor).sum(dim=1, keepdim=True)
    x = exp.x[rank, :T].view(torch.bfloat16).float()
    want = torch.where(s > 0, x * s, torch.zeros((), device=dev)).to(torch.bfloat16)
    got = combined.to(dev)
    differ = (got.view(torch.int16) != want.view(torch.int16)).any(dim=1)
    k = int(differ.sum())
    if k:
        i = int(differ.nonzero()[0])
        j = int((got[i].view(torch.int16) != want[i].view(torch.int16)).nonzero()[0])
        reached = exp.reached[rank, i].nonzero().flatten().tolist()
        raise AssertionError(f"rank {rank}: combine output of {k} of {T} tokens differs from the exact sum, e.g. "
                             f"token {i} (reached ranks {reached}) element {j}: {float(got[i, j])} instead of "
                             f"{float(want[i, j])}")


def check_no_record_left(op, when: str) -> None:
    """Every local rank's consumed signal words (overflow counts and fault records: ``abi.SIGNALS``
    from ``overflow_need`` on) are zero: their readers consumed them in the call that wrote them,
    so nothing outlives its call (``abi.PARITY_RULE``). Call after a whole call's synchronize.

    Raises:
        AssertionError: naming ``when``, the rank and the words left.
    """
    from epgen.codegen import abi

    first = abi.signal("overflow_need").byte_offset
    for r in op.local_ranks:
        words = op.arenas.local_signals[r][first:abi.SIGNAL_WORDS * 4].view(torch.int32)
        left = words.nonzero().flatten().tolist()
        assert not left, f"{when}: rank {r} keeps signal words {[first // 4 + i for i in left[:8]]} after the call"


def run_exact_round(op, cfg: EpConfig, inputs: list[RankInputs], pause=None) -> dict:
    """One dispatch + combine of ``inputs`` (``integer_inputs`` of all W ranks; every process
    passes the same) on the ranks ``op`` drives, checked bit for bit on the op's device: receive
    buffers poisoned before dispatch, expert outputs by ``integer_expert_stage`` (zero-copy),
    combine into NaN-filled outputs. ``pause`` (no arguments), when given, is called right before
    the dispatch and right before the combine (e.g. a random host delay on one rank).

    Returns:
        {"recv": rows received per local rank, "combined": the combine outputs per local rank}.

    Raises:
        AssertionError: any difference (``check_exact_dispatch``, ``check_exact_combine``).
        EpError: the op reported a kernel fault.
    """
    exp = expect(cfg, inputs)
    local = op.local_ranks
    for r in local:
        poison(op, r)
    if pause:
        pause()
    outs = op.dispatch(*op_inputs(op, inputs))
    outs = outs if op.virtual else [outs]
    recv = [check_exact_dispatch(r, o, exp) for r, o in zip(local, outs)]
    ys = [integer_expert_stage(op, r) for r in local]
    nan = [torch.full((exp.tokens[r], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=op.device) for r in local]
    if pause:
        pause()
    combined = op.combine(op_arg(op, ys), out=op_arg(op, nan))
    combined = combined if op.virtual else [combined]
    for r, c in zip(local, combined):
        check_exact_combine(r, c, exp)
    op.check()
    return {"recv": recv, "combined": combined}


# ---- a busy GPU ----------------------------------------------------------------------------------

HOG_SOURCE = r"""
extern "C" __global__ void hog(unsigned long long ns) {
  extern __shared__ unsigned char smem[];
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(10000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
  if (threadIdx.x == 0) smem[0] = 1;
}
"""
"""CUDA source of ``hog_gpu``'s kernel: every block sleeps until ``ns`` nanoseconds have passed."""

HOG_FREE_SMS = 6
"""SMs ``hog_gpu`` leaves free of its blocks (it fills the others with two 1024-thread blocks each)."""


def hog_gpu(device: torch.device, seconds: float, stream: torch.cuda.Stream) -> None:
    """Launch on ``stream`` a kernel that holds all but ``HOG_FREE_SMS`` SMs of ``device`` for
    ``seconds``: two blocks of 1024 threads and 100 KiB of shared memory a SM fill its 2048
    threads, so no block of another kernel fits beside them (a persistent GEMM, or a communication
    kernel waiting for its own peer, as a serving process overlaps one with an EP call). NVIDIA
    only (CuPy's NVRTC; ``%globaltimer``)."""
    import cupy

    from epgen.device import cupy_stream

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    with cupy.cuda.Device(device.index), torch.cuda.stream(stream):
        fn = cupy.RawKernel(HOG_SOURCE, "hog")
        smem = 100 * 1024
        fn.max_dynamic_shared_size_bytes = smem
        fn((2 * (sms - HOG_FREE_SMS),), (1024,), (cupy.uint64(int(seconds * 1e9)),), shared_mem=smem,
           stream=cupy_stream(device))


# ---- processes ------------------------------------------------------------------------------------

PROCESS_WORLD_SIZES = (2, 3, 4)
"""World sizes the multi-process tests run at (``epgen.harness.ranks``: one GPU each, or all sharing cuda:0)."""


def model_config(model: str, world_size: int, max_tokens_per_rank: int, **kw) -> EpConfig:
    """``EpConfig.for_model``, except where the model's routed experts do not divide among
    ``world_size`` ranks (W = 3 and a power-of-two expert count): the model's hidden and top-k with
    E rounded up to the next multiple of W (every kernel of the shape is the same but the expert
    count per rank)."""
    from epgen.codegen.models import model as catalogue

    m = catalogue(model)
    if m.num_experts % world_size == 0:
        return EpConfig.for_model(model, world_size=world_size, max_tokens_per_rank=max_tokens_per_rank, **kw)
    return EpConfig(world_size=world_size, hidden=m.hidden, topk=m.topk,
                    num_experts=-(-m.num_experts // world_size) * world_size, max_tokens_per_rank=max_tokens_per_rank,
                    **kw)


def per_rank(pattern: list[int], world_size: int) -> list[int]:
    """Token counts of ``world_size`` ranks: ``pattern`` repeated (rank r takes pattern[r % len])."""
    return [pattern[r % len(pattern)] for r in range(world_size)]
