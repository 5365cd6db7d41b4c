"""EpDispatchCombine: the generated dispatch and combine kernels as a torch-facing op.

Contract: docs/contract.md. All kernels are rendered and compiled (or loaded from an
ahead-of-time build, ``epgen.aot``) at construction; dispatch() and combine() only check inputs
and launch on torch's current stream (no host synchronization).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import warnings

import attrs
import numpy as np
import torch

from epgen.arena import Arenas, ErrorRecords
from epgen.codegen import abi
from epgen.codegen.arch import ARCH_TRAITS
from epgen.codegen.dtypes import DTypeInfo
from epgen.codegen.spec import EXPERT_OPS, PLAN_BLOCKS, KernelSpec, Op
from epgen.codegen.config import EpConfig
from epgen.platform import HIP_KERNEL_ARGS_BYTES, CooperativeLaunchTooLarge, Platform, capturing
from epgen.tensors import check_tensor, per_rank


class EpError(RuntimeError):
    """A kernel reported a fault (bad expert id, spin-wait timeout, receive overflow, a combine
    input shorter than the rows received).

    Attributes:
        recoverable: the faulted kernel still completed its call's signals and handed the fault to
            every peer (``epgen.codegen.abi.ErrorCode.recoverable``: all but a timeout). Every
            rank's ``synchronize()`` after the faulted call raises it, with the same text (the lowest
            rank's fault when several faulted), and clears it; the op then runs again, starting
            with a dispatch (the faulted call's outputs are invalid). ``validate=True`` synchronizes
            after every call, so there the faulted call itself raises it on every rank. A timeout
            is not recoverable: it names the rank that stopped answering, and the op refuses every
            further call; build a new op.
    """

    def __init__(self, message: str, recoverable: bool = False):
        super().__init__(message)
        self.recoverable = recoverable


@attrs.frozen
class DispatchOutput:
    """What one rank receives from a dispatch. Views into the rank's arena, valid until its next
    dispatch; rows >= num_recv are undefined and row order is unspecified. N receive rows:
    ``EpConfig.max_recv_tokens``, or W x Tmax when it is None.

    Attributes:
        recv_x: [N, H] payload dtype ([N, H/2] uint8 for fp4).
        recv_weights: [N, K] float32, the sender's full row.
        recv_indices: [N, K] int32, the sender's full row.
        recv_scales: [N, S] uint8, or None when S = 0.
        recv_src: [N, 2] int32, (source rank, source token).
        num_recv: [1] int32 device tensor, rows received (at most N: after an overflow, N).
    """

    recv_x: torch.Tensor
    recv_weights: torch.Tensor
    recv_indices: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_src: torch.Tensor
    num_recv: torch.Tensor


@attrs.frozen
class ExpertDispatchOutput:
    """What one rank receives from a dispatch in the expert layout (``EpConfig(layout="expert")``):
    one row per (received token, distinct local expert), grouped by local expert. Views into the
    rank's arena, valid until its next dispatch; device tensors throughout (no host sync).

    Expert e's rows are ``[offsets[e], offsets[e] + counts[e])``, in the order the tokens were
    received; ``offsets[e]`` is a multiple of ``EpConfig.expert_alignment``. The padding rows
    ``[offsets[e] + counts[e], offsets[e + 1])`` hold zeros (x, scales), weight 0 and source
    (-1, -1, -1); rows from ``offsets[L]`` on are never written and never read by combine.

    Attributes:
        x: [R, H] payload dtype ([R, H/2] uint8 for fp4), R = ``KernelSpec.expert_rows`` =
            N x min(K, L) + L x (A - 1), bit-equal to the token's row.
        scales: [R, S] uint8, or None when S = 0.
        weights: [R] float32: the routing weight of the (token, expert) pair; a token naming the
            expert in several top-k slots gets one row with their sum (ascending slot, fp32).
        src: [R, 3] int32: (source rank, source token, first top-k slot naming the expert).
        counts: [L] int32 rows of each local expert.
        offsets: [L + 1] int32 group starts; ``offsets[L]`` rows are used in all.
        recv: the rank-major receive rows the expansion read (``DispatchOutput``).
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    weights: torch.Tensor
    src: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    recv: DispatchOutput


@attrs.frozen
class CombineWireInput:
    """One rank's combine wire rows, for an expert stage that writes its outputs already in the
    combine wire's format (``EpDispatchCombine.combine_wire_input``): passed to ``combine`` as y,
    no quantize pass runs. Views into the rank's arena (rows strided by the wire row's bytes).

    Row i < num_recv must hold receive row i's expert output encoded as
    ``epgen.quant.combine_wire_rows(mode, y, fp8_flavour=epgen.quant.arch_fp8_flavour(op.arch))``
    encodes it (the bytes the quantize kernel would write: fp8 in the arch's flavour, e4m3fnuz on
    gfx942; rows >= num_recv are not read), and stay unchanged until the combine has run.

    Attributes:
        rank: the rank whose rows these are.
        codes: [N, C] uint8, N receive rows, C code bytes a row (fp8: H, one e4m3 code a byte; fp4:
            H / 2, element 2j in byte j's low nibble).
        scales: [N, B] float32 block scales (B = ceil(H / block): element j of a row decodes as
            code x scales[j // block]), or None for a wire without scales (fp8_direct_cast).
    """

    rank: int
    codes: torch.Tensor
    scales: torch.Tensor | None


class DispatchLayout:
    """Where one dispatch put every row, kept by ``EpDispatchCombine.keep_layout()`` so that a
    later ``combine(y, layout=...)`` or a cached-layout ``dispatch(x, layout=...)`` can use it
    after any number of other calls on the same op.

    It holds copies (made on the stream, no host synchronization) of the arena tables that the
    combine and the cached dispatch read, per rank this process drives: ``send_slot`` and
    ``send_pos`` ([T, W] int32: each local token's receive row on every rank), the receive rows'
    metadata (``recv_src`` [N, 2], ``recv_weights`` [N, K], ``recv_indices`` [N, K] int32,
    ``recv_scales`` [N, S]), ``num_recv``, and in the expert layout its tables (``slot_row``
    [N, K], expert counts and offsets, ``expert_weights`` [R], ``expert_src`` [R, 3], the
    expansion's per-block bases). No payload row is kept. Bytes per rank: ``nbytes`` (``docs/training.md``
    gives the formula: 8 T W + N (8 + 8 K + S) + 4 in the rank layout, plus N K 4 + R 16 + 4 (2 L + 1)
    + 4 L PLAN_BLOCKS in the expert layout; N receive rows, R expert rows).

    Expiry: never by later calls (its tables are its own); it belongs to its op and becomes
    unusable (a clear error, before any launch) when the op is closed or when a recoverable fault
    was cleared after it was kept (``EpError``: the op restarts from a dispatch).

    Attributes:
        call: the number of the op's dispatch call it was kept from (1 for the first).
        family: the kernel family that dispatch took ("normal" or "low_latency"); its combine takes
            the same.
        tokens: T of each rank this process drives (the layout's x rows).
        ranks: those ranks.
        nbytes: bytes this layout holds, all ranks together.
    """

    def __init__(self, op: "EpDispatchCombine", call: int, family: str, tokens: list[int],
                 saved: list[dict[str, torch.Tensor]]):
        self._op = op
        self._epoch = op._epoch
        self.call = call
        self.family = family
        self.tokens = list(tokens)
        self.ranks = list(op.local_ranks)
        self._saved = saved

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tables in self._saved for t in tables.values())

    def table(self, rank: int, name: str) -> torch.Tensor:
        """A kept table of ``rank`` as a typed tensor: "recv_src" [N, 2], "recv_weights" [N, K],
        "recv_indices" [N, K], "num_recv" [1], "send_slot" [T, W] int32 (and in the expert layout
        "slot_row" [N, K], "expert_weights" [R], "expert_offsets" [L + 1]). Read-only use.

        Raises:
            ValueError: a rank not in ``ranks``, or a name this layout does not keep."""
        if rank not in self.ranks:
            raise ValueError(f"rank={rank}: this layout holds ranks {self.ranks}")
        saved = self._saved[self.ranks.index(rank)]
        if name not in saved:
            raise ValueError(f"name={name!r}: this layout keeps {sorted(saved)}")
        return saved[name]

    def __repr__(self):
        return (f"DispatchLayout(call={self.call}, family={self.family!r}, tokens={self.tokens}, ranks={self.ranks}, "
                f"nbytes={self.nbytes})")


class RecvHandle:
    """The receiving half of a low-latency dispatch or combine launched with ``async_recv=True``.

    Between the sending half (already on the stream) and ``wait()`` the stream runs whatever the
    caller enqueues (attention, a shared expert): no kernel of the op holds an SM and nothing
    synchronizes the host. ``wait()`` enqueues the receiving half on the current stream, which
    must be the stream the sending half ran on (the halves rely on that stream's order), and
    returns what the synchronous call returns; it captures into CUDA graphs like any launch. The
    op refuses other calls until ``wait()`` has been called.

    Raises (wait):
        RuntimeError: wait() was already called.
    """

    def __init__(self, op: "EpDispatchCombine", finish):
        self._op = op
        self._finish = finish
        self.done = False

    def wait(self):
        if self.done:
            raise RuntimeError("RecvHandle.wait: already waited (each handle finishes its call once)")
        self.done = True
        self._op._recv_handle = None
        return self._finish()  # even after a fault: the halves' call counts must stay in step


HOST_ARCH = "sm_90"
"""The arch whose kernels ``device="cpu"`` runs when no ``arch`` is named."""


def _is_cpu(device) -> bool:
    """Whether ``device`` (an index, a name such as "cpu" / "cpu:0" / "cuda:1", a torch.device, or
    None) names the CPU: the host emulation.

    Raises:
        ValueError: a name torch does not know as a device.
    """
    if device is None or isinstance(device, int):
        return False
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: a CUDA device index, or 'cpu' for the host emulation ({e})") from None


def max_hip_world_size() -> int:
    """The largest W whose ``struct EpArgs`` fits ``epgen.platform.HIP_KERNEL_ARGS_BYTES`` (46)."""
    return max(W for W in range(1, abi.MAX_RANKS + 1) if _args_dtype(W).itemsize <= HIP_KERNEL_ARGS_BYTES)


def _args_dtype(world_size: int) -> np.dtype:
    """numpy dtype of struct EpArgs for ``world_size`` ranks, field by field from ``abi.ARGS``
    (all members 8 bytes: no padding); ``io`` is a [W] array of ``abi.RANK_IO`` records."""
    types = {**abi.NUMPY_TYPES, "EpRankIO": np.dtype([(f.name, abi.NUMPY_TYPES[f.ctype]) for f in abi.RANK_IO])}
    return np.dtype([(f.name, types[f.ctype], (world_size,)) if f.per_rank else (f.name, types[f.ctype])
                     for f in abi.ARGS])


def _rank_io(**fields: int) -> tuple[int, ...]:
    """One EpRankIO record (``a["io"][i] = ...``) from its fields by name; fields not named are 0.

    Raises:
        TypeError: a name is not a field of ``abi.RANK_IO``.
    """
    unknown = set(fields) - {f.name for f in abi.RANK_IO}
    if unknown:
        raise TypeError(f"EpRankIO has no field {', '.join(sorted(unknown))}")
    return tuple(fields.get(f.name, 0) for f in abi.RANK_IO)


VECTOR_BYTES = max(a.vector_bytes for a in ARCH_TRAITS.values())
"""The kernels read the rows of x and write the rows of out with vector accesses of this many bytes
(``ArchTraits.vector_bytes``), which fault (sm_90) on a misaligned address, e.g. a view at a storage
offset that is not a multiple of 16 bytes: those tensors must start on such a boundary (an empty
tensor is not read and passes). weights and indices are read one element at a time (4-byte loads,
which torch's element alignment covers), scales one byte at a time, and y is copied into the arena
by torch unless a kernel reads it in place, so those need no more than their dtype's alignment."""


def op_inputs(value, name: str, ranks: int, virtual: bool, optional: bool = False) -> list:
    """An op call's argument per local rank (``epgen.tensors.per_rank``), refusing a tensor that
    requires grad while grad mode is on: an op records no gradients, so its outputs would be cut
    from the graph without a word (``epgen.autograd`` differentiates the calls).

    Raises:
        TypeError: as ``per_rank``.
        RuntimeError: a tensor requiring grad under grad mode.
    """
    values = per_rank(value, name, ranks, virtual, optional)
    if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
        raise RuntimeError(f"{name}: requires grad, and EpDispatchCombine records no gradients (its outputs would "
                           "not reach the graph); differentiate through epgen.autograd.dispatch / combine, or pass "
                           f"{name}.detach() or call under torch.no_grad()")
    return values


def check_dispatch_inputs(cfg: EpConfig, payload: DTypeInfo, device: torch.device, x, weights, indices, scales,
                          tag: str = "") -> int:
    """Check one rank's dispatch inputs against ``cfg`` before any launch; returns T.

    ``payload`` is the payload dtype as the target takes it (``KernelSpec.dtype_info``: fp8 in the
    arch's flavour, ``ArchTraits.fp8``; the table row ``dtype_info(cfg.dtype)`` on the CPU).
    Rules: x [T, H] of ``payload``'s torch dtype ([T, H / 2] uint8 for fp4) with T <= max_tokens_per_rank;
    weights [T, K] float32;
    indices [T, K] int32; scales [T, S] uint8 iff S > 0; all on ``device`` and contiguous; x
    starts on a 16-byte boundary (its rows are read with 16-byte vector loads; the others are
    read per element or per byte and need only their dtype's alignment).

    Raises:
        TypeError: an argument is not a tensor.
        ValueError: naming the argument (with ``tag``, e.g. "[rank 3]"), its value and the rule.
    """
    check_tensor(f"x{tag}", x, dtype=payload.torch_dtype, shape=(None, payload.columns(cfg.hidden)), device=device,
                 contiguous=True, vector_bytes=VECTOR_BYTES)
    T = x.shape[0]
    if T > cfg.max_tokens_per_rank:
        raise ValueError(f"x{tag}.shape[0]={T}: more tokens than max_tokens_per_rank={cfg.max_tokens_per_rank}")
    check_tensor(f"weights{tag}", weights, dtype=torch.float32, shape=(T, cfg.topk), device=device, contiguous=True)
    check_tensor(f"indices{tag}", indices, dtype=torch.int32, shape=(T, cfg.topk), device=device, contiguous=True)
    if cfg.scale_bytes:
        check_tensor(f"scales{tag}", scales, dtype=torch.uint8, shape=(T, cfg.scale_bytes), device=device,
                     contiguous=True)
    elif scales is not None:
        raise ValueError(f"scales{tag}: given, but EpConfig.scale_bytes=0")
    return T


def check_combine_inputs(cfg: EpConfig, device: torch.device, y, out, tokens: int, capacity: int,
                         tag: str = "", in_place: bool = False) -> None:
    """Check one rank's combine inputs: y [n, H] bf16 with n <= ``capacity`` (the receive rows, or
    in the expert layout its R rows), or None (the caller wrote the wire rows: ``combine_wire_input``);
    out None or [T, H] bf16 (T of the dispatch being combined);
    contiguous, on ``device``; out, and y when a kernel reads it in place (the expert layout's
    fold, the low-latency combine and the quantized wire's kernels: ``in_place``), start on a
    16-byte boundary (16-byte vector accesses; the normal bf16-wire combine copies y into the
    arena with torch, so any address of it works there). Whether y holds every row the dispatch
    produced is known on the device only: the kernels check it and raise ``EpError`` (short input).

    Raises:
        TypeError, ValueError: as ``check_dispatch_inputs``.
    """
    expert = cfg.layout == "expert"
    if y is not None:
        check_tensor(f"y{tag}", y, dtype=torch.bfloat16, shape=(None, cfg.hidden), device=device, contiguous=True,
                     vector_bytes=VECTOR_BYTES if expert or in_place else 0)
        if y.shape[0] > capacity:
            what = ("the expert layout's rows (max_recv_tokens x min(topk, experts per rank) + padding)" if expert
                    else "the receive capacity (max_recv_tokens, or world_size x max_tokens_per_rank)")
            raise ValueError(f"y{tag}.shape[0]={y.shape[0]}: more rows than {what}, {capacity}")
    if out is not None:
        check_tensor(f"out{tag}", out, dtype=torch.bfloat16, shape=(tokens, cfg.hidden), device=device,
                     contiguous=True, vector_bytes=VECTOR_BYTES)


def _check_out_apart(outs: list, ys: list, ranks: list[int] | None) -> None:
    """ValueError where a given ``out`` shares bytes with any rank's y or another rank's out: the
    kernels write out while every rank's y is still read (in place, or copied rank by rank), so an
    overlap would return rows that depend on the launch order. ``ranks``: the virtual ranks, for
    the tags (None: one rank)."""
    def span(t):
        return (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) if t is not None and t.numel() else None

    tag = (lambda i: f"[rank {ranks[i]}]") if ranks else (lambda i: "")
    for i, out in enumerate(outs):
        o = span(out)
        if o is None:
            continue
        for name, others in (("y", ys), ("out", outs)):
            for j, t in enumerate(others):
                other = span(t)
                if other is not None and not (name == "out" and j == i) and o[0] < other[1] and other[0] < o[1]:
                    raise ValueError(f"out{tag(i)}: shares bytes with {name}{tag(j)}; the combine writes out while "
                                     "it still reads every rank's y, so out must be memory of its own")


class EpDispatchCombine:
    """Dispatch tokens to the ranks holding their top-k experts and combine the expert outputs.

    Modes:
        * one process per GPU: ``torch.distributed`` initialized with ``world_size`` ranks (or
          ``group``); peers' arenas are mapped through IPC handles. Inputs are tensors.
        * virtual ranks (``virtual=True``): all W ranks live in this process on one GPU and every
          launch runs all of them; inputs and outputs are lists with one entry per rank.
        * W = 1: a single rank, no process group needed.

    The kernels each call launches are the op's ``plan`` (``epgen.plan.Plan``: built from the
    config, the arch and the tuning tables, its geometries as this GPU runs them; ``epgen plan``
    prints one without a GPU).

    Args:
        config: the layer (validated).
        group: process group of the W ranks (default: the world group).
        virtual: run all W ranks in this process on ``device``.
        device: CUDA device index (default: torch's current device), or ``"cpu"``: the kernels of
            ``arch`` run on the host emulation (``epgen.host``, docs/host.md; for correctness,
            not speed), inputs and outputs CPU tensors.
        validate: synchronize after every call and raise at once on a kernel fault.
        arch: with ``device="cpu"``, the arch whose kernels run (``sm_90`` default, ``gfx942``,
            ``gfx950``, ``gfx1250``).
        schedule: with ``device="cpu"``, the emulation's ``epgen.host.Schedule`` (seed, weakness, delays).

    Raises:
        TypeError: ``config`` is not an EpConfig.
        RuntimeError: no GPU or no CuPy (unless ``device="cpu"``), W > 1 without a process group and
            without ``virtual``, or (ROCm) a HIP runtime older than the arch needs (``epgen.platform.MIN_ROCM``).
        ValueError: ``config.nodes`` > 1 (that layer runs as ``epgen.hierarchical.HierarchicalEp``),
            the process group size differs from ``config.world_size``, ranks hold
            different configs, no kernels exist for this GPU's arch, an explicit geometry
            whose blocks must all be resident at once does not fit the GPU (virtual ranks), or
            (ROCm) W > 46, whose launch argument exceeds ``epgen.platform.HIP_KERNEL_ARGS_BYTES``;
            ``arch`` or ``schedule`` without ``device="cpu"``, or an unknown ``arch``.
    """

    def __init__(self, config: EpConfig, *, group=None, virtual: bool = False, device: int | str | None = None,
                 validate: bool = False, arch: str | None = None, schedule=None):
        if not isinstance(config, EpConfig):
            raise TypeError(f"config: expected an EpConfig, got {type(config).__name__}")
        if config.nodes > 1:
            raise ValueError(f"EpConfig.nodes={config.nodes}: a layer across nodes runs as "
                             "epgen.hierarchical.HierarchicalEp (whose node-local op is "
                             "EpDispatchCombine(config.node_config())); this op spans one node")
        host = _is_cpu(device)
        if not host and (arch is not None or schedule is not None):
            raise ValueError(f"arch={arch!r}, schedule={schedule!r}: only the host emulation (device='cpu') takes "
                             "them; a GPU's arch is its own")
        if not host and not torch.cuda.is_available():
            raise RuntimeError("EpDispatchCombine needs a GPU: torch.cuda.is_available() is False (device='cpu' "
                               "runs the kernels on the host emulation, epgen.host)")
        if not host and importlib.util.find_spec("cupy") is None:  # fail here, with the install hint, not at a launch
            raise RuntimeError("EpDispatchCombine needs CuPy: pip install -e '.[cuda]' (or '.[rocm]')")
        self.config = config
        self.validate = validate
        self.device = torch.device("cpu") if host else torch.device(
            "cuda", torch.cuda.current_device() if device is None else device)
        W = config.world_size
        if virtual or W == 1:
            group = None
            self.local_ranks = list(range(W)) if virtual else [0]
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(f"EpConfig.world_size={W}: needs torch.distributed initialized with one process "
                                   f"per {'rank (gloo, on the host emulation)' if host else 'GPU'}, or virtual=True to "
                                   "run every rank in this process")
            group = group if group is not None else dist.group.WORLD
            if dist.get_world_size(group) != W:
                raise ValueError(f"EpConfig.world_size={W}: the process group has {dist.get_world_size(group)} ranks")
            configs = [None] * W
            dist.all_gather_object(configs, repr(config), group=group)
            differ = [r for r, c in enumerate(configs) if c != repr(config)]
            if differ:
                raise ValueError(f"ranks {differ} built a different EpConfig than rank {dist.get_rank(group)}: "
                                 f"{configs[differ[0]]} vs {config!r}")
            self.local_ranks = [dist.get_rank(group)]
        self.virtual = virtual
        if host:
            from epgen.host import HostPlatform

            self.platform = HostPlatform(HOST_ARCH if arch is None else arch, schedule, processes=group is not None,
                                         rank_base=self.local_ranks[0])
            self.platform.schedule.check_ranks(W)
        else:
            self.platform = Platform.current()  # every vendor-specific host call goes through it
        self.arch = self.platform.arch(self.device.index)  # ValueError for an arch epgen has no kernels for
        self.platform.check_runtime(self.arch)  # ROCm: RuntimeError for a HIP runtime older than the arch needs
        self.platform.check_kernel_args(_args_dtype(W).itemsize, W, max_hip_world_size())
        # Every variant the op can pick is compiled here: dispatch() and combine() never compile.
        self._kernels = {}  # spec -> loaded kernel
        plan = self.platform.plan(config, self.arch, len(self.local_ranks))
        self.platform.prepare([spec for variants in plan.variants.values() for _, spec in variants])
        self.plan = plan.with_variants({key: self._load_variants(key[0], variants)
                                        for key, variants in plan.variants.items()})
        self.dispatch_spec = self.plan.dispatch_spec
        self.low_latency_tokens = self.plan.low_latency_tokens  # T_ll: 0 without the low-latency family
        # A whole low-latency op in one kernel needs every block of its grid resident at once (a
        # block's receiving phase waits for every block's sending phase): it is launched
        # cooperatively where the vendor's rule allows it (Plan.whole_low_latency: not on ROCm);
        # there, and where the GPU cannot hold its grid at all, or once the runtime has refused
        # its grid as too large (_halves_after_refusal), each call launches the two halves instead.
        ranks = len(self.local_ranks)
        self._fused = {call: self.plan.whole_low_latency and self.low_latency_tokens > 0 and all(
            self.resident_blocks(self._kernels[spec], spec) // ranks >= spec.blocks
            for spec in self.plan.whole_grid_specs(call)) for call in (Op.DISPATCH, Op.COMBINE)}
        self.arena_layout = self.dispatch_spec.arena_layout
        self.expert_layout = config.layout == "expert"
        need = self.arena_layout.total_bytes * len(self.local_ranks)
        free = self.platform.free_bytes(self.device, need)
        if need > free:
            raise ValueError(f"EpConfig.max_tokens_per_rank={config.max_tokens_per_rank}: the arenas need "
                             f"{need / 2**30:.1f} GiB ({len(self.local_ranks)} x {self.arena_layout.total_bytes / 2**30:.2f} GiB:"
                             f" {self.arena_layout.capacity_rows} receive rows of payload and combine input"
                             f"{f', {self.arena_layout.expert_rows} expert layout rows' if self.expert_layout else ''}) but "
                             f"{self.device} has {free / 2**30:.1f} GiB free; lower max_tokens_per_rank or set "
                             "EpConfig.max_recv_tokens")
        self.arenas = Arenas(self.arena_layout, W, self.local_ranks, self.device, group, platform=self.platform)
        self.errors = ErrorRecords(W, self.platform)
        self._args = {}
        for op in dict.fromkeys(op for op, _ in self.plan.variants):  # every kind of the config
            a = np.zeros((), dtype=_args_dtype(W))
            a["arena"] = self.arenas.pointers
            a["signals"] = self.arenas.signals
            a["errors"] = self.errors.ptr
            a["rank_base"] = self.local_ranks[0]
            a["timeout_ns"] = int(config.timeout_s * 1e9)
            self._args[op] = a
        self._start_calls()

    def _start_calls(self) -> None:
        """The state that calls carry from one to the next, as before the first call."""
        self._pending_tokens = None  # token counts of the dispatch that combine will undo
        self._pending_family = None  # the kernel family that dispatch took (its combine takes the same)
        # Layouts (DispatchLayout): the dispatch calls so far; the call whose tables the arena holds
        # (None: unknown, or changed by an unweighted combine); the last dispatch (call, family,
        # tokens), which the implicit combine undoes, and its kept copy (taken by keep_layout, or
        # before another layout overwrites its tables); the count of cleared faults (a layout kept
        # before one is stale).
        self._calls = 0
        self._combined = False  # a normal-family combine ran since the last dispatch (_combine_barrier)
        self._resident_call = None
        self._last = None
        self._last_saved = None
        self._epoch = 0
        self._recv_handle = None  # an async_recv call's RecvHandle until it is waited for
        self._fault = None

    # ---- views -------------------------------------------------------------------------------
    def _view(self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.arenas.local[rank][offset:offset + n].view(dtype).view(shape)

    @property
    def payload(self) -> DTypeInfo:
        """The dispatch payload dtype as this arch takes it (``KernelSpec.dtype_info``: fp8 in the
        arch's flavour, ``ArchTraits.fp8``)."""
        return self.dispatch_spec.dtype_info

    def recv_buffers(self, rank: int | None = None) -> DispatchOutput:
        """The receive-side views of ``rank`` (default: this process's rank)."""
        rank = self._local(rank)
        lay, cfg, cap = self.arena_layout, self.config, self.arena_layout.capacity_rows
        return DispatchOutput(
            recv_x=self._view(rank, lay.recv_x, (cap, self.dispatch_spec.dtype_info.columns(cfg.hidden)),
                              self.dispatch_spec.dtype_info.torch_dtype),
            recv_weights=self._view(rank, lay.recv_weights, (cap, cfg.topk), torch.float32),
            recv_indices=self._view(rank, lay.recv_indices, (cap, cfg.topk), torch.int32),
            recv_scales=(self._view(rank, lay.recv_scales, (cap, cfg.scale_bytes), torch.uint8)
                         if cfg.scale_bytes else None),
            recv_src=self._view(rank, lay.recv_src, (cap, 2), torch.int32),
            num_recv=self._signal_view(rank, "num_recv"),
        )

    def expert_buffers(self, rank: int | None = None) -> ExpertDispatchOutput:
        """The expert layout's views of ``rank`` (default: this process's rank).

        Raises:
            RuntimeError: the op's layout is "rank".
        """
        if not self.expert_layout:
            raise RuntimeError("expert_buffers: needs EpConfig(layout='expert'); this op's layout is 'rank'")
        rank = self._local(rank)
        lay, cfg, R, L = self.arena_layout, self.config, self.arena_layout.expert_rows, self.config.experts_per_rank
        info = self.dispatch_spec.dtype_info
        return ExpertDispatchOutput(
            x=self._view(rank, lay.expert_x, (R, info.columns(cfg.hidden)), info.torch_dtype),
            scales=self._view(rank, lay.expert_scales, (R, cfg.scale_bytes), torch.uint8) if cfg.scale_bytes else None,
            weights=self._view(rank, lay.expert_weights, (R,), torch.float32),
            src=self._view(rank, lay.expert_src, (R, 3), torch.int32),
            counts=self._view(rank, lay.expert_counts, (L,), torch.int32),
            offsets=self._view(rank, lay.expert_offsets, (L + 1,), torch.int32),
            recv=self.recv_buffers(rank),
        )

    def _signal_view(self, rank: int, name: str) -> torch.Tensor:
        """[1] int32 view of signal word ``name`` of ``rank`` (its own region on ROCm)."""
        offset = abi.signal(name).byte_offset
        return self.arenas.local_signals[rank][offset:offset + 4].view(torch.int32)

    def combine_input(self, rank: int | None = None) -> torch.Tensor:
        """[N, H] bf16 view of ``rank``'s combine input (N receive rows; in the expert layout
        [R, H], row p for expanded row p): an expert stage that writes its outputs here makes
        combine skip its copy (zero-copy)."""
        rank = self._local(rank)
        if self.expert_layout:
            return self._view(rank, self.arena_layout.expert_y, (self.arena_layout.expert_rows, self.config.hidden),
                              torch.bfloat16)
        return self._combine_in(rank)

    def dispatch_input(self, rank: int | None = None) -> torch.Tensor:
        """[Tmax, H] view of ``rank``'s dispatch_in region in the payload dtype (fp4: [Tmax, H/2]
        uint8), Tmax = ``max_tokens_per_rank``: the rows the pull dispatch's peers read. A caller
        that writes its x into ``dispatch_input()[:T]`` and passes that slice as x dispatches
        without a copy (zero copy; the twin of ``combine_input``); ``transport(T, x)`` says which
        transport such a call takes. The rows may be overwritten once the dispatch that read them
        has passed on this rank's stream (its last kernel waits until every rank has read them).

        Raises:
            ValueError: ``rank`` is not driven by this process (or None in virtual mode).
        """
        rank = self._local(rank)
        info = self.dispatch_spec.dtype_info
        return self._view(rank, self.arena_layout.dispatch_in, (self.config.max_tokens_per_rank, info.columns(self.config.hidden)),
                          info.torch_dtype)

    def _combine_in(self, rank: int) -> torch.Tensor:
        """[N, H] bf16 view of ``rank``'s combine_in region (the rows the normal combine's peers read)."""
        return self._view(rank, self.arena_layout.combine_in, (self.arena_layout.capacity_rows, self.config.hidden),
                          torch.bfloat16)

    def combine_wire_input(self, rank: int | None = None) -> CombineWireInput:
        """The combine wire rows of ``rank`` (default: this process's rank), for an expert stage
        that writes its outputs already quantized: pass the result (a list of them in virtual
        mode) to ``combine`` as y and no quantize pass runs (``CombineWireInput`` says what each
        row must hold).

        Raises:
            RuntimeError: the combine wire is bf16 (``EpConfig.combine_quant`` "none"), or the
                op's layout is "expert" (its fold writes the wire rows).
        """
        cfg = self.config
        quant = self.dispatch_spec.quant
        if not quant.quantized:
            raise RuntimeError("combine_wire_input: needs a quantized combine wire; EpConfig.combine_quant='none' "
                               "(pass the bf16 rows as y, or write them into combine_input())")
        if self.expert_layout:
            raise RuntimeError("combine_wire_input: the expert layout's fold writes the wire rows; pass y "
                               "(the expert outputs) to combine")
        rank = self._local(rank)
        cap, row = self.arena_layout.capacity_rows, quant.wire_row_bytes(cfg.hidden)
        rows = self._view(rank, self.arena_layout.combine_wire, (cap, row), torch.uint8)
        offset, count = quant.scale_offset(cfg.hidden), quant.scale_count(cfg.hidden)
        return CombineWireInput(rank=rank, codes=rows[:, :quant.code_bytes(cfg.hidden)],
                                scales=rows[:, offset:offset + 4 * count].view(torch.float32) if count else None)

    def _wire_inputs(self, y, family: str, tokens: list[int]) -> bool:
        """Whether ``combine``'s y is ``combine_wire_input()`` (a list of them, one per rank, in
        virtual mode), checked against this op, its ranks and the dispatch being combined."""
        items = y if self.virtual and isinstance(y, (list, tuple)) else [y]
        given = [isinstance(v, CombineWireInput) for v in items]
        if not any(given):
            return False
        if not all(given) or [v.rank for v in items] != self.local_ranks:
            raise ValueError(f"y: a CombineWireInput must be this op's combine_wire_input(rank) for every rank it drives "
                             f"({self.local_ranks}), in that order; got {[getattr(v, 'rank', type(v).__name__) for v in items]}")
        if any(v.codes.data_ptr() != self.combine_wire_input(v.rank).codes.data_ptr() for v in items):
            raise ValueError("y: a CombineWireInput of another op; pass this op's combine_wire_input()")
        if family != "normal":
            raise ValueError("y=combine_wire_input(): the low-latency combine encodes its rows as it sends them and "
                             f"cannot take them pre-quantized; this dispatch took it ({max(tokens)} tokens, "
                             f"low_latency_tokens={self.low_latency_tokens}); build the op with "
                             "EpConfig(kernel_family='normal') to pass wire rows at every size")
        return True

    def _local(self, rank):
        if rank is None:
            if len(self.local_ranks) != 1:
                raise ValueError("rank: name which virtual rank (0 <= rank < world_size)")
            return self.local_ranks[0]
        if rank not in self.arenas.local:
            raise ValueError(f"rank={rank}: this process drives ranks {self.local_ranks}")
        return rank

    # ---- calls -------------------------------------------------------------------------------
    def family(self, tokens: int) -> str:
        """The kernel family a call with ``tokens`` (the largest token count of the ranks this
        process drives) takes: "low_latency" or "normal" (``EpConfig.kernel_family``; "auto"
        takes the low-latency family up to ``low_latency_tokens``).

        Raises:
            ValueError: ``tokens`` not an int >= 0."""
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
            raise ValueError(f"tokens={tokens!r}: must be an int >= 0 (the most tokens of any rank in the call)")
        return self.plan.family(tokens)

    def transport(self, tokens: int, x, family: str | None = None) -> str:
        """The transport a dispatch of ``tokens`` (the largest token count of the ranks this
        process drives) with input ``x`` (a list in virtual mode) in ``family`` (default
        ``family(tokens)``) takes: "pull" or "push".
        "push" for the low-latency family and ``dispatch_transport="push"``; "pull" for
        ``dispatch_transport="pull"`` (an x outside ``dispatch_input`` is copied there first);
        "auto" pulls where the tuning bucket of ``tokens`` says "pull" and x starts at
        ``dispatch_input()`` (on every rank in virtual mode), else pushes; with one rank a process
        (W > 1) "auto" always pushes: no process sees its peers' x or token counts, and every rank
        must take the same transport (``Plan.transport``)."""
        return self._transport(tokens, self._per_rank(x, "x"), family)

    def _transport(self, tokens: int, xs: list, family: str | None = None) -> str:
        zero_copy = all(isinstance(t, torch.Tensor) and t.data_ptr() == self.dispatch_input(r).data_ptr()
                        for r, t in zip(self.local_ranks, xs))
        return self.plan.transport(tokens, zero_copy, family)

    def _check_dispatch_input_use(self, rank: int, x: torch.Tensor, tag: str):
        """An x that overlaps ``rank``'s dispatch_input must start at its first row.

        Raises:
            ValueError: naming x, its offset into dispatch_input and the rule.
        """
        region = self.dispatch_input(rank)
        start, end = region.data_ptr(), region.data_ptr() + region.numel() * region.element_size()
        p = x.data_ptr()
        if x.numel() and p != start and p < end and p + x.numel() * x.element_size() > start:
            raise ValueError(f"x{tag}.data_ptr()={p:#x}: {p - start} bytes into dispatch_input(); an x in "
                             "dispatch_input must start at its first row (pass op.dispatch_input()[:T])")

    def dispatch(self, x, weights=None, indices=None, scales=None, family: str | None = None, *,
                 async_recv: bool = False, layout: DispatchLayout | None = None):
        """Send each token to every distinct rank that holds one of its top-k experts.

        With ``layout`` (a ``DispatchLayout`` of this op, ``keep_layout()``): a cached-layout
        dispatch. x's rows go to exactly the receive rows (and expert rows) of the layout's
        dispatch, with no routing phase and no index exchange; weights, indices, scales and family
        are not taken (the outputs' metadata are the layout's). It runs the pull transport's two
        kernels (the dispatch kernel with no tokens, as the handshake that publishes every rank's
        ``dispatch_input``, then DISPATCH_PULL over the layout's receive rows) and, in the expert
        layout, the expansion's copy kernel (not its plan), after restoring the layout's tables:
        an op built with ``EpConfig(dispatch_transport="pull")`` (the other settings build no pull
        kernels). x must have the layout's T rows on each rank; every rank passes the layout of the
        same dispatch call. The call then counts as the op's last dispatch (an implicit
        ``combine(y)`` undoes it).

        Args (one rank; in virtual mode each is a list with one entry per rank):
            x: [T, H] payload dtype (fp4: [T, H/2] uint8, two codes a byte), T <= max_tokens_per_rank
                (0 allowed). Payload bytes move unchanged.
            weights: [T, K] float32 routing weights (forwarded unchanged).
            indices: [T, K] int32 expert ids in [0, E) or -1 (no expert).
            scales: [T, S] uint8 opaque per-token scale bytes, required iff S > 0.
            family: the kernel family of this call, "low_latency" or "normal", the same on every
                rank (docs/contract.md). None: ``EpConfig.kernel_family``, where "auto" picks by
                ``family(T)`` only when the op sees every rank's T (virtual ranks, or W = 1); with
                one process a rank of W > 1 an "auto" op needs it stated, e.g.
                ``family=op.family(max T over the ranks)`` or by phase (prefill / decode).
            async_recv: (keyword) launch only the low-latency family's sending half and return a
                ``RecvHandle`` whose ``wait()`` launches the receiving half (and the expert
                layout's expansion) and returns the outputs. Needs T <= ``low_latency_tokens``.
            layout: (keyword) a cached-layout dispatch (above).

        The normal family moves the rows by ``transport(T, x)``: "push" (one kernel), or "pull"
        (the dispatch kernel sends the metadata, then DISPATCH_PULL loads each received row from
        its source rank's ``dispatch_input``; with ``dispatch_transport="pull"`` an x elsewhere is
        first copied there by torch on the current stream). Every rank must take the same
        transport in a call.

        Returns:
            DispatchOutput, or in the expert layout ExpertDispatchOutput (its ``recv`` the
            rank-major rows; the expansion runs right after the dispatch kernel, see ``expand``);
            a list of them in virtual mode; a RecvHandle with ``async_recv``. The kernel family
            follows ``family(T)``; both return the same rows (their order within [0, num_recv)
            differs).

        Raises:
            TypeError, ValueError: an input breaks the rules above (before any launch), an x that
                overlaps ``dispatch_input`` but does not start at it, ``async_recv`` without a
                low-latency family for T, a ``family`` the op has no kernels for or that cannot
                take T, or no ``family`` where an "auto" op cannot see its peers' T; with ``layout``:
                a layout of another op or stale (``DispatchLayout``), an x whose T differs from the
                layout's, weights / indices / scales / family / async_recv given, or an op without
                the pull kernels.
            RuntimeError: an async_recv call's handle has not been waited for, or the runtime refused
                the whole low-latency op's cooperative grid as too large while a graph was being
                captured (later calls take the halves; eagerly, the call takes them at once).
            EpError: an earlier call timed out in a kernel (recoverable faults are raised by synchronize).
        """
        self._raise_if_faulted()
        self._check_no_recv_pending("dispatch")
        if layout is not None:
            return self._cached_dispatch(x, weights, indices, scales, family, async_recv, layout)
        xs, ws, ids, ss = self._per_rank(x, "x"), self._per_rank(weights, "weights"), \
            self._per_rank(indices, "indices"), self._per_rank(scales, "scales", optional=True)
        cfg = self.config
        tokens = []
        for i, rank in enumerate(self.local_ranks):
            tag = f"[rank {rank}]" if self.virtual else ""
            tokens.append(check_dispatch_inputs(cfg, self.payload, self.device, xs[i], ws[i], ids[i], ss[i], tag))
            self._check_dispatch_input_use(rank, xs[i], tag)
        family = self._family_for_call(max(tokens), async_recv, family)
        route = self.plan.route(Op.DISPATCH, family, self._transport(max(tokens), xs, family),
                                async_recv or not self._fused[Op.DISPATCH])
        io = []
        for i, rank in enumerate(self.local_ranks):
            x = xs[i]
            if route.x_in_dispatch_input:  # the rows must be in dispatch_input, where the peers read them
                x = self.dispatch_input(rank)
                if xs[i].data_ptr() != x.data_ptr() and tokens[i]:
                    x[: tokens[i]].copy_(xs[i])
            io.append(dict(x=x.data_ptr(), weights=ws[i].data_ptr(), indices=ids[i].data_ptr(),
                           scales=ss[i].data_ptr() if cfg.scale_bytes else 0, num_tokens=tokens[i]))
        self._run(route.send, max(tokens), {"call": io})
        self._pending_tokens = tokens
        self._pending_family = family
        self._calls += 1
        self._resident_call = self._calls
        self._combined = False
        self._last, self._last_saved = (self._calls, family, list(tokens)), None

        def finish():
            self._run(route.recv, max(tokens), {"call": io})
            outs = [self.expert_buffers(r) if self.expert_layout else self.recv_buffers(r) for r in self.local_ranks]
            return outs if self.virtual else outs[0]

        return self._finish_or_handle(finish, async_recv)

    def _cached_dispatch(self, x, weights, indices, scales, family, async_recv, layout):
        """``dispatch(x, layout=layout)`` (its docstring)."""
        self._check_layout(layout, "dispatch")
        given = [n for n, v in (("weights", weights), ("indices", indices), ("scales", scales), ("family", family))
                 if v is not None] + (["async_recv"] if async_recv else [])
        if given:
            raise ValueError(f"dispatch(layout=...): {', '.join(given)} given; a cached-layout dispatch moves x alone "
                             "along the layout (its metadata are the layout's)")
        route = self.plan.routes.get((Op.DISPATCH, "normal", "pull", False))
        if route is None:
            raise ValueError(f"dispatch(layout=...): a cached-layout dispatch runs the pull dispatch's kernels, which "
                             f"this op does not build (EpConfig.dispatch_transport={self.config.dispatch_transport!r}, "
                             f"kernel_family={self.config.kernel_family!r}); build it with "
                             "EpConfig(dispatch_transport='pull') and a normal family ('auto' or 'normal')")
        xs = self._per_rank(x, "x")
        cols = self.payload.columns(self.config.hidden)
        for i, rank in enumerate(self.local_ranks):
            tag = f"[rank {rank}]" if self.virtual else ""
            check_tensor(f"x{tag}", xs[i], dtype=self.payload.torch_dtype, shape=(layout.tokens[i], cols),
                         device=self.device, contiguous=True, vector_bytes=VECTOR_BYTES)
            self._check_dispatch_input_use(rank, xs[i], tag)
        handshake, pull = route.send
        io = []
        for i, rank in enumerate(self.local_ranks):
            rows = self.dispatch_input(rank)
            if xs[i].data_ptr() != rows.data_ptr() and layout.tokens[i]:
                rows[: layout.tokens[i]].copy_(xs[i])
            io.append(dict(x=rows.data_ptr(), num_tokens=0))
        # The dispatch kernel with no tokens routes nothing and sends nothing: its done flags, released
        # after every rank's dispatch_input rows, are the handshake the pull kernel relies on; it leaves
        # num_recv 0, so the layout's tables are restored after it, on the stream.
        self._run([handshake], 0, {"call": io})
        # this call supersedes the last dispatch (nothing to keep of it), and the handshake left
        # num_recv 0: every table of the layout goes back
        self._pending_tokens, self._resident_call = None, None
        self._make_resident(layout)
        self._run((pull,) + tuple(s for s in route.recv if s.op is Op.EXPAND), max(layout.tokens), {})
        self._pending_tokens, self._pending_family = list(layout.tokens), layout.family
        self._last, self._last_saved = (layout.call, layout.family, list(layout.tokens)), layout
        self._combined = False
        outs = [self.expert_buffers(r) if self.expert_layout else self.recv_buffers(r) for r in self.local_ranks]
        return outs if self.virtual else outs[0]

    # ---- layouts -----------------------------------------------------------------------------
    def _tables(self, rank: int, tokens: int) -> dict[str, torch.Tensor]:
        """The arena tables of ``rank`` that a combine and a cached dispatch read (``DispatchLayout``),
        as typed views, for a dispatch of ``tokens`` tokens on that rank."""
        lay, cfg, cap, K, W = self.arena_layout, self.config, self.arena_layout.capacity_rows, self.config.topk, self.config.world_size
        views = dict(send_slot=self._view(rank, lay.send_slot, (tokens, W), torch.int32),
                     send_pos=self._view(rank, lay.send_pos, (tokens, W), torch.int32),
                     recv_src=self._view(rank, lay.recv_src, (cap, 2), torch.int32),
                     recv_weights=self._view(rank, lay.recv_weights, (cap, K), torch.float32),
                     recv_indices=self._view(rank, lay.recv_indices, (cap, K), torch.int32),
                     num_recv=self._signal_view(rank, "num_recv"))
        if cfg.scale_bytes:
            views["recv_scales"] = self._view(rank, lay.recv_scales, (cap, cfg.scale_bytes), torch.uint8)
        if self.expert_layout:
            R, L = lay.expert_rows, cfg.experts_per_rank
            views.update(slot_row=self._view(rank, lay.slot_row, (cap, K), torch.int32),
                         expert_counts=self._view(rank, lay.expert_counts, (L,), torch.int32),
                         expert_offsets=self._view(rank, lay.expert_offsets, (L + 1,), torch.int32),
                         expert_weights=self._view(rank, lay.expert_weights, (R,), torch.float32),
                         expert_src=self._view(rank, lay.expert_src, (R, 3), torch.int32),
                         expert_block_base=self._view(rank, lay.expert_block_base, (PLAN_BLOCKS, L), torch.int32))
        return views

    def _snapshot(self, call: int, family: str, tokens: list[int]) -> DispatchLayout:
        """A DispatchLayout of the tables the arena holds now (copies on the stream)."""
        saved = [{name: view.clone() for name, view in self._tables(rank, tokens[i]).items()}
                 for i, rank in enumerate(self.local_ranks)]
        return DispatchLayout(self, call, family, tokens, saved)

    def keep_layout(self) -> DispatchLayout:
        """The layout of the last dispatch (a full or a cached one), kept for a later
        ``combine(y, layout=...)`` or ``dispatch(x, layout=...)``: copies of its tables made on the
        current stream (no host synchronization; ``DispatchLayout`` lists them and their bytes),
        once per dispatch (a second call returns the same object; a cached dispatch's layout is
        the one it was given). Call it after the dispatch and before the next one.

        Raises:
            RuntimeError: no dispatch yet, or the arena holds another layout's tables now (a
                combine or cached dispatch with another layout ran since the last dispatch, which
                was combined), or an async_recv dispatch's handle has not been waited for.
            EpError: an earlier call timed out in a kernel.
        """
        self._raise_if_faulted()
        self._check_no_recv_pending("keep_layout")
        if self._last is None:
            raise RuntimeError("keep_layout: needs a dispatch first")
        if self._last_saved is None:
            call, family, tokens = self._last
            if self._resident_call != call:
                raise RuntimeError(f"keep_layout: the arena no longer holds dispatch call {call}'s tables (a combine "
                                   "or cached dispatch with another layout ran after it was combined); keep a "
                                   "layout right after its dispatch")
            self._last_saved = self._snapshot(call, family, tokens)
        return self._last_saved

    def _check_layout(self, layout, what: str):
        """A layout this op may use now: of this op, kept since the last cleared fault."""
        if not isinstance(layout, DispatchLayout):
            raise TypeError(f"{what}: layout must be a DispatchLayout (op.keep_layout()), got {type(layout).__name__}")
        if layout._op is not self:
            raise ValueError(f"{what}: layout={layout!r} was kept by another op; a layout works on its own op only")
        if layout._epoch != self._epoch:
            raise ValueError(f"{what}: layout={layout!r} is stale: a fault was cleared after it was kept (the op "
                             "restarted from a dispatch); dispatch again and keep that layout")

    def _make_resident(self, layout: DispatchLayout, unit_weights: bool = False):
        """Put ``layout``'s tables into the arena (copies on the stream; nothing when they are there),
        first keeping those of the last dispatch while an implicit combine still has to undo it;
        ``unit_weights``: every expert row's weight 1 (the arena then holds no call's tables)."""
        if self._resident_call == layout.call and not unit_weights:
            return
        if self._last is not None and self._last_saved is None and self._pending_tokens is not None \
                and self._resident_call == self._last[0]:
            self._last_saved = self._snapshot(*self._last)
        for i, rank in enumerate(self.local_ranks):
            tables = self._tables(rank, layout.tokens[i])
            for name, view in tables.items():
                view.copy_(layout._saved[i][name])
            if unit_weights:
                tables["expert_weights"].fill_(1.0)
        self._resident_call = None if unit_weights else layout.call

    def _combine_barrier(self):
        """Before a combine that follows a normal-family combine with no dispatch between them (a
        layout's combine makes that possible): the normal combine has no departure handshake (its
        peers read this rank's combine_in and wire rows until their kernel ends; the next dispatch's
        handshake orders that before the next write), so the dispatch kernel runs first with no
        tokens, as the barrier: its done flags are released after each rank's earlier kernels on
        its stream. It leaves num_recv 0, so the tables are kept first where an implicit combine
        still needs them, and restored after."""
        if self._last is not None and self._last_saved is None and self._pending_tokens is not None \
                and self._resident_call == self._last[0]:
            self._last_saved = self._snapshot(*self._last)
        io = [dict(x=self.dispatch_input(rank).data_ptr(), num_tokens=0) for rank in self.local_ranks]
        self._run(self.plan.route(Op.DISPATCH, "normal", "push").send, 0, {"call": io})
        self._resident_call = None
        self._combined = False

    def _make_last_resident(self):
        """Before an implicit combine, expand or fold: the arena holds the last dispatch's tables."""
        if self._resident_call != self._last[0]:
            self._make_resident(self._last_saved)

    def _family_for_call(self, tokens: int, async_recv: bool, family: str | None) -> str:
        """The family of a dispatch of ``tokens`` (the most of the ranks this process drives): the
        caller's ``family``, the low-latency one for ``async_recv``, else ``family(tokens)`` where
        every rank is bound to pick the same. ValueError where it cannot (before any launch)."""
        if not isinstance(async_recv, bool):
            raise TypeError(f"async_recv={async_recv!r}: must be a bool")
        if family not in (None, "low_latency", "normal"):
            raise ValueError(f"family={family!r}: must be 'low_latency', 'normal' or None (the op's kernel_family)")
        kind = self.config.kernel_family
        if async_recv and family == "normal":
            raise ValueError("dispatch(async_recv=True, family='normal'): the split needs the low-latency family")
        if family is None and async_recv:
            family = "low_latency"
        if family is None:
            if kind == "auto" and not self.virtual and self.config.world_size > 1:
                raise ValueError(
                    f"dispatch: EpConfig.kernel_family='auto' with one process a rank (W={self.config.world_size}) "
                    f"needs the call's family stated: each rank sees only its own {tokens} tokens, and ranks on "
                    f"both sides of low_latency_tokens={self.low_latency_tokens} would take different kernels and "
                    "wait for each other until timeout_s. Pass family=op.family(T) with T the most tokens of any "
                    "rank, or a family by phase ('normal' for prefill, 'low_latency' for decode), the same on "
                    "every rank; or build the op with kernel_family='normal' or 'low_latency'")
            family = self.family(tokens)
        if family == "normal" and kind == "low_latency":
            raise ValueError("dispatch(family='normal'): this op builds only the low-latency kernels "
                             "(EpConfig.kernel_family='low_latency'); build it with 'auto' or 'normal'")
        if family == "low_latency" and (not self.low_latency_tokens or tokens > self.low_latency_tokens):
            why = ("this op builds no low-latency kernels (EpConfig.kernel_family='normal', or 'auto' where the "
                   "tuning table's threshold or EpConfig.max_recv_tokens makes it 0)" if not self.low_latency_tokens
                   else f"the low-latency family takes at most low_latency_tokens={self.low_latency_tokens} tokens "
                   "a rank (EpConfig.kernel_family='low_latency' sizes it for max_tokens_per_rank; "
                   "EpConfig.max_recv_tokens lowers it)")
            how = "async_recv=True" if async_recv else "family='low_latency'"
            need = "the split needs the low-latency family, and " if async_recv else ""
            raise ValueError(f"dispatch({how}) with {tokens} tokens: {need}{why}")
        return family

    def _finish_or_handle(self, finish, async_recv: bool):
        if not async_recv:
            return finish()
        self._recv_handle = RecvHandle(self, finish)
        return self._recv_handle

    def _check_no_recv_pending(self, name: str):
        if self._recv_handle is not None:
            raise RuntimeError(f"{name}: the last async_recv call's receiving half has not run; call its "
                               "handle.wait() first")

    def expand(self):
        """Expert layout: expand the last dispatch's received rows into per-expert groups (the plan
        kernel, then the copy kernel; local HBM traffic only). ``dispatch()`` runs it; calling it
        again recomputes the same rows, which times the expansion alone.

        Raises:
            RuntimeError: the op's layout is "rank", or no dispatch preceded it.
            EpError: an earlier call timed out in a kernel (recoverable faults are raised by synchronize).
        """
        self._expert_stage("expand", "it expands that dispatch's rows")
        self._make_last_resident()
        self._run([s for s in self.plan.route(Op.DISPATCH, self._pending_family).recv if s.op in EXPERT_OPS], 0, {})

    def fold(self, y):
        """Expert layout: sum each received token's weighted expert outputs into the row combine
        sends (``combine()`` runs it first; calling it alone times the fold).

        Args:
            y: as ``combine``'s (a list in virtual mode).

        Raises:
            RuntimeError: the op's layout is "rank", or no dispatch preceded it.
            TypeError, ValueError: bad y (before any launch).
            EpError: an earlier call timed out in a kernel (recoverable faults are raised by synchronize).
        """
        self._expert_stage("fold", "it folds that dispatch's rows")
        ys = self._per_rank(y, "y")
        for i, rank in enumerate(self.local_ranks):
            check_combine_inputs(self.config, self.device, ys[i], None, self._pending_tokens[i],
                                 self.arena_layout.expert_rows, f"[rank {rank}]" if self.virtual else "")
        route = self.plan.route(Op.COMBINE, self._pending_family)
        self._make_last_resident()
        self._run([s for s in route.send if s.op is Op.FOLD], 0, {"fold": self._fold_io(ys)})

    def _expert_stage(self, name: str, why: str):
        """Before ``expand`` or ``fold`` alone: no fault pending, the expert layout, a dispatch to work on."""
        self._raise_if_faulted()
        self._check_no_recv_pending(name)
        if not self.expert_layout:
            raise RuntimeError(f"{name}: needs EpConfig(layout='expert'); this op's layout is 'rank'")
        if self._pending_tokens is None:
            raise RuntimeError(f"{name}: needs a dispatch first ({why})")

    @staticmethod
    def _fold_io(ys) -> list[dict]:
        """The fold's io records: each rank's expert outputs y."""
        return [dict(y=y.data_ptr(), y_rows=y.shape[0]) for y in ys]

    def combine(self, y, out=None, *, async_recv: bool = False, layout: DispatchLayout | None = None,
                weighted: bool = True):
        """Sum, for each token of the last dispatch, the expert outputs of the ranks it reached.

        Args:
            y: [n, H] bf16, row i the expert output of received row i, n <= the receive rows
                (rows >= num_recv are ignored; n < num_recv raises EpError: short input). In the
                expert layout: row p the output of expanded row p, n <= R, n >= offsets[L]
                (checked on the device likewise), read in place (16-byte aligned).
                ``combine_input()`` itself is used without a copy. A list with one entry per rank
                in virtual mode.
                The low-latency family reads y in place too (16-byte aligned) and copies nothing;
                y must stay unchanged until its receiving half has run (it reads a rank's rows for
                its own tokens from y; with ``async_recv``: until ``wait()``). So does the normal
                family with a quantized wire (the quantize kernel encodes the rows for other ranks
                into the wire rows, the combine the rank's own rows as it sums them).
                Or ``combine_wire_input()`` (a list of them in virtual mode), whose rows the caller
                wrote in the wire's format: no quantize pass (rank layout, normal family).
            out: optional [T, H] bf16 contiguous output (T of the last dispatch); a new tensor
                when None. A list in virtual mode.
            async_recv: (keyword) launch only the sending half (after the expert layout's fold) and return a
                ``RecvHandle`` whose ``wait()`` launches the receiving half and returns the output.
                Needs a dispatch that took the low-latency family. The family is always the one
                the dispatch took.
            layout: (keyword) combine along this ``DispatchLayout`` of the op (``keep_layout()``)
                instead of the last dispatch: y holds the expert outputs of the layout's rows, out
                has its T rows; any number of times, after any other calls. Every rank passes the
                layout of the same dispatch call. The last dispatch stays the one an implicit
                combine undoes (its tables are kept first when the layout's replace them).
            weighted: (keyword) expert layout: False sums a token's expert rows with weight 1
                (the fold's products w x y become y; rounding as with weights), the backward of
                the expansion; True (default) applies the routing weights. Needs ``layout`` when
                False. The rank layout's combine is unweighted whatever this says.

        Returns:
            [T, H] bf16 per rank (a list in virtual mode): the expert outputs as the combine wire
            delivers them (``EpConfig.combine_quant``; bit-equal to
            ``epgen.quant.combine_roundtrip`` with ``fp8_flavour`` the arch's,
            ``epgen.quant.arch_fp8_flavour(self.arch)``), summed in fp32 in ascending rank and rounded once;
            a token that reached no rank gets zeros. In the expert layout each rank first folds
            a token's rows: bf16(sum in ascending first top-k slot of weight x y, fp32, each product
            rounded before its sum), and that folded row travels (``epgen.reference.combine_weighted``).
            With ``async_recv``, a RecvHandle whose ``wait()`` returns that.

        Raises:
            RuntimeError: no dispatch precedes this combine, an async_recv call's handle has not
                been waited for, or the runtime refused the whole low-latency op's cooperative grid
                as too large while a graph was being captured (as in ``dispatch``).
            TypeError, ValueError: bad y (before any launch), or ``async_recv`` after a dispatch
                that took the normal family; a layout of another op or stale (``DispatchLayout``),
                or ``weighted=False`` without a layout or in the rank layout.
            EpError: an earlier call timed out in a kernel (recoverable faults are raised by synchronize).
        """
        self._raise_if_faulted()
        self._check_no_recv_pending("combine")
        if not isinstance(async_recv, bool):
            raise TypeError(f"async_recv={async_recv!r}: must be a bool")
        if not isinstance(weighted, bool):
            raise TypeError(f"weighted={weighted!r}: must be a bool")
        if layout is not None:
            self._check_layout(layout, "combine")
        elif self._pending_tokens is None:
            raise RuntimeError("combine: needs a dispatch first (each dispatch is combined once; combine(y, "
                               "layout=op.keep_layout()) combines a kept layout again)")
        if not weighted and (layout is None or not self.expert_layout):
            raise ValueError("combine(weighted=False): takes a layout, in the expert layout (the rank layout's "
                             "combine has no weights)")
        pending, family = (layout.tokens, layout.family) if layout is not None else (self._pending_tokens,
                                                                                   self._pending_family)
        low_latency = family == "low_latency"
        if async_recv and not low_latency:
            raise ValueError("combine(async_recv=True): the split needs the low-latency family, and the dispatch "
                             f"being combined took the normal family ({max(pending)} tokens; "
                             f"low_latency_tokens={self.low_latency_tokens})")
        cfg = self.config
        wire_input = self._wire_inputs(y, family, pending)
        ys, given = self._per_rank(y, "y"), self._per_rank(out, "out", optional=True)
        route = self.plan.route(Op.COMBINE, family, "push", async_recv or not self._fused[Op.COMBINE])
        capacity = self.arena_layout.expert_rows if self.expert_layout else self.arena_layout.capacity_rows
        for i, rank in enumerate(self.local_ranks):  # every rank's inputs before any copy or launch
            tag = f"[rank {rank}]" if self.virtual else ""
            check_combine_inputs(cfg, self.device, None if wire_input else ys[i], given[i], pending[i],
                                 capacity, tag, in_place=not wire_input and route.y == "in_place")
        _check_out_apart(given, [] if wire_input else ys, self.local_ranks if self.virtual else None)
        if self._combined:
            self._combine_barrier()
        if layout is not None:
            self._make_resident(layout, unit_weights=not weighted)
        else:
            self._make_last_resident()
        outs, io = [], []
        for i, rank in enumerate(self.local_ranks):
            # y: the rows this rank's kernels read as bf16 (Route.y: y itself, the fold's rows, or
            # combine_in, where peers reach them, filled from y unless y is combine_input()
            # itself); 0 with wire rows. y_rows: the caller's rows, which the kernels check against
            # the rows the dispatch produced (num_recv, or expert_offsets[L] in the expert layout)
            source, rows = None, self.arena_layout.capacity_rows
            if not wire_input:
                source, rows = ys[i] if route.y == "in_place" else self._combine_in(rank), ys[i].shape[0]
                if route.y == "copy" and ys[i].data_ptr() != source.data_ptr():
                    source[:rows].copy_(ys[i])
            T = pending[i]
            o = given[i] if given[i] is not None else torch.empty((T, cfg.hidden), dtype=torch.bfloat16,
                                                                  device=self.device)
            io.append(dict(out=o.data_ptr(), num_tokens=T, y_rows=rows, y=source.data_ptr() if source is not None else 0))
            outs.append(o)
        records = {"call": io, "fold": [] if wire_input else self._fold_io(ys)}
        tokens = max(pending)
        self._run([s for s in route.send if not (wire_input and s.encodes)], tokens, records)
        self._combined = family == "normal"
        if layout is None:
            self._pending_tokens = None

        def finish():
            self._run(route.recv, tokens, records)
            return outs if self.virtual else outs[0]

        return self._finish_or_handle(finish, async_recv)

    # ---- faults ------------------------------------------------------------------------------
    # A kernel that finds a recoverable fault of its call (a bad id, a short y) hands it to every
    # rank's signal region, its own included, before its flags (abi.FAULT_RECORD); every rank's
    # receiving kernel of the call copies the call's records into this process's error records and
    # zeroes them, and a normal dispatch does the same with the receive overflows of the call
    # (templates/common/_prelude.j2, ep_consume_fault). So a fault is in every rank's error records
    # once that rank's stream has passed the call's receiving half, and no record outlives its call.
    # The host reads the error records alone, and raises the lowest rank's fault.

    def check(self):
        """Raise EpError if a kernel of this op has recorded a fault that this process sees now
        (reads host memory; no sync). A recoverable fault is not cleared here: with one process
        per GPU another rank may not see it yet, so ``synchronize()`` (on every rank) is the point
        where every rank raises it alike and clears it. While an ``async_recv`` call's handle is
        open, recoverable faults wait for the first check or synchronize after ``wait()``."""
        self._raise_if_faulted(recoverable=True)

    def synchronize(self):
        """Wait for this op's work on the current stream, then raise EpError on a fault. A
        recoverable fault (``EpError.recoverable``) of any rank is raised by every rank's
        synchronize after the faulted call's receiving half, with the same text when the ranks
        synchronize after the same calls (docs/contract.md), and cleared: the op runs again,
        starting with a dispatch. While an ``async_recv`` call's handle is open (between a split
        call's halves) a synchronize raises fatal faults only; recoverable ones are raised by the
        first synchronize after ``wait()``, as on every peer."""
        self.platform.synchronize_stream(self.device)
        self._raise_if_faulted(synchronized=True)

    def _raise_if_faulted(self, synchronized: bool = False, recoverable: bool = False):
        """Raise EpError for a recorded fault: a fatal one (a timeout) always, and from then on at
        every call; a recoverable one when ``synchronized`` (then cleared) or ``recoverable``
        (``check``), and no ``async_recv`` handle is open. The calls themselves raise fatal faults
        only: a rank that stopped at a recoverable fault its peers do not see yet would leave them
        waiting for it."""
        if getattr(self, "_closed", False):
            raise RuntimeError("EpDispatchCombine: closed (close() released its buffers); build a new op")
        if self._fault is None:
            found = self._read_fault()
            if found is None:
                return
            text, fatal = found
            if fatal:
                self._fault = text
            elif not (synchronized or recoverable) or self._recv_handle is not None:
                return
            else:
                if not synchronized:
                    raise EpError(f"{text} [the faulted call's outputs are invalid; op.synchronize() on every rank "
                                  "raises it there too and clears it, then dispatch again]", recoverable=True)
                self.errors.clear()  # the stream is idle: no kernel of this op can write a record now
                self._pending_tokens = None
                self._epoch += 1  # every layout kept so far is stale
                self._last = self._last_saved = self._resident_call = None
                raise EpError(f"{text} [cleared: the op runs again from the next dispatch]", recoverable=True)
        raise EpError(f"{self._fault} [this op is unusable after that fault; build a new EpDispatchCombine]")

    def _read_fault(self) -> tuple[str, bool] | None:
        """(text, fatal) of the fault to raise from this process's error records (each holds the
        first fault of its rank since they were cleared: the rank's own, or a peer's that a
        receiving kernel copied there): the lowest rank's fatal one, else the lowest rank's
        recoverable one; None without one."""
        if not self.errors.any():
            return None
        found = []
        for rank in range(self.config.world_size):
            code, a, b, c = self.errors.read(rank)
            if code == abi.ERROR_CLAIMED:
                code, a, b, c = self._reread_claimed(rank)
            if code:
                found.append((rank, code, a, b, c))
        if not found:
            return None

        def fatal(code):
            known = abi.error_code(code)
            return not (known and known.recoverable)

        rank, code, a, b, c = min(found, key=lambda f: (not fatal(f[1]), f[0]))
        return self._describe(rank, code, a, b, c), fatal(code)

    def _reread_claimed(self, rank) -> tuple[int, ...]:
        """The record of ``rank`` once its kernel has stored the real code after claiming it
        (``abi.ERROR_CLAIMED``), re-read at most ``abi.CLAIM_REREADS`` times; still claimed
        after that, the claimed record itself (worded as a fault whose details are unwritten)."""
        for _ in range(abi.CLAIM_REREADS):
            record = self.errors.read(rank)
            if record[0] != abi.ERROR_CLAIMED:
                break
        return record

    def _describe(self, rank, code, a, b, c) -> str:
        return f"rank {rank}: " + abi.fault_message(code, a, b, c, rank=rank, num_experts=self.config.num_experts,
                                                    timeout_s=self.config.timeout_s,
                                                    capacity_rows=self.arena_layout.capacity_rows)

    # ---- launch ------------------------------------------------------------------------------
    def _per_rank(self, value, name: str, optional: bool = False) -> list:
        return op_inputs(value, name, len(self.local_ranks), self.virtual, optional)

    def variant(self, op: Op, tokens: int, transport: str = "push") -> KernelSpec:
        """The spec ``op`` launches for ``tokens`` (the largest token count of the ranks this
        process drives): the smallest bucket not below it, else the largest; ``transport`` "pull"
        (op DISPATCH): the pull dispatch's first kernel.

        Raises:
            KeyError: the op builds no kernels of ``op`` (or no pull kernels)."""
        return self.plan.variant(op, tokens, transport)

    def kernel(self, op: Op, tokens: int, transport: str = "push") -> tuple[KernelSpec, object]:
        """``(spec, loaded kernel)`` that ``op`` launches for ``tokens`` (``variant``): what a
        measurement of one kernel of a call launches, or edits a copy of.

        Raises:
            KeyError: the op builds no kernels of ``op`` (or no pull kernels)."""
        spec = self.plan.variant(op, tokens, transport)
        return spec, self._kernels[spec]

    def launch_kernel(self, op: Op, tokens: int, kernel: tuple[KernelSpec, object] | None = None) -> None:
        """Launch ``op``'s kernel for ``tokens`` alone over the local ranks, on the current
        stream, with the launch argument (buffers, io records) the op's last call of ``op`` left:
        one kernel of a call, timed or replayed apart from the call (run the call once first).
        ``kernel``: a ``(spec, loaded kernel)`` of the same op to launch instead of the plan's, e.g.
        ``kernel(op, tokens)``'s spec at another geometry or its source edited, loaded by
        ``platform.load_kernel`` (its launch argument is the same record).

        Raises:
            KeyError: the op builds no kernels of ``op``.
            ValueError: ``kernel``'s spec is of another op.
            EpError: a fatal fault the kernels recorded (as the calls raise it).
            RuntimeError: the op was closed."""
        self._raise_if_faulted()
        if kernel is not None and kernel[0].op is not op:
            raise ValueError(f"kernel: its spec {kernel[0].name} is of op {kernel[0].op.value}, not {op.value}")
        self._launch(op, tokens, self._args[op], kernel=kernel)

    def _load_variants(self, op: Op, variants) -> tuple[tuple[int, KernelSpec], ...]:
        """Load (or compile) each ``(max_tokens, spec)`` of ``op`` into ``self._kernels``; returns
        them, a table geometry clamped where virtual ranks need it (below)."""
        cfg = self.config
        explicit = cfg.dispatch_geometry if op.call is Op.DISPATCH else cfg.combine_geometry
        out = []
        for max_tokens, spec in variants:
            fn = self._compile(spec)
            # With virtual ranks every block of every rank this grid runs must be resident at once
            # (a cooperative launch: Op.waits_within_grid): one rank's blocks wait for another's.
            ranks = len(self.local_ranks)
            if op.waits_within_grid(ranks) and not op.low_latency:  # the whole low-latency op: self._fused
                fits = self.resident_blocks(fn, spec) // ranks
                if fits < spec.blocks:
                    if explicit or fits < 1:
                        raise ValueError(
                            f"{op.value} geometry {spec.blocks}x{spec.warps_per_block}u{spec.unroll}: virtual ranks need all "
                            f"{spec.blocks * ranks} blocks resident at once but this GPU holds "
                            f"{self.resident_blocks(fn, spec)}; lower EpConfig.{op.call.value}_geometry blocks to "
                            f"{max(fits, 1)} or fewer warps")
                    spec = spec.replace(blocks=fits)  # table geometry, clamped so every rank fits
                    self._compile(spec)
            out.append((max_tokens, spec))
        return tuple(out)

    def _compile(self, spec: KernelSpec):
        src = self.platform.render(spec)
        fn = self._kernels[spec] = self.platform.load_kernel(src.text, src.entry, self.device.index)
        return fn

    def _run(self, steps, tokens: int, records: dict[str, list[dict]]):
        """Launch ``steps`` (of a ``Route``) for a call of ``tokens``, each with its launch
        argument's io records from ``records[step.io]`` (fields by name, one dict per local rank;
        a kind not there leaves them as they are)."""
        for step in steps:
            if step.raises_first:
                self._raise_if_faulted()
            a = self._args[step.op]
            for i, fields in enumerate(records.get(step.io, ())):
                a["io"][i] = _rank_io(quantize=int(step.quantize), **fields)
            try:
                self._launch(step.op, tokens, a, step.transport, step.sync)
            except CooperativeLaunchTooLarge as e:
                if not step.op.low_latency:  # a normal kernel of virtual ranks: no halves to take
                    raise
                self._run(self._halves_after_refusal(step.op, tokens, e), tokens, records)

    def _halves_after_refusal(self, op: Op, tokens: int, error: CooperativeLaunchTooLarge) -> list:
        """The runtime refused the whole low-latency ``op``'s cooperative grid as too large (its
        occupancy estimate, not ``epgen.codegen.occupancy``'s; nothing was enqueued): from now on
        every call of ``op.call`` takes the halves (warned once). Returns the steps that
        replace ``op`` in this call: the sending and the receiving half, as the split route
        launches them.

        Raises:
            RuntimeError: the stream is capturing a graph, where a failed launch may leave the
                capture unusable; the op still takes the halves from now on, so capturing again
                works (an eager call before a capture settles this outside it).
        """
        call = op.call
        self._fused[call] = False
        spec = self.variant(op, tokens)
        what = (f"{call.value}: the runtime refused the whole low-latency kernel {spec.name} ({spec.blocks} x "
                f"{len(self.local_ranks)} blocks of {spec.threads} threads, one cooperative launch) as too large: {error}")
        if capturing():
            raise RuntimeError(f"{what}; this happened while the stream was capturing a graph, which the failed "
                               f"launch may have left unusable. The op launches {call.value}'s two halves from now "
                               "on: capture again (run one call eagerly before capturing to settle this outside a "
                               "capture)") from error
        warnings.warn(f"{what}. This op launches {call.value}'s two halves instead from now on", RuntimeWarning,
                      stacklevel=4)
        return [s for s in self.plan.route(call, "low_latency", "push", True).steps if s.op.low_latency]

    def _launch(self, op: Op, tokens: int, args: np.ndarray, transport: str = "push", sync: bool = True,
                kernel: tuple[KernelSpec, object] | None = None):
        """Launch the variant of ``op`` (of ``transport``) for ``tokens`` (local ops have one), or
        ``kernel`` (``launch_kernel``), over the local ranks; with ``validate``, synchronize after
        it when ``sync`` (``Step.sync``)."""
        spec, fn = kernel or self.kernel(op, tokens, transport)
        ranks = len(self.local_ranks)
        try:
            self.platform.launch(fn, (spec.blocks, ranks, 1), (spec.threads, 1, 1), args.ctypes.data, self.device,
                                 cooperative=op.waits_within_grid(ranks))
        except self.platform.fatal_errors as e:  # the host's HostError: a grid stopped mid-way
            self._fault = str(e)  # its buffers and signals are mid-call: fatal, as a GPU's stopped kernel
            raise
        if self.validate and sync:
            self.synchronize()

    def resident_blocks(self, fn, spec: KernelSpec) -> int:
        """Blocks of the loaded kernel ``fn`` (of ``spec``) the op's device holds at once
        (``Platform.resident_blocks``)."""
        return self.platform.resident_blocks(fn, spec, self.device)

    def close(self):
        """Release the arenas and error records; every later call of the op raises RuntimeError."""
        self._closed = True
        self.arenas.close()
        self.errors.close()
