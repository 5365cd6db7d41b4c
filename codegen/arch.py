"""Per-target facts: the one table that says what differs between the arches (one row of
``ARCH_TRAITS`` each).

No other module compares arch names; everything reads a row of ``ARCH_TRAITS``.

Sources: wave sizes and LDS sizes from the AMD CDNA4 ISA guide (gfx950: wave64, 160 KiB LDS per
CU) and the gfx1250 LLVM AMDGPU target notes (wave32, 320 KiB LDS per WGP); sm_90 from the CUDA
C++ Programming Guide, compute capability 9.0 (warp 32, 227 KiB shared memory per block opt-in,
228 KiB per SM, 64 Ki 32-bit registers per SM allocated per warp in units of 256, at most 32
resident blocks and 64 warps per SM, 1 KiB of shared memory reserved per block). AMD occupancy
limits (waves per SIMD: 8 on gfx950, 16 on gfx1250; VGPRs allocated in units of 8; 4 SIMDs per
CU) follow LLVM's AMDGPU subtarget descriptions; gfx1250 figures are from pre-release LLVM and
are leads, not measurements.
The ELF target numbers (``elf_mach``) are LLVM's ``EF_AMDGPU_MACH_AMDGCN_GFX950`` (0x04f) and
``..._GFX1250`` (0x049) and the ``EF_CUDA_SM`` value 90 (llvm/BinaryFormat/ELF.h), as found in
the code objects clang 22 and NVRTC 13.5 write.
gfx942 (MI300X/MI325X, CDNA3): wave64; 64 KiB LDS per CU; 304 CUs on MI300X; 512 unified
VGPRs per SIMD lane, architectural and accumulation registers together, allocated in units of 8,
at most 8 waves per SIMD, 4 SIMDs per CU (AMD's "AMD Instinct MI300 series microarchitecture" page
of the ROCm documentation and the AMD CDNA3 ISA reference guide; LLVM AMDGPUUsage's processor
table lists gfx942 as a wave64 GFX9 target with the unified register file of gfx90a). Its fp8 is
the CDNA3 ISA's e4m3fnuz (``FP8_FLAVOURS``), and its memory model is LLVM AMDGPUUsage's "Memory
Model GFX942" table, the one gfx950 follows, so ``release_needs_explicit_wait`` holds there too.
``EF_AMDGPU_MACH_AMDGCN_GFX942`` is 0x04c (llvm/BinaryFormat/ELF.h; tests/codegen/test_offline.py
reads it from the code objects clang writes).
The AMD steady counter (``s_memrealtime`` / ``__builtin_readsteadycounter``) runs at 100 MHz on
CDNA3/CDNA4 and gfx12 parts (LLVM AMDGPU usage notes); sm_90 reads ``%globaltimer`` in ns.
"""

from __future__ import annotations

import attrs

from epgen.codegen.dtypes import fp8_flavour


@attrs.frozen
class ArchTraits:
    """Facts about one compile target.

    Attributes:
        name: target name as users spell it (``gfx950``, ``gfx1250``, ``sm_90``).
        vendor: ``amd`` or ``nvidia``; selects the platform template.
        wave_size: lanes per wave/warp.
        platform_template: Jinja template with the primitive layer for this vendor.
        suffix: file suffix of generated sources (``.hip`` or ``.cu``).
        code_object_suffix: file suffix of compiled code objects in the ahead-of-time cache
            (``.hsaco`` for AMD code objects, ``.cubin`` for NVIDIA CUBINs).
        elf_mach: the target number an ELF code object for this arch carries in ``e_flags``
            (AMD ``EF_AMDGPU_MACH_*``: 0x04c gfx942, 0x04f gfx950, 0x049 gfx1250; NVIDIA ``EF_CUDA_SM``: 90),
            checked before a cached code object is loaded.
        runtime_compiler: what CuPy uses at runtime (``hiprtc`` or ``nvrtc``).
        offload_arch: the name the compiler takes (``--offload-arch`` / ``--gpu-architecture``).
        vector_bytes: widest global load/store per lane, bytes.
        shared_bytes_per_block: shared memory / LDS a block may use, bytes.
        steady_clock_hz: frequency of the clock the bounded spin-waits read, Hz.
        fp8: the target's fp8 e4m3 flavour, a key of ``epgen.codegen.dtypes.FP8_FLAVOURS``
            (``e4m3fnuz`` on gfx942, ``e4m3fn`` on the others): the torch dtype of fp8
            payloads there (``KernelSpec.dtype_info``) and the numbers its combine wire codec
            prints (``KernelSpec.template_vars``'s ``wire_element``).
        hw_fp8_convert: the combine wire encodes and decodes fp8 e4m3 with the platform's
            ``ep_e4m3x2_hw`` / ``ep_e4m3x2_decode_hw`` (sm_90: ``cvt.rn.satfinite.e4m3x2.f32``,
            ``cvt.rn.f16x2.e4m3x2``); otherwise with the bit-exact software encoder and decoder
            of common/wire/_codec.j2. gfx942, gfx950 and gfx1250
            have converts too, but their rounding and saturation were not verified on hardware
            here, so they take the software path. fp4 is software everywhere (sm_90 has no
            e2m1 convert).
        registers_per_simd: 32-bit registers per SIMD (AMD, per lane) or per SM (NVIDIA).
        max_threads_per_block: hardware limit on threads per block.
        register_granule: allocation unit of registers (AMD: VGPRs per lane; NVIDIA: registers
            per warp).
        max_waves_per_simd: resident waves per SIMD (AMD) / warps per SM (NVIDIA).
        simds_per_cu: SIMDs per CU (AMD; a block's waves spread over them) / SM sub-partitions
            (NVIDIA: each holds its share of the register file, ``registers_per_simd`` the SM's
            whole file; occupancy is counted per SM).
        shared_bytes_per_cu: LDS per CU (AMD) / shared memory per SM (NVIDIA), bytes.
        shared_reserved_per_block: shared memory the runtime reserves per resident block, bytes.
        max_blocks_per_cu: resident blocks per CU/SM.
        compute_units: CUs (AMD) / SMs (NVIDIA) of the target's reference part, which the tuning
            schedule's derived geometries are fractions of (``epgen.codegen.tuning.derived``):
            gfx942 304 (MI300X), gfx950 256 (MI350X and MI355X), sm_90 132 (H100 SXM and H200), all
            from the vendors' specification tables (ROCm "Accelerator and GPU hardware
            specifications"; NVIDIA H100/H200 data sheets); gfx1250 256, a lead, not a published
            count (the most blocks mori's published gfx1250 EP4 tables keep).
        release_needs_explicit_wait: the platform layer follows every system-scope release
            writeback with its own ``s_waitcnt vmcnt(0)`` (and emits a seq_cst fence as a
            release fence, that wait, then an acquire fence) instead of trusting the compiler to
            place it. LLVM's AMDGPU memory model (AMDGPUUsage, "Memory Model GFX942" table, which
            GFX950 follows; rows "store atomic release", "fence release" and "fence acq_rel",
            system scope) requires ``buffer_wbl2 sc0 sc1``, then ``s_waitcnt vmcnt(0)``, then the
            store or ``buffer_inv sc0 sc1``; clang 22.1.8 omits the wait when the wave has
            nothing else in flight (llvm/llvm-project#178316). True on gfx942 and gfx950; False on gfx1250,
            whose ``global_wb scope:SCOPE_SYS`` clang follows with ``s_wait_storecnt 0`` itself
            (its platform branch writes out the other waits of the "Memory Model GFX125x"
            table, before that writeback and after ``global_inv``, which clang 22.1.8 omits;
            tests/codegen/test_amd_assembly.py checks both targets), and on sm_90 (no such layer).
    """

    name: str
    vendor: str
    wave_size: int
    platform_template: str
    suffix: str
    code_object_suffix: str
    elf_mach: int
    runtime_compiler: str
    offload_arch: str
    vector_bytes: int
    shared_bytes_per_block: int
    steady_clock_hz: int
    fp8: str = attrs.field(validator=lambda _inst, _attr, value: fp8_flavour(value))
    hw_fp8_convert: bool
    registers_per_simd: int
    max_threads_per_block: int
    register_granule: int
    max_waves_per_simd: int
    simds_per_cu: int
    shared_bytes_per_cu: int
    shared_reserved_per_block: int
    max_blocks_per_cu: int
    compute_units: int
    release_needs_explicit_wait: bool

    @property
    def clock_ns_per_tick(self) -> int:
        """Nanoseconds per tick of the spin-wait clock (an integer for every row)."""
        return 1_000_000_000 // self.steady_clock_hz


ARCH_TRAITS: dict[str, ArchTraits] = {
    t.name: t
    for t in (
        ArchTraits(
            name="gfx942", vendor="amd", wave_size=64, platform_template="platform/amd.j2",
            suffix=".hip", code_object_suffix=".hsaco", elf_mach=0x04C, runtime_compiler="hiprtc",
            offload_arch="gfx942", vector_bytes=16,
            shared_bytes_per_block=64 * 1024, steady_clock_hz=100_000_000, fp8="e4m3fnuz",
            hw_fp8_convert=False, registers_per_simd=512, max_threads_per_block=1024, register_granule=8, max_waves_per_simd=8,
            simds_per_cu=4, shared_bytes_per_cu=64 * 1024, shared_reserved_per_block=0, max_blocks_per_cu=32,
            compute_units=304, release_needs_explicit_wait=True,
        ),
        ArchTraits(
            name="gfx950", vendor="amd", wave_size=64, platform_template="platform/amd.j2",
            suffix=".hip", code_object_suffix=".hsaco", elf_mach=0x04F, runtime_compiler="hiprtc",
            offload_arch="gfx950", vector_bytes=16,
            shared_bytes_per_block=160 * 1024, steady_clock_hz=100_000_000, fp8="e4m3fn",
            hw_fp8_convert=False, registers_per_simd=512, max_threads_per_block=1024, register_granule=8, max_waves_per_simd=8,
            simds_per_cu=4, shared_bytes_per_cu=160 * 1024, shared_reserved_per_block=0, max_blocks_per_cu=32,
            compute_units=256, release_needs_explicit_wait=True,
        ),
        ArchTraits(
            name="gfx1250", vendor="amd", wave_size=32, platform_template="platform/amd.j2",
            suffix=".hip", code_object_suffix=".hsaco", elf_mach=0x049, runtime_compiler="hiprtc",
            offload_arch="gfx1250", vector_bytes=16,
            shared_bytes_per_block=320 * 1024, steady_clock_hz=100_000_000, fp8="e4m3fn",
            hw_fp8_convert=False, registers_per_simd=1024, max_threads_per_block=1024, register_granule=8, max_waves_per_simd=16,
            simds_per_cu=4, shared_bytes_per_cu=320 * 1024, shared_reserved_per_block=0, max_blocks_per_cu=32,
            compute_units=256, release_needs_explicit_wait=False,
        ),
        ArchTraits(
            name="sm_90", vendor="nvidia", wave_size=32, platform_template="platform/nvidia.j2",
            suffix=".cu", code_object_suffix=".cubin", elf_mach=90, runtime_compiler="nvrtc",
            offload_arch="sm_90", vector_bytes=16,
            shared_bytes_per_block=227 * 1024, steady_clock_hz=1_000_000_000, fp8="e4m3fn",
            hw_fp8_convert=True, registers_per_simd=65536, max_threads_per_block=1024, register_granule=256, max_waves_per_simd=64,
            simds_per_cu=4, shared_bytes_per_cu=228 * 1024, shared_reserved_per_block=1024, max_blocks_per_cu=32,
            compute_units=132, release_needs_explicit_wait=False,
        ),
    )
}

ARCHES: tuple[str, ...] = tuple(ARCH_TRAITS)


def traits(arch: str) -> ArchTraits:
    """Return the traits row of ``arch``.

    Raises:
        ValueError: ``arch`` is not a known target (the message lists the known ones).
    """
    try:
        return ARCH_TRAITS[arch]
    except KeyError:
        raise ValueError(f"arch={arch!r}: unknown target; known: {', '.join(ARCHES)}") from None
