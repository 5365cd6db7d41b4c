"""Record what an ``EpDispatchCombine`` launches, on the CPU.

A stand-in platform (host memory for the arenas and error records, a kernel object per loaded
entry, launches logged) and a faked ``torch.cuda`` let the op's host path run on host tensors.
``record(cfg, ...)`` runs a fixed sequence of calls (each family, transport, the async_recv
split, the quantized wire's pre-encoded rows) and returns one event per launch: the spec's
name, grid, block, cooperative flag and the launch argument with every pointer named by the
buffer it points into (arena, signals, error records, an input or output tensor, plus offset),
and one event per synchronize; so two ops that launch the same kernels with the same
arguments give equal records whatever the addresses.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import sys
import types

import numpy as np
import torch

from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import dtype_info
from epgen.platform import CooperativeLaunchTooLarge, Platform


class _Kernel:
    def __init__(self, entry: str, regs: int):
        self.entry, self.num_regs, self.shared_size_bytes = entry, regs, 1024


class _Memory:
    def __init__(self, nbytes: int):
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()


class FakePlatform(Platform):
    """The calls ``EpDispatchCombine`` makes of ``epgen.platform.Platform``, on host memory (the
    ones not overridden here, ``plan``, ``prepare``, ``render``, ``free_bytes``,
    ``resident_blocks`` and ``synchronize_stream``, are the real platform's over the patched torch.cuda)."""

    rocm = False
    name = "cuda"
    refuse_cooperative = False
    """Refuse every cooperative launch as the CUDA driver refuses a grid it cannot hold at once
    (``Platform.launch`` turns CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE into this); the refusal is
    logged as ("refused", entry, grid, block), the launch not."""

    def __init__(self, log: list, names: dict, arch: str, regs: int):
        self.log, self.names, self._arch, self.regs, self.host = log, names, arch, regs, []

    def arch(self, device_index):
        return self._arch

    def check_runtime(self, arch):  # the vendor's checks, as the real platform of this vendor makes them
        Platform(rocm=self.rocm).check_runtime(arch)

    def check_kernel_args(self, nbytes, world_size, max_world_size):
        Platform(rocm=self.rocm).check_kernel_args(nbytes, world_size, max_world_size)

    def use_device(self, device_index):
        return contextlib.nullcontext()

    def synchronize(self):
        pass

    def alloc_device(self, nbytes):
        mem = _Memory(nbytes)
        self.names[f"arena{len([n for n in self.names if n.startswith('arena')])}"] = mem.tensor
        return mem

    def tensor(self, ptr, nbytes, owner, device):
        return owner.tensor

    def host_alloc_mapped(self, nbytes):
        mem = _Memory(nbytes)
        self.host.append(mem)
        self.names["errors"] = mem.tensor
        return mem.ptr

    def free_host(self, ptr):
        pass

    def load_kernel(self, text, entry, device_index):
        return _Kernel(entry, self.regs)

    def launch(self, fn, grid, block, args_address, device, cooperative=False):
        if cooperative and self.refuse_cooperative:
            self.log.append(("refused", fn.entry, tuple(grid), tuple(block)))
            raise CooperativeLaunchTooLarge(f"cooperative grid {grid[0]}x{grid[1]}x{grid[2]} refused by the stand-in")
        self.log.append(("launch", fn.entry, tuple(grid), tuple(block), cooperative,
                         ctypes.string_at(args_address, self.args_bytes)))


def _named(value: int, names: dict) -> str | int:
    for name, t in names.items():
        start = t.data_ptr()
        if start <= value < start + max(t.numel() * t.element_size(), 1):
            return f"{name}+{value - start}"
    return value


def _decode(raw: bytes, dtype: np.dtype, names: dict):
    a = np.frombuffer(raw, dtype=dtype)[0]

    def walk(v):
        if isinstance(v, np.void):
            return [walk(v[f]) for f in v.dtype.names]
        if isinstance(v, np.ndarray):
            return [walk(x) for x in v]
        v = int(v)
        return _named(v, names) if v > 1 << 20 else v

    return walk(a)


@contextlib.contextmanager
def fake_gpu(op_module, log: list, names: dict, arch: str, sms: int, regs: int):
    """Patch ``op_module`` (an ``epgen.op``) and torch.cuda so that the op builds on the CPU."""
    platform = FakePlatform(log, names, arch, regs)
    saved_modules = sys.modules.get("cupy")
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    sys.modules["cupy"] = cupy
    props = types.SimpleNamespace(multi_processor_count=sms)
    stream = types.SimpleNamespace(synchronize=lambda: log.append(("sync",)), cuda_stream=0)
    cuda = {"is_available": lambda: True, "current_device": lambda: 0, "mem_get_info": lambda device=None: (1 << 40, 1 << 40),
            "get_device_properties": lambda index: props, "current_stream": lambda device=None: stream}
    saved = {k: getattr(torch.cuda, k) for k in cuda}
    saved_platform = op_module.Platform
    try:
        for k, v in cuda.items():
            setattr(torch.cuda, k, v)
        op_module.Platform = types.SimpleNamespace(current=lambda: platform)
        yield platform
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        op_module.Platform = saved_platform
        if saved_modules is None:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved_modules


def record(op_module, cfg: EpConfig, *, virtual: bool, arch: str = "sm_90", sms: int = 132, regs: int = 64,
           validate: bool = False, tokens: tuple[int, ...] = (), refuse_cooperative: bool = False) -> list:
    """The events of the call sequence on an ``op_module.EpDispatchCombine(cfg)``: for each token
    count of ``tokens`` (default: 5, and the largest count when it exceeds the low-latency
    threshold) a dispatch and a combine; then, where the op has the low-latency family, the
    async_recv split of both; with a quantized wire in the rank layout, a combine of
    ``combine_wire_input()`` rows; with a pull path, a dispatch of ``dispatch_input()`` rows.
    ``refuse_cooperative``: the stand-in refuses every cooperative launch as too large
    (``FakePlatform.refuse_cooperative``)."""
    log, names, keep = [], {}, []
    with fake_gpu(op_module, log, names, arch, sms, regs) as platform:
        platform.refuse_cooperative = refuse_cooperative
        from epgen.op import _args_dtype

        dtype = _args_dtype(cfg.world_size)
        platform.args_bytes = dtype.itemsize
        op = op_module.EpDispatchCombine(cfg, virtual=virtual, validate=validate)
        op.device = torch.device("cpu")
        ranks = op.local_ranks
        info = dtype_info(cfg.dtype)
        H, K, E = cfg.hidden, cfg.topk, cfg.num_experts

        def name(tag, t):
            names[f"{tag}{len(keep)}"] = t
            keep.append(t)
            return t

        def inputs(T, in_region=False):
            xs, ws, ids, ss = [], [], [], []
            for r in ranks:
                if in_region:
                    x = op.dispatch_input(r)[:T]
                    x.view(torch.uint8).fill_(r + 1)
                else:
                    x = name("x", torch.zeros(T, info.columns(H), dtype=info.torch_dtype))
                xs.append(x)
                ws.append(name("w", torch.ones(T, K)))
                ids.append(name("i", (torch.arange(T * K, dtype=torch.int32).view(T, K) * (r + 3)) % E))
                ss.append(name("s", torch.zeros(T, cfg.scale_bytes, dtype=torch.uint8)) if cfg.scale_bytes else None)
            one = (lambda v: v) if virtual else (lambda v: v[0])
            return one(xs), one(ws), one(ids), one(ss)

        def ys(rows):
            out = [name("y", torch.full((rows, H), 1.0 + r, dtype=torch.bfloat16)) for r in ranks]
            return out if virtual else out[0]

        def step(label, call):
            log.append(("step", label))
            try:
                result = call()
            except (TypeError, ValueError, RuntimeError) as e:
                log.append(("error", f"{type(e).__name__}: {e}"))
                return None
            for t in result if isinstance(result, list) else [result]:
                if isinstance(t, torch.Tensor):
                    name("out", t)
            log.append(("result", type(result).__name__))
            return result

        rows = op.arena_layout.expert_rows if cfg.layout == "expert" else 6
        t_ll = op.low_latency_tokens
        counts = tokens or tuple(dict.fromkeys(t for t in (5, cfg.max_tokens_per_rank) if t == 5 or t > t_ll))
        for T in counts:
            step(f"dispatch {T}", lambda: op.dispatch(*inputs(T)))
            step(f"combine {T}", lambda: op.combine(ys(rows)))
        if t_ll:
            h = step("dispatch async", lambda: op.dispatch(*inputs(min(5, t_ll)), async_recv=True))
            step("wait", h.wait)
            h = step("combine async", lambda: op.combine(ys(rows), async_recv=True))
            step("wait", h.wait)
        if op.dispatch_spec.quant.quantized and cfg.layout == "rank" and cfg.kernel_family != "low_latency":
            T = max(counts)
            step(f"dispatch {T}", lambda: op.dispatch(*inputs(T)))
            wire = [op.combine_wire_input(r) for r in ranks]
            step("combine wire rows", lambda: op.combine(wire if virtual else wire[0]))
        if cfg.kernel_family != "low_latency" and cfg.dispatch_transport != "push":
            T = max(counts)
            step(f"dispatch {T} in dispatch_input", lambda: op.dispatch(*inputs(T, in_region=True)))
            step(f"combine {T}", lambda: op.combine(ys(rows)))
        events = [e[:5] + (_decode(e[5], dtype, names),) if e[0] == "launch" else e for e in log]
        op.close()
    return events
