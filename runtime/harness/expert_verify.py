"""Rounds of the expert layout on virtual ranks, shared by the GPU tests
(tests/gpu/test_expert_layout.py and the pull dispatch's expert-layout test) and ``epgen selftest``:
random inputs with -1 slots, repeated and same-rank experts, the dispatch and its expansion checked
bit for bit against ``epgen.reference`` (sets, counts, offsets, zero padding), and the weighted
combine against ``reference.combine_weighted``."""

from __future__ import annotations

import torch

from epgen import reference
from epgen.codegen.config import EpConfig, Geometry
from epgen.harness.verify import payload_view, wire_fp8_flavour

GEO = Geometry(blocks=8, warps_per_block=8, unroll=2)  # W x 8 blocks resident at once on one H200


def expert_config(world_size, *, hidden=256, topk=4, experts_per_rank=3, tmax=96, alignment=16, **kw):
    """An expert-layout EpConfig of ``world_size`` ranks (``GEO`` for dispatch and combine; ``kw``
    more EpConfig fields)."""
    return EpConfig(world_size=world_size, hidden=hidden, topk=topk, num_experts=world_size * experts_per_rank,
                    max_tokens_per_rank=tmax, layout="expert", expert_alignment=alignment, timeout_s=10.0,
                    dispatch_geometry=GEO, combine_geometry=GEO, **kw)


def expert_op(cfg, validate=True):
    """``EpDispatchCombine(cfg)`` over virtual ranks of this GPU (W > 1)."""
    from epgen.op import EpDispatchCombine

    return EpDispatchCombine(cfg, virtual=cfg.world_size > 1, validate=validate)


def _lists(op, values):
    return values if op.virtual else values[0]


def expert_inputs(cfg, tokens, seed, *, invalid=0.15, duplicates=0.2, local_pairs=0.3):
    """Per rank (x, weights, indices, scales) on the CPU: random bf16 (or fp8 codes) rows, random
    weights, ids with -1 slots, a slot repeating an earlier slot's expert, and a slot naming another
    expert of an earlier slot's rank."""
    g = torch.Generator().manual_seed(seed)
    E, K, L = cfg.num_experts, cfg.topk, cfg.experts_per_rank
    out = []
    for T in tokens:
        if cfg.dtype == "bf16":
            x = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16)
        else:
            x = torch.randint(0, 256, (T, cfg.hidden), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        w = torch.rand(T, K, generator=g) + 0.01
        ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
        for k in range(1, K):
            pick = torch.rand(T, generator=g)
            earlier = ids[:, torch.randint(0, k, (1,), generator=g).item()]
            ids[:, k] = torch.where(pick < duplicates, earlier, ids[:, k])
            same_rank = earlier // L * L + torch.randint(0, L, (T,), generator=g, dtype=torch.int32)
            ids[:, k] = torch.where((pick >= duplicates) & (pick < duplicates + local_pairs), same_rank, ids[:, k])
        ids[torch.rand(T, K, generator=g) < invalid] = -1
        s = (torch.randint(0, 256, (T, cfg.scale_bytes), generator=g, dtype=torch.uint8) if cfg.scale_bytes
             else None)
        out.append((x, w, ids, s))
    return out


def expert_dispatch(op, cfg, inputs):
    """``op.dispatch`` of ``expert_inputs`` (every rank's) on the op's device, in the family the
    most tokens of any rank pick; a list of one output per rank."""
    dev = op.device
    cols = [[t[i].to(dev) if t[i] is not None else None for t in inputs] for i in range(4)]
    cols[0] = [payload_view(op, x) for x in cols[0]]  # fp8 in the arch's flavour
    outs = op.dispatch(*(_lists(op, c) for c in cols[:3]), _lists(op, cols[3]) if cfg.scale_bytes else None,
                       op.family(max(t[0].shape[0] for t in inputs)))
    return outs if op.virtual else [outs]


def expert_reference(cfg, inputs):
    """(``reference.dispatch``'s receive rows, ``reference.expand``'s expert layout) per rank."""
    recv = reference.dispatch([t[0] for t in inputs], [t[1] for t in inputs], [t[2] for t in inputs],
                              experts_per_rank=cfg.experts_per_rank,
                              scales=[t[3] for t in inputs] if cfg.scale_bytes else None)
    return recv, reference.expand(recv, experts_per_rank=cfg.experts_per_rank, alignment=cfg.expert_alignment)


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _check_layout(cfg, got, want) -> list[torch.Tensor]:
    """Per rank: the expanded rows equal the reference's, group by group; returns per rank the
    permutation ``kernel_row[perm[q]]`` = reference row q (over the reference's rows)."""
    perms = []
    for d, (g, w) in enumerate(zip(got, want)):
        counts, offsets = g.counts.cpu(), g.offsets.cpu()
        assert torch.equal(counts, w.counts), (d, counts, w.counts)
        assert torch.equal(offsets, w.offsets), (d, offsets, w.offsets)
        used = int(offsets[-1])
        src = g.src[:used].cpu()
        perm = torch.full((used,), -1, dtype=torch.int64)
        for e in range(cfg.experts_per_rank):
            lo, n, hi = int(offsets[e]), int(counts[e]), int(offsets[e + 1])
            p = reference.align_rows(w.src[lo:lo + n], src[lo:lo + n])  # the expert's set, exact
            perm[lo:lo + n] = p + lo
            pad = slice(lo + n, hi)  # padding: zeros, weight 0, source -1
            assert not g.x[pad].cpu().view(torch.uint8).any() and not g.weights[pad].cpu().any(), (d, e)
            assert (src[pad] == -1).all(), (d, e)
            if g.scales is not None:
                assert not g.scales[pad].cpu().any(), (d, e)
        rows = perm >= 0
        for name in ("x", "weights", "scales"):
            mine, theirs = getattr(g, name), getattr(w, name)
            if theirs is None:
                continue
            assert torch.equal(_bits(mine[:used].cpu()[perm[rows]]), _bits(theirs[rows])), (d, name)
        perms.append(perm)
    return perms


def _ys(op, cfg, want, perms, seed, zero_copy):
    """Reference y per rank (random bf16) and the kernel's y: the same row for the same (rank,
    token, slot), NaN in every row the fold must not read."""
    g = torch.Generator().manual_seed(seed)
    ref, mine = [], []
    for d, (w, perm) in enumerate(zip(want, perms)):
        y = torch.randn(w.num_rows, cfg.hidden, generator=g).to(torch.bfloat16)
        ref.append(y)
        dst = (op.combine_input(op.local_ranks[d]) if zero_copy else
               torch.empty(op.arena_layout.expert_rows, cfg.hidden, dtype=torch.bfloat16, device=op.device))
        dst.fill_(float("nan"))
        rows = perm >= 0
        dst[perm[rows].to(op.device)] = y[rows].to(op.device)
        mine.append(dst)
    return ref, mine


def run_expert_round(op, cfg, tokens, seed, *, zero_copy=True):
    """One verified expert-layout round on virtual ranks: ``tokens`` [W] per rank; the dispatch's
    groups, counts, offsets and padding bit for bit against ``reference.expand``, the weighted
    combine bit for bit against ``reference.combine_weighted`` (``zero_copy``: y written into
    ``op.combine_input``); an fp8 wire in the op's arch's flavour (``verify.wire_fp8_flavour``).

    Raises:
        AssertionError: any mismatch (naming the rank).
    """
    inputs = expert_inputs(cfg, tokens, seed)
    got = expert_dispatch(op, cfg, inputs)
    recv, want = expert_reference(cfg, inputs)
    perms = _check_layout(cfg, got, want)
    ref_y, ys = _ys(op, cfg, want, perms, seed + 1000, zero_copy)
    out = op.combine(_lists(op, ys))
    out = out if op.virtual else [out]
    expect = reference.combine_weighted(ref_y, want, recv, list(tokens), combine_quant=cfg.combine_quant,
                                        fp8_flavour=wire_fp8_flavour(op))
    for r, (o, e) in enumerate(zip(out, expect)):
        assert torch.equal(o.cpu(), e), (r, (o.cpu().float() - e.float()).abs().max())
