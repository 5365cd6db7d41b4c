"""Symmetric arenas: one device allocation per rank, mapped into every process that drives a rank.

Real ranks (one process per GPU) exchange CUDA/HIP IPC handles over a torch.distributed process
group; virtual ranks (W ranks in one process on one GPU) allocate all W arenas locally. Error
records live in host-mapped memory so the host reads them without a device synchronization.
"""

from __future__ import annotations

import ctypes

import torch

from epgen.codegen.abi import ERROR_RECORD


class ErrorRecords:
    """W records of uint32 words ``ERROR_RECORD`` (code, a, b, c) in host-mapped pinned memory.

    Kernels write a record when they detect an input error or a spin-wait timeout (codes:
    ``epgen.codegen.abi.ERRORS``); the host reads them with plain loads.
    """

    def __init__(self, world_size: int):
        import cupy

        self.world_size = world_size
        words = world_size * len(ERROR_RECORD)
        self.nbytes = words * 4
        flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
        self.ptr = cupy.cuda.runtime.hostAlloc(self.nbytes, flags)  # unified addressing: same pointer on device
        self._words = (ctypes.c_uint32 * words).from_address(self.ptr)
        ctypes.memset(self.ptr, 0, self.nbytes)

    def read(self, rank: int) -> tuple[int, ...]:
        """The record of ``rank``: (code, a, b, c); code 0 means no error."""
        n = len(ERROR_RECORD)
        return tuple(self._words[n * rank:n * (rank + 1)])

    def close(self):
        import cupy

        if self.ptr:
            cupy.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0


class Arenas:
    """The arenas of all W ranks as seen from this process.

    Attributes:
        pointers: W device addresses (this process's mapping of every rank's arena).
        local: {rank: uint8 torch tensor over that rank's arena} for the ranks this process drives.
    """

    def __init__(self, nbytes: int, world_size: int, local_ranks: list[int], device: torch.device, group=None):
        import cupy

        self.nbytes = nbytes
        self._memory = {}
        self._opened = []
        self.local = {}
        with cupy.cuda.Device(device.index):
            for r in local_ranks:
                mem = cupy.cuda.Memory(nbytes)
                cupy.cuda.runtime.memset(mem.ptr, 0, nbytes)
                self._memory[r] = mem
                arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
                self.local[r] = torch.as_tensor(arr, device=device)
            cupy.cuda.runtime.deviceSynchronize()
            pointers = {r: m.ptr for r, m in self._memory.items()}
            if group is not None:
                import torch.distributed as dist

                (rank,) = local_ranks
                handle = cupy.cuda.runtime.ipcGetMemHandle(pointers[rank])
                handles = [None] * world_size
                dist.all_gather_object(handles, handle, group=group)
                for peer, h in enumerate(handles):
                    if peer != rank:
                        p = cupy.cuda.runtime.ipcOpenMemHandle(h, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
                        self._opened.append(p)
                        pointers[peer] = p
                dist.barrier(group=group)  # every arena is zeroed before any peer signals into it
        self.pointers = [pointers[r] for r in range(world_size)]

    def close(self):
        import cupy

        for p in self._opened:
            cupy.cuda.runtime.ipcCloseMemHandle(p)
        self._opened = []
        self.local = {}
        self._memory = {}
