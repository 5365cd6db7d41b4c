"""Compile a rendered kernel source without a GPU and report the resources its entry uses.

Two offline toolchains, chosen by ``traits(arch).vendor``:

* ``amd``: clang 22 from the ``ziglang`` PyPI package, run as
  ``python -m ziglang clang -x hip --cuda-device-only -nogpulib -nogpuinc -S``. The resource
  counts come from the ``amdhsa.kernels`` entry of the AMDGPU metadata block in the assembly
  (``.name``, ``.vgpr_count``, ``.agpr_count`` (only on targets with AGPRs, e.g. gfx950),
  ``.sgpr_count``, ``.private_segment_fixed_size``, ``.group_segment_fixed_size``,
  ``.vgpr_spill_count``, ``.sgpr_spill_count``, ``.wavefront_size``).
* ``nvidia``: NVRTC through ``cuda.bindings.nvrtc`` (``cuda-bindings`` plus the
  ``nvidia-cuda-nvrtc`` library), with ``--ptxas-options=-v`` so that the program log carries
  ptxas's per-function ``Used N registers`` / ``bytes smem`` / ``bytes stack frame`` /
  ``bytes spill stores`` / ``bytes spill loads`` lines. NVRTC compiles in memory, so only
  the AMD path writes files (in a ``tempfile.TemporaryDirectory``).

Sources must be self-contained: no GPU runtime headers are on the include path.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

from epgen.codegen.arch import traits

_AMD_PACKAGE = "ziglang==0.17.1"
_NVIDIA_PACKAGES = "cuda-bindings nvidia-cuda-nvrtc"
_SOURCE_STEM = "kernel"
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


def _amd_status() -> str | None:
    if importlib.util.find_spec("ziglang") is None:
        return f"AMD offline compiler (clang) missing: pip install {_AMD_PACKAGE}"
    return None


def _nvidia_status() -> str | None:
    try:
        from cuda.bindings import nvrtc

        _check_nvrtc(nvrtc.nvrtcVersion()[0], "nvrtcVersion")
    except (ImportError, RuntimeError) as exc:
        return f"NVRTC unusable ({type(exc).__name__}: {exc}): pip install {_NVIDIA_PACKAGES}"
    return None


def toolchain_status(arch: str) -> str | None:
    """Say whether the offline compiler for ``arch`` is usable.

    Returns:
        None when usable, else a one-line reason naming the pip package(s) to install.

    Raises:
        ValueError: ``arch`` is not a known target.
    """
    vendor = traits(arch).vendor
    return _amd_status() if vendor == "amd" else _nvidia_status()


def compile_offline(text: str, arch: str, entry: str) -> Resources:
    """Compile kernel source ``text`` for ``arch`` and report the resources of ``entry``.

    Args:
        text: complete, self-contained HIP (AMD) or CUDA (NVIDIA) source.
        arch: target name, a key of ``ARCH_TRAITS``.
        entry: kernel symbol to report (``extern "C"`` name, or the mangled name otherwise).

    Returns:
        The entry's ``Resources`` (register counts per lane/thread, byte sizes as documented
        there).

    Raises:
        ValueError: ``arch`` is not a known target.
        ToolchainMissing: the compiler for the arch's vendor is not installed.
        CompileError: the compiler rejected ``text``, or ``entry`` is not a kernel in its output.
    """
    t = traits(arch)
    missing = toolchain_status(arch)
    if missing is not None:
        raise ToolchainMissing(missing)
    if t.vendor == "amd":
        return _compile_amd(text, arch, entry)
    return _compile_nvidia(text, arch, entry)


def compile_many(
    jobs: list[tuple[str, str, str]], max_workers: int | None = None, on_done=None
) -> list[Resources | CompileError]:
    """Compile ``(text, arch, entry)`` jobs in parallel threads.

    Args:
        jobs: ``(text, arch, entry)`` triples as taken by ``compile_offline``.
        max_workers: thread count; None means ``os.cpu_count()``.
        on_done: called with no arguments after each job finishes (e.g. to advance a progress bar).

    Returns:
        One item per job, in input order: its ``Resources``, or the ``CompileError`` it raised.

    Raises:
        ValueError: a job names an unknown arch.
        ToolchainMissing: a job's toolchain is not installed.
    """

    def run(job: tuple[str, str, str]) -> Resources | CompileError:
        try:
            return compile_offline(*job)
        except CompileError as exc:
            return exc
        finally:
            if on_done is not None:
                on_done()

    with ThreadPoolExecutor(max_workers=max_workers or os.cpu_count()) as pool:
        return list(pool.map(run, jobs))


def _compile_amd(text: str, arch: str, entry: str) -> Resources:
    t = traits(arch)
    with tempfile.TemporaryDirectory(prefix="epgen-offline-") as tmp:
        src = Path(tmp) / f"{_SOURCE_STEM}.hip"
        src.write_text(text)
        cmd = [
            sys.executable, "-m", "ziglang", "clang", "-x", "hip", "-std=c++17",
            "--cuda-device-only", "-nogpulib", "-nogpuinc", f"--offload-arch={t.offload_arch}",
            "-O3", "-S", src.name, "-o", f"{_SOURCE_STEM}.s",
        ]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(arch, entry, log)
        asm = (Path(tmp) / f"{_SOURCE_STEM}.s").read_text()
    kernels = _amd_metadata_kernels(asm)
    meta = kernels.get(entry)
    if meta is None:
        reason = f"entry not found; kernels compiled: {sorted(kernels)}"
        raise CompileError(arch, entry, log, reason)
    agprs = int(meta[".agpr_count"]) if ".agpr_count" in meta else None
    return Resources(
        arch=arch,
        entry=entry,
        registers=int(meta[".vgpr_count"]) - (agprs or 0),
        agprs=agprs,
        sgprs=int(meta[".sgpr_count"]),
        scratch_bytes=int(meta[".private_segment_fixed_size"]),
        spill_bytes=4 * (int(meta[".vgpr_spill_count"]) + int(meta[".sgpr_spill_count"])),
        shared_bytes=int(meta[".group_segment_fixed_size"]),
        wave_size=int(meta[".wavefront_size"]),
    )


_METADATA_BLOCK = re.compile(
    r"^\s*\.amdgpu_metadata\s*$(.*?)^\s*\.end_amdgpu_metadata", re.M | re.S
)
# Scalar keys of one kernel map: the first key sits after "  - ", the rest at a 4-space indent.
_KERNEL_KEY = re.compile(r"^(  - |    )(\.[a-z_]+):\s*(\S*)\s*$")


def _amd_metadata_kernels(asm: str) -> dict[str, dict[str, str]]:
    """Map kernel ``.name`` to its scalar metadata fields from the ``amdhsa.kernels`` YAML list."""
    block = _METADATA_BLOCK.search(asm)
    if block is None:
        return {}
    kernels: list[dict[str, str]] = []
    in_kernels = False
    for line in block.group(1).splitlines():
        if line and not line.startswith(" "):
            in_kernels = line.startswith("amdhsa.kernels:")
            continue
        m = _KERNEL_KEY.match(line)
        if not in_kernels or m is None:
            continue
        if m.group(1) == "  - ":
            kernels.append({})
        kernels[-1][m.group(2)] = m.group(3)
    return {k[".name"]: k for k in kernels}


def _check_nvrtc(result: object, call: str) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {result!r}")


def _nvrtc_compile(text: str, arch: str, entry: str) -> tuple[str, bytes]:
    """Compile ``text`` in memory with NVRTC; return the program log and the CUBIN image.

    Raises:
        CompileError: NVRTC rejected the source (``entry`` only labels the error).
        RuntimeError: an NVRTC API call other than the compile itself failed.
    """
    from cuda.bindings import nvrtc

    opts = [f"--gpu-architecture={traits(arch).offload_arch}", "-std=c++17", "--ptxas-options=-v"]
    source_name = f"{_SOURCE_STEM}.cu".encode()
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), source_name, 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        (compiled,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check_nvrtc(err, "nvrtcGetProgramLogSize")
        log_buf = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log_buf)
        _check_nvrtc(err, "nvrtcGetProgramLog")
        log = log_buf.rstrip(b"\0").decode(errors="replace")
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(arch, entry, log)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check_nvrtc(err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return log, cubin


def _compile_nvidia(text: str, arch: str, entry: str) -> Resources:
    log, cubin = _nvrtc_compile(text, arch, entry)
    if not cubin:
        raise CompileError(arch, entry, log, "NVRTC produced an empty CUBIN")
    return _parse_ptxas(log, arch, entry, traits(arch).wave_size)


def _parse_ptxas(log: str, arch: str, entry: str, wave_size: int) -> Resources:
    """Read ``entry``'s ptxas ``-v`` lines: its entry section and its function-properties pair."""
    name = re.escape(entry)
    section = re.search(
        rf"Compiling entry function '{name}' for '[^']*'\n(.*?)(?=Compiling entry function|\Z)",
        log,
        re.S,
    )
    props = re.search(
        rf"Function properties for {name}\n\s*ptxas\s+\.\s+(\d+) bytes stack frame, "
        r"(\d+) bytes spill stores, (\d+) bytes spill loads",
        log,
    )
    used = re.search(r"Used (\d+) registers", section.group(1)) if section else None
    if used is None or props is None:
        found = re.findall(r"Compiling entry function '([^']*)'", log)
        raise CompileError(arch, entry, log, f"entry not found; kernels compiled: {sorted(found)}")
    smem = re.search(r"(\d+) bytes smem", section.group(1))
    return Resources(
        arch=arch,
        entry=entry,
        registers=int(used.group(1)),
        agprs=None,
        sgprs=None,
        scratch_bytes=int(props.group(1)),
        spill_bytes=int(props.group(2)) + int(props.group(3)),
        shared_bytes=int(smem.group(1)) if smem else 0,
        wave_size=wave_size,
    )
