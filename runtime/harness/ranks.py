"""Start one process per rank with torch.distributed, for real (non-virtual) ranks.

Rank r takes cuda:r when the machine has at least W GPUs; with fewer, every rank takes cuda:0:
W processes share one GPU, each with its own CUDA context, and reach each other's arenas through
CUDA IPC exactly as on W GPUs (``cudaIpcOpenMemHandle`` maps an allocation of another process on
the same device). The GPU then time-slices the processes' kernels, so a kernel that waits for a
peer's flag keeps waiting until the peer's context runs: every cross-process race of the
deployment mode (one process per GPU) can happen, which virtual ranks (one grid for every rank)
rule out. Timings of shared-GPU runs measure the time slicing, not the kernels.
"""

from __future__ import annotations

import atexit
import numbers
import os
import shutil
import tempfile
import time

import torch


def rank_device(rank: int, world_size: int) -> int:
    """The CUDA device index of ``rank``: ``rank`` when the machine has ``world_size`` GPUs or
    more, else 0 (every rank shares cuda:0)."""
    return rank if torch.cuda.device_count() >= world_size else 0


def shares_gpu(world_size: int) -> bool:
    """Whether ``world_size`` processes started by ``run_ranks`` share one GPU (fewer GPUs than ranks)."""
    return world_size > 1 and torch.cuda.device_count() < world_size


def _init_group(rank: int, world_size: int, store: str) -> None:
    """This process's device and process group as rank ``rank`` of ``world_size``."""
    import torch.distributed as dist

    # NVLink multicast stays off (shared hosts; docs/measurements/README.md#environment).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = rank_device(rank, world_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    if shares_gpu(world_size):
        # NCCL refuses two ranks on one device (and needs one); the op needs only object
        # collectives and barriers (gloo also moves CUDA tensors, through the host).
        dist.init_process_group(backend="gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method=f"file://{store}",
                                rank=rank, world_size=world_size, device_id=torch.device("cuda", device))


def _serve(rank: int, world_size: int, store: str, conn) -> None:
    """A pool process: join the group, then run each ``(fn, args)`` received on ``conn`` as
    ``fn(rank, world_size, *args)`` and answer ("ok", None) or ("raised", traceback text), until
    None or the parent's end of the pipe closes. It ignores SIGINT: Ctrl-C at a terminal reaches
    every process of the group, and the parent alone answers it (it ends the pool: ``RankPool.run``)."""
    import signal
    import traceback

    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_group(rank, world_size, store)
    try:
        while True:
            try:
                task = conn.recv()
            except EOFError:
                return
            if task is None:
                return
            fn, args = task
            try:
                fn(rank, world_size, *args)
                conn.send(("ok", None))
            except BaseException:  # noqa: BLE001 (reported to the parent with its traceback)
                conn.send(("raised", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` processes that joined one process group (rank r on ``rank_device(r, W)``)
    and run functions on request: started once, so that a run costs the function alone, not a
    Python start, a CUDA context and a rendezvous each time. Any failure (a rank raised, died or ran
    past the bound) ends every process of the pool; the next run starts a new one.

    Raises (``run``): as ``run_ranks``.
    """

    def __init__(self, world_size: int):
        import multiprocessing

        self.world_size = world_size
        self._folder = tempfile.mkdtemp(prefix="epgen-ranks-")
        # The rendezvous goes through a file, not a TCP port: a port found free and bound later by
        # the ranks can be taken in between (EADDRINUSE seen on the device between back-to-back runs).
        store = os.path.join(self._folder, "store")
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, world_size, store, child), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, args: tuple, timeout_s: float | None = None) -> None:
        """``fn(rank, world_size, *args)`` on every process of the pool, until each returned (or
        ended with exit status 0: a test playing a dead peer; the pool then closes).

        Raises:
            ValueError: ``timeout_s`` neither None nor in (0, ``MAX_TIMEOUT_S``] (before any rank runs).
        """
        from multiprocessing.connection import wait

        _check_timeout(timeout_s)
        for conn in self._conns:
            conn.send((fn, args))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(enumerate(self._conns))
        exited = False
        try:
            while pending:
                ready = wait(list(pending.values()) + [self._procs[r].sentinel for r in pending],
                             None if deadline is None else max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError(f"processes {sorted(pending)} of {self.world_size} still running after "
                                       f"timeout_s={timeout_s}; killed them")
                for rank in list(pending):
                    conn, proc = pending[rank], self._procs[rank]
                    try:
                        answer = conn.recv() if conn in ready or conn.poll() else None
                    except EOFError:  # the process ended without answering
                        answer = None
                    if answer is not None:
                        status, text = answer
                        del pending[rank]
                        if status == "raised":
                            raise torch.multiprocessing.ProcessRaisedException(
                                f"\n\n-- Process {rank} terminated with the following error:\n{text}", rank, proc.pid)
                    elif proc.sentinel in ready or not proc.is_alive():
                        proc.join()
                        del pending[rank]
                        exited = True
                        if proc.exitcode != 0:
                            raise torch.multiprocessing.ProcessExitedException(
                                f"process {rank} terminated with exit code {proc.exitcode}", rank, proc.pid,
                                proc.exitcode)
        except BaseException:
            self.close()
            raise
        if exited:
            self.close()

    def close(self) -> None:
        """End every process of the pool (killed if it does not stop at once)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        shutil.rmtree(self._folder, ignore_errors=True)


MAX_TIMEOUT_S = 1e6
"""The longest bound a run takes, in seconds (11.6 days; the process waits refuse 2^31 ms and more)."""


def _check_timeout(timeout_s) -> None:
    """``timeout_s`` is None or a real number in (0, ``MAX_TIMEOUT_S``] seconds.

    Raises:
        ValueError: naming the value and the rule.
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
                                  or not 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s={timeout_s!r}: must be None (no bound) or a real number of seconds in "
                         f"(0, {MAX_TIMEOUT_S:g}]")


_POOLS: dict[int, RankPool] = {}


def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(_close_pools)


def run_ranks(world_size: int, fn, *args, timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes, rank r on
    ``rank_device(r, world_size)``: its own GPU when there are enough, else all on cuda:0 (the
    process group is then gloo alone; otherwise gloo for CPU tensors and NCCL for CUDA ones);
    without a GPU, gloo alone (the host emulation's ranks, ``EpDispatchCombine(device="cpu")``). The
    processes stay up for the next run with the same world size (``RankPool``) unless this one failed.

    ``fn`` must be a module-level function (it is pickled by reference). A rank that ends with
    exit status 0 before ``fn`` returns (``os._exit(0)``, e.g. a test playing a dead peer) counts
    as finished; the others run on.

    Args:
        timeout_s: bound on the whole run (None: no bound). Past it every rank still running is
            killed and TimeoutError raised, so a hung rank fails the caller instead of hanging it.

    Raises:
        ValueError: world_size not an int >= 1, or timeout_s neither None nor in (0, ``MAX_TIMEOUT_S``].
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback included); the
            other ranks are terminated.
        torch.multiprocessing.ProcessExitedException: a rank died with a non-zero status or a signal.
        TimeoutError: ranks still running after ``timeout_s``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    world_size = int(world_size)
    _check_timeout(timeout_s)
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = RankPool(world_size)
    pool.run(fn, args, timeout_s)


def start_and_join(target, args: tuple, nprocs: int, timeout_s: float | None = None) -> None:
    """``torch.multiprocessing.spawn(target, args, nprocs)`` with an optional bound: past
    ``timeout_s`` seconds, kill every process still running and raise TimeoutError naming them.
    Failures propagate as from ``spawn``; no process outlives the call.

    Raises:
        ValueError: ``timeout_s`` neither None nor in (0, ``MAX_TIMEOUT_S``] (before any process starts).
    """
    _check_timeout(timeout_s)
    ctx = torch.multiprocessing.start_processes(target, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                running = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                raise TimeoutError(f"processes {running} of {nprocs} still running after timeout_s={timeout_s}; "
                                   "killed them")
    finally:
        for p in ctx.processes:
            try:
                if p.is_alive():
                    p.kill()
                p.join()
            except ValueError:  # already closed by the join above
                pass


def run_ranks_or_here(world_size: int, virtual: bool, fn, *args) -> None:
    """``fn(rank, world_size, *args)``: in ``world_size`` processes (one per GPU, or all sharing
    cuda:0: ``run_ranks``) when ``world_size > 1`` and not ``virtual``, else once in this process
    as rank 0 (which then drives every virtual rank, or the only one)."""
    if world_size > 1 and not virtual:
        run_ranks(world_size, fn, *args)
    else:
        fn(0, world_size, *args)
