"""What an offline compile returns (``Resources``) or raises (``CompileError``, ``ToolchainMissing``),
the same for every toolchain."""

from __future__ import annotations

import attrs

_ERROR_LINES = 5


@attrs.frozen
class Resources:
    """Resources one compiled kernel entry uses.

    Attributes:
        arch: target name (a key of ``ARCH_TRAITS``).
        entry: kernel symbol name as compiled (unmangled for ``extern "C"`` kernels).
        registers: AMD: architectural VGPRs per lane, as allocated (metadata ``.vgpr_count``
            minus ``.agpr_count``; when AGPRs are used this is the accumulation offset, i.e.
            the arch VGPRs rounded up to a multiple of 4). sm_90: 32-bit registers per thread.
        agprs: AMD accumulation VGPRs per lane when the target reports them (gfx950), else None.
        sgprs: AMD scalar registers per wave (including VCC/flat-scratch reserves); None on
            NVIDIA.
        scratch_bytes: private segment (AMD) / stack frame (sm_90) size, bytes per lane/thread.
        spill_bytes: AMD: ``(vgpr_spill_count + sgpr_spill_count) * 4``; sm_90: spill-store
            bytes plus spill-load bytes, per lane/thread.
        shared_bytes: static LDS / shared memory per block, bytes.
        wave_size: lanes per wave/warp the code was compiled for.
    """

    arch: str
    entry: str
    registers: int
    agprs: int | None
    sgprs: int | None
    scratch_bytes: int
    spill_bytes: int
    shared_bytes: int
    wave_size: int

    @property
    def ok(self) -> bool:
        """True when the entry uses no scratch/stack memory and spills nothing."""
        return self.scratch_bytes == 0 and self.spill_bytes == 0


class CompileError(RuntimeError):
    """The offline compiler rejected a source, or its output lacks the requested entry.

    Attributes:
        arch: target name.
        entry: requested kernel entry.
        log: full compiler output (clang stderr or the NVRTC program log).
    """

    def __init__(self, arch: str, entry: str, log: str, reason: str | None = None) -> None:
        self.arch = arch
        self.entry = entry
        self.log = log
        if reason is None:
            lines = [ln for ln in log.splitlines() if "error" in ln.lower()] or log.splitlines()
            reason = "\n".join(lines[:_ERROR_LINES]) or "compiler failed without output"
        super().__init__(f"arch={arch} entry={entry}: {reason}")


class ToolchainMissing(RuntimeError):
    """The offline compiler for an arch is not installed; the message names the pip package."""
