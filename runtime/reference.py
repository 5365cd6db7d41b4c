"""Pure-torch CPU reference of MoE expert-parallel dispatch and combine, all ranks in one process.

Notation: ``W`` ranks; rank ``r`` holds ``T_r`` tokens (0 allowed); hidden size ``H``; top-k ``K``;
``L`` experts per rank, ``E = W * L`` experts; expert ``e`` lives on rank ``e // L``. Expert id -1
means "no expert" for that top-k slot; any other id outside ``[0, E)`` is an input error.

dispatch: every token goes to each DISTINCT destination rank of its valid experts exactly once (the
first top-k slot naming a rank is the one kept; ``route`` reports which). Rank ``d`` receives, per
row, the source token (bit-equal), the sender's full weights / indices / scales rows, and the
``(source rank, source token)`` pair. Here rows are ordered by (source rank, source token); a
kernel may order them differently, and ``align_rows`` maps its rows onto these.

``max_recv_tokens`` caps the rows one rank may receive; a dispatch over the cap raises before
producing anything.

combine: ``out_r[t]`` = sum over the distinct ranks ``d`` that token ``t`` of rank ``r`` reached of
that rank's expert-output row for ``(r, t)``, accumulated in float32 in ascending ``d`` and cast
once to the output dtype; a token that reached no rank gets zeros.

Expert-major layout (``expand``): on rank ``d`` every received row becomes one row per DISTINCT
local expert ``e`` (global id ``d * L + e``) it names; slots naming the same expert merge into one
row whose weight is their float32 sum in ascending slot order and whose slot is the first. Expert
``e`` owns rows ``[offsets[e], offsets[e] + counts[e])`` in ascending receive row, and
``offsets[e + 1] = offsets[e] + roundup(counts[e], A)`` for the alignment ``A``; padding rows hold
zeros, weight 0.0 and src (-1, -1, -1). A kernel's receive rows, and so each group's order, may
differ; ``align_rows`` on the (source rank, source token, slot) triples maps them.

Weighted combine (``fold``, ``combine_weighted``): per receive row, ``acc = 0.0`` and for each of
its expanded rows in ascending first slot ``acc = acc + (w * float32(y))`` (product and sum each
rounded to float32, no fused multiply-add), rounded to bf16 once: ``F``. The combine wire's
``epgen.quant.combine_roundtrip`` of ``F`` (an fp8 wire in the arch's flavour, ``fp8_flavour``) is
then summed over ranks exactly like ``combine``.

Nodes (``combine_hierarchical``, docs/multinode.md): with the W ranks on N nodes of G (rank d on
node d // G), the hierarchical op delivers exactly ``dispatch``'s rows (each token once to every
rank holding one of its experts), and its combine sums in two levels: per (token, node) the wire
rows of the node's ranks in ascending rank, fp32, rounded to bf16 once; then those partial sums in
ascending node, fp32, rounded once more.

Errors: a tensor argument that is not a torch.Tensor raises TypeError; every other rule a
function's ``Raises`` names raises ValueError (``epgen.tensors.check_tensor`` and the checks here).
"""

from __future__ import annotations

import numbers
from collections import Counter

import attrs
import torch

from epgen.quant import combine_roundtrip
from epgen.tensors import check_tensor

__all__ = [
    "ExpertRows",
    "RecvRows",
    "align_rows",
    "combine",
    "combine_hierarchical",
    "combine_weighted",
    "dispatch",
    "expand",
    "fold",
    "relative_l2",
    "route",
]


# --- validation helpers --------------------------------------------------------------------------


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be an int")
    if value < 1:
        raise ValueError(f"{name}={value}: must be at least 1")


def _check_expert_ids(name: str, indices: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError on the first (row-major) id that is neither -1 nor in [0, num_experts)."""
    bad = (indices != -1) & ((indices < 0) | (indices >= num_experts))
    if bool(bad.any()):
        where = bad.nonzero()
        t, k = (int(v) for v in where[0])
        more = f" ({where.shape[0] - 1} more invalid ids)" if where.shape[0] > 1 else ""
        raise ValueError(
            f"{name}[token {t}, slot {k}]={int(indices[t, k])}: expert ids must be -1 or in "
            f"[0, {num_experts}){more}"
        )


def _route(indices: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """route() after validation: [T, K] int32 -> [T, W] int64 first slot per rank, or -1."""
    num_tokens, topk = indices.shape
    if topk == 0:
        return torch.full((num_tokens, world_size), -1, dtype=torch.int64, device=indices.device)
    idx = indices.to(torch.int64)
    dest = torch.where(idx >= 0, idx // experts_per_rank, -1)  # [T, K] destination rank or -1
    ranks = torch.arange(world_size, device=indices.device)
    hits = dest[:, None, :] == ranks[None, :, None]  # [T, W, K]
    first = hits.to(torch.int32).argmax(dim=-1)  # argmax returns the FIRST maximal slot
    return torch.where(hits.any(dim=-1), first.to(torch.int64), -1)


# --- public API ----------------------------------------------------------------------------------


def route(indices: torch.Tensor, *, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """Destination ranks of every token, deduplicated, with the top-k slot kept for each.

    Args:
        indices: [T, K] int32 expert ids; -1 = no expert; others must lie in [0, W * L).
        experts_per_rank: L (>= 1); expert e lives on rank e // L.
        world_size: W (>= 1).

    Returns:
        [T, W] int64: entry [t, d] is the first top-k slot of token t whose expert lives on rank
        d, or -1 when no slot of token t names rank d.

    Raises:
        ValueError: indices not a 2-D int32 tensor, L or W not a positive int, or an expert id
            that is neither -1 nor in [0, E) (the message names token, slot, value and rule).
    """
    _check_positive_int("experts_per_rank", experts_per_rank)
    _check_positive_int("world_size", world_size)
    indices = check_tensor("indices", indices, dtype=torch.int32, dim=2)
    _check_expert_ids("indices", indices, world_size * experts_per_rank)
    return _route(indices, experts_per_rank, world_size)


@attrs.frozen
class RecvRows:
    """The rows one rank received from a dispatch (R rows, possibly 0).

    Attributes:
        x: [R, H] tokens, the source dtype, bit-equal to the source rows.
        weights: [R, K] float32, the sender's full top-k weights row.
        indices: [R, K] int32, the sender's full top-k expert ids row.
        scales: [R, S] the sender's scales row (its dtype), or None when dispatch had no scales.
        src: [R, 2] int32 (source rank, source token) of each row.

    Raises:
        ValueError: on construction, when a field is not 2-D or the row counts disagree.
    """

    x: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    scales: torch.Tensor | None
    src: torch.Tensor

    def __attrs_post_init__(self):
        src = check_tensor("RecvRows.src", self.src, dtype=torch.int32, shape=(None, 2))
        rows = src.shape[0]
        for name in ("x", "weights", "indices", "scales"):
            value = getattr(self, name)
            if value is None and name == "scales":
                continue
            value = check_tensor(f"RecvRows.{name}", value, dim=2)
            if value.shape[0] != rows:
                raise ValueError(
                    f"RecvRows.{name}: {value.shape[0]} rows must match the {rows} rows of RecvRows.src"
                )

    @property
    def num_rows(self) -> int:
        """R, the number of received rows."""
        return self.src.shape[0]


def _validate_dispatch(xs, weights, indices, scales, experts_per_rank) -> None:
    _check_positive_int("experts_per_rank", experts_per_rank)
    if not isinstance(xs, (list, tuple)) or len(xs) == 0:
        raise ValueError("xs: must be a non-empty list with one [T_r, H] tensor per rank")
    world = len(xs)
    lists = {"weights": weights, "indices": indices}
    if scales is not None:
        lists["scales"] = scales
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{name}: must be a list of {world} tensors (one per rank, like xs), got {got}")

    x0 = check_tensor("xs[rank 0]", xs[0], dim=2)
    w0 = check_tensor("weights[rank 0]", weights[0], dim=2)
    i0 = check_tensor("indices[rank 0]", indices[0], dim=2)
    hidden, dtype, device, topk = x0.shape[1], x0.dtype, x0.device, w0.shape[1]
    if i0.shape[1] != topk:
        raise ValueError(f"weights[rank 0] has {topk} columns, indices[rank 0] has {i0.shape[1]}: both must be "
                         "[T, K] with the same top-k K")
    s0 = check_tensor("scales[rank 0]", scales[0], dim=2) if scales is not None else None
    for r in range(world):
        x = check_tensor(f"xs[rank {r}]", xs[r], dim=2)
        tokens = x.shape[0]
        if x.shape[1] != hidden or x.dtype != dtype or x.device != device:
            raise ValueError(
                f"xs[rank {r}]: shape {tuple(x.shape)} {x.dtype} on {x.device} must be [T, {hidden}] "
                f"{dtype} on {device} (same H, dtype and device on every rank)"
            )
        expect = {
            "weights": (weights[r], (tokens, topk), torch.float32),
            "indices": (indices[r], (tokens, topk), torch.int32),
        }
        if scales is not None:
            expect["scales"] = (scales[r], (tokens, s0.shape[1]), s0.dtype)
        for name, (value, shape, want_dtype) in expect.items():
            t = check_tensor(f"{name}[rank {r}]", value, dim=2)
            if tuple(t.shape) != shape or t.dtype != want_dtype or t.device != device:
                raise ValueError(
                    f"{name}[rank {r}]: shape {tuple(t.shape)} {t.dtype} on {t.device} must be "
                    f"{list(shape)} {want_dtype} on {device} (T of xs[rank {r}], same width and dtype "
                    f"on every rank)"
                )
        _check_expert_ids(f"indices[rank {r}]", indices[r], world * experts_per_rank)


def dispatch(
    xs: list[torch.Tensor],
    weights: list[torch.Tensor],
    indices: list[torch.Tensor],
    *,
    experts_per_rank: int,
    scales: list[torch.Tensor] | None = None,
    max_recv_tokens: int | None = None,
) -> list[RecvRows]:
    """Simulate dispatch on all ranks; W = len(xs).

    Args:
        xs: per rank r, [T_r, H] tokens (any dtype, the same on every rank; T_r may be 0).
        weights: per rank, [T_r, K] float32 top-k weights.
        indices: per rank, [T_r, K] int32 top-k expert ids (-1 = no expert).
        experts_per_rank: L (>= 1).
        scales: None, or per rank [T_r, S] (any dtype, the same S and dtype on every rank).
        max_recv_tokens: None (no cap), or N >= 1: the most rows one rank may receive.

    Returns:
        One RecvRows per destination rank d, rows ordered by (source rank, source token): every
        token of every rank whose valid experts include one on rank d, once (see ``route``).
        ``scales`` is None in every RecvRows when ``scales`` was None.

    Raises:
        ValueError: list lengths differ from W; a tensor not 2-D; shapes, dtypes or devices
            inconsistent (the message names argument, rank, value and rule); an expert id that is
            neither -1 nor in [0, W * L) (names argument, rank, token, slot, value and rule);
            max_recv_tokens not None nor an int >= 1; some rank would receive more than
            max_recv_tokens rows (names the first such rank, the rows it needs and the cap; raised
            before any row is gathered).
    """
    _validate_dispatch(xs, weights, indices, scales, experts_per_rank)
    if max_recv_tokens is not None:
        _check_positive_int("max_recv_tokens", max_recv_tokens)
    world = len(xs)
    slots = [_route(indices[r], experts_per_rank, world) for r in range(world)]  # per rank [T_r, W]
    if max_recv_tokens is not None:
        needed = sum((s >= 0).sum(dim=0) for s in slots).tolist()  # [W] rows each rank receives
        over = [d for d in range(world) if needed[d] > max_recv_tokens]
        if over:
            d = over[0]
            more = f" (ranks over the cap: {over})" if len(over) > 1 else ""
            raise ValueError(
                f"max_recv_tokens={max_recv_tokens}: rank {d} would receive {needed[d]} rows, more than "
                f"the cap{more}"
            )
    out = []
    for d in range(world):
        parts = {"x": [], "weights": [], "indices": [], "scales": [], "src": []}
        for r in range(world):
            tok = (slots[r][:, d] >= 0).nonzero().flatten()  # ascending source token
            parts["x"].append(xs[r][tok])
            parts["weights"].append(weights[r][tok])
            parts["indices"].append(indices[r][tok])
            if scales is not None:
                parts["scales"].append(scales[r][tok])
            src = torch.stack([torch.full_like(tok, r), tok], dim=1).to(torch.int32)
            parts["src"].append(src)
        out.append(
            RecvRows(
                x=torch.cat(parts["x"]),
                weights=torch.cat(parts["weights"]),
                indices=torch.cat(parts["indices"]),
                scales=torch.cat(parts["scales"]) if scales is not None else None,
                src=torch.cat(parts["src"]),
            )
        )
    return out


def combine(ys: list[torch.Tensor], recv: list[RecvRows], num_tokens: list[int]) -> list[torch.Tensor]:
    """Simulate combine on all ranks after a dispatch; W = len(ys).

    Args:
        ys: per rank d, [R_d, H] expert outputs (floating dtype, the same on every rank), row i
            belonging to the received row i of ``recv[d]``.
        recv: per rank d, the RecvRows that rank received (gives each row's (source rank, token)).
        num_tokens: per rank r, T_r (the token count rank r dispatched).

    Returns:
        Per rank r, [T_r, H] in the dtype of ys: out_r[t] = sum over the ranks d holding a row for
        (r, t), in ascending d, of that row of ys[d], accumulated in float32 and cast once. A token
        that reached no rank gets zeros.

    Raises:
        ValueError: list lengths differ; ys[d] not 2-D, not floating, not R_d rows, or H / dtype
            differing across ranks; a recv src pair outside [0, W) x [0, T_r), or one pair received
            twice by the same rank.
    """
    if not isinstance(ys, (list, tuple)) or len(ys) == 0:
        raise ValueError("ys: must be a non-empty list with one [R_d, H] tensor per rank")
    world = len(ys)
    for name, value in (("recv", recv), ("num_tokens", num_tokens)):
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{name}: must be a list of {world} entries (one per rank, like ys), got {got}")
    num_tokens = list(num_tokens)
    for r, t in enumerate(num_tokens):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0:
            raise ValueError(f"num_tokens[rank {r}]={t!r}: must be an int >= 0")
        num_tokens[r] = int(t)
    y0 = check_tensor("ys[rank 0]", ys[0], dim=2)
    hidden, dtype, device = y0.shape[1], y0.dtype, y0.device
    if not dtype.is_floating_point:
        raise ValueError(f"ys[rank 0]: dtype {dtype} must be a floating dtype")

    offsets = [0]
    for t in num_tokens:
        offsets.append(offsets[-1] + t)
    offsets_t = torch.tensor(offsets[:-1], dtype=torch.int64, device=device)
    limits_t = torch.tensor(num_tokens, dtype=torch.int64, device=device)
    acc = torch.zeros(offsets[-1], hidden, dtype=torch.float32, device=device)

    for d in range(world):
        y = check_tensor(f"ys[rank {d}]", ys[d], dim=2)
        if not isinstance(recv[d], RecvRows):
            raise ValueError(f"recv[rank {d}]: must be a RecvRows, got {type(recv[d]).__name__}")
        rows = recv[d].num_rows
        if tuple(y.shape) != (rows, hidden) or y.dtype != dtype or y.device != device:
            raise ValueError(
                f"ys[rank {d}]: shape {tuple(y.shape)} {y.dtype} on {y.device} must be [{rows}, {hidden}] "
                f"{dtype} on {device} (one row per received row of rank {d}; same H, dtype, device on "
                f"every rank)"
            )
        src = recv[d].src.to(device=device, dtype=torch.int64)
        src_rank, src_tok = src[:, 0], src[:, 1]
        bad_rank = (src_rank < 0) | (src_rank >= world)
        if bool(bad_rank.any()):
            i = int(bad_rank.nonzero()[0])
            raise ValueError(f"recv[rank {d}].src[{i}]={tuple(src[i].tolist())}: source rank must be in [0, {world})")
        bad_tok = (src_tok < 0) | (src_tok >= limits_t[src_rank])
        if bool(bad_tok.any()):
            i = int(bad_tok.nonzero()[0])
            r, t = src[i].tolist()
            raise ValueError(
                f"recv[rank {d}].src[{i}]=({r}, {t}): source token must be in [0, {num_tokens[r]}) "
                f"(num_tokens[rank {r}])"
            )
        flat = offsets_t[src_rank] + src_tok
        if flat.unique().numel() != flat.numel():
            dup = [p for p, n in Counter(map(tuple, src.tolist())).items() if n > 1]
            raise ValueError(
                f"recv[rank {d}].src: (source rank, source token) pairs {dup[:5]} appear more than "
                f"once; a rank receives each token at most once"
            )
        # Each target appears at most once per d, so this adds one term per token per rank d.
        acc.index_add_(0, flat, y.to(torch.float32))

    out = acc.to(dtype)
    return [out[offsets[r] : offsets[r + 1]].clone() for r in range(world)]


def combine_hierarchical(
    ys: list[torch.Tensor],
    recv: list[RecvRows],
    num_tokens: list[int],
    *,
    gpus_per_node: int,
    combine_quant: str = "none",
    fp8_flavour: str = "e4m3fn",
) -> list[torch.Tensor]:
    """Simulate the hierarchical combine (N nodes of G ranks) on all ranks; W = len(ys) = N x G.

    With wire_d = ``epgen.quant.combine_roundtrip(combine_quant, ys[d], fp8_flavour=fp8_flavour)``
    (what the node-local combine delivers from rank d): P_n(r, t) = bf16 of the fp32 sum, in
    ascending d over node n's ranks [n G, (n + 1) G), of wire_d's row for (r, t) (0 where t reached
    no rank of n); out_r[t] = bf16 of the fp32 sum of P_n(r, t) in ascending n. A token that
    reached no rank gets zeros. With N = 1 (G = W) this is ``combine`` of the wire rows.

    Args:
        ys: per rank d, [R_d, H] bfloat16 expert outputs, row i for received row i of ``recv[d]``.
        recv: per rank d, its RecvRows (``dispatch`` with W = N x G ranks; (source rank, source
            token) are global).
        num_tokens: per rank r, T_r.
        gpus_per_node: G (>= 1), dividing W.
        combine_quant: the combine wire (``epgen.codegen.dtypes.COMBINE_QUANTS``), applied by the
            node-local leg to each rank's rows.
        fp8_flavour: the fp8 flavour of an fp8 wire's codes, the node-local op's arch's
            (``epgen.quant.arch_fp8_flavour``; "e4m3fnuz" on gfx942); default "e4m3fn".

    Returns:
        Per rank r, [T_r, H] bfloat16.

    Raises:
        ValueError: G not a positive int dividing W; ys[d] not 2-D bfloat16; an unknown
            combine_quant or fp8_flavour, or a non-finite y for a blockwise mode
            (``combine_roundtrip``); as ``combine``.
    """
    if not isinstance(ys, (list, tuple)) or len(ys) == 0:
        raise ValueError("ys: must be a non-empty list with one [R_d, H] tensor per rank")
    _check_positive_int("gpus_per_node", gpus_per_node)
    world = len(ys)
    if world % gpus_per_node:
        raise ValueError(f"gpus_per_node={gpus_per_node}: must divide the {world} ranks of ys")
    for d, y in enumerate(ys):
        check_tensor(f"ys[rank {d}]", y, dtype=torch.bfloat16, dim=2)
    wire = [combine_roundtrip(combine_quant, y, fp8_flavour=fp8_flavour) for y in ys]
    acc = None
    for n in range(world // gpus_per_node):
        mine = range(n * gpus_per_node, (n + 1) * gpus_per_node)
        # The other nodes' rows as +0.0: the fp32 sum from +0.0 is unchanged by adding them.
        partial = combine([w if d in mine else torch.zeros_like(w) for d, w in enumerate(wire)], recv, num_tokens)
        partial = [p.to(torch.bfloat16).to(torch.float32) for p in partial]
        acc = partial if acc is None else [a + p for a, p in zip(acc, partial)]
    return [a.to(torch.bfloat16) for a in acc]


# --- expert-major layout and weighted combine ----------------------------------------------------


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A [R, C] tensor's bytes as [R, C * itemsize] uint8 (gathers then move any dtype bit for bit)."""
    return t.contiguous().view(torch.uint8)


@attrs.frozen
class ExpertRows:
    """One rank's received rows in the expert-major layout (R expanded rows, padding included).

    Local expert e (global id d * L + e on rank d) owns rows [offsets[e], offsets[e] + counts[e]),
    in ascending receive row; rows [offsets[e] + counts[e], offsets[e + 1]) are padding.

    Attributes:
        x: [R, cols] the received payload rows (the source dtype, bit-equal); padding rows zero.
        scales: [R, S] the received scales rows (their dtype), padding rows zero; or None when the
            dispatch had no scales.
        weights: [R] float32, the expert's weight for the row (the sum over the top-k slots naming
            it, added in ascending slot order); padding 0.0.
        src: [R, 3] int32 (source rank, source token, first top-k slot naming the expert); padding
            (-1, -1, -1).
        counts: [L] int32 rows per local expert, padding excluded.
        offsets: [L + 1] int32 group starts; offsets[0] = 0, offsets[L] = R.
        recv_row: [R] int64 the rank's receive row (``RecvRows`` row) each row was expanded from;
            -1 on padding.

    Raises:
        ValueError: on construction, when a field has the wrong rank, row count or dtype; counts
            negative; offsets not starting at 0, a group shorter than its count, offsets[L] != R;
            or recv_row not >= 0 exactly on the rows of the groups and -1 on the padding.
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    weights: torch.Tensor
    src: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    recv_row: torch.Tensor

    def __attrs_post_init__(self):
        src = check_tensor("ExpertRows.src", self.src, dtype=torch.int32, shape=(None, 3))
        rows = src.shape[0]
        for name in ("x", "scales"):
            value = getattr(self, name)
            if value is None and name == "scales":
                continue
            value = check_tensor(f"ExpertRows.{name}", value, dim=2)
            if value.shape[0] != rows:
                raise ValueError(
                    f"ExpertRows.{name}: {value.shape[0]} rows must match the {rows} rows of ExpertRows.src"
                )
        counts = check_tensor("ExpertRows.counts", self.counts, dtype=torch.int32, dim=1)
        if counts.shape[0] < 1:
            raise ValueError(f"ExpertRows.counts.shape={list(counts.shape)}: must be [L] with L >= 1")
        local = counts.shape[0]
        for name, length, dtype in (("weights", rows, torch.float32), ("offsets", local + 1, torch.int32),
                                    ("recv_row", rows, torch.int64)):
            check_tensor(f"ExpertRows.{name}", getattr(self, name), dtype=dtype, shape=(length,))
        cnt, off = counts.tolist(), self.offsets.tolist()
        if min(cnt) < 0:
            raise ValueError(f"ExpertRows.counts={cnt}: must be >= 0")
        if off[0] != 0 or off[-1] != rows or any(off[e + 1] - off[e] < cnt[e] for e in range(local)):
            raise ValueError(f"ExpertRows.offsets={off}: must start at 0, end at R={rows} and leave each "
                             f"expert e at least counts[e] rows (counts={cnt})")
        in_group = torch.zeros(rows, dtype=torch.bool, device=self.recv_row.device)
        for e in range(local):
            in_group[off[e] : off[e] + cnt[e]] = True
        wrong = torch.where(in_group, self.recv_row < 0, self.recv_row != -1)
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0])
            raise ValueError(f"ExpertRows.recv_row[{i}]={int(self.recv_row[i])}: must be >= 0 on the rows of an "
                             f"expert group and -1 on padding (offsets={off}, counts={cnt})")

    @property
    def num_rows(self) -> int:
        """R = offsets[L], the number of expanded rows, padding included."""
        return self.src.shape[0]

    @property
    def experts_per_rank(self) -> int:
        """L, the number of local experts."""
        return self.counts.shape[0]


def _check_alignment(alignment) -> None:
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1
            or alignment & (alignment - 1)):
        raise ValueError(f"alignment={alignment!r}: must be a power of two >= 1")


def _expand_rank(d: int, rows: RecvRows, local: int, alignment: int, world: int) -> ExpertRows:
    """expand() for rank d after the list checks."""
    name = f"recv[rank {d}]"
    idx, w = rows.indices, rows.weights
    if idx.dtype != torch.int32 or w.dtype != torch.float32 or idx.shape != w.shape:
        raise ValueError(f"{name}: indices {tuple(idx.shape)} {idx.dtype} and weights {tuple(w.shape)} {w.dtype} "
                         f"must be [R, K] torch.int32 and [R, K] torch.float32")
    _check_expert_ids(f"{name}.indices", idx, world * local)
    device = idx.device
    n, topk = idx.shape
    e_all = idx.to(torch.int64) - d * local
    valid = (idx >= 0) & (e_all >= 0) & (e_all < local)  # [n, K] slots naming an expert of rank d
    lonely = ~valid.any(dim=1)
    if bool(lonely.any()):
        i = int(lonely.nonzero()[0])
        raise ValueError(f"{name}.indices[row {i}]={idx[i].tolist()}: names no expert of rank {d} (ids "
                         f"{d * local}..{d * local + local - 1}); every received row names at least one")

    # Valid slots in (row, slot) order; a stable sort by (row, expert) keeps ascending slots together.
    e_row = torch.arange(n, device=device)[:, None].expand(n, topk)[valid]
    e_slot = torch.arange(topk, device=device)[None, :].expand(n, topk)[valid]
    e_exp = e_all[valid]
    e_w = w[valid]
    order = torch.argsort(e_row * local + e_exp, stable=True)
    e_row, e_slot, e_exp, e_w = e_row[order], e_slot[order], e_exp[order], e_w[order]
    first = torch.ones(e_row.shape[0], dtype=torch.bool, device=device)
    first[1:] = (e_row[1:] != e_row[:-1]) | (e_exp[1:] != e_exp[:-1])
    starts = first.nonzero().flatten()  # one per distinct (row, expert) pair
    sizes = torch.diff(starts, append=torch.tensor([e_row.shape[0]], device=device))
    p_row, p_slot, p_exp = e_row[starts], e_slot[starts], e_exp[starts]
    p_w = e_w[starts].clone()
    for j in range(1, int(sizes.max()) if sizes.numel() else 1):  # fp32 sum, ascending slot order
        more = sizes > j
        p_w[more] = p_w[more] + e_w[starts[more] + j]

    # Expert-major: by expert, then ascending receive row (the (row, expert) pairs are distinct).
    order = torch.argsort(p_exp * n + p_row)
    p_row, p_slot, p_exp, p_w = p_row[order], p_slot[order], p_exp[order], p_w[order]
    counts = torch.bincount(p_exp, minlength=local)
    padded = (counts + alignment - 1) // alignment * alignment
    offsets = torch.zeros(local + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts  # first sorted pair of each expert
    dest = offsets[p_exp] + torch.arange(p_row.shape[0], device=device) - group_start[p_exp]

    total = int(offsets[-1])
    recv_row = torch.full((total,), -1, dtype=torch.int64, device=device)
    recv_row[dest] = p_row
    padding = recv_row < 0
    gather = recv_row.clamp(min=0)  # total > 0 implies n > 0: row 0 exists

    def gathered(t: torch.Tensor) -> torch.Tensor:
        out = _raw_bytes(t).index_select(0, gather)  # one pass over the (large) payload
        out[padding] = 0
        return out.view(t.dtype)

    weights = torch.zeros(total, dtype=torch.float32, device=device)
    weights[dest] = p_w
    src = torch.full((total, 3), -1, dtype=torch.int32, device=device)
    src[dest, :2] = rows.src[p_row].to(device=device, dtype=torch.int32)
    src[dest, 2] = p_slot.to(torch.int32)
    scales = gathered(rows.scales) if rows.scales is not None else None
    return ExpertRows(x=gathered(rows.x), scales=scales, weights=weights, src=src, counts=counts.to(torch.int32),
                      offsets=offsets.to(torch.int32), recv_row=recv_row)


def expand(recv: list[RecvRows], *, experts_per_rank: int, alignment: int = 1) -> list[ExpertRows]:
    """Expand every rank's receive rows into the expert-major layout; W = len(recv).

    On rank d each received row i becomes one row per DISTINCT local expert e (global id d * L + e)
    its indices row names: x and scales row i bit for bit, weight = the fp32 sum of the weights of
    the slots naming e, added in ascending slot order, src = (source rank, source token, first such
    slot), recv_row = i. Expert e's rows start at offsets[e], a multiple of ``alignment``, in
    ascending receive row, and are followed by padding up to the next multiple.

    Args:
        recv: per rank d, the RecvRows of a dispatch (``dispatch``), R_d rows of [R_d, K] int32
            indices and [R_d, K] float32 weights.
        experts_per_rank: L (>= 1).
        alignment: A, a power of two >= 1.

    Returns:
        Per rank d, ExpertRows with offsets[e + 1] = offsets[e] + roundup(counts[e], A); at most
        R_d * min(K, L) + L * (A - 1) rows.

    Raises:
        ValueError: recv not a non-empty list of RecvRows; L not a positive int; A not a power of
            two >= 1; indices / weights not [R, K] int32 / float32; an expert id neither -1 nor in
            [0, W * L); a received row naming no expert of its rank (names rank, row and ids).
    """
    if not isinstance(recv, (list, tuple)) or len(recv) == 0:
        raise ValueError("recv: must be a non-empty list with one RecvRows per rank")
    _check_positive_int("experts_per_rank", experts_per_rank)
    _check_alignment(alignment)
    for d, rows in enumerate(recv):
        if not isinstance(rows, RecvRows):
            raise ValueError(f"recv[rank {d}]: must be a RecvRows, got {type(rows).__name__}")
    return [_expand_rank(d, rows, experts_per_rank, alignment, len(recv)) for d, rows in enumerate(recv)]


def _fold(y, rows, num_recv_rows, y_name: str, rows_name: str) -> torch.Tensor:
    """fold() with the argument names its messages use."""
    if not isinstance(rows, ExpertRows):
        raise ValueError(f"{rows_name}: must be an ExpertRows, got {type(rows).__name__}")
    if not isinstance(num_recv_rows, numbers.Integral) or isinstance(num_recv_rows, bool) or num_recv_rows < 0:
        raise ValueError(f"num_recv_rows={num_recv_rows!r}: must be an int >= 0")
    y = check_tensor(y_name, y, dtype=torch.bfloat16, dim=2)
    used = rows.num_rows
    if y.shape[0] < used:
        raise ValueError(f"{y_name}: n={y.shape[0]} rows, fewer than offsets[L]={used} of {rows_name}: y must hold "
                         f"n >= offsets[L] rows (rows >= offsets[L] are not read)")
    device = y.device
    recv_row = rows.recv_row.to(device)
    live = (recv_row >= 0).nonzero().flatten()  # the group rows
    keys = torch.stack([recv_row[live], rows.src[live, 2].to(device=device, dtype=torch.int64)], dim=1)
    if bool((keys[:, 0] >= num_recv_rows).any()):
        i = int(live[keys[:, 0] >= num_recv_rows][0])
        raise ValueError(f"{rows_name}.recv_row[{i}]={int(recv_row[i])}: must be < num_recv_rows={num_recv_rows}")
    terms = torch.bincount(keys[:, 0], minlength=num_recv_rows)
    if bool((terms == 0).any()):
        i = int((terms == 0).nonzero()[0])
        raise ValueError(f"{rows_name}: receive row {i} has no expanded row; every received row names at least one "
                         f"local expert")
    order = _lex_order(keys)  # by receive row, then ascending first slot
    live, keys = live[order], keys[order]
    if _has_duplicates(keys):
        raise ValueError(f"{rows_name}: two expanded rows share a (receive row, slot) pair; a row's experts have "
                         f"distinct first slots")
    run_start = torch.cumsum(terms, 0) - terms
    pos = torch.arange(live.shape[0], device=device) - run_start[keys[:, 0]]
    weights = rows.weights.to(device)
    acc = torch.zeros(num_recv_rows, y.shape[1], dtype=torch.float32, device=device)
    for j in range(int(terms.max()) if num_recv_rows else 0):
        sel = pos == j
        target, src_row = keys[sel, 0], live[sel]  # each receive row at most once per j
        product = y.index_select(0, src_row).to(torch.float32)
        product.mul_(weights[src_row][:, None])  # rounded to fp32 on its own ...
        acc.index_add_(0, target, product)  # ... then one fp32 add per row: no fused multiply-add
    return acc.to(torch.bfloat16)


def fold(y: torch.Tensor, rows: ExpertRows, num_recv_rows: int) -> torch.Tensor:
    """Weighted sum of one rank's expert outputs per receive row (the combine's local stage).

    F[i] = bf16(acc), acc = 0.0 (fp32), then for each expanded row j of receive row i in ascending
    first slot (src[j, 2]): acc = acc + (weights[j] * float32(y[j])), the product rounded to fp32
    and then the sum rounded to fp32 (not a fused multiply-add); rounded to bf16 once (nearest
    even).

    Args:
        y: [n, H] bfloat16 expert outputs in the expert-major layout of ``rows``, n >= offsets[L]
            (rows >= offsets[L] and padding rows are not read).
        rows: the rank's ExpertRows.
        num_recv_rows: R_d, the rank's receive rows (``RecvRows.num_rows``).

    Returns:
        [num_recv_rows, H] bfloat16, on y's device.

    Raises:
        ValueError: y not 2-D bfloat16, or n < offsets[L] (names y, n and the rule); rows not an
            ExpertRows; num_recv_rows not an int >= 0; a recv_row >= num_recv_rows; a receive row
            with no expanded row; two expanded rows with the same (receive row, slot).
    """
    return _fold(y, rows, num_recv_rows, "y", "rows")


def combine_weighted(
    ys: list[torch.Tensor],
    expert: list[ExpertRows],
    recv: list[RecvRows],
    num_tokens: list[int],
    *,
    combine_quant: str = "none",
    fp8_flavour: str = "e4m3fn",
) -> list[torch.Tensor]:
    """Simulate the weighted combine of the expert-major layout on all ranks; W = len(ys).

    Per rank d: F_d = ``fold(ys[d], expert[d], recv[d].num_rows)``; G_d =
    ``epgen.quant.combine_roundtrip(combine_quant, F_d, fp8_flavour=fp8_flavour)``, the wire (F_d
    itself for "none");
    out_r[t] = bf16 of the fp32 sum, in ascending d, of G_d's row for (r, t) (``combine``). A token
    that reached no rank gets zeros.

    Args:
        ys: per rank d, [n_d, H] bfloat16 expert outputs in the layout of expert[d], n_d >=
            expert[d].offsets[L].
        expert: per rank d, the ExpertRows of ``expand``.
        recv: per rank d, the RecvRows expert[d] was expanded from.
        num_tokens: per rank r, T_r.
        combine_quant: the combine wire mode (``epgen.codegen.dtypes.COMBINE_QUANTS``).
        fp8_flavour: the fp8 flavour of an fp8 wire's codes, the op's arch's
            (``epgen.quant.arch_fp8_flavour``; "e4m3fnuz" on gfx942); default "e4m3fn".

    Returns:
        Per rank r, [T_r, H] bfloat16.

    Raises:
        ValueError: list lengths differ; as ``fold`` (naming ys[rank d] and expert[rank d]); an
            expanded row whose (source rank, source token) differs from that of its receive row;
            an unknown combine_quant or fp8_flavour, or a non-finite F for a blockwise mode
            (``combine_roundtrip``); as ``combine``.
    """
    if not isinstance(ys, (list, tuple)) or len(ys) == 0:
        raise ValueError("ys: must be a non-empty list with one [n_d, H] tensor per rank")
    world = len(ys)
    for name, value in (("expert", expert), ("recv", recv), ("num_tokens", num_tokens)):
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{name}: must be a list of {world} entries (one per rank, like ys), got {got}")
    wire = []
    for d in range(world):
        if not isinstance(recv[d], RecvRows):
            raise ValueError(f"recv[rank {d}]: must be a RecvRows, got {type(recv[d]).__name__}")
        y = check_tensor(f"ys[rank {d}]", ys[d], dim=2)
        if y.shape[1] != check_tensor("ys[rank 0]", ys[0], dim=2).shape[1]:
            raise ValueError(f"ys[rank {d}]: shape {tuple(y.shape)} {y.dtype}: hidden size {y.shape[1]} must be "
                             f"ys[rank 0]'s {ys[0].shape[1]} (the same H on every rank)")
        folded = _fold(ys[d], expert[d], recv[d].num_rows, f"ys[rank {d}]", f"expert[rank {d}]")
        live = (expert[d].recv_row >= 0).nonzero().flatten()
        pairs = expert[d].src[live, :2].to(torch.int64).cpu()
        sent = recv[d].src.to(torch.int64).cpu()[expert[d].recv_row[live].cpu()]
        if not torch.equal(pairs, sent):
            j = int(live.cpu()[(pairs != sent).any(dim=1).nonzero()[0]])
            i = int(expert[d].recv_row[j])
            raise ValueError(f"expert[rank {d}].src[{j}]={expert[d].src[j].tolist()}: (source rank, source token) "
                             f"must be recv[rank {d}].src[{i}]={recv[d].src[i].tolist()}, its receive row's")
        wire.append(combine_roundtrip(combine_quant, folded, fp8_flavour=fp8_flavour))
    return [out.to(torch.bfloat16) for out in combine(wire, recv, num_tokens)]


def _lex_order(keys: torch.Tensor) -> torch.Tensor:
    """Permutation sorting [R, C] rows lexicographically (column 0 first, then column 1, ...)."""
    order = torch.arange(keys.shape[0], device=keys.device)
    for c in reversed(range(keys.shape[1])):
        order = order[torch.argsort(keys[order, c], stable=True)]
    return order


def _has_duplicates(sorted_src: torch.Tensor) -> bool:
    return bool((sorted_src[1:] == sorted_src[:-1]).all(dim=1).any())


_KEY_LABELS = {2: "(rank, token)", 3: "(rank, token, slot)"}
"""How align_rows' messages name a key of 2 columns (receive rows) or 3 (expanded rows)."""


def align_rows(ref_src: torch.Tensor, test_src: torch.Tensor) -> torch.Tensor:
    """Map a kernel's rows onto the reference's by their integer keys (the orders may differ).

    The keys are the receive rows' (source rank, source token) pairs ([R, 2], ``RecvRows.src``) or
    the expanded rows' (source rank, source token, slot) triples ([R, 3], the non-padding rows of
    ``ExpertRows.src``); any C >= 2 columns work.

    Args:
        ref_src: [R, C] integer keys of the reference rows.
        test_src: [R', C] integer keys of the rows under test (the same C).

    Returns:
        perm, int64 [R], with ``test_src[perm] == ref_src`` row for row.

    Raises:
        ValueError: an argument is not a 2-D integer tensor with C >= 2 columns, or the two have
            different column counts.
        AssertionError: the two sets of keys differ or either holds duplicates; the message gives
            both row counts, up to 5 missing keys (in ref, not in test), up to 5 extra keys (in
            test, not in ref) and up to 5 duplicated keys of each side.
    """
    for name, value in (("ref_src", ref_src), ("test_src", test_src)):
        t = check_tensor(name, value, dim=2)
        if t.shape[1] < 2 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name}: shape {tuple(t.shape)} {t.dtype} must be [R, C] integer with C >= 2")
    cols = ref_src.shape[1]
    if test_src.shape[1] != cols:
        raise ValueError(f"test_src: shape {tuple(test_src.shape)} must have the {cols} columns of ref_src")
    ref = ref_src.to(torch.int64).cpu()
    test = test_src.to(torch.int64).cpu()
    ref_order, test_order = _lex_order(ref), _lex_order(test)
    ref_sorted, test_sorted = ref[ref_order], test[test_order]
    if (
        ref.shape == test.shape
        and torch.equal(ref_sorted, test_sorted)
        and not _has_duplicates(ref_sorted)
    ):
        perm = torch.empty(ref.shape[0], dtype=torch.int64)
        perm[ref_order] = test_order
        return perm.to(test_src.device)

    ref_count = Counter(map(tuple, ref.tolist()))
    test_count = Counter(map(tuple, test.tolist()))
    missing = sorted(set(ref_count) - set(test_count))
    extra = sorted(set(test_count) - set(ref_count))
    dup_ref = sorted(p for p, n in ref_count.items() if n > 1)
    dup_test = sorted(p for p, n in test_count.items() if n > 1)
    key = _KEY_LABELS.get(cols, f"({cols}-column key)")
    what = "receive rows" if cols == 2 else "rows"
    lines = [f"{what} differ: reference has {ref.shape[0]} rows, test has {test.shape[0]} rows"]
    for label, keys in (
        (f"missing from test {key}", missing),
        (f"extra in test {key}", extra),
        (f"duplicated in test {key}", dup_test),
        (f"duplicated in reference {key}", dup_ref),
    ):
        if keys:
            more = f" ... ({len(keys)} in all)" if len(keys) > 5 else ""
            lines.append(f"  {label}: {keys[:5]}{more}")
    raise AssertionError("\n".join(lines))


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||out - ref|| / ||ref||, computed in float64.

    Args:
        out: tensor under test (any real dtype).
        ref: reference tensor, same shape.

    Returns:
        The ratio as a float; 0.0 when both are all-zero (or empty); inf when ref is all-zero and
        out is not; inf when either holds a NaN or an infinity.

    Raises:
        ValueError: shapes differ.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out: shape {tuple(out.shape)} must equal ref shape {tuple(ref.shape)}")
    o = out.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    if not (bool(torch.isfinite(o).all()) and bool(torch.isfinite(r).all())):
        return float("inf")
    diff = float(torch.linalg.vector_norm(o - r))
    norm = float(torch.linalg.vector_norm(r))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm
