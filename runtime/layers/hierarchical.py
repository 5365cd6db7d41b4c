"""Dispatch and combine across nodes: a network leg on ``torch.distributed`` around a node-local
leg on epgen's kernels (docs/multinode.md has the design, the costs and the process layouts).

W = N x G ranks, global rank = node x G + local rank; node n holds experts [n G L, (n + 1) G L).

Dispatch on rank (n0, g): every token goes once to each node n holding one of its experts, to rank
(n, g) (``all_to_all_single`` of its row bytes, split sizes from an exchange of counts read to the
host); that forwarding rank runs the node-local dispatch (``EpConfig.node_config()``) on the rows
of every node, with node-local ids (-1 outside node n) and the global metadata (the K global ids
and the global (source rank, source token)) in the node-local scale bytes. The final receivers'
outputs are the single-node contract's fields, as views.

Combine: the node-local combine sums each forwarded row's expert outputs inside the node (ascending
local rank, fp32, bf16 once); those rows go back over the network and the token's rank sums them in
ascending node (fp32, bf16 once): ``epgen.reference.combine_hierarchical``.

The node-local op is an ``EpDispatchCombine`` of ``node_config()`` (virtual ranks: one process per
node; or one process per GPU with ``process_groups``), or ``ReferenceNodeOp``, the CPU stand-in
with the same interface built from ``epgen.reference``.
"""

from __future__ import annotations

import time

import attrs
import torch
import torch.distributed as dist

from epgen import reference
from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import combine_quant, dtype_info
from epgen.op import DispatchOutput, EpError, check_combine_inputs, check_dispatch_inputs
from epgen.quant import combine_roundtrip
from epgen.tensors import check_tensor

__all__ = ["HierarchicalEp", "HierarchicalError", "ReferenceNodeOp", "process_groups"]

_BAD = 5
"""Columns of the count exchange per (node, local rank): rows, then a bad id's flag, token, slot
and value (flag 0: none)."""


def _columns(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of the [R, B] uint8 ``rows`` as a new [R, stop - start] tensor with
    row stride stop - start (a slice's stride would follow B, which need not suit a wider dtype)."""
    out = torch.empty((rows.shape[0], stop - start), dtype=torch.uint8, device=rows.device)
    return out.copy_(rows[:, start:stop])


class HierarchicalError(RuntimeError):
    """The network leg failed on this rank: a collective raised or exceeded the process group's
    timeout. The peers are out of step afterwards, so the op refuses further calls."""


class ReferenceNodeOp:
    """CPU stand-in for the node-local ``EpDispatchCombine``: the same calls, inputs and outputs,
    computed by ``epgen.reference``.

    Modes, as the op's: every rank of the node in this process (``group`` None: virtual ranks, lists
    of one tensor per rank), or one process per rank (``group``: the node's W processes; tensors),
    where each call gathers every rank's inputs (``all_gather_object``), computes the whole node and
    keeps this rank's part. Receive rows come back in a shuffled order (``EpDispatchCombine``
    specifies none; the same shuffle in every process of a group) in buffers of the receive
    capacity (``max_recv_tokens``, else W x max_tokens_per_rank), the rows from ``num_recv`` on
    filled with 0xFF bytes; an over-capacity dispatch or a short ``y`` raises ``EpError``
    (recoverable) as the kernels' faults do.

    Args:
        config: the node-local layer (nodes 1, layout "rank").
        group: None, or the process group of the node's W ranks (gloo: CPU tensors).
        seed: seed of the row shuffle (the same in every process of a group).

    Raises:
        TypeError: config is not an EpConfig.
        ValueError: config spans nodes or has the expert layout; a group whose size is not W.
    """

    def __init__(self, config: EpConfig, *, group=None, seed: int = 0):
        if not isinstance(config, EpConfig):
            raise TypeError(f"config: expected an EpConfig, got {type(config).__name__}")
        if config.nodes != 1:
            raise ValueError(f"EpConfig.nodes={config.nodes}: the node-local op runs one node (node_config())")
        if config.layout != "rank":
            raise ValueError(f"EpConfig.layout={config.layout!r}: ReferenceNodeOp runs the rank layout only")
        if group is not None and dist.get_world_size(group) != config.world_size:
            raise ValueError(f"EpConfig.world_size={config.world_size}: the node group has "
                             f"{dist.get_world_size(group)} processes")
        self.config = config
        self.group = group
        self.virtual = group is None
        self.local_ranks = list(range(config.world_size)) if group is None else [dist.get_rank(group)]
        self.device = torch.device("cpu")
        self.payload = dtype_info(config.dtype)  # the reference's flavour (fp8: e4m3fn)
        self.capacity = config.max_recv_tokens or config.world_size * config.max_tokens_per_rank
        self._generator = torch.Generator().manual_seed(seed)
        self._combine_in = {}
        self._pending = None

    def _lists(self, value, name, optional=False):
        if not self.virtual:
            return [value]
        if value is None and optional:
            return [None] * len(self.local_ranks)
        if not isinstance(value, (list, tuple)) or len(value) != len(self.local_ranks):
            raise TypeError(f"{name}: virtual mode takes a list of {len(self.local_ranks)} tensors (one per rank)")
        return list(value)

    def _everyone(self, values: list) -> list:
        """Every rank's entry of ``values`` (this process's ranks'): itself in virtual mode, else
        gathered over the group."""
        if self.virtual:
            return values
        gathered = [None] * self.config.world_size
        dist.all_gather_object(gathered, values[0], group=self.group)
        return gathered

    def _padded(self, rows: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        width = rows.shape[1] * rows.element_size()
        out = torch.full((self.capacity, width), 0xFF, dtype=torch.uint8)
        out[: rows.shape[0]] = rows.contiguous().view(torch.uint8)[perm]
        return out.view(rows.dtype)

    def dispatch(self, x, weights, indices, scales=None):
        """As ``EpDispatchCombine.dispatch`` (no ``async_recv``).

        Raises:
            TypeError, ValueError: as ``epgen.op.check_dispatch_inputs``.
            EpError: an expert id outside [-1, E) or more rows for a rank than its capacity
                (recoverable).
        """
        cfg = self.config
        xs, ws, ids = self._lists(x, "x"), self._lists(weights, "weights"), self._lists(indices, "indices")
        ss = self._lists(scales, "scales", optional=True)
        for i, r in enumerate(self.local_ranks):
            check_dispatch_inputs(cfg, self.payload, self.device, xs[i], ws[i], ids[i], ss[i],
                                  f"[rank {r}]" if self.virtual else "")
        xs, ws, ids, ss = (self._everyone(v) for v in (xs, ws, ids, ss))
        try:
            recv = reference.dispatch(xs, ws, ids, experts_per_rank=cfg.experts_per_rank,
                                      scales=ss if cfg.scale_bytes else None, max_recv_tokens=self.capacity)
        except ValueError as e:  # what the kernels report as a fault
            raise EpError(f"node-local dispatch: {e}", recoverable=True) from e
        perms = [torch.randperm(rows.num_rows, generator=self._generator) for rows in recv]
        outs = [DispatchOutput(
            recv_x=self._padded(recv[r].x, perms[r]), recv_weights=self._padded(recv[r].weights, perms[r]),
            recv_indices=self._padded(recv[r].indices, perms[r]),
            recv_scales=self._padded(recv[r].scales, perms[r]) if cfg.scale_bytes else None,
            recv_src=self._padded(recv[r].src, perms[r]), num_recv=torch.tensor([recv[r].num_rows], dtype=torch.int32))
            for r in self.local_ranks]
        self._pending = (recv, perms, [t.shape[0] for t in xs])
        return outs if self.virtual else outs[0]

    def combine_input(self, rank: int | None = None) -> torch.Tensor:
        """[capacity, H] bf16 buffer of ``rank`` for the expert outputs (as the op's zero-copy input)."""
        rank = self.local_ranks[0] if rank is None else rank
        if rank not in self.local_ranks:
            raise ValueError(f"rank={rank}: this stand-in drives ranks {self.local_ranks}")
        if rank not in self._combine_in:
            self._combine_in[rank] = torch.zeros((self.capacity, self.config.hidden), dtype=torch.bfloat16)
        return self._combine_in[rank]

    def combine(self, y, out=None):
        """As ``EpDispatchCombine.combine`` (no ``async_recv``): per rank [T, H] bf16, the combine
        wire's rows summed in ascending rank (fp32, bf16 once).

        Raises:
            RuntimeError: no dispatch precedes it.
            TypeError, ValueError: as ``epgen.op.check_combine_inputs``.
            EpError: y has fewer rows than the rank received (recoverable).
        """
        if self._pending is None:
            raise RuntimeError("combine: needs a dispatch first (each dispatch is combined once)")
        recv, perms, tokens = self._pending
        cfg = self.config
        ys, given = self._lists(y, "y"), self._lists(out, "out", optional=True)
        for i, r in enumerate(self.local_ranks):
            check_combine_inputs(cfg, self.device, ys[i], given[i], tokens[r], self.capacity,
                                 f"[rank {r}]" if self.virtual else "")
        self._pending = None
        ys = self._everyone(ys)
        wire = []
        for r, rows in enumerate(recv):
            if ys[r].shape[0] < rows.num_rows:
                raise EpError(f"rank {r}: combine input y has {ys[r].shape[0]} rows, fewer than the {rows.num_rows} "
                              "received (short input)", recoverable=True)
            inverse = torch.empty_like(perms[r])
            inverse[perms[r]] = torch.arange(perms[r].numel())
            wire.append(combine_roundtrip(cfg.combine_quant, ys[r][: rows.num_rows][inverse]))
        summed = reference.combine(wire, recv, tokens)
        outs = []
        for i, r in enumerate(self.local_ranks):
            o = summed[r].to(torch.bfloat16)
            if given[i] is not None:
                given[i].copy_(o)
                o = given[i]
            outs.append(o)
        return outs if self.virtual else outs[0]


@attrs.frozen
class _Sent:
    """What one local rank's dispatch sent, for its combine: ``tok`` [C] int64 the tokens in send
    order (ascending node, then token), ``sent[n]`` / ``received[n]`` the rows to and from node n."""

    tok: torch.Tensor
    sent: tuple[int, ...]
    received: tuple[int, ...]
    tokens: int


class HierarchicalEp:
    """Dispatch and combine of a layer spanning ``config.nodes`` nodes (module docstring).

    Modes (docs/multinode.md, "Process layouts"):
        * one process per node: ``node_op`` drives the node's G ranks as virtual ranks (an
          ``EpDispatchCombine(config.node_config(), virtual=True)``, or a ``ReferenceNodeOp``) and
          ``network_group`` has one process per node, in node order; inputs and outputs are lists
          with one entry per local rank;
        * one process per GPU: ``node_group, network_group = process_groups(config)``, ``node_op =
          EpDispatchCombine(config.node_config(), group=node_group)``; inputs and outputs are
          tensors. ``kernel_family`` must be "normal" or "low_latency" there.

    The network leg moves bytes (``all_to_all_single`` of uint8 rows): on ``wire_device`` (default:
    the CPU for a gloo group, else the node-local op's device); copies between it and the node-local
    op's device are part of the leg. Its waits are bounded by the group's timeout.

    Args:
        config: the layer (``EpConfig`` with ``nodes`` N; layout "rank").
        node_op: the node-local op: ``config``, ``local_ranks`` (local indices this process drives),
            ``virtual``, ``device``, ``dispatch(x, weights, indices, scales)``, ``combine(y, out)``,
            ``combine_input(rank)``; its config must equal ``config.node_config()``.
        network_group: the N processes that drive the same local ranks on every node, ranked by node
            (default: the world group).
        wire_device: where the network leg's tensors live (None: as above).
        time_legs: after every call, ``legs`` maps each leg ("dispatch network", "dispatch
            node-local", "combine node-local", "combine network") to (seconds, bytes): host wall
            time with the device synchronized at the leg's ends, and the bytes this process moved
            in it (network: rows to other nodes; node-local: rows its ranks received, payload
            bytes for dispatch and the combine wire's row bytes for combine: bf16, or a quantized
            wire row's codes and scales). Off by default (it synchronizes).

    Raises:
        TypeError: config is not an EpConfig.
        RuntimeError: torch.distributed is not initialized.
        ValueError: the network group's size is not N; ``node_op.config`` is not
            ``config.node_config()``; the expert layout; "auto" family with one process per GPU;
            processes of the group with another config or other local ranks (naming the node).
    """

    def __init__(self, config: EpConfig, node_op, *, network_group=None, wire_device=None, time_legs: bool = False):
        if not isinstance(config, EpConfig):
            raise TypeError(f"config: expected an EpConfig, got {type(config).__name__}")
        if config.layout != "rank":
            raise ValueError(f"EpConfig.layout={config.layout!r}: the hierarchical op runs the rank layout only")
        node_cfg = config.node_config()
        if getattr(node_op, "config", None) != node_cfg:
            raise ValueError(f"node_op.config={getattr(node_op, 'config', None)!r}: must be config.node_config() = "
                             f"{node_cfg!r}")
        if not dist.is_initialized():
            raise RuntimeError("HierarchicalEp needs torch.distributed initialized (one process per node, or per GPU "
                               "with process_groups)")
        self.config = config
        self.node_op = node_op
        self.group = network_group if network_group is not None else dist.group.WORLD
        N, G = config.nodes, config.ranks_per_node
        if dist.get_world_size(self.group) != N:
            raise ValueError(f"EpConfig.nodes={N}: the network group has {dist.get_world_size(self.group)} processes "
                             "(one per node)")
        self.local_ranks = list(node_op.local_ranks)
        if not node_op.virtual and G > 1 and node_cfg.kernel_family == "auto":
            raise ValueError("EpConfig.kernel_family='auto': with one process per GPU the forwarding ranks of a node "
                             "hold different row counts and could take different kernel families; use 'normal' "
                             "or 'low_latency'")
        self.node = dist.get_rank(self.group)
        self.ranks = [self.node * G + g for g in self.local_ranks]
        self.device = node_op.device
        gloo = dist.get_backend(self.group) == "gloo"
        self.wire_device = torch.device(wire_device) if wire_device is not None else (
            torch.device("cpu") if gloo else self.device)
        mine = (repr(config), self.local_ranks)
        theirs = [None] * N
        dist.all_gather_object(theirs, mine, group=self.group)
        for n, other in enumerate(theirs):
            if other != mine:
                raise ValueError(f"node {n} built {other} and node {self.node} {mine}: every process of the network "
                                 "group needs the same EpConfig and local ranks")
        self._pending = None
        self._broken = None
        self.time_legs = time_legs
        self.legs = {}
        self._clock = None

    # ---- helpers -----------------------------------------------------------------------------
    def _who(self) -> str:
        return f"global rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))} (node {self.node})"

    def _lists(self, value, name, optional=False) -> list:
        if not self.node_op.virtual:
            return [value]
        if value is None and optional:
            return [None] * len(self.local_ranks)
        if not isinstance(value, (list, tuple)) or len(value) != len(self.local_ranks):
            got = f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (list, tuple)) else "")
            raise TypeError(f"{name}: this process drives local ranks {self.local_ranks}; give a list of "
                            f"{len(self.local_ranks)} tensors (one per rank), got {got}")
        return list(value)

    def _usable(self, name: str):
        if self._broken is not None:
            raise HierarchicalError(f"{name}: {self._broken} [the op is unusable after a network-leg failure]")

    def _exchange(self, leg: str, rows: torch.Tensor, sent: list[int], received: list[int]) -> torch.Tensor:
        """The network leg: ``all_to_all_single`` of the [sum(sent), B] uint8 ``rows`` (blocks for node
        0, 1, ... of ``sent`` rows each) on ``wire_device``; returns the [sum(received), B] rows
        from each node, on the node-local op's device."""
        out = torch.empty((sum(received), rows.shape[1]), dtype=torch.uint8, device=self.wire_device)
        try:
            dist.all_to_all_single(out, rows.to(self.wire_device), output_split_sizes=received,
                                   input_split_sizes=sent, group=self.group)
        except RuntimeError as e:
            self._broken = f"{self._who()}: network leg ({leg}) failed: {e}"
            raise HierarchicalError(self._broken) from e
        return out.to(self.device)

    def _node_call(self, leg: str, fn, *args):
        try:
            return fn(*args)
        except EpError as e:
            raise EpError(f"{self._who()}: node-local kernel ({leg}) failed (node-local rank r is global rank "
                          f"{self.node} x {self.config.ranks_per_node} + r): {e}", recoverable=e.recoverable) from e

    def _mark(self, leg: str | None = None, nbytes: int = 0):
        """With ``time_legs``: close the running leg as ``leg`` (its bytes ``nbytes``) and start the next."""
        if not self.time_legs:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if leg is not None:
            self.legs[leg] = (now - self._clock, nbytes)
        self._clock = now

    def _row_bytes(self) -> tuple[int, int]:
        """(payload bytes of x, network row bytes) of one forwarded row."""
        cfg = self.config
        xb = dtype_info(cfg.dtype).row_bytes(cfg.hidden)
        return xb, xb + 8 * cfg.topk + 8 + cfg.scale_bytes

    def network_row_bytes(self) -> int:
        """Bytes of one (token, node) copy on the network: x row, K weights, K global ids, the global
        (source rank, source token), S scale bytes."""
        return self._row_bytes()[1]

    # ---- calls -------------------------------------------------------------------------------
    def dispatch(self, x, weights, indices, scales=None):
        """Send each token to every rank that holds one of its top-k experts, through the node
        that holds it (collective over every rank of the layer).

        Args (one rank; a list with one entry per local rank when the node-local op is virtual):
            x: [T, H] payload dtype (fp4: [T, H/2] uint8), T <= max_tokens_per_rank (0 allowed).
            weights: [T, K] float32.
            indices: [T, K] int32 global expert ids in [0, E) or -1.
            scales: [T, S] uint8, required iff S > 0.

        Returns:
            DispatchOutput per rank (a list in the virtual case): ``recv_x``, ``recv_weights``,
            ``recv_indices`` (the sender's global ids), ``recv_scales``, ``recv_src`` (global
            source rank, source token), ``num_recv``: views into the node-local op's outputs,
            valid until its next dispatch; rows >= num_recv undefined, row order unspecified.

        Raises:
            TypeError, ValueError: an input breaks the rules (before anything is sent); an expert
                id outside [-1, E) on any rank of the network group (raised on all of them after
                the count exchange, before any row is sent, naming that rank, token, slot and value).
            HierarchicalError: the network leg failed or timed out.
            EpError: the node-local kernels faulted (naming the leg; ``recoverable`` as theirs).
        """
        self._usable("dispatch")
        cfg, N, G = self.config, self.config.nodes, self.config.ranks_per_node
        span = G * cfg.experts_per_rank  # experts a node holds
        xs, ws, ids = self._lists(x, "x"), self._lists(weights, "weights"), self._lists(indices, "indices")
        ss = self._lists(scales, "scales", optional=True)
        tokens = [check_dispatch_inputs(cfg, self.node_op.payload, self.device, xs[i], ws[i], ids[i], ss[i], f"[rank {r}]")
                  for i, r in enumerate(self.ranks)]
        self._mark()
        nodes = torch.arange(N, device=self.device)
        counts = torch.zeros((N, len(self.ranks), _BAD), dtype=torch.int64, device=self.device)
        order = []
        for i, idx in enumerate(ids):
            bad = (idx != -1) & ((idx < 0) | (idx >= cfg.num_experts))
            if bool(bad.any()):
                t, k = (int(v) for v in bad.nonzero()[0])
                counts[:, i, 1:] = torch.tensor([1, t, k, int(idx[t, k])], device=self.device)
                order.append(torch.zeros(0, dtype=torch.int64, device=self.device))
                continue
            node_of = torch.where(idx >= 0, idx.to(torch.int64) // span, -1)
            reached = (node_of[:, :, None] == nodes).any(dim=1)  # [T, N]
            counts[:, i, 0] = reached.sum(dim=0)
            order.append(reached.t().nonzero(as_tuple=True)[1])  # tokens by node, ascending token
        got = torch.empty((N * len(self.ranks) * _BAD,), dtype=torch.int64, device=self.wire_device)
        try:
            dist.all_to_all_single(got, counts.view(-1).to(self.wire_device), group=self.group)
        except RuntimeError as e:
            self._broken = f"{self._who()}: network leg (dispatch counts) failed: {e}"
            raise HierarchicalError(self._broken) from e
        sent_counts = counts[:, :, 0].tolist()  # [N][local]
        got = got.view(N, len(self.ranks), _BAD).tolist()  # [source node][local][...]
        for n in range(N):
            for i, r in enumerate(self.local_ranks):
                flag, t, k, v = got[n][i][1:]
                if flag:
                    raise ValueError(f"indices[rank {n * G + r}][token {t}, slot {k}]={v}: expert ids must be -1 or "
                                     f"in [0, {cfg.num_experts}) (every rank of the network group refuses this "
                                     "dispatch; no row was sent)")
        xb, B = self._row_bytes()
        packed = []
        for i, r in enumerate(self.ranks):
            tok = order[i]
            src = torch.stack([torch.full_like(tok, r), tok], dim=1).to(torch.int32)
            parts = [xs[i][tok].view(torch.uint8), ws[i][tok].view(torch.uint8), ids[i][tok].view(torch.uint8),
                     src.view(torch.uint8)] + ([ss[i][tok]] if cfg.scale_bytes else [])
            packed.append(torch.cat(parts, dim=1))  # [C, B]
        blocks, sent = [], []
        starts = [[0] * (N + 1) for _ in self.ranks]
        for i in range(len(self.ranks)):
            for n in range(N):
                starts[i][n + 1] = starts[i][n] + sent_counts[n][i]
        for n in range(N):  # node-major, local rank minor: what node n's process expects
            for i in range(len(self.ranks)):
                blocks.append(packed[i][starts[i][n]:starts[i][n + 1]])
            sent.append(sum(sent_counts[n]))
        received = [sum(got[n][i][0] for i in range(len(self.ranks))) for n in range(N)]
        rows = self._exchange("dispatch rows", torch.cat(blocks), sent, received)
        per_rank = [[] for _ in self.ranks]
        at = 0
        for n in range(N):
            for i in range(len(self.ranks)):
                per_rank[i].append(rows[at:at + got[n][i][0]])
                at += got[n][i][0]
        node_cfg = cfg.node_config()
        lo, hi = self.node * span, (self.node + 1) * span
        fx, fw, fi, fs = [], [], [], []
        pad = node_cfg.scale_bytes - (B - xb - 4 * cfg.topk)
        for i in range(len(self.ranks)):
            fwd = torch.cat(per_rank[i])  # ascending source node, then source token
            gids = _columns(fwd, xb + 4 * cfg.topk, xb + 8 * cfg.topk).view(torch.int32)
            fx.append(_columns(fwd, 0, xb).view(self.node_op.payload.torch_dtype))
            fw.append(_columns(fwd, xb, xb + 4 * cfg.topk).view(torch.float32))
            fi.append(torch.where((gids >= lo) & (gids < hi), gids - lo, -1).to(torch.int32))
            fs.append(torch.cat([fwd[:, xb + 4 * cfg.topk:], fwd.new_zeros((fwd.shape[0], pad))], dim=1))
        args = (fx, fw, fi, fs) if self.node_op.virtual else (fx[0], fw[0], fi[0], fs[0])
        self._mark("dispatch network", B * (sum(sent) - sent[self.node]))
        outs = self._node_call("dispatch", self.node_op.dispatch, *args)
        self._pending = [_Sent(tok=order[i], sent=tuple(sent_counts[n][i] for n in range(N)),
                               received=tuple(got[n][i][0] for n in range(N)), tokens=tokens[i])
                         for i in range(len(self.ranks))]
        K, S = cfg.topk, cfg.scale_bytes
        views = []
        for o in (outs if self.node_op.virtual else [outs]):
            meta = o.recv_scales
            views.append(DispatchOutput(recv_x=o.recv_x, recv_weights=o.recv_weights,
                                        recv_indices=meta[:, :4 * K].view(torch.int32),
                                        recv_scales=meta[:, 4 * K + 8:4 * K + 8 + S] if S else None,
                                        recv_src=meta[:, 4 * K:4 * K + 8].view(torch.int32), num_recv=o.num_recv))
        if self.time_legs:
            self._received = sum(int(v.num_recv.item()) for v in views)
            self._mark("dispatch node-local", self._received * xb)
        return views if self.node_op.virtual else views[0]

    def combine_input(self, rank: int | None = None) -> torch.Tensor:
        """The node-local op's combine input of local ``rank`` (zero-copy expert outputs)."""
        return self.node_op.combine_input(rank)

    def combine(self, y, out=None):
        """Sum, for each token of the last dispatch, the expert outputs of the ranks it reached:
        inside each node first, then over nodes (collective over every rank of the layer).

        Args:
            y: [n, H] bf16 per rank (a list when the node-local op is virtual), row i the expert
                output of received row i (as the node-local op's combine takes it).
            out: optional [T, H] bf16 contiguous output per rank (T of the last dispatch).

        Returns:
            [T, H] bf16 per rank (a list in the virtual case): bf16(sum over nodes n ascending of
            fp32(P_n)), P_n the node-local combine's row for the token on node n (its ranks'
            wire rows summed ascending in fp32, bf16 once); zeros for a token that reached no
            rank (``epgen.reference.combine_hierarchical``).

        Raises:
            RuntimeError: no dispatch precedes it.
            TypeError, ValueError: bad y or out (before anything runs).
            HierarchicalError: the network leg failed or timed out.
            EpError: the node-local kernels faulted (naming the leg).
        """
        self._usable("combine")
        if self._pending is None:
            raise RuntimeError("combine: needs a dispatch first (each dispatch is combined once)")
        cfg, N = self.config, self.config.nodes
        given = self._lists(out, "out", optional=True)
        for i, r in enumerate(self.ranks):
            if given[i] is not None:
                check_tensor(f"out[rank {r}]", given[i], dtype=torch.bfloat16,
                             shape=(self._pending[i].tokens, cfg.hidden), device=self.device, contiguous=True)
        pending, self._pending = self._pending, None
        self._mark()
        partial = self._node_call("combine", self.node_op.combine, y)
        partial = partial if self.node_op.virtual else [partial]
        wire = combine_quant(cfg.combine_quant)
        row = wire.wire_row_bytes(cfg.hidden) if wire.quantized else 2 * cfg.hidden
        self._mark("combine node-local", self._received * row if self.time_legs else 0)
        blocks = []
        starts = [[0] for _ in self.ranks]
        for i, p in enumerate(pending):
            for n in range(N):
                starts[i].append(starts[i][-1] + p.received[n])
        for n in range(N):  # back to the source nodes: node-major, local rank minor
            for i in range(len(self.ranks)):
                blocks.append(partial[i][starts[i][n]:starts[i][n + 1]].view(torch.uint8))
        sent = [sum(p.received[n] for p in pending) for n in range(N)]
        received = [sum(p.sent[n] for p in pending) for n in range(N)]
        rows = self._exchange("combine rows", torch.cat(blocks), sent, received).view(torch.bfloat16)
        outs, at = [], 0
        acc = [torch.zeros((p.tokens, cfg.hidden), dtype=torch.float32, device=self.device) for p in pending]
        for n in range(N):  # ascending node: one fp32 add per (token, node)
            for i, p in enumerate(pending):
                c, first = p.sent[n], sum(p.sent[:n])
                acc[i].index_add_(0, p.tok[first:first + c], rows[at:at + c].to(torch.float32))
                at += c
        for i, a in enumerate(acc):
            o = a.to(torch.bfloat16)
            if given[i] is not None:
                given[i].copy_(o)
                o = given[i]
            outs.append(o)
        self._mark("combine network", 2 * cfg.hidden * (sum(sent) - sent[self.node]))
        return outs if self.node_op.virtual else outs[0]


def process_groups(config: EpConfig, *, timeout=None):
    """The two groups of this process for one process per GPU: (node group, network group).

    Every process of the world calls it (``dist.new_group`` is collective): it builds the N node
    groups (global ranks n G .. n G + G - 1) and the G network groups (local index g on every node:
    g, G + g, ...), and returns this process's. ``timeout`` (a ``datetime.timedelta``) bounds the
    network leg's waits (None: the default process group timeout).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the world size is not ``config.world_size``.
    """
    if not dist.is_initialized():
        raise RuntimeError("process_groups needs torch.distributed initialized (one process per GPU)")
    if dist.get_world_size() != config.world_size:
        raise ValueError(f"EpConfig.world_size={config.world_size}: the world has {dist.get_world_size()} processes")
    N, G = config.nodes, config.ranks_per_node
    kw = {} if timeout is None else {"timeout": timeout}
    node_groups = [dist.new_group([n * G + g for g in range(G)], **kw) for n in range(N)]
    network_groups = [dist.new_group([n * G + g for n in range(N)], **kw) for g in range(G)]
    rank = dist.get_rank()
    return node_groups[rank // G], network_groups[rank % G]
