"""Occupancy from the arch traits (``codegen/arch.py``) and a kernel's resources.

One formula serves the offline resource report (resources read from the compiler's output) and
the op at runtime (resources read from the loaded kernel's attributes), so no GPU runtime's
occupancy API is needed: CuPy's HIP backend stubs ``cuOccupancyMaxActiveBlocksPerMultiprocessor``
to return ``hipErrorUnknown`` (``cupy_backends/hip/cupy_hip.h``).

* AMD: a block of ``w`` waves puts ``ceil(w / simds_per_cu)`` waves on each SIMD; the VGPR file
  allows ``registers_per_simd // roundup(vgprs + agprs, register_granule)`` waves per SIMD (at
  most ``max_waves_per_simd``); LDS allows ``shared_bytes_per_cu // lds`` blocks per CU. SGPRs do
  not limit occupancy on these targets. Reported as waves per SIMD.
* NVIDIA: blocks per SM, limited by threads (``max_waves_per_simd`` warps per SM), registers
  (``roundup(regs * 32, register_granule)`` per warp, allocated in each of the SM's
  ``simds_per_cu`` sub-partitions out of its share of ``registers_per_simd``: with 96 registers
  a 1-warp block fits 4 x 5 = 20 times, not 65536 / 3072 = 21, as the driver says), shared
  memory (``shared_bytes_per_cu // (roundup(smem, 128) + shared_reserved_per_block)``) and
  ``max_blocks_per_cu`` (the CUDA occupancy calculator's rules). On the H200 a GPU test checks
  this against the driver's ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` for every variant the
  op builds (tests/gpu/test_op.py).
"""

from __future__ import annotations

from epgen.codegen.arch import ArchTraits, traits
from epgen.codegen.offline import Resources
from epgen.codegen.spec import KernelSpec


def _roundup(n: int, k: int) -> int:
    return -(-n // k) * k


def _amd_blocks(t: ArchTraits, warps_per_block: int, registers: int, shared_bytes: int, agprs: int) -> int:
    per_simd = -(-warps_per_block // t.simds_per_cu)
    vgprs = _roundup(max(registers + agprs, 1), t.register_granule)
    by_vgpr = min(t.max_waves_per_simd, t.registers_per_simd // vgprs) // per_simd
    by_lds = t.shared_bytes_per_cu // shared_bytes if shared_bytes else t.max_blocks_per_cu
    return min(by_vgpr, by_lds, t.max_blocks_per_cu)


def _nvidia_blocks(t: ArchTraits, warps_per_block: int, registers: int, shared_bytes: int, agprs: int) -> int:
    per_warp = _roundup(max(registers, 1) * t.wave_size, t.register_granule)
    # each sub-partition holds the warps its share of the register file allows
    by_regs = t.simds_per_cu * (t.registers_per_simd // t.simds_per_cu // per_warp) // warps_per_block
    by_threads = t.max_waves_per_simd // warps_per_block
    by_smem = t.shared_bytes_per_cu // (_roundup(shared_bytes, 128) + t.shared_reserved_per_block)
    return min(by_regs, by_threads, by_smem, t.max_blocks_per_cu)


RULES = {
    "amd": (_amd_blocks, lambda t, warps_per_block: -(-warps_per_block // t.simds_per_cu), "waves/SIMD"),
    "nvidia": (_nvidia_blocks, lambda t, warps_per_block: 1, "blocks/SM"),
}
"""Vendor (``ArchTraits.vendor``) -> (its resident-blocks rule, the report's figure per resident
block, the figure's unit)."""


def _rule(t: ArchTraits):
    try:
        return RULES[t.vendor]
    except KeyError:
        raise ValueError(f"vendor={t.vendor!r} (arch {t.name!r}): no occupancy rule; known: {', '.join(RULES)}") from None


def resident_blocks(arch: str, warps_per_block: int, registers: int, shared_bytes: int, agprs: int = 0) -> int:
    """Blocks of one kernel a CU (AMD) or SM (NVIDIA) holds at once.

    Args:
        arch: target name (a key of ``ARCH_TRAITS``).
        warps_per_block: waves/warps per block.
        registers: AMD: architectural VGPRs per lane; NVIDIA: 32-bit registers per thread.
        shared_bytes: static LDS / shared memory per block, bytes (no dynamic shared memory).
        agprs: AMD accumulation VGPRs per lane (0 where the target has none).

    Raises:
        ValueError: unknown arch, or an arch whose vendor has no rule in ``RULES``.
    """
    t = traits(arch)
    return _rule(t)[0](t, warps_per_block, registers, shared_bytes, agprs)


def occupancy(spec: KernelSpec, res: Resources) -> tuple[int, str]:
    """(value, unit) of the resource report: waves per SIMD on AMD, blocks per SM on NVIDIA."""
    t = traits(spec.arch)
    blocks = resident_blocks(spec.arch, spec.warps_per_block, res.registers, res.shared_bytes, res.agprs or 0)
    _, per_block, unit = _rule(t)
    return blocks * per_block(t, spec.warps_per_block), unit
