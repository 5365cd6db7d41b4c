"""epgen's kernels on the CPU: the host emulation (docs/host.md).

``EpDispatchCombine(config, device="cpu", arch=...)`` runs the kernels the op would launch on a GPU
of ``arch``, rendered with the host platform layer (``epgen.codegen.render.render_host``: the
arch's kernel logic and traits, the vendor's memory orders as C++ atomics), compiled once per
source by the clang of the ``ziglang`` package (PyPI) and launched through ``HostPlatform``, the
host's counterpart of ``epgen.platform.Platform``. Each launch runs its whole grid on one CPU
thread: every GPU thread is a fiber, resumed in an order drawn from ``Schedule.seed``; stores to
the arenas, signal words and error records sit in per-thread store buffers until a release, loads
may return a snapshot as old as the thread's last acquire (host_runtime.j2 states the rules). A
seed that fails replays exactly (one process; ranks in other processes add the OS's timing).

This is for correctness, not speed: a launch of a few hundred threads takes milliseconds to
seconds, and nothing here models timing, caches or residency.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import attrs
import torch

from epgen.codegen.arch import traits
from epgen.codegen.render import render_host
from epgen.codegen.tuning import Geometry

COMPILE_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing", "-w",
                 "-fsanitize=thread", "-mllvm", "-tsan-instrument-func-entry-exit=0")
"""clang's flags for a host source: ThreadSanitizer's instrumentation without its runtime (the
source defines the ``__tsan_*`` hooks; linking is a separate step without ``-fsanitize``), and no
contraction into FMAs the GPU code does not ask for."""

GEOMETRY = Geometry(blocks=2, warps_per_block=2, unroll=1)
"""The launch geometry the host takes for every kernel whose geometry the config leaves to the
tuning tables (``HostPlatform.plan``): 2 blocks of 2 waves (64 threads on sm_90 and gfx1250, 128
on gfx942 and gfx950), so a W = 4 launch is a few hundred fibers. More than one block and wave, so
the kernels' block and wave hand-offs run. The local kernels (expand, fold, the combine's quantize
kernel) keep their unroll."""


class HostError(RuntimeError):
    """A host launch did not finish: every thread waits at a barrier or wave collective
    (deadlock), the grid ran past ``Schedule.max_steps``, or a thread accessed memory outside
    every mapping (a memory fault: the op is unusable after it, as after a GPU's). The message
    names the kernel, the seed that replays it and where the threads wait or which thread faulted."""


def _probability(name: str, p: float) -> int:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"Schedule.{name}={p!r}: a probability, 0 <= {name} <= 1")
    return min(65536, round(p * 65536))


@attrs.frozen
class Schedule:
    """How the host emulation interleaves and weakens one op's launches.

    Attributes:
        seed: the scheduler's seed; launch i of the op uses ``seed + i`` (``HostPlatform.launches``).
        preempt: chance of a switch to another thread at each access of global memory.
        drain: chance, at each switch, that one buffered store somewhere is committed.
        stale: chance that a thread's snapshot for plain loads is taken at its last acquire
            rather than at its first load after it.
        hold: chance that a buffered store is held: not committed at random while any thread
            runs, only by a release, once every thread waits, or at the kernel's end (a store
            delayed as long as nothing forces it out).
        delays: ``{rank: steps}`` or ``{(rank, block): steps}``: scheduler steps before that
            rank's (or block's) threads may first run (a slow peer); a rank the op lacks is
            refused when the op is built, a block past a kernel's grid delays nothing.
        max_steps: steps after which a launch fails as never finishing (``HostError``).
        real_clock: the kernels' clock (timeouts) is the OS's monotonic clock instead of the
            scheduler's steps (50 ns each); None: real with a process group, virtual otherwise.
    """

    seed: int = 0
    preempt: float = 1 / 16
    drain: float = 1 / 8
    stale: float = 1 / 2
    hold: float = 1 / 4
    delays: dict = attrs.field(factory=dict, hash=False)
    max_steps: int = 4_000_000
    real_clock: bool | None = None

    def __attrs_post_init__(self):
        for name in ("preempt", "drain", "stale", "hold"):
            _probability(name, getattr(self, name))
        if not _u64(self.seed, 2**32):
            raise ValueError(f"Schedule.seed={self.seed!r}: an int in [0, 2^32)")
        if not _u64(self.max_steps) or self.max_steps < 1:
            raise ValueError(f"Schedule.max_steps={self.max_steps!r}: an int in [1, 2^63)")
        for key, steps in self.delays.items():
            ids = key if isinstance(key, tuple) else (key,)
            if len(ids) not in (1, 2) or not all(_u64(i, 2**31) for i in ids) or not _u64(steps):
                raise ValueError(f"Schedule.delays[{key!r}]={steps!r}: rank (or (rank, block)) -> steps, "
                                 "non-negative ints (steps below 2^63)")

    def check_ranks(self, world_size: int) -> None:
        """Refuse a delay of a rank the op does not have.

        Raises:
            ValueError: naming the key and the world size.
        """
        for key in self.delays:
            rank = key[0] if isinstance(key, tuple) else key
            if rank >= world_size:
                raise ValueError(f"Schedule.delays[{key!r}]: rank {rank} of world_size={world_size}")


def _u64(v, bound: int = 2**63) -> bool:
    """``v`` is an int (not a bool) in [0, bound)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound


class _Options(ctypes.Structure):  # struct EphOptions (platform/host_runtime.j2)
    _fields_ = [("seed", ctypes.c_uint64), ("preempt", ctypes.c_uint32), ("drain", ctypes.c_uint32),
                ("stale", ctypes.c_uint32), ("hold", ctypes.c_uint32), ("real_clock", ctypes.c_uint32), ("max_steps", ctypes.c_uint64),
                ("delays", ctypes.POINTER(ctypes.c_uint64)), ("regions", ctypes.POINTER(ctypes.c_uint64)),
                ("num_regions", ctypes.c_uint32), ("stack_bytes", ctypes.c_uint32)]


class _Stats(ctypes.Structure):  # struct EphStats
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("steps", "switches", "commits", "random_drains", "stale_loads", "parks", "clock_jumps")]


def cache_dir() -> Path:
    """Where compiled host kernels are kept: ``$EPGEN_HOST_CACHE``, else ``~/.cache/epgen/host``."""
    return Path(os.environ.get("EPGEN_HOST_CACHE") or Path.home() / ".cache" / "epgen" / "host")


def compile_source(text: str) -> Path:
    """The shared library of host source ``text``, compiled once (cached by the sha256 of the text
    and the flags) with ``python -m ziglang c++``.

    Raises:
        RuntimeError: the ``ziglang`` package is missing, or clang failed (its diagnostics).
    """
    key = hashlib.sha256("\0".join((text,) + COMPILE_FLAGS).encode()).hexdigest()[:32]
    out = cache_dir() / f"{key}.so"
    if out.exists():
        return out
    import importlib.util

    if importlib.util.find_spec("ziglang") is None:
        raise RuntimeError("the host emulation compiles with the clang of the ziglang package: pip install ziglang")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    src, obj = tmp.with_suffix(".cpp"), tmp.with_suffix(".o")
    src.write_text(text)
    try:
        for cmd in ([sys.executable, "-m", "ziglang", "c++", *COMPILE_FLAGS, "-c", str(src), "-o", str(obj)],
                    [sys.executable, "-m", "ziglang", "c++", "-shared", "-nostdlib++", str(obj), "-o", str(tmp)]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"host compile failed ({' '.join(cmd[3:5])} ...):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders of one source agree
    finally:
        for p in (src, obj, tmp):
            p.unlink(missing_ok=True)
    return out


_LAUNCH_LOCK = threading.Lock()
"""Host launches of one process run one at a time (two threads' launches would share a library's
scheduler); ranks in one process are virtual ranks of one op, or one process per rank."""


class HostKernel:
    """One compiled host source: ``launch`` runs a grid of its kernel."""

    def __init__(self, path: Path, entry: str):
        self.entry = entry
        self.lib = ctypes.CDLL(str(path))
        self.lib.ep_host_launch.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            ctypes.POINTER(_Options), ctypes.POINTER(_Stats))
        self.lib.ep_host_launch.restype = ctypes.c_int
        self.lib.ep_host_error.restype = ctypes.c_char_p
        self.args_bytes = self.lib.ep_host_args_bytes()

    def launch(self, args_address: int, grid: tuple[int, int], threads: int, options: _Options) -> _Stats:
        stats = _Stats()
        with _LAUNCH_LOCK:  # one emulation at a time per process: its state is the library's globals
            status = self.lib.ep_host_launch(ctypes.c_void_p(args_address), grid[0], grid[1], threads,
                                             ctypes.byref(options), ctypes.byref(stats))
        if status:
            raise HostError(f"{self.entry} (grid {grid[0]}x{grid[1]} of {threads} threads, seed {options.seed}): "
                            f"{self.lib.ep_host_error().decode()}")
        return stats


def _shm_dir() -> str:
    """Where shared segments live: /dev/shm (memory) where it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Shared:
    """One shared-memory segment: a file in ``_shm_dir()`` mapped with ``mmap`` (a peer process
    maps it by its path, the host's IPC handle). The creator removes the file at ``close``; the
    mapping lives while any tensor over it does."""

    def __init__(self, nbytes: int, path: str | None = None):
        self.owner = path is None
        if self.owner:
            fd, path = tempfile.mkstemp(prefix="epgen-host-", dir=_shm_dir())
            # the file goes when this object does (close, garbage collection or exit), not only at close
            self._unlink = weakref.finalize(self, _unlink, path)
            os.ftruncate(fd, max(nbytes, 1))
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size)  # a new file reads as zeros
        finally:
            os.close(fd)
        self.path = path
        self.ptr = ctypes.addressof(ctypes.c_uint8.from_buffer(self.map))

    def close(self):
        if self.owner:
            self._unlink()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class HostPlatform:
    """``epgen.platform.Platform``'s calls on the host: memory in shared-memory segments (peer
    processes open them by name, as CUDA IPC handles), kernels rendered by ``render_host`` and
    run by the emulation; launches finish before they return.

    Attributes:
        rocm: False (the signal words live in the arena, as on CUDA, for every arch).
        name: ``"host"``.
        schedule: the ``Schedule`` of every launch.
        launches: launches so far; launch i runs with seed ``schedule.seed + i``.
        stats: per launch, (kernel, seed, the scheduler's counters as a dict).
    """

    rocm = False
    name = "host"
    fatal_errors = (HostError,)

    def __init__(self, arch: str, schedule: Schedule | None = None, processes: bool = False, rank_base: int = 0):
        self._arch = traits(arch).name  # ValueError for an unknown arch
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError(f"schedule={schedule!r}: must be None or an epgen.host.Schedule")
        self.rank_base = rank_base  # the first rank this process drives: delays name global ranks
        self.schedule = schedule if schedule is not None else Schedule()
        self.real_clock = processes if self.schedule.real_clock is None else self.schedule.real_clock
        self._allocations: dict[int, _Shared] = {}
        self.launches = 0
        self.stats: list[tuple[str, int, dict]] = []

    def __repr__(self) -> str:
        return f"HostPlatform({self._arch}, {self.schedule})"

    def render(self, spec):
        return render_host(spec)

    def check_runtime(self, arch: str) -> None:
        pass

    def check_kernel_args(self, nbytes: int, world_size: int, max_world_size: int) -> None:
        pass

    def arch(self, device_index) -> str:
        return self._arch

    def use_device(self, device_index):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def synchronize_stream(self, device) -> None:
        pass

    def free_bytes(self, device, need: int = 0) -> int:
        """Memory the host can give (the physical memory; shared-memory segments are backed by it;
        no cache holds any of it, so ``need`` changes nothing)."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def resident_blocks(self, fn, spec, device) -> int:
        """Every block of a grid is resident at once on the host (each thread is a fiber)."""
        return 1 << 30

    # ---- memory ------------------------------------------------------------------------------
    def _keep(self, alloc: _Shared) -> _Shared:
        self._allocations[alloc.ptr] = alloc
        return alloc

    def alloc_device(self, nbytes: int):
        return self._keep(_Shared(nbytes))

    def alloc_signals(self, nbytes: int) -> int:
        raise RuntimeError("HostPlatform.alloc_signals: the host keeps the signal words in the arena")

    def free_signals(self, ptr: int) -> None:
        raise RuntimeError("HostPlatform.free_signals: the host keeps the signal words in the arena")

    def tensor(self, ptr: int, nbytes: int, owner, device) -> torch.Tensor:
        alloc = self._allocations[ptr]
        return torch.frombuffer(alloc.map, dtype=torch.uint8, count=nbytes)

    def host_alloc_mapped(self, nbytes: int) -> int:
        return self._keep(_Shared(nbytes)).ptr

    def free_host(self, ptr: int) -> None:
        self._allocations.pop(ptr).close()

    def ipc_handle(self, ptr: int) -> bytes:
        return self._allocations[ptr].path.encode()

    def ipc_open(self, handle: bytes) -> int:
        return self._keep(_Shared(0, path=handle.decode())).ptr

    def ipc_close(self, ptr: int) -> None:
        self._allocations.pop(ptr).close()

    # ---- kernels -----------------------------------------------------------------------------
    def plan(self, config, arch: str, grid_ranks: int):
        """The op's plan on the host: ``Plan.build`` with ``GEOMETRY`` where ``config`` names no
        geometry (the tables' are a GPU's: 24 to 264 blocks of up to 1,024 threads, a hundred
        thousand fibers a launch), and for the local kernels; ``op.config`` stays the caller's."""
        from epgen.codegen.spec import LOCAL_OPS
        from epgen.plan import Plan

        fields = ("dispatch_geometry", "combine_geometry") + (
            ("low_latency_geometry",) if config.kernel_family != "normal" else ())
        plan = Plan.build(attrs.evolve(config, **{f: getattr(config, f) or GEOMETRY for f in fields}), arch,
                          grid_ranks)
        local = {key: tuple((t, spec.replace(blocks=GEOMETRY.blocks,
                                             warps_per_block=min(spec.warps_per_block, GEOMETRY.warps_per_block)))
                            for t, spec in variants)
                 for key, variants in plan.variants.items() if key[0] in LOCAL_OPS}
        kernels = attrs.evolve(plan.kernels, config=config, variants={**plan.variants, **local})
        return attrs.evolve(plan, kernels=kernels)

    def prepare(self, specs) -> None:
        """Compile the host sources of ``specs`` not in the cache yet, one compiler process per
        core at once (``load_kernel`` then finds them there)."""
        from concurrent.futures import ThreadPoolExecutor

        texts = list(dict.fromkeys(self.render(spec).text for spec in specs))
        with ThreadPoolExecutor(max_workers=max(1, min(len(texts), os.cpu_count() or 1))) as pool:
            list(pool.map(compile_source, texts))

    def load_kernel(self, text: str, entry: str, device_index) -> HostKernel:
        return HostKernel(compile_source(text), entry)

    def launch(self, fn: HostKernel, grid: tuple[int, int, int], block: tuple[int, int, int], args_address: int,
               device, cooperative: bool = False) -> None:
        """Run ``fn``'s grid to its end with the next seed of the schedule.

        Raises:
            HostError: the grid deadlocked or ran past ``Schedule.max_steps``.
        """
        s = self.schedule
        regions = [v for a in self._allocations.values() for v in (a.ptr, a.size)]
        region_array = (ctypes.c_uint64 * len(regions))(*regions)
        delays = None
        if s.delays:
            table = [0] * (grid[0] * grid[1])
            for key, steps in s.delays.items():
                rank, which = key if isinstance(key, tuple) else (key, None)
                local = rank - self.rank_base
                if not 0 <= local < grid[1]:
                    continue
                for b in range(grid[0]) if which is None else [which]:
                    if 0 <= b < grid[0]:
                        table[local * grid[0] + b] = steps
            delays = (ctypes.c_uint64 * len(table))(*table)
        seed = s.seed + self.launches
        options = _Options(seed=seed, preempt=_probability("preempt", s.preempt), drain=_probability("drain", s.drain),
                           stale=_probability("stale", s.stale), hold=_probability("hold", s.hold),
                           real_clock=int(self.real_clock),
                           max_steps=s.max_steps, delays=delays, regions=region_array,
                           num_regions=len(regions) // 2, stack_bytes=256 * 1024)
        self.launches += 1
        stats = fn.launch(args_address, (grid[0], grid[1]), block[0], options)
        self.stats.append((fn.entry, seed, {n: getattr(stats, n) for n, _ in _Stats._fields_}))
