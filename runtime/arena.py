"""Symmetric arenas: one device allocation per rank (and on ROCm a separate one for its signal
words), mapped into every process that drives a rank.

Real ranks (one process per GPU) exchange CUDA/HIP IPC handles over a torch.distributed process
group; virtual ranks (W ranks in one process on one GPU) allocate all W arenas locally. Error
records live in host-mapped memory so the host reads them without a device synchronization.
Every vendor-specific call goes through ``epgen.platform.Platform``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from epgen.codegen.abi import ERROR_RECORD, SIGNAL_WORDS
from epgen.codegen.spec import ArenaLayout
from epgen.platform import Platform


class ErrorRecords:
    """W records of uint32 words ``ERROR_RECORD`` (code, a, b, c) in host-mapped pinned memory,
    record r for rank r, in every process (with one rank a process too).

    Kernels write a record when they detect an input error or a spin-wait timeout (codes:
    ``epgen.codegen.abi.ERRORS``): their own rank's, and the record of a peer whose recoverable
    fault of the call they read from their signal region (``abi.FAULT_RECORD``); the host reads
    them with plain loads.
    """

    def __init__(self, world_size: int, platform: Platform):
        self.world_size = world_size
        self._platform = platform
        words = world_size * len(ERROR_RECORD)
        self.nbytes = words * 4
        self.ptr = platform.host_alloc_mapped(self.nbytes)  # unified addressing: same pointer on device
        self._words = (ctypes.c_uint32 * words).from_address(self.ptr)
        ctypes.memset(self.ptr, 0, self.nbytes)

    def any(self) -> bool:
        """Whether some record's code is not 0 (one vectorized read of the W code words)."""
        return bool(np.ctypeslib.as_array(self._words)[::len(ERROR_RECORD)].any())

    def read(self, rank: int) -> tuple[int, ...]:
        """The record of ``rank``: (code, a, b, c); code 0 means no error."""
        n = len(ERROR_RECORD)
        return tuple(self._words[n * rank:n * (rank + 1)])

    def clear(self):
        """Zero every record (only while no kernel of the op can be running)."""
        ctypes.memset(self.ptr, 0, self.nbytes)

    def close(self):
        if self.ptr:
            self._platform.free_host(self.ptr)
            self.ptr = 0


SIGNAL_BYTES = SIGNAL_WORDS * 4
"""Bytes of one rank's signal words."""


class Arenas:
    """The arenas and signal words of all W ranks as seen from this process.

    On CUDA a rank's signal words are the ``layout.signals`` region of its arena; on ROCm they
    are a separate uncached allocation (``Platform.alloc_signals``), exchanged with a second IPC
    handle (see ``epgen.codegen.spec.ARENA_REGIONS``).

    Args:
        layout: the arena layout (``layout.total_bytes`` per arena).
        world_size: W.
        local_ranks: the ranks this process drives (one with ``group``).
        device: the torch device of the local ranks.
        group: process group of the W ranks (one per process), or None when every rank is local.
        platform: the vendor's calls.

    Attributes:
        pointers: W device addresses (this process's mapping of every rank's arena).
        signals: W device addresses of every rank's signal words, as mapped here.
        local: {rank: uint8 torch tensor over that rank's arena} for the ranks this process drives.
        local_signals: {rank: uint8 torch tensor [SIGNAL_BYTES] over that rank's signal words}.
    """

    def __init__(self, layout: ArenaLayout, world_size: int, local_ranks: list[int], device: torch.device,
                 group=None, *, platform: Platform):
        nbytes = layout.total_bytes
        self.nbytes = nbytes
        self._platform = platform
        self._memory = {}
        self._signal_memory = []  # ROCm: this process's alloc_signals allocations
        self._opened = []
        self.local = {}
        self.local_signals = {}
        pointers, signals = {}, {}
        with platform.use_device(device.index):
            for r in local_ranks:
                mem = platform.alloc_device(nbytes)
                self._memory[r] = mem
                pointers[r] = mem.ptr
                self.local[r] = platform.tensor(mem.ptr, nbytes, mem, device)
                if platform.rocm:
                    signals[r] = platform.alloc_signals(SIGNAL_BYTES)
                    self._signal_memory.append(signals[r])
                    self.local_signals[r] = platform.tensor(signals[r], SIGNAL_BYTES, None, device)
                else:
                    signals[r] = mem.ptr + layout.signals
                    self.local_signals[r] = self.local[r][layout.signals:layout.signals + SIGNAL_BYTES]
            platform.synchronize()
            if group is not None:
                import torch.distributed as dist

                (rank,) = local_ranks
                mine = (platform.ipc_handle(pointers[rank]),
                        platform.ipc_handle(signals[rank]) if platform.rocm else None)
                handles = [None] * world_size
                dist.all_gather_object(handles, mine, group=group)  # both regions' handles at once
                for peer, (arena_handle, signal_handle) in enumerate(handles):
                    if peer == rank:
                        continue
                    pointers[peer] = self._open(arena_handle)
                    signals[peer] = self._open(signal_handle) if platform.rocm else pointers[peer] + layout.signals
                dist.barrier(group=group)  # every arena is zeroed before any peer signals into it
        self.pointers = [pointers[r] for r in range(world_size)]
        self.signals = [signals[r] for r in range(world_size)]

    def _open(self, handle: bytes) -> int:
        p = self._platform.ipc_open(handle)
        self._opened.append(p)
        return p

    def close(self):
        for p in self._opened:
            self._platform.ipc_close(p)
        self._opened = []
        self.local = {}
        self.local_signals = {}
        for p in self._signal_memory:
            self._platform.free_signals(p)
        self._signal_memory = []
        self._memory = {}
