"""The op's ROCm host path on the CPU, against a recording stand-in for CuPy's ROCm build.

Two processes (W = 2) joined by a gloo process group each build an ``EpDispatchCombine`` with
torch's ROCm build faked (``torch.version.hip``, ``torch.cuda`` properties with a gfx950
``gcnArchName``), a fake ``cupy`` module in ``sys.modules`` that records every attribute the op
touches (each checked against what the ``cupy-rocm-7-0`` wheel provides: ``rocm_surface``), and a
fake ``libamdhip64.so`` behind ``ctypes.CDLL``. Device memory is host memory here; no kernel runs (the fake kernel records its
launch arguments). The ahead-of-time cache holds the gfx950 code objects (built here with the
offline clang), so the op must load them with ``RawModule(path=...)`` and compile nothing.

The calls of ``FAMILY_CFG`` run ``dispatch()`` and ``combine()`` on host tensors (the ops' device
set to the CPU after construction: device memory is host memory here) and record which kernels
each call launches: the kernel family per call, the whole low-latency op or its halves, the
async_recv split and its refusals. ROCm takes the halves by default (``epgen.plan.WHOLE_LOW_LATENCY``);
with that rule flipped the calls run again: the whole op through ``hipModuleLaunchCooperativeKernel``,
the halves where the grid does not fit, and the halves after the stand-in refuses a cooperative
launch with ``hipErrorCooperativeLaunchTooLarge``.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from epgen.aot import build, config_specs
from epgen.cache import CACHE_ENV
from epgen.codegen import abi, offline
from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.spec import Op
from epgen.harness.ranks import start_and_join

sys.path.insert(0, str(Path(__file__).parent))
from rocm_surface import problem  # noqa: E402

ARCH = "gfx950"
GCN_ARCH_NAME = "gfx950:sramecc+:xnack-"
CFG = EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=16,
               combine_quant="fp8_direct_cast",  # a quantized combine: the op computes resident blocks
               dispatch_geometry=Geometry(4, 4, 2), combine_geometry=Geometry(4, 4, 2), timeout_s=2.5)

FAMILY_CFG = EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=160,
                      dispatch_geometry=Geometry(4, 4, 2), combine_geometry=Geometry(4, 4, 2), timeout_s=2.5)
"""kernel_family "auto" (the default) with no tuning entry: T_ll = tuning.LOW_LATENCY_MAX_TOKENS =
128 < max_tokens_per_rank, so a call takes either family."""
NORMAL_CFG = attrs.evolve(FAMILY_CFG, kernel_family="normal")
PULL_CFG = attrs.evolve(NORMAL_CFG, dispatch_transport="pull", dtype="fp4")
"""The pull dispatch (fp4: dispatch_input is [Tmax, H/2] uint8)."""
CONFIGS = (CFG, FAMILY_CFG, NORMAL_CFG, PULL_CFG)
T_LL = 128
SMALL, LARGE = 5, T_LL + 1

HIP_UNCACHED = 0x3  # hipDeviceMallocUncached, hip/hip_runtime_api.h
HIP_IPC_LAZY = 0x1  # hipIpcMemLazyEnablePeerAccess, hip/hip_runtime_api.h
HIP_HOST_MAPPED_PORTABLE = 0x2 | 0x1  # hipHostMallocMapped | hipHostMallocPortable
SIGNAL_BYTES = 4 * abi.SIGNAL_WORDS
HIP_VERSION = 70051831  # hipRuntimeGetVersion of ROCm 7.0 (HIP 7.0.51831, torch.version.hip below)
HIP_COOPERATIVE_TOO_LARGE = 720  # hipErrorCooperativeLaunchTooLarge, hip/hip_runtime_api.h



class _Recorded:
    """A namespace that logs every attribute read as ``<prefix>.<name>`` and has only ``attrs``."""

    def __init__(self, log: list, prefix: str, **attrs):
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_attrs", attrs)

    def __getattr__(self, name):
        self._log.append(f"{self._prefix}.{name}")
        try:
            return self._attrs[name]
        except KeyError:
            raise AttributeError(f"{self._prefix}.{name}: not offered by the CuPy-ROCm stand-in") from None


class _Memory:
    """Host bytes playing device memory (kept alive by the fake)."""

    def __init__(self, fake, nbytes: int):
        self.buffer = (ctypes.c_uint8 * nbytes)()
        self.ptr, self.size = ctypes.addressof(self.buffer), nbytes
        fake.buffers[self.ptr] = self.buffer


class _FakeCupyRocm:
    """The stand-in: ``module`` goes into ``sys.modules["cupy"]``; calls are logged in ``calls``."""

    def __init__(self):
        self.touched, self.calls, self.buffers, self.launches, self.functions = [], [], {}, [], {}
        self.refuse_cooperative = False  # hipModuleLaunchCooperativeKernel returns hipErrorCooperativeLaunchTooLarge
        log, fake = self.touched, self

        def memset(ptr, value, nbytes):
            self.calls.append(["memset", ptr, value, nbytes])
            ctypes.memset(ptr, value, nbytes)

        def host_alloc(nbytes, flags):
            self.calls.append(["hostAlloc", nbytes, flags])
            return _Memory(self, nbytes).ptr

        def ipc_get(ptr):
            self.calls.append(["ipcGetMemHandle", ptr])
            return f"{os.getpid()}:{ptr:x}".encode().ljust(64, b"\0")

        def ipc_open(handle, flags):
            mapped = _Memory(self, SIGNAL_BYTES).ptr  # a peer's memory is not reachable here
            self.calls.append(["ipcOpenMemHandle", handle.rstrip(b"\0").decode(), flags, mapped])
            return mapped

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Memory(_Memory):
            def __init__(self, nbytes):
                super().__init__(fake, nbytes)
                fake.calls.append(["Memory", nbytes, self.ptr])

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size = ptr, size

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        class ndarray:
            def __init__(self, shape, dtype, memptr):
                (self.nbytes,) = shape
                self.ptr = memptr.ptr

        class Kernel:
            def __init__(self, path, entry):
                self.path, self.entry = path, entry
                self.ptr = 0x7000 + len(fake.functions)  # the hipFunction_t (Function.ptr)
                fake.functions[self.ptr] = entry

            kernel = property(lambda self: self)

            def __getattr__(self, name):  # num_regs / shared_size_bytes: what the occupancy reads
                log.append(f"kernel.{name}")
                return {"num_regs": 64, "shared_size_bytes": 1024}[name]

            def __call__(self, grid, block, args, stream):
                (arg,) = args
                fake.launches.append({"entry": self.entry, "grid": list(grid), "block": list(block),
                                      "address": arg.address, "stream": stream.ptr, "cooperative": False})

        class RawModule:
            def __init__(self, *, code=None, path=None, options=()):
                fake.calls.append(["RawModule", "path" if path is not None else "code", path])
                self.path = path

            def get_function(self, entry):
                return Kernel(self.path, entry)

        self.hip_version = HIP_VERSION
        rt = _Recorded(log, "cupy.cuda.runtime", getDevice=lambda: torch.cuda.current_device(), memset=memset,
                       runtimeGetVersion=lambda: self.hip_version,
                       deviceSynchronize=lambda: None, hostAlloc=host_alloc,
                       freeHost=lambda p: self.calls.append(["freeHost", p]), hostAllocPortable=1, hostAllocMapped=2,
                       ipcGetMemHandle=ipc_get, ipcOpenMemHandle=ipc_open,
                       ipcCloseMemHandle=lambda p: self.calls.append(["ipcCloseMemHandle", p]),
                       cudaIpcMemLazyEnablePeerAccess=HIP_IPC_LAZY)
        cuda = _Recorded(log, "cupy.cuda", Device=Device, Memory=Memory, UnownedMemory=UnownedMemory,
                         MemoryPointer=MemoryPointer, runtime=rt,
                         ExternalStream=lambda ptr, device_id: types.SimpleNamespace(ptr=ptr, device_id=device_id),
                         function=_Recorded(log, "cupy.cuda.function",
                                            CPointer=lambda address: types.SimpleNamespace(address=address)))
        surface = {"uint8": np.uint8, "ndarray": ndarray, "RawModule": RawModule, "cuda": cuda}
        self.module = types.ModuleType("cupy")
        self.module.__spec__ = importlib.machinery.ModuleSpec("cupy", None)

        def module_getattr(name):  # PEP 562: every attribute but the module's own dunders
            log.append(f"cupy.{name}")
            try:
                return surface[name]
            except KeyError:
                raise AttributeError(f"cupy.{name}: not offered by the CuPy-ROCm stand-in") from None

        self.module.__getattr__ = module_getattr


class _FakeHip:
    """``libamdhip64.so``: hipExtMallocWithFlags / hipFree / hipGetErrorString /
    hipModuleLaunchCooperativeKernel, logged (a cooperative launch into ``fake.launches``)."""

    def __init__(self, fake: _FakeCupyRocm):
        def cooperative(f, gx, gy, gz, bx, by, bz, shared, stream, params):
            if fake.refuse_cooperative:  # the runtime's occupancy estimate says the grid cannot be resident
                fake.calls.append(["cooperative refused", fake.functions[f.value], [gx, gy, gz], [bx, by, bz]])
                return HIP_COOPERATIVE_TOO_LARGE
            fake.launches.append({"entry": fake.functions[f.value], "grid": [gx, gy, gz], "block": [bx, by, bz],
                                  "address": params[0], "stream": stream.value, "cooperative": True,
                                  "shared": shared})
            return 0

        def ext_malloc(ptr_ref, nbytes, flags):
            p = _Memory(fake, nbytes).ptr
            ptr_ref._obj.value = p  # ctypes.byref(c_void_p): the out-parameter
            fake.calls.append(["hipExtMallocWithFlags", nbytes, flags, p])
            return 0

        def free(ptr):
            fake.calls.append(["hipFree", ptr.value])
            return 0

        self.hipExtMallocWithFlags = _CFunction(ext_malloc)
        self.hipModuleLaunchCooperativeKernel = _CFunction(cooperative)
        self.hipFree = _CFunction(free)
        self.hipGetErrorString = _CFunction(lambda status: b"fake error")


class _CFunction:
    def __init__(self, fn):
        self._fn, self.argtypes, self.restype = fn, None, None

    def __call__(self, *args):
        return self._fn(*args)


def _fake_rocm(rank: int) -> _FakeCupyRocm:
    """Install the stand-ins in this (spawned) process: CuPy-ROCm, torch's ROCm build, libamdhip64."""
    fake = _FakeCupyRocm()
    sys.modules["cupy"] = fake.module
    torch.version.hip = "7.0.51831"
    props = types.SimpleNamespace(gcnArchName=GCN_ARCH_NAME, name="AMD Instinct MI355X", multi_processor_count=256,
                                  major=9, minor=5, total_memory=288 << 30)
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: rank
    torch.cuda.get_device_properties = lambda index: props
    torch.cuda.mem_get_info = lambda device=None: (200 << 30, 288 << 30)
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0x5000 + rank, device=device)
    real_as_tensor, real_cdll = torch.as_tensor, ctypes.CDLL

    def as_tensor(obj, *args, device=None, **kwargs):  # torch's view of "device" memory: the host bytes
        if isinstance(obj, fake.module.ndarray):
            fake.calls.append(["as_tensor", obj.ptr, obj.nbytes, str(device)])
            return torch.frombuffer((ctypes.c_uint8 * obj.nbytes).from_address(obj.ptr), dtype=torch.uint8)
        return real_as_tensor(obj, *args, device=device, **kwargs)

    def cdll(name, *args, **kwargs):
        fake.calls.append(["CDLL", name])
        return _FakeHip(fake) if name == "libamdhip64.so" else real_cdll(name, *args, **kwargs)

    torch.as_tensor, ctypes.CDLL = as_tensor, cdll
    return fake


def _family_calls(fake, cfg: EpConfig, rank: int) -> list[dict]:
    """Calls of one ``cfg`` op on host tensors, each recorded as {"step", "ops" (the kernels it
    launched), "error" (type and message, or None), "result" (type name)}; combine steps add
    "y" (the address the combine kernels were given in io.y), "own_y" (y's own address) and
    "combine_in" (what the rank's combine_in region held after the call: "zero", "y", or "other",
    an earlier call's y)."""
    from epgen.op import EpDispatchCombine

    op = EpDispatchCombine(cfg)
    op.device = torch.device("cpu")  # device memory is host memory here: the inputs are host tensors
    H, K, E = cfg.hidden, cfg.topk, cfg.num_experts
    steps = []

    def inputs(T):
        return (torch.zeros(T, H, dtype=torch.bfloat16), torch.ones(T, K),
                torch.arange(T * K, dtype=torch.int32).view(T, K) % E)

    kernel_op = {spec.name: o for (o, _), variants in op.plan.variants.items() for _, spec in variants}

    def step(name, call, y=None):
        before = len(fake.launches)
        try:
            result, error = call(), None
        except (TypeError, ValueError, RuntimeError) as e:
            result, error = None, f"{type(e).__name__}: {e}"
        launched = [kernel_op[x["entry"]] for x in fake.launches[before:]]
        row = {"step": name, "ops": [o.value for o in launched], "error": error, "result": type(result).__name__,
               "cooperative": [x["cooperative"] for x in fake.launches[before:]]}
        if y is not None:
            used = [int(op._args[o]["io"][0]["y"]) for o in launched
                    if o in (Op.COMBINE, Op.COMBINE_LL, Op.COMBINE_LL_SEND, Op.COMBINE_LL_RECV)]
            combine_in = op._combine_in(rank)[: y.shape[0]]
            row.update(y=used, own_y=y.data_ptr(),
                       combine_in="zero" if not combine_in.any() else "y" if torch.equal(combine_in, y) else "other")
        steps.append(row)
        return result

    def combine(name, value, **kw):  # a fresh y each time: combine_in holds it only if this call copied it
        y = torch.full((6, H), float(value), dtype=torch.bfloat16)
        return step(name, lambda: op.combine(y, **kw), y)

    step("dispatch small", lambda: op.dispatch(*inputs(SMALL), family=op.family(SMALL)))
    combine("combine", 1)
    if cfg.kernel_family == "normal":  # no low-latency kernels: the split is refused before any launch
        step("dispatch small async", lambda: op.dispatch(*inputs(SMALL), async_recv=True))
        step("dispatch small", lambda: op.dispatch(*inputs(SMALL), family=op.family(SMALL)))
        combine("combine async", 2, async_recv=True)
        combine("combine", 3)
        op.close()
        return steps
    step("dispatch large", lambda: op.dispatch(*inputs(LARGE), family=op.family(LARGE)))
    combine("combine", 2)
    handle = step("dispatch small async", lambda: op.dispatch(*inputs(SMALL), async_recv=True))
    step("dispatch before wait", lambda: op.dispatch(*inputs(SMALL), family=op.family(SMALL)))
    combine("combine before wait", 3)
    step("wait", lambda: handle.wait())
    step("wait again", lambda: handle.wait())
    handle = combine("combine async", 4, async_recv=True)
    step("wait", lambda: handle.wait())
    step("dispatch large async", lambda: op.dispatch(*inputs(LARGE), async_recv=True))
    step("dispatch large", lambda: op.dispatch(*inputs(LARGE), family=op.family(LARGE)))
    combine("combine async", 5, async_recv=True)
    combine("combine", 6)
    op.close()
    return steps


STRADDLE = [(0, T_LL + 1), (T_LL - 1, T_LL + 1), (T_LL, T_LL + 1), (T_LL + 1, T_LL), (T_LL + 1, 0)]
"""(rank 0's tokens, rank 1's): counts on both sides of the low-latency threshold in one call."""


def _straddle_calls(fake, cfg: EpConfig, rank: int) -> list[dict]:
    """For each pair of STRADDLE, this rank's dispatch of its own count: with no family (an "auto"
    op with one process a rank: refused before any launch), then with the family of the most
    tokens of either rank (``op.family``), and its combine; each as {"step", "ops", "error"}."""
    from epgen.op import EpDispatchCombine

    op = EpDispatchCombine(cfg)
    op.device = torch.device("cpu")
    H, K, E = cfg.hidden, cfg.topk, cfg.num_experts
    kernel_op = {spec.name: o.value for (o, _), variants in op.plan.variants.items() for _, spec in variants}
    steps = []

    def step(name, call):
        before = len(fake.launches)
        try:
            call()
            error = None
        except (TypeError, ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        steps.append({"step": name, "ops": [kernel_op[x["entry"]] for x in fake.launches[before:]], "error": error})

    for pair in STRADDLE:
        T = pair[rank]
        x, w, i = (torch.zeros(T, H, dtype=torch.bfloat16), torch.ones(T, K),
                   torch.arange(T * K, dtype=torch.int32).view(T, K) % E)
        step(f"{pair} unstated", lambda: op.dispatch(x, w, i))
        step(f"{pair} dispatch", lambda: op.dispatch(x, w, i, family=op.family(max(pair))))
        step(f"{pair} combine", lambda: op.combine(torch.zeros(op.arena_layout.capacity_rows, H, dtype=torch.bfloat16)))
    op.close()
    return steps


def _pull_calls(fake, cfg: EpConfig, rank: int) -> list[dict]:
    """Dispatches of a ``dispatch_transport="pull"`` op on host tensors, each recorded as {"step",
    "ops" (kernels launched, with the pull dispatch's first kernel as "dispatch:pull"), "x" (the
    io.x address the dispatch kernel got, as "dispatch_input" or "own"), "copied" (dispatch_input
    holds the call's x), "error"}."""
    from epgen.op import EpDispatchCombine

    op = EpDispatchCombine(cfg)
    op.device = torch.device("cpu")
    H, K, E = cfg.hidden, cfg.topk, cfg.num_experts
    kernel = {spec.name: o.value if tr == "push" else f"{o.value}:{tr}" for (o, tr), variants in op.plan.variants.items()
              for _, spec in variants}
    region = op.dispatch_input()
    steps = []

    def step(name, x):
        before = len(fake.launches)
        w, i = torch.ones(x.shape[0], K), torch.arange(x.shape[0] * K, dtype=torch.int32).view(-1, K) % E
        try:
            op.dispatch(x, w, i, family="normal")
            error = None
        except (TypeError, ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {e}"
        got = int(op._args[Op.DISPATCH]["io"]["x"][0])
        steps.append({"step": name, "ops": [kernel[x["entry"]] for x in fake.launches[before:]], "error": error,
                      "x": "dispatch_input" if got == region.data_ptr() else "own" if got == x.data_ptr() else "other",
                      "copied": bool(torch.equal(region[: x.shape[0]], x)), "transport": op.transport(x.shape[0], x)})

    own = torch.full((5, H // 2), 7 + rank, dtype=torch.uint8)
    step("x elsewhere", own)
    region[:5].fill_(3)
    step("x is dispatch_input", region[:5])
    step("x inside dispatch_input", region[1:6])
    op.close()
    return steps


def _rank(rank: int, world_size: int, store: str, cache: str, out: str):
    import warnings

    import torch.distributed as dist

    fake = _fake_rocm(rank)
    os.environ[CACHE_ENV] = cache
    warnings.simplefilter("error")  # a cache miss or a rejected file warns: fail instead
    dist.init_process_group(backend="gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        from epgen.op import EpDispatchCombine

        op = EpDispatchCombine(CFG)
        record = {"platform": repr(op.platform), "arch": op.arch, "layout_signals": op.arena_layout.signals,
                  "pointers": op.arenas.pointers, "signals": op.arenas.signals,
                  "combine_blocks": op.variant(Op.COMBINE, 1).blocks}
        word = op.arenas.signals[rank] + 16  # kSigNumRecv (index 4) in this rank's signal words
        ctypes.c_uint32.from_address(word).value = 7
        record["num_recv"] = op.recv_buffers().num_recv.tolist()
        record["launched"] = []
        for which in (Op.DISPATCH, Op.COMBINE):
            op._launch(which, 1, op._args[which])  # the host half of dispatch()/combine(): no tensors here
            record["launched"].append(op.variant(which, 1).name)
        record["launch_args"] = []
        for launch in fake.launches:
            a = np.frombuffer((ctypes.c_uint8 * op._args[Op.DISPATCH].nbytes).from_address(launch["address"]),
                              dtype=op._args[Op.DISPATCH].dtype)[0]
            record["launch_args"].append({"arena": a["arena"].tolist(), "signals": a["signals"].tolist(),
                                          "errors": int(a["errors"]), "rank_base": int(a["rank_base"])})
        op.close()
        dist.barrier()
        record.update(calls=list(fake.calls), launches=list(fake.launches))  # CFG's op alone
        record["default"] = _family_calls(fake, FAMILY_CFG, rank)  # ROCm's rule: the halves
        import epgen.plan

        epgen.plan.WHOLE_LOW_LATENCY["amd"] = True  # the rule flipped, as a measurement of the whole op would
        try:
            record["fused"] = _family_calls(fake, FAMILY_CFG, rank)
            props = torch.cuda.get_device_properties(rank)
            props.multi_processor_count = 1  # a GPU too small for a whole low-latency op's grid at once
            record["halves"] = _family_calls(fake, FAMILY_CFG, rank)
            props.multi_processor_count = 256
            fake.refuse_cooperative, before = True, len(fake.calls)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                record["refused"] = _family_calls(fake, FAMILY_CFG, rank)
            record["refused_warnings"] = [[w.category.__name__, str(w.message)] for w in caught]
            record["refused_attempts"] = [c[1:] for c in fake.calls[before:] if c[0] == "cooperative refused"]
        finally:
            fake.refuse_cooperative = False
            epgen.plan.WHOLE_LOW_LATENCY["amd"] = False
        record["normal"] = _family_calls(fake, NORMAL_CFG, rank)
        record["straddle"] = _straddle_calls(fake, FAMILY_CFG, rank)
        record["pull"] = _pull_calls(fake, PULL_CFG, rank)
        record["loads"] = [c[1:] for c in fake.calls if c[0] == "RawModule"]
        record["refusals"] = []  # refused before anything is compiled, allocated or launched
        wide = attrs.evolve(CFG, world_size=48, num_experts=48)
        for cfg, version in ((wide, HIP_VERSION), (CFG, 60443483)):  # W = 48; ROCm 6.4 (HIP 6.4.43483)
            fake.hip_version, before = version, len(fake.calls)
            try:
                EpDispatchCombine(cfg, virtual=True)
            except (ValueError, RuntimeError) as e:
                record["refusals"].append([type(e).__name__, str(e), fake.calls[before:]])
        fake.hip_version = HIP_VERSION
        dist.barrier()
    finally:
        dist.destroy_process_group()
    record.update(touched=sorted(set(fake.touched)),
                  modules=sorted(m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_backends")))
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The ahead-of-time cache with the gfx950 code objects of CONFIGS (``epgen build``'s compile)."""
    if offline.toolchain_status(ARCH):
        pytest.skip(offline.toolchain_status(ARCH))
    directory = tmp_path_factory.mktemp("aot")
    build(list(dict.fromkeys(s for cfg in CONFIGS for s in config_specs(cfg, ARCH))), directory)
    return directory


@pytest.fixture(scope="module")
def records(cache, tmp_path_factory) -> list[dict]:
    """Each rank's record of the host path (two gloo processes)."""
    out = tmp_path_factory.mktemp("ranks")
    start_and_join(_rank, (2, str(out / "store"), str(cache), str(out)), 2, timeout_s=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _calls(record, name):
    return [c[1:] for c in record["calls"] if c[0] == name]


def test_the_rocm_platform_and_arch_are_chosen(records):
    for r in records:
        assert r["platform"] == "Platform(rocm)" and r["arch"] == ARCH


def test_only_calls_cupy_rocm_has_are_touched(records):
    """Every name the op touched exists in the cupy-rocm-7-0 wheel and reaches HIP there
    (``rocm_surface``: derived from the wheel), the loads included: ``RawModule(path=...)`` is
    ``driver.moduleLoad`` / ``moduleGetFunction`` (cupy/cuda/function.pyx ``Module.load_file``)."""
    for r in records:
        cupy_names = {t for t in r["touched"] if t.startswith("cupy.")}
        assert not [problem(n) for n in sorted(cupy_names) if problem(n)]
        assert not problem("cupy.cuda.driver.moduleLoad") and not problem("cupy.cuda.driver.moduleGetFunction")
        assert not any(t.startswith("cupy.cuda.driver") for t in r["touched"])  # cupy_backends.cuda.api.driver
        assert r["modules"] == ["cupy"]  # the stand-in alone: nothing imported cupy_backends or a cupy submodule
        assert _calls(r, "hostAlloc") == [[2 * 4 * 4, HIP_HOST_MAPPED_PORTABLE]]  # flags HIP has


def test_a_launch_argument_beyond_hips_limit_and_an_old_runtime_are_refused_before_any_work(records):
    for r in records:
        (wide, old) = r["refusals"]
        assert wide == ["ValueError", "EpConfig.world_size=48: the launch argument (struct EpArgs, 88 x W + 24 = 4248 "
                        "bytes) exceeds the 4096 bytes of kernel arguments epgen passes to a HIP launch; "
                        "world_size <= 46 on ROCm", []]
        kind, message, calls = old
        assert (kind, calls) == ("RuntimeError", [])
        assert message.startswith("HIP runtime 6.4.43483: epgen on gfx950 needs ROCm 7.0 or later (MI350X/MI355X: ")
        assert "cupy.cuda.runtime.runtimeGetVersion" in r["touched"]


def test_the_signal_words_are_a_separate_uncached_allocation_freed_at_close(records):
    for rank, r in enumerate(records):
        assert ["libamdhip64.so"] in _calls(r, "CDLL")
        (alloc,) = _calls(r, "hipExtMallocWithFlags")
        nbytes, flags, ptr = alloc
        assert (nbytes, flags) == (SIGNAL_BYTES, HIP_UNCACHED) and r["signals"][rank] == ptr
        assert [ptr, 0, SIGNAL_BYTES] in _calls(r, "memset")  # zeroed
        assert ptr != r["pointers"][rank] + r["layout_signals"]
        assert [[m[1]] for m in _calls(r, "Memory")] == [[r["pointers"][rank]]]  # the arena: ordinary memory
        assert _calls(r, "hipFree") == [[ptr]]
        assert r["num_recv"] == [7]  # recv_buffers reads num_recv from the signal allocation


def test_both_regions_ipc_handles_are_exchanged_opened_and_closed(records):
    for rank, r in enumerate(records):
        peer = records[1 - rank]
        assert _calls(r, "ipcGetMemHandle") == [[r["pointers"][rank]], [r["signals"][rank]]]
        opened = _calls(r, "ipcOpenMemHandle")
        peer_pid_handles = [f"{h.split(':')[0]}" for h, _, _ in opened]
        assert len(set(peer_pid_handles)) == 1 and peer_pid_handles[0] != str(os.getpid())
        assert [h.split(":")[1] for h, _, _ in opened] == [f"{peer['pointers'][1 - rank]:x}",
                                                            f"{peer['signals'][1 - rank]:x}"]
        assert all(flags == HIP_IPC_LAZY for _, flags, _ in opened)
        arena_mapped, signals_mapped = (p for _, _, p in opened)
        assert r["pointers"][1 - rank] == arena_mapped and r["signals"][1 - rank] == signals_mapped
        assert sorted(_calls(r, "ipcCloseMemHandle")) == sorted([[arena_mapped], [signals_mapped]])


def test_every_launch_passes_every_ranks_signal_words_on_torchs_stream(records):
    for rank, r in enumerate(records):
        assert [x["entry"] for x in r["launches"]] == r["launched"]
        assert r["launched"] == [s.name for s in config_specs(CFG, ARCH) if s.op in (Op.DISPATCH, Op.COMBINE)]
        for launch, args in zip(r["launches"], r["launch_args"]):
            assert args["arena"] == r["pointers"] and args["signals"] == r["signals"] and args["rank_base"] == rank
            assert launch["grid"] == [4, 1, 1] and launch["block"] == [4 * 64, 1, 1]  # gfx950: wave 64
            assert launch["stream"] == 0x5000 + rank


def test_the_cached_code_objects_load_without_a_compile_and_feed_the_occupancy(records, cache):
    for r in records:
        loads = r["loads"]  # every config's op: each distinct source once (the loader's memo)
        assert [kind for kind, _ in loads] == ["path"] * len({s.name for c in CONFIGS for s in config_specs(c, ARCH)})
        assert len(_calls(r, "RawModule")) == len(config_specs(CFG, ARCH))  # no RawModule(code=...): no hipcc/hiprtc
        assert all(Path(p).parent == cache / ARCH and p.endswith(".hsaco") for _, p in loads)
        assert {"kernel.num_regs", "kernel.shared_size_bytes"} <= set(r["touched"])
        assert r["combine_blocks"] == 4


PENDING = "RuntimeError: {}: the last async_recv call's receiving half has not run; call its handle.wait() first"


def _family_steps(whole: bool) -> list[tuple[str, list[str], str | None, str]]:
    """(step, kernels launched, error or None, result type) of ``_family_calls`` on FAMILY_CFG:
    the low-latency family up to T_ll tokens, the normal one above; ``whole``: one kernel per
    low-latency op (its grid fits the GPU at once), else its two halves."""
    dispatch_ll = ["dispatch_ll"] if whole else ["dispatch_ll_send", "dispatch_ll_recv"]
    combine_ll = ["combine_ll"] if whole else ["combine_ll_send", "combine_ll_recv"]
    return [
        ("dispatch small", dispatch_ll, None, "DispatchOutput"),
        ("combine", combine_ll, None, "Tensor"),
        ("dispatch large", ["dispatch"], None, "DispatchOutput"),
        ("combine", ["combine"], None, "Tensor"),
        ("dispatch small async", ["dispatch_ll_send"], None, "RecvHandle"),
        ("dispatch before wait", [], PENDING.format("dispatch"), "NoneType"),
        ("combine before wait", [], PENDING.format("combine"), "NoneType"),
        ("wait", ["dispatch_ll_recv"], None, "DispatchOutput"),
        ("wait again", [], "RuntimeError: RecvHandle.wait: already waited (each handle finishes its call once)",
         "NoneType"),
        ("combine async", ["combine_ll_send"], None, "RecvHandle"),
        ("wait", ["combine_ll_recv"], None, "Tensor"),
        ("dispatch large async", [], f"ValueError: dispatch(async_recv=True) with {LARGE} tokens: the split needs the "
         f"low-latency family, and the low-latency family takes at most low_latency_tokens={T_LL} tokens a rank "
         "(EpConfig.kernel_family='low_latency' sizes it for max_tokens_per_rank; EpConfig.max_recv_tokens "
         "lowers it)", "NoneType"),
        ("dispatch large", ["dispatch"], None, "DispatchOutput"),
        ("combine async", [], "ValueError: combine(async_recv=True): the split needs the low-latency family, and the "
         f"dispatch being combined took the normal family ({LARGE} tokens; low_latency_tokens={T_LL})", "NoneType"),
        ("combine", ["combine"], None, "Tensor"),
    ]


MODES = ("default", "fused", "halves", "refused")
"""The FAMILY_CFG runs: ROCm's default; with the whole op allowed (``WHOLE_LOW_LATENCY["amd"]``
flipped): its grid fitting, not fitting, and refused by the runtime as too large."""


@pytest.mark.parametrize("mode", MODES)
def test_each_call_takes_the_family_its_tokens_pick_and_async_recv_splits_it(records, mode):
    for r in records:
        got = [(x["step"], x["ops"], x["error"], x["result"]) for x in r[mode]]
        assert got == _family_steps(whole=mode == "fused")


def test_rocm_takes_the_halves_by_default_and_a_refused_cooperative_grid_falls_back_to_them_once(records):
    """ROCm's default launches what a whole-op grid that does not fit launches (the halves); with
    the whole op allowed, a runtime that refuses its grid as too large costs one refused attempt a
    call kind and a warning naming the kernel and the grid, and every call, the refused ones
    included, completes with the launches of the halves route (test_plan.py compares the launch
    arguments too, on the CUDA stand-in)."""
    def launched(run):
        return [(x["step"], x["ops"], x["cooperative"], x["error"], x["result"]) for x in run]

    for r in records:
        assert launched(r["default"]) == launched(r["halves"]) == launched(r["refused"])
        assert [entry.split("_gfx950")[0] for entry, _, _ in r["refused_attempts"]] == [
            "epgen_dispatch_ll", "epgen_combine_ll"]  # remembered: one attempt each, never again
        assert [grid for _, grid, _ in r["refused_attempts"]] == [[64, 1, 1], [64, 1, 1]]  # tuning.derived: 256 CUs / 4
        assert [w[0] for w in r["refused_warnings"]] == ["RuntimeWarning", "RuntimeWarning"]
        for (_, message), (entry, _, _), call in zip(r["refused_warnings"], r["refused_attempts"],
                                                     ("dispatch", "combine")):
            assert message.startswith(f"{call}: the runtime refused the whole low-latency kernel {entry} (64 x 1 blocks "
                                      "of 256 threads, one cooperative launch) as too large: cooperative grid 64x1x1 of "
                                      "256x1x1 threads refused by the HIP runtime (hipErrorCooperativeLaunchTooLarge, "
                                      "720)"), message
            assert message.endswith(f"This op launches {call}'s two halves instead from now on"), message


@pytest.mark.parametrize("mode", MODES)
def test_the_low_latency_combine_reads_y_in_place_and_the_normal_one_copies_it(records, mode):
    for r in records:
        assert next(x for x in r[mode] if "y" in x)["combine_in"] == "zero"  # the first combine: low-latency
        for x in (x for x in r[mode] if "y" in x and not x["error"]):
            if x["ops"][0].startswith("combine_ll"):  # both halves get y's own address; this y is not copied
                assert x["y"] == [x["own_y"]] * len(x["ops"]) and x["combine_in"] != "y", x
            else:  # the normal combine's peers read combine_in: y is copied there
                assert x["ops"] == ["combine"] and x["y"] != [x["own_y"]] and x["combine_in"] == "y", x


def test_only_the_whole_low_latency_ops_launch_cooperatively_through_hip(records):
    """One rank a process: the whole low-latency op's blocks wait for each other, so where it runs
    (the rule flipped) it launches through hipModuleLaunchCooperativeKernel (CuPy-ROCm's cooperative
    launch is a stub); its halves and the normal family's kernels wait only for peers and launch as
    any kernel. By default nothing launches cooperatively on ROCm."""
    for r in records:
        for mode in MODES + ("normal",):
            launches = [(op, coop) for x in r[mode] for op, coop in zip(x["ops"], x["cooperative"])]
            assert launches and all(coop == (op in ("dispatch_ll", "combine_ll")) for op, coop in launches), launches
            assert any(coop for _, coop in launches) == (mode == "fused")


def test_ranks_on_both_sides_of_the_threshold_take_one_family_or_are_refused_before_any_launch(records):
    """One process a rank, kernel_family "auto": a dispatch that does not state its family is
    refused on every rank, whatever its own count (0, T_ll - 1, T_ll, T_ll + 1), before a launch
    (choosing by its own count would split the ranks between the families: a hang); stated as the
    family of the most tokens of any rank, both ranks launch the same kernels for every pair."""
    mine = [[(x["step"], x["ops"], x["error"]) for x in r["straddle"]] for r in records]
    for rank, steps in enumerate(mine):
        for pair, (unstated, dispatch, combine) in zip(STRADDLE, zip(*[iter(steps)] * 3)):
            assert unstated[1] == [] and unstated[2].startswith(
                "ValueError: dispatch: EpConfig.kernel_family='auto' with one process a rank (W=2) needs the call's "
                f"family stated: each rank sees only its own {pair[rank]} tokens"), unstated
            want = ("dispatch_ll", "combine_ll") if max(pair) <= T_LL else ("dispatch", "combine")
            assert (dispatch[1], combine[1], dispatch[2], combine[2]) == ([want[0]], [want[1]], None, None), (pair, rank)
    assert [[(s, ops) for s, ops, _ in steps if "unstated" not in s] for steps in mine][0] == \
        [[(s, ops) for s, ops, _ in steps if "unstated" not in s] for steps in mine][1]


def test_the_normal_family_refuses_the_split_before_any_launch(records):
    for r in records:
        got = [(x["step"], x["ops"], x["error"]) for x in r["normal"]]
        assert got == [
            ("dispatch small", ["dispatch"], None),
            ("combine", ["combine"], None),
            ("dispatch small async", [], f"ValueError: dispatch(async_recv=True) with {SMALL} tokens: the split needs "
             "the low-latency family, and this op builds no low-latency kernels (EpConfig.kernel_family='normal', or "
             "'auto' where the tuning table's threshold or EpConfig.max_recv_tokens makes it 0)"),
            ("dispatch small", ["dispatch"], None),
            ("combine async", [], "ValueError: combine(async_recv=True): the split needs the low-latency family, and "
             f"the dispatch being combined took the normal family ({SMALL} tokens; low_latency_tokens=0)"),
            ("combine", ["combine"], None),
        ]


def test_a_failed_hip_call_raises_naming_the_call_the_code_and_its_text_and_the_library_is_found_by_soname(monkeypatch):
    from epgen.platform import HipError, Platform

    hip = types.SimpleNamespace(hipExtMallocWithFlags=_CFunction(lambda ptr_ref, nbytes, flags: 2),
                                hipFree=_CFunction(lambda ptr: 1),
                                hipModuleLaunchCooperativeKernel=_CFunction(lambda *args: 1),
                                hipGetErrorString=_CFunction(lambda status: {1: b"invalid argument",
                                                                             2: b"out of memory"}[status]))
    def cdll(name):
        if name != "libamdhip64.so.7":
            raise OSError(f"{name}: cannot open shared object file")
        return hip

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    rocm = Platform(rocm=True)
    with pytest.raises(HipError, match=r"^hipExtMallocWithFlags returned hipError_t 2 \(out of memory\)$"):
        rocm.alloc_signals(SIGNAL_BYTES)
    with pytest.raises(HipError, match=r"^hipFree returned hipError_t 1 \(invalid argument\)$"):
        rocm.free_signals(0x1000)
    with pytest.raises(RuntimeError, match=r"Platform\(cuda\)\.alloc_signals: CUDA keeps the signal words in the arena"):
        Platform(rocm=False).alloc_signals(SIGNAL_BYTES)

    monkeypatch.setattr(ctypes, "CDLL", lambda name: cdll("none"))
    with pytest.raises(OSError, match=r"^the HIP runtime library could not be loaded \(libamdhip64\.so: .*"
                                      r"libamdhip64\.so\.6: .*\); ROCm's lib directory must be on the loader path"):
        Platform(rocm=True).free_signals(0x1000)


def test_the_pull_dispatch_launches_both_kernels_and_copies_an_x_elsewhere_into_dispatch_input(records):
    for r in records:
        got = [(x["step"], x["ops"], x["x"], x["copied"], x["transport"], x["error"]) for x in r["pull"]]
        assert got[0] == ("x elsewhere", ["dispatch:pull", "dispatch_pull"], "dispatch_input", True, "pull", None)
        assert got[1] == ("x is dispatch_input", ["dispatch:pull", "dispatch_pull"], "dispatch_input", True, "pull",
                          None)
        step, ops, _, _, _, error = got[2]  # refused before any launch
        assert (step, ops) == ("x inside dispatch_input", [])
        assert error.startswith("ValueError: x.data_ptr()=0x") and error.endswith(
            ": 1024 bytes into dispatch_input(); an x in dispatch_input must start at its first row "
            "(pass op.dispatch_input()[:T])"), error
