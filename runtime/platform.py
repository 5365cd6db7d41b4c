"""The platform seam: every host call of the op that differs between CUDA and ROCm, in one object.

``Platform.current()`` picks the vendor from ``torch.version.hip`` (set by torch's ROCm build).
On ROCm the GPU runtime is CuPy's ROCm build (e.g. ``cupy-rocm-7-0``): ``cupy.cuda.runtime.*``
map to HIP (CuPy ``cupy_backends/hip/cupy_hip_runtime.h``: ``cudaMalloc`` -> ``hipMalloc``,
``cudaHostAlloc`` -> ``hipHostMalloc`` with the flags passed through, ``cudaIpc*MemHandle`` ->
``hipIpc*MemHandle``, ``cudaMemset`` -> ``hipMemset``), so most calls are the same on both
vendors and only their memory differs:

* bulk data (the arena, ``epgen.codegen.spec.ArenaLayout``): ``cupy.cuda.Memory`` on both
  (``hipMalloc`` on ROCm: coarse-grained, coherent only at kernel boundaries);
* signal words (``epgen.codegen.abi.SIGNALS``), which peers store to and add to while the kernels
  run: on CUDA the ``signals`` region of the arena; on ROCm a separate allocation made with
  ``hipExtMallocWithFlags(..., hipDeviceMallocUncached)`` through ctypes on ``libamdhip64.so``
  (CuPy has no binding for it). mori's choice depends on how it is run (ROCm/mori at 624002c,
  2026-08-21): its default symmetric heap (``MORI_SHMEM_MODE`` unset: one static heap) is one
  uncached ``hipExtMallocWithFlags`` allocation (``hipMalloc`` with ``MORI_SHMEM_HEAP_TYPE=normal``),
  src/shmem/init.cpp ``InitializeStaticHeap``; its dispatch/combine op asks for uncached buffers
  (``ShmemExtMallocWithFlags(size, hipDeviceMallocUncached)``), a flag that only the isolation mode
  honours; and a plain ``ShmemMalloc`` there is ``hipMalloc`` unless the SDMA transport is on
  (``MORI_ENABLE_SDMA``: src/application/memory/symmetric_memory.cpp ``SymmMemManager::Malloc``).
  epgen makes the signal words uncached whatever mori does;
* error records: host-mapped pinned memory (``hostAllocMapped | hostAllocPortable``, the same
  bits as ``hipHostMallocMapped | hipHostMallocPortable``).

The kernels are loaded through ``epgen.loader.load_kernel`` on both vendors (the ahead-of-time
cache through ``cupy.RawModule(path=...)``, which loads without compiling, CuPy
``cupy/_core/raw.pyx`` ``_get_raw_module``; else a runtime compile: NVRTC, or hiprtc on ROCm)
and launched on CuPy's view of torch's current stream (``epgen.device.cupy_stream``).
"""

from __future__ import annotations

import ctypes

import torch

HIP_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")
"""The HIP runtime library that CuPy's ROCm build links (``hipExtMallocWithFlags`` comes from it),
by the names tried in order: the development link, then the ROCm 7 and 6 sonames."""

HIP_DEVICE_MALLOC_UNCACHED = 0x3
"""``hipDeviceMallocUncached`` (hip/hip_runtime_api.h): device memory the caches do not keep, so
stores and atomics from peers are seen while a kernel runs (fine-grained)."""

HIP_SUCCESS = 0
"""``hipSuccess``: the ``hipError_t`` of a call that worked."""

ROCM_FLOOR = (7, 0)
"""The oldest ROCm any arch runs on: CuPy's ROCm wheel (``cupy-rocm-7-0``, the ``[rocm]`` extra)
links ``libamdhip64.so.7`` (``readelf -d`` of its ``cupy_backends/cuda/api/runtime`` extension,
recorded in tests/runtime/core/cupy_rocm_surface.json), which ROCm 7.0 is the first to ship."""

MIN_ROCM = {
    "gfx942": ((7, 0), "MI300X/MI325X: ROCm supports MI300 from 6.0 (6.0.2 is 'a point release with minor bug "
                       "fixes to improve stability of MI300 GPU applications'), and the wheel needs 7.0"),
    "gfx950": ((7, 0), "MI350X/MI355X: hipcc knows gfx950 from ROCm 6.4, the ROCm libraries add it in 7.0.0 "
                       "(hipFFT 1.0.20 for ROCm 7.0.0, 'Added gfx950 support'), and the wheel needs 7.0"),
    "gfx1250": ((7, 14), "MI450: the ROCm libraries add gfx1250 in ROCm 7.14 (hipRAND 3.4.0 for ROCm 7.14, "
                         "'gfx1250 support'; PyTorch's ROCm build gates gfx1250 on ROCm 7.14+, ROCm/pytorch#3421)"),
}
"""arch -> (the oldest ROCm release, as (major, minor), that runs epgen's kernels there; why).
Every AMD arch of ``epgen.codegen.arch.ARCH_TRAITS`` has an entry (tests/runtime/core/test_rocm_runtime.py)."""

HIP_KERNEL_ARGS_BYTES = 4096
"""The most bytes of kernel arguments epgen passes to a HIP launch: a bound epgen chose, not a
limit the ROCm runtime states. HIP documents none (its C++ language extensions page lists what
kernel parameters cannot be, not a size), and today's runtime has no fixed buffer either: ROCclr
copies each dispatch's arguments into a block of the kernel's own ``kernarg_segment_byte_size``
(from its code object, the hidden arguments included) carved from the queue's kernarg pool
(ROCm/clr rocclr/device/rocm/rocvirtual.cpp ``VirtualGPU::submitKernelInternal`` ->
``allocKernArg``, at f9f995c; the pool is ``HSA_KERNARG_POOL_SIZE``: 1 MiB used in 4 chunks
there, 4 MiB in ROCm/rocm-systems projects/clr/rocclr/utils/flags.hpp, where ROCclr lives now).
The 4,096 bytes are CUDA's classic limit for a ``__global__`` function's parameters (CUDA C++
Programming Guide, "Function Parameters"; 32,764 bytes from CUDA 12.1 on Volta and later), the size
ported CUDA code assumes; no larger struct has run on AMD hardware. (The 4 KB kernel-argument
buffer of the retired hcc runtime, ROCm/hcc#1377, no longer applies.) epgen's one argument,
``struct EpArgs`` (``epgen.codegen.abi.ARGS``), takes 88 x W + 24 bytes, so W <= 46 fits."""


def hip_version(encoded: int) -> tuple[int, int, int]:
    """(major, minor, patch) of a HIP version as ``hipRuntimeGetVersion`` returns it
    (hip/hip_version.h: ``HIP_VERSION_MAJOR * 10000000 + HIP_VERSION_MINOR * 100000 +
    HIP_VERSION_PATCH``); HIP's major.minor is the ROCm release (HIP 7.0 ships in ROCm 7.0)."""
    return encoded // 10_000_000, encoded // 100_000 % 100, encoded % 100_000


HIP_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720
"""``hipErrorCooperativeLaunchTooLarge`` (hip/hip_runtime_api.h)."""

CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720
"""``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`` (cuda.h), the ``status`` of CuPy's ``CUDADriverError``."""


class HipError(RuntimeError):
    """A HIP runtime call made through ctypes returned an error (the message names the call, the
    ``hipError_t`` code and ``hipGetErrorString``'s text)."""


class CooperativeLaunchTooLarge(RuntimeError):
    """The runtime refused a cooperative launch because, by its own occupancy estimate, the grid
    cannot be resident at once (CUDA ``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE``, HIP
    ``hipErrorCooperativeLaunchTooLarge``); nothing was enqueued. HIP checks before it creates the
    command: the grid's blocks against ``ihipOccupancyMaxActiveBlocksPerMultiprocessor``'s blocks a
    grid (ROCm/clr hipamd/src/hip_module.cpp ``ihipLaunchKernel_validate``, f9f995c). The message
    names the grid, the block and the vendor's error."""


class DeviceAllocation:
    """One device allocation (a ``cupy.cuda.Memory``, attribute ``mem``; ``ptr`` its address),
    owned by the torch views over it (``Platform.tensor``) and freed when the last of them dies,
    except while this thread's current stream is capturing a graph: a free there fails and
    invalidates the capture (``cudaErrorStreamCaptureUnsupported``), and the garbage collector
    may drop an old op's last view in the middle of another graph's capture (seen on the H200:
    a cycle through a test's ``pytest.raises`` record held one). Such a free waits in
    ``deferred`` for the next allocation made outside a capture."""

    deferred: list = []

    def __init__(self, mem):
        self.mem = mem
        self.ptr = mem.ptr

    def __del__(self):
        if capturing():
            DeviceAllocation.deferred.append(self.mem)
        self.mem = None


def capturing() -> bool:
    """This thread's current stream is capturing a CUDA/HIP graph."""
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # no usable device: nothing can be capturing
        return False


class Platform:
    """The vendor's host calls for the op (``epgen.op``) and its arenas (``epgen.arena``).

    Attributes:
        rocm: True on ROCm (torch's and CuPy's ROCm builds), False on CUDA.
        name: ``"rocm"`` or ``"cuda"``.
    """

    fatal_errors: tuple = ()
    """Exceptions of ``launch`` after which the op is unusable (its buffers mid-call): none here;
    the host emulation's ``HostError``."""

    def __init__(self, rocm: bool):
        self.rocm = rocm
        self.name = "rocm" if rocm else "cuda"
        self._hip = None

    @classmethod
    def current(cls) -> Platform:
        """The platform of this process's torch: ROCm when ``torch.version.hip`` is set."""
        return cls(rocm=bool(getattr(torch.version, "hip", None)))

    def __repr__(self) -> str:
        return f"Platform({self.name})"

    # ---- device ------------------------------------------------------------------------------
    def check_runtime(self, arch: str) -> None:
        """Refuse a HIP runtime older than ``MIN_ROCM[arch]`` (ROCm only; CUDA: nothing to check).

        Reads the version through CuPy-ROCm's ``cupy.cuda.runtime.runtimeGetVersion``
        (``hipRuntimeGetVersion``).

        Raises:
            RuntimeError: the runtime is older than the arch needs (the message names the version
                found, the arch, the release needed and why).
        """
        if not self.rocm:
            return
        import cupy

        need, why = MIN_ROCM[arch]
        found = hip_version(cupy.cuda.runtime.runtimeGetVersion())
        if found[:2] < need:
            raise RuntimeError(f"HIP runtime {'.'.join(map(str, found))}: epgen on {arch} needs ROCm "
                               f"{need[0]}.{need[1]} or later ({why}); install a newer ROCm (docs/rocm.md)")

    def check_kernel_args(self, nbytes: int, world_size: int, max_world_size: int) -> None:
        """Refuse a launch argument larger than ``HIP_KERNEL_ARGS_BYTES`` (ROCm only).

        Args:
            nbytes: size of ``struct EpArgs`` for ``world_size`` ranks, bytes.
            max_world_size: the largest W whose struct fits (named in the message).

        Raises:
            ValueError: on ROCm, ``nbytes`` > ``HIP_KERNEL_ARGS_BYTES``.
        """
        if self.rocm and nbytes > HIP_KERNEL_ARGS_BYTES:
            raise ValueError(f"EpConfig.world_size={world_size}: the launch argument (struct EpArgs, 88 x W + 24 = "
                             f"{nbytes} bytes) exceeds the {HIP_KERNEL_ARGS_BYTES} bytes of kernel arguments epgen "
                             f"passes to a HIP launch; world_size <= {max_world_size} on ROCm")

    def arch(self, device_index: int) -> str:
        """Target name of the torch device (``sm_90``, ``gfx950``): ``epgen.device.device_arch``."""
        from epgen.device import device_arch

        return device_arch(device_index)

    def use_device(self, device_index: int):
        """Context manager making ``device_index`` CuPy's (and the runtime's) current device."""
        import cupy

        return cupy.cuda.Device(device_index)

    def synchronize(self) -> None:
        """Wait for all work on the current device (``cudaDeviceSynchronize`` / ``hipDeviceSynchronize``)."""
        import cupy

        cupy.cuda.runtime.deviceSynchronize()

    def synchronize_stream(self, device: torch.device) -> None:
        """Wait for the work queued on torch's current stream of ``device``."""
        torch.cuda.current_stream(device).synchronize()

    def free_bytes(self, device: torch.device, need: int = 0) -> int:
        """Bytes free on ``device`` (``torch.cuda.mem_get_info``). The arenas are allocated by
        ``cudaMalloc``/``hipMalloc``, which cannot reach the blocks torch's caching allocator holds
        unused: where fewer than ``need`` bytes are free, those blocks are first given back to the
        driver (``torch.cuda.empty_cache``) and the free bytes read again."""
        free = torch.cuda.mem_get_info(device)[0]
        if free < need:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        return free

    def resident_blocks(self, fn, spec, device: torch.device) -> int:
        """Blocks of ``fn`` the whole GPU holds at once: ``epgen.codegen.occupancy`` over the loaded
        kernel's registers and static shared memory (CuPy's ``num_regs`` / ``shared_size_bytes``,
        which CuPy-ROCm reads with ``hipFuncGetAttribute``; its occupancy call is a stub there),
        times the CUs/SMs."""
        from epgen.codegen.occupancy import resident_blocks

        per_cu = resident_blocks(spec.arch, spec.warps_per_block, fn.num_regs, fn.shared_size_bytes)
        return per_cu * torch.cuda.get_device_properties(device.index).multi_processor_count

    def plan(self, config, arch: str, grid_ranks: int):
        """The op's plan (``epgen.plan.Plan.build``: the tuning tables' geometries for this GPU)."""
        from epgen.plan import Plan

        return Plan.build(config, arch, grid_ranks)

    def prepare(self, specs) -> None:
        """Compile ahead what the op will load (nothing here: CuPy compiles each kernel as it loads it)."""

    def render(self, spec):
        """The source of ``spec`` for this vendor (``epgen.codegen.render.render``)."""
        from epgen.codegen.render import render

        return render(spec)

    # ---- memory ------------------------------------------------------------------------------
    def alloc_device(self, nbytes: int):
        """``nbytes`` of ordinary device memory on the current device, zeroed.

        Returns:
            A ``DeviceAllocation`` (its ``ptr`` is the address; freed when released, never during
            a graph capture).
        """
        import cupy

        if not capturing():
            DeviceAllocation.deferred.clear()  # frees a capture put off
        mem = cupy.cuda.Memory(nbytes)
        cupy.cuda.runtime.memset(mem.ptr, 0, nbytes)
        return DeviceAllocation(mem)

    def alloc_signals(self, nbytes: int) -> int:
        """``nbytes`` of uncached (fine-grained) device memory on the current device, zeroed
        (ROCm only: ``hipExtMallocWithFlags(&p, nbytes, hipDeviceMallocUncached)``). Free it with
        ``free_signals``.

        Returns:
            The device address.

        Raises:
            RuntimeError: called on CUDA (its signal words stay in the arena).
            HipError: the allocation failed (e.g. hipErrorOutOfMemory).
        """
        if not self.rocm:
            raise RuntimeError("Platform(cuda).alloc_signals: CUDA keeps the signal words in the arena")
        hip = self._hip_library()
        ptr = ctypes.c_void_p()
        self._check("hipExtMallocWithFlags",
                    hip.hipExtMallocWithFlags(ctypes.byref(ptr), nbytes, HIP_DEVICE_MALLOC_UNCACHED))
        import cupy

        try:
            cupy.cuda.runtime.memset(ptr.value, 0, nbytes)  # hipMemset
        except Exception:
            self.free_signals(ptr.value)
            raise
        return ptr.value

    def free_signals(self, ptr: int) -> None:
        """Free an ``alloc_signals`` allocation (``hipFree``).

        Raises:
            HipError: hipFree failed.
        """
        self._check("hipFree", self._hip_library().hipFree(ctypes.c_void_p(ptr)))

    def tensor(self, ptr: int, nbytes: int, owner, device: torch.device) -> torch.Tensor:
        """A uint8 torch tensor [nbytes] over the device memory at ``ptr`` (no copy).

        Args:
            owner: the ``DeviceAllocation`` at ``ptr`` (the tensor keeps it alive), or None for
                memory freed elsewhere (``alloc_signals``).
        """
        import cupy

        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device.index)
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=device)

    def host_alloc_mapped(self, nbytes: int) -> int:
        """``nbytes`` of pinned host memory mapped into every device's address space (unified
        addressing: the same address on host and device); free with ``free_host``."""
        import cupy

        rt = cupy.cuda.runtime
        return rt.hostAlloc(nbytes, rt.hostAllocMapped | rt.hostAllocPortable)

    def free_host(self, ptr: int) -> None:
        import cupy

        cupy.cuda.runtime.freeHost(ptr)

    # ---- IPC ---------------------------------------------------------------------------------
    def ipc_handle(self, ptr: int) -> bytes:
        """The IPC handle (64 bytes) of the device allocation at ``ptr``."""
        import cupy

        return cupy.cuda.runtime.ipcGetMemHandle(ptr)

    def ipc_open(self, handle: bytes) -> int:
        """This process's address of a peer's allocation (lazy peer access); close with ``ipc_close``."""
        import cupy

        rt = cupy.cuda.runtime
        return rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)

    def ipc_close(self, ptr: int) -> None:
        import cupy

        cupy.cuda.runtime.ipcCloseMemHandle(ptr)

    # ---- kernels -----------------------------------------------------------------------------
    def load_kernel(self, text: str, entry: str, device_index: int):
        """The kernel ``entry`` of ``text`` on ``device_index``: ``epgen.loader.load_kernel`` (the
        ahead-of-time cache first, else a runtime compile with ``RUNTIME_OPTIONS``)."""
        from epgen.loader import load_kernel

        with self.use_device(device_index):
            return load_kernel(text, entry)

    def launch(self, fn, grid: tuple[int, int, int], block: tuple[int, int, int], args_address: int,
               device: torch.device, cooperative: bool = False) -> None:
        """Launch ``fn`` with one by-value struct argument (at host address ``args_address``) on
        torch's current stream of ``device`` (``epgen.device.cupy_stream``).

        Args:
            cooperative: launch so that every block of the grid is resident at once (the kernel's
                blocks wait for each other): CUDA ``cuLaunchCooperativeKernel`` (CuPy's
                ``cupy.cuda.driver.launchCooperativeKernel``, which unlike ``RawKernel``'s
                ``enable_cooperative_groups`` takes a 2-D grid as it is and queries no occupancy
                per launch), HIP ``hipModuleLaunchCooperativeKernel`` through ctypes (CuPy-ROCm's
                binding of the driver call is a stub that returns ``hipErrorUnknown``,
                cupy_backends/hip/cupy_hip.h). The device starts such a grid only once all its
                blocks fit beside whatever else runs (measured on the H200:
                ``tools/residency_probe.py``), and a graph captures it like any launch.

        Raises:
            CooperativeLaunchTooLarge: the runtime refused a cooperative grid as larger than the
                device holds at once (by its occupancy estimate, which may differ from
                ``epgen.codegen.occupancy``'s); the op then launches the kernel's halves.
            HipError: another failure of the cooperative launch on ROCm; CUDA raises CuPy's
                ``CUDADriverError`` likewise.
        """
        import cupy

        from epgen.device import cupy_stream

        with self.use_device(device.index):
            stream = cupy_stream(device)
            if not cooperative:
                fn(grid, block, (cupy.cuda.function.CPointer(args_address),), stream=stream)
                return
            params = (ctypes.c_void_p * 1)(args_address)  # void* kernelParams[]: the struct's address
            too_large = f"cooperative grid {grid[0]}x{grid[1]}x{grid[2]} of {block[0]}x{block[1]}x{block[2]} threads"
            if self.rocm:
                status = self._hip_library().hipModuleLaunchCooperativeKernel(
                    ctypes.c_void_p(fn.kernel.ptr), *grid, *block, 0, ctypes.c_void_p(stream.ptr), params)
                if status == HIP_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
                    raise CooperativeLaunchTooLarge(f"{too_large} refused by the HIP runtime "
                                                    f"(hipErrorCooperativeLaunchTooLarge, {status})")
                self._check("hipModuleLaunchCooperativeKernel", status)
            else:
                try:
                    cupy.cuda.driver.launchCooperativeKernel(fn.kernel.ptr, *grid, *block, 0, stream.ptr,
                                                             ctypes.addressof(params))
                except RuntimeError as e:  # CuPy's CUDADriverError, whose status is the CUresult
                    if getattr(e, "status", None) != CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
                        raise
                    raise CooperativeLaunchTooLarge(f"{too_large} refused by the CUDA driver ({e})") from e

    # ---- HIP through ctypes ------------------------------------------------------------------
    def _hip_library(self):
        if self._hip is None:
            hip = _load_first(HIP_LIBRARIES)
            # hip/hip_runtime_api.h: hipError_t hipExtMallocWithFlags(void** ptr, size_t sizeBytes,
            # unsigned int flags); hipError_t hipFree(void* ptr); const char* hipGetErrorString(hipError_t).
            hip.hipExtMallocWithFlags.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
            hip.hipExtMallocWithFlags.restype = ctypes.c_int
            hip.hipFree.argtypes = (ctypes.c_void_p,)
            hip.hipFree.restype = ctypes.c_int
            hip.hipGetErrorString.argtypes = (ctypes.c_int,)
            hip.hipGetErrorString.restype = ctypes.c_char_p
            # hipError_t hipModuleLaunchCooperativeKernel(hipFunction_t f, unsigned int gridDimX, gridDimY,
            # gridDimZ, blockDimX, blockDimY, blockDimZ, unsigned int sharedMemBytes, hipStream_t stream,
            # void** kernelParams)
            hip.hipModuleLaunchCooperativeKernel.argtypes = (ctypes.c_void_p,) + (ctypes.c_uint,) * 7 + (
                ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
            hip.hipModuleLaunchCooperativeKernel.restype = ctypes.c_int
            self._hip = hip
        return self._hip

    def _check(self, call: str, status: int) -> None:
        if status != HIP_SUCCESS:
            text = self._hip_library().hipGetErrorString(status)
            raise HipError(f"{call} returned hipError_t {status} "
                           f"({text.decode(errors='replace') if text else 'no description'})")


def _load_first(names: tuple[str, ...]) -> ctypes.CDLL:
    """The first of ``names`` that ``ctypes.CDLL`` loads.

    Raises:
        OSError: none loads (naming each with its loader error).
    """
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise OSError(f"the HIP runtime library could not be loaded ({'; '.join(errors)}); ROCm's lib directory "
                  "must be on the loader path (LD_LIBRARY_PATH or ldconfig)")
