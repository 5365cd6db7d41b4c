"""Differentiable dispatch and combine: ``torch.autograd.Function``s over ``EpDispatchCombine``
whose backward runs the op's own kernels along the forward dispatch's kept layout
(``EpDispatchCombine.keep_layout``).

    d = epgen.autograd.dispatch(op, x, weights, indices)   # x [T, H] bf16, weights [T, K] fp32
    y = experts(d.x, ...)                                   # any differentiable torch code
    out = epgen.autograd.combine(op, y, d)                  # [T, H] bf16

The derivatives (W ranks; ``slot(t, d)`` the receive row of token t on rank d, the layout):

* dispatch, rank layout: ``recv_x[d][slot(t, d)] = x[t]`` and ``recv_weights[d][slot(t, d)] =
  weights[t]`` for every rank d that token t reached. Backward: ``grad_x[t] = sum_d
  grad_recv_x[d][slot(t, d)]``, which is the combine of the row gradients along the layout
  (``combine(g, layout=...)``: fp32 sum in ascending rank, rounded to bf16 once, through the
  op's combine wire); ``grad_weights[t, k] = sum_d grad_recv_weights[d][slot(t, d), k]``.
* dispatch, expert layout: expanded row p of (token t, local expert e) holds ``x[t]`` and the
  weight ``w_p = sum of weights[t, k] over the slots k naming e``. Backward: ``grad_x[t] =
  sum_d bf16(sum_{p of t on d} grad_x_p)`` (``combine(g, layout=..., weighted=False)``) and
  ``grad_weights[t, k] = grad_w_p`` of the row p whose expert slot k names.
* combine, rank layout: ``out[t] = sum_d y[d][slot(t, d)]``. Backward: ``grad_y[d][i] =
  grad_out[s][t]`` for receive row i = slot(t, d) of token t of rank s: the cached-layout
  dispatch of the output gradients (``dispatch(g, layout=...)``, bit-exact).
* combine, expert layout: ``out[t] = sum_d sum_{p of t on d} w_p y_p``. Backward: with ``g_p``
  the cached dispatch of ``grad_out`` to expanded row p, ``grad_y_p = w_p g_p`` and ``grad_w_p =
  <y_p, g_p>`` (float32).

The routing-weight gradients travel back through the combine kernel too: each float32 value is
split into three bf16 numbers whose float32 sum is the value exactly (hi = bf16(v), mid =
bf16(v - hi), lo = bf16(v - hi - mid)), one column each, and every column receives a value from
at most one rank (the rank layout gives rank d its own 3 K columns, the expert layout's slot k
has one owning rank), so the combine's fp32 sum and its bf16 rounding are exact. This needs
3 K W <= H (rank layout) or 3 K <= H (expert layout) and the bf16 combine wire; it is one more
combine in the backward, run only when the routing weights need a gradient.

Quantized combine wires: the forward output carries the wire's rounding, and the combine's
backward treats that rounding as the identity (straight-through: ``grad_y`` is the exact cached
dispatch of ``grad_out``); the dispatch's backward sums the row gradients through the same wire,
so ``grad_x`` carries the wire's rounding of each rank's partial sum (``epgen.quant.combine_roundtrip``).
Routing-weight gradients need the bf16 wire and are refused on a quantized one.

Collectives: with one process a rank, the backward's kernels are collective like the forward's,
so every rank must run the backward of every dispatch and combine it ran forward, with the same
tensors requiring grad (x, weights, y) on every rank (a rank with no tokens included: its
outputs are empty tensors, whose gradients torch still passes).

Saved for backward: the layout's tables (``DispatchLayout.nbytes``), and for the expert layout's
combine its y and weights (to form ``grad_w_p``); the outputs are copies of the arena's rows
(rows past the ones received are zeros), so later calls on the op never change them. No host
synchronization anywhere.
"""

from __future__ import annotations

import attrs
import torch

import epgen.reference as ref
from epgen.codegen.config import EpConfig
from epgen.codegen.spec import Op
from epgen.op import DispatchOutput, EpDispatchCombine, ExpertDispatchOutput
from epgen.tensors import per_rank

__all__ = ["CombineFunction", "DispatchFunction", "Dispatched", "ReferenceEp", "combine", "dispatch"]


@attrs.frozen
class Dispatched:
    """What ``dispatch`` returns for the ranks this process drives (lists in virtual mode, one
    entry per rank; a tensor each with one rank a process).

    Attributes:
        x: rank layout [N, H] bf16, row i the token of receive row i (rows >= num_recv zeros);
            expert layout [R, H] bf16, row p the token of expanded row p (padding rows and rows
            >= offsets[L] zeros). Differentiable.
        weights: rank layout [N, K] float32, the sender's full weights row; expert layout [R]
            float32, the summed weight of the expanded row (0 for padding). Differentiable.
        indices: rank layout [N, K] int32; expert layout None.
        src: rank layout [N, 2] int32 (source rank, source token); expert layout [R, 3] int32
            (source rank, source token, first slot; -1 for padding).
        num_recv: [1] int32 device tensor, receive rows.
        offsets: expert layout [L + 1] int32 group starts (None in the rank layout).
        layout: the ``DispatchLayout`` the backward and ``combine`` use.
    """

    x: object
    weights: object
    indices: object
    src: object
    num_recv: object
    offsets: object
    layout: object

    def per_rank(self) -> list["Dispatched"]:
        """One Dispatched of tensors per rank this process drives (in virtual mode the lists
        split; else this one), all with the same layout."""
        if not isinstance(self.x, list):
            return [self]
        fields = ("x", "weights", "indices", "src", "num_recv", "offsets")
        return [Dispatched(**{f: getattr(self, f)[r] for f in fields}, layout=self.layout) for r in range(len(self.x))]


def _ops_checks(op, what: str, weights_grad: bool):
    """Refusals before any launch: a payload other than bf16, an op without the pull kernels that
    the cached dispatch needs, and routing-weight gradients that cannot travel exactly."""
    if not isinstance(op, EpDispatchCombine):
        return  # the reference stand-in takes every float dtype and moves values exactly
    cfg = op.config
    if cfg.dtype != "bf16":
        raise ValueError(f"{what}: EpConfig.dtype={cfg.dtype!r}: differentiable dispatch takes bf16 rows (their "
                         "gradients travel back as bf16). For fp8 training, quantize outside and dispatch a bf16 "
                         "op's rows, or treat the quantization as the identity in your own Function")
    if op.plan.routes.get((Op.DISPATCH, "normal", "pull", False)) is None:
        raise ValueError(f"{what}: the backward runs the cached-layout dispatch, which needs the pull kernels: build "
                         f"the op with EpConfig(dispatch_transport='pull') (it has {cfg.dispatch_transport!r}) and a "
                         f"normal family (it has {cfg.kernel_family!r})")
    if weights_grad:
        columns = 3 * cfg.topk * (1 if op.expert_layout else cfg.world_size)
        if columns > cfg.hidden:
            raise ValueError(f"{what}: routing-weight gradients travel as 3 bf16 columns per top-k slot"
                             f"{'' if op.expert_layout else ' and rank'}, {columns} columns, more than H={cfg.hidden}; "
                             "pass weights that do not require grad")
        if cfg.combine_quant != "none":
            raise ValueError(f"{what}: routing-weight gradients travel exactly only over the bf16 combine wire; "
                             f"EpConfig.combine_quant={cfg.combine_quant!r} (pass weights that do not require grad)")


def _row_dtype(op) -> torch.dtype:
    """The dtype of the rows (and of their gradients) that ``op`` moves: bf16 on the kernels,
    the stand-in's own (``ReferenceEp.dtype``)."""
    return op.dtype if isinstance(op, ReferenceEp) else torch.bfloat16


def _rows_below(rows: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[n, ...] rows with those at index >= count (a [1] device tensor) set to zero, no host sync."""
    keep = torch.arange(rows.shape[0], device=rows.device) < count.to(rows.device)
    return torch.where(keep.view(-1, *([1] * (rows.dim() - 1))), rows, torch.zeros((), dtype=rows.dtype,
                                                                                     device=rows.device))


def _rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the op takes rows: ``dtype``, contiguous, starting on a 16-byte boundary (the
    kernels read them with 16-byte vector loads; a gradient may be a view at any offset)."""
    t = t.to(dtype).contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def _split(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., 3] bf16 with (hi + mid) + lo == v exactly in float32 (module docstring) for bf16 rows;
    [..., 1] ``v`` itself for rows of a dtype that holds it."""
    if dtype != torch.bfloat16:
        return v.to(dtype)[..., None]
    hi = v.to(torch.bfloat16)
    r = v - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo], dim=-1)


def _join(columns: torch.Tensor) -> torch.Tensor:
    """[...] from ``_split``'s pieces [..., 3] bf16 ((hi + mid) + lo, float32) or [..., 1]."""
    if columns.shape[-1] == 1:
        return columns[..., 0]
    c = columns.float()
    return (c[..., 0] + c[..., 1]) + c[..., 2]


def _local(op) -> list[int]:
    return list(op.local_ranks)


def _per_rank(op, value) -> list:
    return list(value) if op.virtual else [value]


def _back(op, values: list):
    return values if op.virtual else values[0]


class DispatchFunction(torch.autograd.Function):
    """``dispatch`` as a ``torch.autograd.Function``: ``apply(op, indices, keep, *xs, *weights)``
    with n = len(op.local_ranks) tensors of each; returns the n dispatched x then the n weights
    (``Dispatched``'s); ``keep`` (a dict) passes the call's "family" in and receives the layout and
    the non-differentiable outputs."""

    @staticmethod
    def forward(ctx, op, indices, keep, *tensors):
        n = len(op.local_ranks)
        xs, ws = list(tensors[:n]), list(tensors[n:])
        family = {"family": keep["family"]} if keep.get("family") else {}
        outs = op.dispatch(_back(op, xs), _back(op, ws), _back(op, list(indices)), **family)
        layout = op.keep_layout()
        outs = _per_rank(op, outs)
        rx, rw = [], []
        for o in outs:
            if op.expert_layout:
                used = o.offsets[-1:]
                rx.append(_rows_below(o.x, used))
                rw.append(_rows_below(o.weights, used))
            else:
                rx.append(_rows_below(o.recv_x, o.num_recv))
                rw.append(_rows_below(o.recv_weights, o.num_recv))
        keep.update(layout=layout, outs=[_detached_meta(op, o) for o in outs])
        ctx.op, ctx.layout, ctx.n = op, layout, n
        return tuple(rx + rw)

    @staticmethod
    def backward(ctx, *grads):
        op, layout, n = ctx.op, ctx.layout, ctx.n
        gx, gw = list(grads[:n]), list(grads[n:])
        need_x = any(ctx.needs_input_grad[3:3 + n]) and any(g is not None for g in gx)
        need_w = any(ctx.needs_input_grad[3 + n:]) and any(g is not None for g in gw)
        grad_x = [None] * n
        grad_w = [None] * n
        if need_x:
            rows = [_zero_rows(op) if g is None else _rows(g, _row_dtype(op)) for g in gx]
            grad_x = _per_rank(op, op.combine(_back(op, rows), layout=layout, weighted=not op.expert_layout))
        if need_w:
            grad_w = _weight_grads(op, layout, gw)
        return (None, None, None, *grad_x, *grad_w)


def _zero_rows(op) -> torch.Tensor:
    rows = op.arena_layout.expert_rows if op.expert_layout else op.arena_layout.capacity_rows
    return torch.zeros(rows, op.config.hidden, dtype=_row_dtype(op), device=op.device)


def _detached_meta(op, o) -> dict:
    """The non-differentiable outputs of one rank's dispatch, copied out of the arena."""
    if op.expert_layout:
        used = o.offsets[-1:]
        return dict(indices=None, src=_rows_below(o.src, used).masked_fill(
            (torch.arange(o.src.shape[0], device=o.src.device) >= used)[:, None], -1),
                    num_recv=o.recv.num_recv.clone(), offsets=o.offsets.clone())
    return dict(indices=_rows_below(o.recv_indices, o.num_recv), src=_rows_below(o.recv_src, o.num_recv),
                num_recv=o.num_recv.clone(), offsets=None)


def _weight_grads(op, layout, grads: list) -> list:
    """The routing weights' gradients [T, K] float32 per rank from the dispatched weights'
    gradients, through one combine of exactly split columns (module docstring)."""
    cfg = op.config
    K, H, W = cfg.topk, cfg.hidden, cfg.world_size
    dtype = _row_dtype(op)
    c = 3 if dtype == torch.bfloat16 else 1  # columns a value takes
    ys = []
    for i, rank in enumerate(_local(op)):
        g = grads[i]
        if op.expert_layout:
            R = op.arena_layout.expert_rows
            rows = torch.zeros(R, H, dtype=dtype, device=op.device)
            if g is not None:
                slot_row = layout.table(rank, "slot_row")  # [N, K]: the expanded row of each first slot
                ids = layout.table(rank, "recv_indices")
                # slot k of row i feeds the expanded row of the first slot naming the same expert
                same = ids[:, :, None] == ids[:, None, :]  # [N, K, K]: slot k names slot j's expert
                first = same.to(torch.int32).argmax(dim=-1)  # the first such slot j <= k
                p = torch.gather(slot_row, 1, first)
                received = torch.arange(p.shape[0], device=p.device)[:, None] < layout.table(rank, "num_recv")
                p = torch.where(received & (ids // cfg.experts_per_rank == rank), p, -1)  # local experts only
                live = p >= 0
                values = torch.where(live, g[p.clamp(min=0)], 0.0)  # [N, K]
                pieces = _split(values, dtype)  # [N, K, c]
                target = p.clamp(min=0)[:, :, None].expand(-1, -1, c)
                column = (c * torch.arange(K, device=op.device)[:, None] + torch.arange(c, device=op.device))
                column = column[None].expand(p.shape[0], -1, -1)
                mask = live[:, :, None].expand(-1, -1, c)
                rows.index_put_((target[mask], column[mask]), pieces[mask])
        else:
            N = op.arena_layout.capacity_rows
            rows = torch.zeros(N, H, dtype=dtype, device=op.device)
            if g is not None:
                pieces = _split(_rows_below(g, layout.table(rank, "num_recv")), dtype)  # [N, K, c]
                rows[:, c * K * rank:c * K * (rank + 1)] = pieces.reshape(N, c * K)
        ys.append(rows)
    outs = _per_rank(op, op.combine(_back(op, ys), layout=layout, weighted=not op.expert_layout))
    result = []
    for o in outs:
        if op.expert_layout:
            result.append(_join(o[:, :c * K].reshape(-1, K, c)))
        else:
            parts = o[:, :c * K * W].reshape(-1, W, K, c)
            total = _join(parts[:, 0])
            for d in range(1, W):  # ascending rank
                total = total + _join(parts[:, d])
            result.append(total)
    return result


class CombineFunction(torch.autograd.Function):
    """``combine`` as a ``torch.autograd.Function``: ``apply(op, layout, *ys, *weights)`` with n
    tensors of y and, in the expert layout, the n dispatched weights (``Dispatched.weights``) for
    their gradient (the combine itself applies the layout's weights, which equal them)."""

    @staticmethod
    def forward(ctx, op, layout, *tensors):
        n = len(op.local_ranks)
        ys = [_rows(y, y.dtype) for y in tensors[:n]]  # a wrong dtype is the op's error to raise
        out = _per_rank(op, op.combine(_back(op, ys), layout=layout))
        ctx.op, ctx.layout, ctx.n = op, layout, n
        ctx.rows = [y.shape[0] for y in ys]
        if op.expert_layout:
            ctx.save_for_backward(*ys, *tensors[n:])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        op, layout, n = ctx.op, ctx.layout, ctx.n
        g = [torch.zeros(t, op.config.hidden, dtype=_row_dtype(op), device=op.device) if gr is None
             else _rows(gr, _row_dtype(op)) for gr, t in zip(grads, layout.tokens)]
        rows = _per_rank(op, op.dispatch(_back(op, g), layout=layout))
        grad_y, grad_w = [None] * n, [None] * (len(ctx.needs_input_grad) - 2 - n)
        if not op.expert_layout:
            grad_y = [_rows_below(r.recv_x[:m], r.num_recv) for r, m in zip(rows, ctx.rows)]
            return (None, None, *grad_y)
        saved = ctx.saved_tensors
        ys, ws = saved[:n], saved[n:]
        for i, (r, m) in enumerate(zip(rows, ctx.rows)):
            acc = torch.promote_types(ys[i].dtype, torch.float32)  # float32, or float64 on the stand-in
            gp = _rows_below(r.x[:m], r.offsets[-1:]).to(acc)  # grad_out of each expanded row's token
            if ctx.needs_input_grad[2 + i]:
                grad_y[i] = (ws[i][:m].to(acc)[:, None] * gp).to(ys[i].dtype)
            if ctx.needs_input_grad[2 + n + i]:
                grad_w[i] = torch.nn.functional.pad((ys[i].to(acc) * gp).sum(dim=1), (0, ws[i].shape[0] - m))
                grad_w[i] = grad_w[i].to(ws[i].dtype)
        return (None, None, *grad_y, *grad_w)


def dispatch(op, x, weights, indices, family: str | None = None) -> Dispatched:
    """Differentiable ``op.dispatch`` (module docstring: its derivatives and what it saves).

    Args:
        op: an ``EpDispatchCombine`` with dtype "bf16" and the pull kernels
            (``EpConfig(dispatch_transport="pull")``), either layout.
        x: [T, H] bf16 (a list in virtual mode), may require grad.
        weights: [T, K] float32 routing weights (a list in virtual mode), may require grad.
        indices: [T, K] int32 expert ids (a list in virtual mode).
        family: the forward dispatch's kernel family, as ``EpDispatchCombine.dispatch``'s (the
            backward's kernels follow the layout).

    Returns:
        ``Dispatched`` (its x and weights differentiable; its layout for ``combine``).

    Raises:
        ValueError: a payload other than bf16, an op without the pull kernels, or weights that
            require grad where their gradient cannot travel (3 K W > H in the rank layout, 3 K > H
            in the expert layout, a quantized combine wire); as ``EpDispatchCombine.dispatch``.
    """
    n = len(op.local_ranks)
    xs, ws, ids = (per_rank(v, name, n, op.virtual) for v, name in ((x, "x"), (weights, "weights"), (indices, "indices")))
    _ops_checks(op, "epgen.autograd.dispatch", any(isinstance(w, torch.Tensor) and w.requires_grad for w in ws))
    keep = {"family": family}
    out = DispatchFunction.apply(op, ids, keep, *xs, *ws)
    n = len(xs)
    meta = keep["outs"]
    return Dispatched(x=_back(op, list(out[:n])), weights=_back(op, list(out[n:])),
                      indices=_back(op, [m["indices"] for m in meta]), src=_back(op, [m["src"] for m in meta]),
                      num_recv=_back(op, [m["num_recv"] for m in meta]), offsets=_back(op, [m["offsets"] for m in meta]),
                      layout=keep["layout"])


def combine(op, y, dispatched: Dispatched):
    """Differentiable ``op.combine`` along ``dispatched.layout`` (module docstring).

    Args:
        op: the op that dispatched.
        y: rank layout [N, H] bf16, row i the expert output of receive row i; expert layout [R, H]
            bf16, row p that of expanded row p (a list in virtual mode); may require grad.
        dispatched: what ``dispatch`` returned; in the expert layout its weights carry the
            gradient of the routing weights (the combine applies the layout's weights, equal to them).

    Returns:
        [T, H] bf16 per rank (a list in virtual mode).

    Raises:
        ValueError: as ``EpDispatchCombine.combine`` with a layout.
    """
    ys = per_rank(y, "y", len(op.local_ranks), op.virtual)
    extra = _per_rank(op, dispatched.weights) if op.expert_layout else []
    out = CombineFunction.apply(op, dispatched.layout, *ys, *extra)
    return _back(op, list(out))


# --- the reference stand-in -----------------------------------------------------------------------


@attrs.frozen
class _Rows:
    capacity_rows: int
    expert_rows: int


class _ReferenceLayout:
    """A ``ReferenceEp`` dispatch's layout: its reference rows and token counts."""

    def __init__(self, op, recv, expert, tokens):
        self.op, self.recv, self.expert, self.tokens, self.family = op, recv, expert, list(tokens), "normal"

    def table(self, rank: int, name: str) -> torch.Tensor:
        r, N, K = self.recv[rank], self.op.arena_layout.capacity_rows, self.op.config.topk
        n = r.num_rows
        if name == "num_recv":
            return torch.tensor([n], dtype=torch.int32)
        if name == "recv_indices":
            return torch.cat([r.indices, torch.full((N - n, K), -1, dtype=torch.int32)])
        if name == "slot_row":
            rows = self.expert[rank]
            slot_row = torch.full((N, K), -1, dtype=torch.int32)
            live = rows.recv_row >= 0
            slot_row[rows.recv_row[live], rows.src[live, 2].long()] = live.nonzero().flatten().to(torch.int32)
            return slot_row
        raise ValueError(f"name={name!r}: the reference layout serves num_recv, recv_indices and slot_row")


class ReferenceEp:
    """A stand-in of ``EpDispatchCombine`` (virtual ranks) on ``epgen.reference``, for checking the
    autograd Functions in float64 (``torch.autograd.gradcheck``) and the kernels' gradients
    against it: the same calls the Functions make (``dispatch``, ``keep_layout``, ``combine`` with
    a layout and ``weighted``), the same row counts (N receive rows, R expert rows, zeros past the
    rows used), rows of ``dtype`` moved and summed exactly in float64 (no rounding but the cast
    to ``dtype`` of each sum; the expert layout's per-rank fold rounded to ``dtype`` as the kernels
    round it to bf16).

    Args:
        config: an EpConfig (its world_size, hidden, topk, experts_per_rank, max_tokens_per_rank,
            max_recv_tokens, layout, expert_alignment are used).
        dtype: the rows' floating dtype (default float64).
    """

    virtual = True

    def __init__(self, config: EpConfig, dtype: torch.dtype = torch.float64):
        self.config, self.dtype, self.device = config, dtype, torch.device("cpu")
        self.local_ranks = list(range(config.world_size))
        self.expert_layout = config.layout == "expert"
        self.arena_layout = _Rows(capacity_rows=config.receive_rows, expert_rows=config.expert_layout_rows)
        self._last = None

    def _pad(self, t: torch.Tensor, rows: int, fill=0) -> torch.Tensor:
        return torch.cat([t, torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)])

    def dispatch(self, x, weights=None, indices=None, family=None, *, layout=None):
        """As ``EpDispatchCombine.dispatch`` on virtual ranks; ``family`` (None, "normal" or
        "low_latency") is taken as the op takes it and changes nothing (the reference has one
        path)."""
        if family not in (None, "normal", "low_latency"):
            raise ValueError(f"family={family!r}: must be None, 'normal' or 'low_latency'")
        L, N = self.config.experts_per_rank, self.arena_layout.capacity_rows
        if layout is None:  # the reference routes with float32 weights; the rows carry the caller's
            recv = ref.dispatch(list(x), [w.float() for w in weights], list(indices), experts_per_rank=L)
            expert = ref.expand(recv, experts_per_rank=L, alignment=self.config.expert_alignment) \
                if self.expert_layout else None
            layout = _ReferenceLayout(self, recv, expert, [t.shape[0] for t in x])
            layout.weights = [self._gather(weights, r) for r in recv]
        self._last = layout
        outs = []
        for d, r in enumerate(layout.recv):
            rows = self._gather(x, r)
            rw = layout.weights[d]
            recv = DispatchOutput(recv_x=self._pad(rows, N), recv_weights=self._pad(rw, N),
                                  recv_indices=self._pad(r.indices, N, -1), recv_scales=None,
                                  recv_src=self._pad(r.src, N, -1), num_recv=torch.tensor([r.num_rows], dtype=torch.int32))
            if not self.expert_layout:
                outs.append(recv)
                continue
            e, R = layout.expert[d], self.arena_layout.expert_rows
            live = e.recv_row >= 0
            ex = torch.zeros(e.num_rows, self.config.hidden, dtype=rows.dtype)
            ex[live] = rows[e.recv_row[live]]
            # an expanded row's weight: the sum of its receive row's slots naming its expert
            i, first = e.recv_row[live], e.src[live, 2].long()
            ids = r.indices[i]
            ew = torch.zeros(e.num_rows, dtype=rw.dtype)
            ew[live] = ((ids == ids.gather(1, first[:, None])) * rw[i]).sum(dim=1)
            layout.expert_weights = getattr(layout, "expert_weights", {})
            layout.expert_weights[d] = ew
            outs.append(ExpertDispatchOutput(x=self._pad(ex, R), scales=None, weights=self._pad(ew, R),
                                             src=self._pad(e.src, R, -1), counts=e.counts, offsets=e.offsets,
                                             recv=recv))
        return outs

    def _gather(self, values, r) -> torch.Tensor:
        """The rows of ``values`` (one tensor per rank) that reference rows ``r`` received, in order."""
        if not r.num_rows:
            return torch.zeros(0, *values[0].shape[1:], dtype=values[0].dtype)
        return torch.stack([values[s][t] for s, t in r.src.tolist()])

    def keep_layout(self):
        return self._last

    def combine(self, y, *, layout, weighted: bool = True):
        acc = torch.float64
        sums = [torch.zeros(t, self.config.hidden, dtype=acc) for t in layout.tokens]
        for d, r in enumerate(layout.recv):  # ascending rank
            n = r.num_rows
            if self.expert_layout:
                e = layout.expert[d]
                live = (e.recv_row >= 0).nonzero().flatten()
                w = layout.expert_weights[d][live].to(acc) if weighted else torch.ones(live.shape[0], dtype=acc)
                folded = torch.zeros(n, self.config.hidden, dtype=acc)
                folded.index_add_(0, e.recv_row[live], w[:, None] * y[d][live].to(acc))
                rows = folded.to(self.dtype).to(acc)  # the fold's rounding
            else:
                rows = y[d][:n].to(acc)
            for s in range(len(layout.tokens)):
                mine = (r.src[:, 0] == s).nonzero().flatten()
                sums[s].index_add_(0, r.src[mine, 1].long(), rows[mine])
        return [t.to(self.dtype) for t in sums]
