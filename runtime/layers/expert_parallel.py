"""Expert parallelism behind a framework's experts call: what every framework integration shares.

A framework calls its MoE experts with a block's tokens, their top-k expert ids and top-k weights,
and expects the weighted sum of the experts' outputs back (transformers' experts function, vLLM's
modular kernel: docs/architecture.md, "A new framework integration"). ``ExpertParallel.run``
answers that call on epgen's op, with nothing of the framework in it:

1. dispatch in the expert layout (``EpConfig(layout="expert")``): the rank's received rows
   grouped by local expert, ``offsets``, per-row routing weights;
2. the experts: a callable the integration passes, given the dispatched rows of each rank this
   process drives, returning each one's unweighted expert outputs (``expert_rows`` computes them
   from an ``ExpertShard`` and the framework's activation);
3. the weighted combine back to token order.

Token layouts (which tokens each rank brings to a call; both shard the weights alike, each rank
holding E / W experts):

* ``"own_tokens"``: each rank brings its own tokens (data-parallel attention): it dispatches all
  of them and gets their outputs back.
* ``"same_tokens"``: every rank brings the same T tokens (tensor-parallel attention): rank r
  dispatches rows [r c, (r + 1) c) of them, c = ceil(T / W) (``token_slices``), and the outputs
  are gathered (``torch.distributed.all_gather`` over ``group``) so every rank returns all T rows.

With virtual ranks (one process holds all W) the T tokens are split the same way and the outputs
concatenated; both layouts then compute the same thing.

The kernel family of each call is the same on every rank without exchanging counts
(``ExpertParallel.family``): by the forward's phase, which the integration sets (prefill normal,
decode low-latency), or by the largest slice. ``ExpertParallel.train`` runs the same call with
gradients through ``epgen.autograd``.

Backends (``build_op``): ``"epgen"`` (``EpDispatchCombine``: on the GPU, or the host emulation of
an arch for a CPU device, ``epgen.host``) or ``"reference"`` (``ReferenceOp``: ``epgen.reference``
on the CPU).
"""

from __future__ import annotations

import warnings
from typing import Callable

import attrs
import torch

from epgen import reference
from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import dtype_info
from epgen.layers import autograd
from epgen.layers.moe import _host_offsets
from epgen.op import check_combine_inputs, check_dispatch_inputs, op_inputs

__all__ = ["BACKENDS", "DEPRECATED_TOKEN_LAYOUTS", "PHASES", "TOKEN_LAYOUTS", "ExpertParallel", "ExpertShard", "ReferenceOp",
           "build_op", "check_host_options", "expert_rows", "resolve_backend", "token_layout", "token_slices"]

TOKEN_LAYOUTS = ("own_tokens", "same_tokens")
"""The token layouts: which tokens each rank brings to a dispatch."""

DEPRECATED_TOKEN_LAYOUTS = {"owned": "own_tokens", "replicated": "same_tokens"}
"""The token layouts' former names, accepted with a DeprecationWarning."""

PHASES = ("prefill", "decode")
"""The phases of a framework's forward: a decode runs one position a sequence on a filled cache."""

BACKENDS = ("epgen", "reference")
"""epgen's kernels (``epgen.op.EpDispatchCombine``: on a GPU, or on the host emulation for a CPU
device, ``epgen.host``) or ``ReferenceOp`` (``epgen.reference`` on the CPU)."""


def token_layout(layout, stacklevel: int = 3) -> str:
    """The token layout ``layout`` names (a deprecated name warns: ``DEPRECATED_TOKEN_LAYOUTS``).

    Raises:
        ValueError: not one of ``TOKEN_LAYOUTS`` or a deprecated name.
    """
    if isinstance(layout, str) and layout in DEPRECATED_TOKEN_LAYOUTS:
        warnings.warn(f"layout={layout!r} is deprecated: use layout={DEPRECATED_TOKEN_LAYOUTS[layout]!r} (the tokens "
                      "each rank brings; both layouts shard the weights alike)", DeprecationWarning,
                      stacklevel=stacklevel)
        return DEPRECATED_TOKEN_LAYOUTS[layout]
    if layout not in TOKEN_LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {', '.join(TOKEN_LAYOUTS)}")
    return layout


def _check_phase(phase) -> None:
    if phase not in PHASES + (None,):
        raise ValueError(f"phase={phase!r}: must be one of {', '.join(PHASES)} (or None: ExpertParallel.phase)")


def token_slices(tokens: int, world: int) -> list[tuple[int, int]]:
    """Rank r's rows [r c, (r + 1) c) of ``tokens``, c = ceil(tokens / world), clipped.

    Raises:
        ValueError: tokens not an int >= 0, or world not an int >= 1.
    """
    for name, value, least in (("tokens", tokens, 0), ("world", world, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r}: must be an int >= {least}")
    c = -(-tokens // world)
    return [(min(r * c, tokens), min((r + 1) * c, tokens)) for r in range(world)]


# --- the op ---------------------------------------------------------------------------------------


def resolve_backend(backend: str | None, device: torch.device | None) -> str | None:
    """``backend`` checked, or where None the default of ``device``: "epgen" for a CUDA device,
    else "reference" (None without a device).

    Raises:
        ValueError: ``backend`` not None or one of ``BACKENDS``.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be None or one of {', '.join(BACKENDS)}")
    if backend is None and device is not None:
        return "epgen" if torch.device(device).type == "cuda" else "reference"
    return backend


def check_host_options(backend: str | None, device: torch.device | None, arch, schedule) -> None:
    """ValueError when ``arch`` or ``schedule`` is given but the op is not the host emulation
    (backend "epgen" on a CPU device); ``device`` None: only the backend is known yet."""
    if arch is None and schedule is None or backend is None and device is None:  # backend None: decided later
        return
    device = torch.device(device) if device is not None else None
    given = f"arch={arch!r}, schedule={schedule!r}"
    if backend != "epgen" or (device is not None and device.type != "cpu"):
        where = f"backend={backend!r}" + (f" on {device.type} weights" if device is not None else "")
        raise ValueError(f"{given}: only the host emulation takes them (backend='epgen' with the model's weights on "
                         f"the CPU: epgen's kernels of that arch run on the CPU); here {where}")


def build_op(cfg: EpConfig, backend: str, device: torch.device, group, virtual: bool, arch=None, schedule=None):
    """The op of the experts: ``EpDispatchCombine`` (backend "epgen": on ``device``'s GPU, or on the
    host emulation of ``arch`` with ``schedule`` for a CPU device) or ``ReferenceOp``.

    Raises:
        ValueError: ``backend`` not one of ``BACKENDS``; ``arch`` or ``schedule`` given but the op
            is not the host emulation (``check_host_options``); as ``EpDispatchCombine`` or
            ``ReferenceOp``.
    """
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {', '.join(BACKENDS)}")
    check_host_options(backend, device, arch, schedule)
    if backend == "epgen":
        from epgen.op import EpDispatchCombine

        if device.type == "cpu":
            return EpDispatchCombine(cfg, group=group, virtual=virtual, device="cpu", arch=arch, schedule=schedule)
        return EpDispatchCombine(cfg, group=group, virtual=virtual, device=device.index)
    return ReferenceOp(cfg, virtual=virtual, group=group)


class ReferenceOp:
    """``EpDispatchCombine``'s expert-layout calls computed by ``epgen.reference`` on the CPU: the
    same semantics (dispatch, expansion per local expert, weighted fold and combine, the combine
    wire), every rank simulated.

    Modes: virtual (every rank in this process: lists of one tensor per rank), or one process per
    rank over ``group`` (gloo), where each call gathers every rank's inputs
    (``all_gather_object``), computes every rank and keeps this rank's part; W = 1 needs neither.

    Args:
        config: an EpConfig with layout "expert".
        virtual: every rank in this process.
        group: the process group of the W processes (not virtual, W > 1; default the world group).

    Raises:
        ValueError: config.layout is not "expert"; a group whose size is not W.
        (dispatch, combine) TypeError, ValueError: this process's inputs as the op checks them
            (``epgen.op.check_dispatch_inputs``, ``check_combine_inputs``: dtype, shape, device,
            contiguity, max_tokens_per_rank, the expert layout's rows; y with fewer rows than the
            dispatch's layout); RuntimeError: a tensor requiring grad under grad mode; as
            ``epgen.reference.dispatch``, ``expand`` and ``combine_weighted``.
    """

    def __init__(self, config: EpConfig, *, virtual: bool = False, group=None):
        if config.layout != "expert":
            raise ValueError(f"EpConfig.layout={config.layout!r}: ReferenceOp runs the expert layout only")
        self.config = config
        self.virtual = virtual
        self.device = torch.device("cpu")
        self.payload = dtype_info(config.dtype)
        W = config.world_size
        self.group = None
        if virtual or W == 1:
            self.local_ranks = list(range(W)) if virtual else [0]
        else:
            import torch.distributed as dist

            self.group = group if group is not None else dist.group.WORLD
            if dist.get_world_size(self.group) != W:
                raise ValueError(f"EpConfig.world_size={W}: the process group has {dist.get_world_size(self.group)} "
                                 "ranks")
            self.local_ranks = [dist.get_rank(self.group)]
        self._pending = None

    def _everyone(self, value) -> list:
        if self.virtual:
            return list(value)
        if self.group is None:
            return [value]
        import torch.distributed as dist

        gathered = [None] * self.config.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _tag(self, i: int) -> str:
        return f"[rank {self.local_ranks[i]}]" if self.virtual else ""

    def dispatch(self, x, weights, indices, family=None):
        """x [T, H], weights [T, K] float32, indices [T, K] int32 (lists in virtual mode) ->
        ``epgen.reference.ExpertRows`` of this rank (a list in virtual mode). ``family`` is taken
        as the GPU op takes it and changes nothing here (the reference has one path). The inputs
        are checked by the op's own rules (``epgen.op.check_dispatch_inputs``, on the CPU), so
        what runs here runs on the op."""
        cfg = self.config
        n = len(self.local_ranks)
        mine = zip(*(op_inputs(v, name, n, self.virtual) for v, name in ((x, "x"), (weights, "weights"),
                                                                          (indices, "indices"))))
        for i, (xi, wi, ii) in enumerate(mine):
            check_dispatch_inputs(cfg, self.payload, self.device, xi, wi, ii, None, self._tag(i))
        xs, ws, ids = (self._everyone(v) for v in (x, weights, indices))
        recv = reference.dispatch(xs, ws, ids, experts_per_rank=cfg.experts_per_rank,
                                  max_recv_tokens=cfg.max_recv_tokens)
        expert = reference.expand(recv, experts_per_rank=cfg.experts_per_rank, alignment=cfg.expert_alignment)
        self._pending = (recv, expert, [t.shape[0] for t in xs])
        mine = [expert[r] for r in self.local_ranks]
        return mine if self.virtual else mine[0]

    def combine(self, y):
        """y [n, H] bf16 in the layout of the last dispatch (a list in virtual mode) -> [T, H] bf16
        (a list in virtual mode)."""
        if self._pending is None:
            raise RuntimeError("combine: needs a dispatch first")
        recv, expert, tokens = self._pending
        for i, yi in enumerate(op_inputs(y, "y", len(self.local_ranks), self.virtual)):
            rows = expert[self.local_ranks[i]].x.shape[0]
            check_combine_inputs(self.config, self.device, yi, None, 0, self.config.expert_layout_rows, self._tag(i))
            if yi.shape[0] < rows:
                raise ValueError(f"y{self._tag(i)}.shape[0]={yi.shape[0]}: fewer rows than the dispatch's expert "
                                 f"layout, {rows}")
        outs = reference.combine_weighted(self._everyone(y), expert, recv, tokens,
                                          combine_quant=self.config.combine_quant)
        return outs if self.virtual else outs[self.local_ranks[0]]

    def synchronize(self):
        """Nothing to wait for: every fault raises at its call."""

    def close(self):
        self._pending = None


# --- the experts of one rank ---------------------------------------------------------------------


@attrs.frozen
class ExpertShard:
    """The L local experts of one rank of one experts module, as grouped GEMM operands (views of
    the module's parameters: no copy; an integration's reader builds it).

    Attributes:
        up: [L, H, N] the up projection, input-major (a transposed view when the module stores
            [L, N, H]): gate and up together (N = 2I, the activation splits them), or the up
            projection alone (N = I: experts without a gate, or with the gate in ``gate``).
        up_bias: [L, N] or None.
        down: [L, I, H] the down projection, input-major likewise.
        down_bias: [L, H] or None.
        gate: [L, H, I] a gate projection stored apart from the up projection (dbrx's ``w1``),
            input-major; None where ``up`` holds it or the experts have none.
    """

    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    gate: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.up.shape[0]


def _row_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64: the local expert of each row of the expert layout; L for the rows past
    offsets[L] (padding: ``_row_bias`` gives them a zero bias)."""
    ends = offsets[1:].contiguous()
    index = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(ends, index, right=True)


def _row_bias(bias: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[R, N] each row's expert bias (``bias`` [L, N]; ``rows`` from ``_row_experts``), zero on the
    padding rows, so that no gradient of a padding row reaches an expert's bias (their outputs
    are never read, but their gradient rows need not be zero)."""
    return torch.nn.functional.pad(bias, (0, 0, 0, 1))[rows]


def expert_rows(shard: ExpertShard, x: torch.Tensor, offsets: torch.Tensor, *,
                activate: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                post: Callable[[torch.Tensor], torch.Tensor] | None = None, grouped: bool,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' math on one rank's rows of the expert layout (no routing weight on the output:
    the weighted combine applies it).

    Rows [offsets[e], offsets[e + 1]) of x belong to local expert e. Per row: h = x @ up[e]
    (+ up_bias[e]); h = activate(h, x @ gate[e] or None) (the framework's activation: its gated
    split of h, an activation of h, or act(gate) * h for a gate stored apart); y = h @ down[e]
    (+ down_bias[e]); post(y) where given (a post-expert norm). Each matmul accumulates in float32
    and rounds once to the weights' dtype.

    Experts whose routing weight scales their input (llama4: f(w x), ``weights`` given, the rows'
    routing weights) run f on x w (rounded to x's dtype, as the model's bf16 product) and return
    f(x w) / w (0 where w = 0: padding, and f(0) = 0 for a bias-free expert), so that the weighted
    combine's w f(x w) / w is the model's f(x w) within one rounding.

    Paths:
        grouped: two ``torch._grouped_mm`` calls (group ends offsets[1:]) and row-wise bias, gate
            and norm on every row of x; no host synchronization (CUDA-graph capturable). Rows
            past offsets[L] hold whatever the kernels left there, with no bias added (none of
            their gradient reaches a bias).
        loop: reads offsets to the host (one synchronization), then per non-empty expert two
            matmuls; rows past offsets[L] are zero.

    Args:
        shard: the local experts, on x's device, x's dtype.
        x: [R, H] the rank's expanded rows (``ExpertDispatchOutput.x`` or
            ``epgen.reference.ExpertRows.x``).
        offsets: [L + 1] int32 on x's device, offsets[0] = 0, non-decreasing, offsets[L] <= R.
        activate: (h [r, N], gate [r, I] or None) -> [r, I].
        post: y [R, H] -> [R, H], or None.
        grouped: the path.
        weights: None, or [R] float32 the rows' routing weights (``ExpertDispatchOutput.weights``)
            for experts whose weight scales their input.

    Returns:
        y [R, H], x's dtype.

    Raises:
        ValueError: offsets not [L + 1] int32; (loop path, and the grouped path on the CPU, where reading
            them costs no synchronization) offsets not starting at 0, decreasing, or past R. On a
            GPU the grouped path trusts the op's offsets (a check would synchronize the host).
    """
    L = shard.num_experts
    if offsets.dim() != 1 or offsets.shape[0] != L + 1 or offsets.dtype != torch.int32:
        raise ValueError(f"offsets: {tuple(offsets.shape)} {offsets.dtype} must be [L + 1] = [{L + 1}] torch.int32 (the "
                         f"shard's {L} experts)")
    if grouped and x.device.type == "cpu":
        _host_offsets(offsets, x.shape[0])  # read for free on the CPU: checked as the loop path checks them
    if weights is not None:
        x = (x * weights[:, None]).to(x.dtype)
    if grouped:
        offs = offsets[1:]
        h = torch._grouped_mm(x, shard.up, offs=offs)
        rows = _row_experts(offsets, x.shape[0]) if shard.up_bias is not None or shard.down_bias is not None else None
        if shard.up_bias is not None:
            h = h + _row_bias(shard.up_bias, rows)
        h = activate(h, torch._grouped_mm(x, shard.gate, offs=offs) if shard.gate is not None else None)
        y = torch._grouped_mm(h, shard.down, offs=offs)
        if shard.down_bias is not None:
            y = y + _row_bias(shard.down_bias, rows)
    else:
        bounds = _host_offsets(offsets, x.shape[0])
        y = x.new_zeros(x.shape[0], shard.down.shape[-1])
        for e in range(L):
            lo, hi = bounds[e], bounds[e + 1]
            if lo == hi:
                continue
            h = x[lo:hi] @ shard.up[e]
            if shard.up_bias is not None:
                h = h + shard.up_bias[e]
            h = activate(h, x[lo:hi] @ shard.gate[e] if shard.gate is not None else None)
            out = h @ shard.down[e]
            y[lo:hi] = out + shard.down_bias[e] if shard.down_bias is not None else out
    if post is not None:
        y = post(y)
    if weights is not None:
        w = weights[:, None]
        y = torch.where(w > 0, y.float() / torch.where(w > 0, w, 1.0), 0.0).to(y.dtype)
    return y


# --- one experts call across the ranks ------------------------------------------------------------

Experts = Callable[[list], list]
"""The experts stage an integration passes: the dispatched rows of each rank this process drives
(``ExpertDispatchOutput`` or ``epgen.reference.ExpertRows``: ``x``, ``offsets``, ``weights``), in
rank order -> each one's unweighted expert outputs y [R, H]."""


class ExpertParallel:
    """Dispatch, the experts and the weighted combine of one experts call, in a token layout, on
    one op that every MoE layer of a model shares. Use ``synchronize()`` where a step ends (a GPU
    kernel fault raises there) and ``close()`` to release the op (later calls then refuse).

    Raises (construction):
        ValueError: backend unknown or not the op's; config not the op's, or its layout not
            "expert"; ``virtual`` not the op's.

    Attributes:
        config: the EpConfig of the layers (layout "expert").
        op: an ``EpDispatchCombine`` or a ``ReferenceOp`` (``build_op``).
        backend: "epgen" or "reference".
        layout: "own_tokens" or "same_tokens".
        virtual: every rank in this process.
        group: the process group of the W processes (one process a rank), or None.
        ranks: the ranks this process drives.
        phase: "prefill" or "decode", the phase of the framework's current forward (the
            integration sets it; a decode runs one position a sequence on a filled cache).
        closed: ``close()`` was called: calls refuse.
    """

    def __init__(self, config: EpConfig, op, *, backend: str, layout: str, virtual: bool, group=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: must be one of {', '.join(BACKENDS)}")
        if (backend == "reference") != isinstance(op, ReferenceOp):
            raise ValueError(f"backend={backend!r}: the op is a {type(op).__name__} (build_op builds the backend's)")
        if config.layout != "expert":
            raise ValueError(f"EpConfig.layout={config.layout!r}: ExpertParallel runs the expert layout (its experts "
                             "stage takes the rows grouped by local expert)")
        if op.config != config:
            raise ValueError("config: must be the op's own EpConfig (op.config)")
        if bool(virtual) != bool(op.virtual) and config.world_size > 1:
            raise ValueError(f"virtual={virtual!r}: the op {'drives' if op.virtual else 'does not drive'} every rank "
                             "in this process")
        self.config = config
        self.op = op
        self.backend = backend
        self.layout = token_layout(layout)
        self.virtual = virtual
        self.group = group
        self.ranks = list(op.local_ranks)
        self.phase = "prefill"
        self.closed = False

    def family(self, tokens: int, phase: str | None = None) -> str | None:
        """The kernel family of a dispatch of ``tokens`` on this rank, the same on every rank
        without exchanging counts: None (the op's own pick) where the op sees every rank's count
        (virtual ranks, W = 1), the config fixes the family, or the backend is the reference; in
        the same_tokens layout the family of the largest slice (every rank slices the same T); in
        the own_tokens layout the phase's (``phase``, default ``self.phase``): "normal" for a
        prefill, "low_latency" for a decode where the op has that family (a rank's decode batch
        must then fit ``op.low_latency_tokens``)."""
        _check_phase(phase)
        W = self.config.world_size
        if self.backend != "epgen" or self.virtual or W == 1 or self.config.kernel_family != "auto":
            return None
        if self.layout == "same_tokens":
            return self.op.family(-(-tokens // W))
        phase = self.phase if phase is None else phase
        return "low_latency" if phase == "decode" and self.op.low_latency_tokens else "normal"

    def _check_open(self, name: str) -> None:
        if self.closed:
            raise RuntimeError(f"{name}: its epgen expert parallelism was closed (close() released the op's buffers); "
                               "convert a freshly loaded model to run it")

    def _stage(self, experts: Experts, dispatched: list, name: str) -> list:
        """The experts stage's outputs for ``dispatched``, checked: one tensor per dispatched rank
        (the op checks each tensor's dtype, shape and rows)."""
        ys = experts(dispatched)
        if not isinstance(ys, (list, tuple)) or len(ys) != len(dispatched) or \
                not all(isinstance(y, torch.Tensor) for y in ys):
            got = (f"a {type(ys).__name__} of {len(ys)}" if isinstance(ys, (list, tuple)) else
                   f"a {type(ys).__name__}")
            raise TypeError(f"{name}: the experts stage must return a list of {len(dispatched)} tensors (one [R, H] "
                            f"bf16 y per dispatched rank, in order), got {got}")
        return list(ys)

    def _routes(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """ids and w with the config's K routes a row: a call with k < K routes a row (a framework
        that gives each route its own row: ergo's experts take [T K, 1]) is padded with id -1 (no
        expert) and weight 0, which the op routes nowhere.

        Raises:
            ValueError: ids and w not [T, k] alike for x [T, H], or k > K."""
        K = self.config.topk
        if ids.dim() != 2 or w.shape != ids.shape or x.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"{name}: top-k ids {tuple(ids.shape)} and weights {tuple(w.shape)} must both be [T, k] "
                             f"for x {tuple(x.shape)} [T, H]")
        k = ids.shape[1]
        if k > K:
            raise ValueError(f"{name}: {k} routes a token, more than the config's top-k {K} (EpConfig.topk, read from "
                             "the model config)")
        if k == K:
            return ids, w
        return (torch.cat([ids, ids.new_full((ids.shape[0], K - k), -1)], 1),
                torch.cat([w, w.new_zeros(w.shape[0], K - k)], 1))

    def _rank_tokens(self, tokens: list[int]) -> None:
        most = max(tokens)
        if most > self.config.max_tokens_per_rank:
            r = tokens.index(most)
            raise ValueError(f"epgen expert parallel (layout {self.layout}, W={self.config.world_size}): rank "
                             f"{self.ranks[r] if len(tokens) == len(self.ranks) else r} passes {most} tokens to one "
                             f"dispatch, more than max_tokens_per_rank={self.config.max_tokens_per_rank} (raise it in "
                             "expert_parallel; a call that gives each route its own row, as ergo's experts do, counts "
                             "its rows: tokens x top-k)")

    def run(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: Experts, *, phase: str | None = None,
            name: str = "experts") -> torch.Tensor:
        """One experts call: x [T, H] bf16, ids [T, k] int32, w [T, k] float32, contiguous, k <= K
        (fewer routes a row are padded with id -1: ``_routes``); the experts stage ``experts``; ``phase`` the forward's phase as the caller saw it (default
        ``self.phase``; the family of the own_tokens layout); ``name`` names the caller's module in
        errors. Returns [T, H] bf16, the top-k weighted sum of the experts' outputs for this rank's
        tokens (all T in every layout).

        Raises:
            RuntimeError: closed.
            TypeError: the experts stage returned other than one tensor per dispatched rank.
            ValueError: ids and w not [T, k] alike for x [T, H], or k above the config's top-k; a rank's share
                above max_tokens_per_rank; in the own_tokens layout with
                one process a rank, a decode step above the op's low_latency_tokens; ``phase``
                not one of ``PHASES``; as the op's dispatch and combine (the stage's y included).
        """
        self._check_open(name)
        _check_phase(phase)
        ids, w = self._routes(x, ids, w, name)
        T, W = x.shape[0], self.config.world_size
        if self.virtual:
            parts = token_slices(T, W)
            self._rank_tokens([b - a for a, b in parts])
            d = self.op.dispatch([x[a:b] for a, b in parts], [w[a:b] for a, b in parts], [ids[a:b] for a, b in parts])
            return torch.cat(self.op.combine(self._stage(experts, d, name)))
        if self.layout == "same_tokens" and W > 1:
            parts = token_slices(T, W)
            a, b = parts[self.ranks[0]]
            self._rank_tokens([parts[0][1] - parts[0][0]])
            d = self.op.dispatch(x[a:b], w[a:b], ids[a:b], family=self.family(T, phase))
            return self.gather(self.op.combine(self._stage(experts, [d], name)[0]), parts)
        self._rank_tokens([T])
        family = self.family(T, phase)
        if family == "low_latency" and T > self.op.low_latency_tokens:
            raise ValueError(f"epgen expert parallel (own tokens, W={W}): a decode step of {T} tokens on rank "
                             f"{self.ranks[0]}, more than the low-latency family takes (low_latency_tokens="
                             f"{self.op.low_latency_tokens}); decode at most that many sequences a rank, or pass "
                             "kernel_family='normal' to expert_parallel")
        d = self.op.dispatch(x, w, ids, family=family)
        return self.op.combine(self._stage(experts, [d], name)[0])

    def train(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: Experts, *,
              name: str = "experts") -> torch.Tensor:
        """``run`` with gradients: its calls through ``epgen.autograd`` (the backward runs the op's
        kernels along each dispatch's kept layout), eagerly; a prefill's family. In the
        same_tokens layout every rank computes the same loss from the same tokens: the gather of
        the outputs passes back each rank's slice of the output gradient, and the slice each rank
        dispatches gathers the slices' input gradients (``_GatherSlices``, ``_RankSlice``), so the
        replicated layers see the whole gradient on every rank.

        Raises:
            RuntimeError: closed; the reference backend (it has no backward); under torch.compile.
            ValueError: an op without the pull kernels the backward's cached dispatch runs
                (``dispatch_transport="pull"``); as ``run``.
        """
        self._check_open(name)
        if self.backend != "epgen":
            raise RuntimeError(f"{name}: gradients need backend='epgen' (its kernels run the backward; on CPU weights "
                               f"the host emulation); this model runs backend={self.backend!r}, which has no backward: "
                               "run it under torch.no_grad() or convert with backend='epgen'")
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{name}: training under torch.compile is not supported (the experts call is an opaque "
                               "operator without a backward); train the model eagerly")
        if self.config.dispatch_transport != "pull":
            raise ValueError(f"{name}: a forward that needs gradients runs epgen.autograd, whose backward needs the "
                             "pull kernels; convert with expert_parallel(..., dispatch_transport='pull') to train, or "
                             "run inference under torch.no_grad() (this model has dispatch_transport="
                             f"{self.config.dispatch_transport!r})")
        ids, w = self._routes(x, ids, w, name)
        T, W = x.shape[0], self.config.world_size

        def experts_of(d):
            ys = self._stage(experts, d.per_rank(), name)
            return ys if self.virtual else ys[0]

        if self.virtual:
            parts = token_slices(T, W)
            self._rank_tokens([b - a for a, b in parts])
            d = autograd.dispatch(self.op, [x[a:b] for a, b in parts], [w[a:b] for a, b in parts],
                                  [ids[a:b] for a, b in parts])
            return torch.cat(autograd.combine(self.op, experts_of(d), d))
        if self.layout == "same_tokens" and W > 1:
            parts = token_slices(T, W)
            a, b = parts[self.ranks[0]]
            self._rank_tokens([parts[0][1] - parts[0][0]])
            d = autograd.dispatch(self.op, _RankSlice.apply(x, self, parts), _RankSlice.apply(w, self, parts),
                                  ids[a:b], family=self.family(T))
            return _GatherSlices.apply(autograd.combine(self.op, experts_of(d), d), self, parts)
        self._rank_tokens([T])
        d = autograd.dispatch(self.op, x, w, ids, family=self.family(T, "prefill"))
        return autograd.combine(self.op, experts_of(d), d)

    def gather(self, out: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
        """Every rank's rows of a same_tokens call, in rank order (all_gather of equal-size chunks
        over ``group``; ``parts``: ``token_slices``)."""
        import torch.distributed as dist

        chunk = parts[0][1] - parts[0][0]
        # A gloo-only group (W processes sharing one GPU: epgen.harness.ranks) gathers host tensors.
        host = out.is_cuda and dist.get_backend(self.group) == "gloo"
        buf = torch.zeros(chunk, out.shape[1], dtype=out.dtype, device="cpu" if host else out.device)
        buf[: out.shape[0]] = out
        gathered = [torch.empty_like(buf) for _ in parts]
        dist.all_gather(gathered, buf, group=self.group)
        return torch.cat([g[: b - a] for g, (a, b) in zip(gathered, parts)]).to(out.device)

    def synchronize(self) -> None:
        """The op's ``synchronize()``: raises ``epgen.op.EpError`` for a kernel fault of an earlier
        call (the reference raises at the call)."""
        self.op.synchronize()

    def close(self) -> None:
        """Release the op's buffers; later calls refuse (RuntimeError naming the caller's module).
        Closing twice is harmless."""
        self.closed = True
        self.op.close()


class _RankSlice(torch.autograd.Function):
    """The same_tokens layout's slice under autograd: forward this rank's rows of x (every rank
    holds the same x); backward every rank's slice gradient, gathered (``ExpertParallel.gather``):
    rows of another rank's slice reach the loss through that rank's dispatch only."""

    @staticmethod
    def forward(ctx, x, handle, parts):
        ctx.handle, ctx.parts = handle, parts
        a, b = parts[handle.ranks[0]]
        return x[a:b].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.handle.gather(grad.contiguous(), ctx.parts), None, None


class _GatherSlices(torch.autograd.Function):
    """The same_tokens layout's gather under autograd: forward ``ExpertParallel.gather`` (every
    rank's rows); backward this rank's slice of the output gradient, with no communication:
    every rank runs the same tokens through the same replicated layers to the same loss, so the
    gradient of the gathered rows is the same on every rank and rank r's rows came from its own
    combine."""

    @staticmethod
    def forward(ctx, out, handle, parts):
        ctx.slice = parts[handle.ranks[0]]
        ctx.rows = out.shape[0]
        return handle.gather(out, parts)

    @staticmethod
    def backward(ctx, grad):
        a, _ = ctx.slice
        return grad[a:a + ctx.rows], None, None
