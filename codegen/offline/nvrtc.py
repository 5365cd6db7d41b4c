"""The NVIDIA offline toolchain: NVRTC through ``cuda.bindings.nvrtc`` (``cuda-bindings`` plus the
``nvidia-cuda-nvrtc`` library).

It compiles in memory with ``--ptxas-options=-v``, so that the program log carries ptxas's
per-function ``Used N registers`` / ``bytes smem`` / ``bytes stack frame`` / ``bytes spill
stores`` / ``bytes spill loads`` lines; the code object is NVRTC's CUBIN. ``cuda.bindings`` is
imported when a function here is first called, not with the module.
"""

from __future__ import annotations

import re

from epgen.codegen.arch import ArchTraits
from epgen.codegen.offline import elf
from epgen.codegen.offline.results import CompileError, Resources
from epgen.codegen.render import RUNTIME_OPTIONS

PACKAGES = "'cuda-bindings>=13,<14' 'nvidia-cuda-nvrtc==13.0.88'"  # as pyproject.toml's dev extra pins them
RUNTIME_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
"""What CuPy appends to every NVRTC compile (cupy/cuda/compiler.py: ``-ftz=true`` always,
``--device-as-default-execution-space`` with NVRTC >= 12)."""
ELF = elf.CUDA

_SOURCE_STEM = "kernel"


def status() -> str | None:
    """None when NVRTC loads and answers ``nvrtcVersion``, else the reason and the pip packages."""
    try:
        from cuda.bindings import nvrtc

        _check(nvrtc.nvrtcVersion()[0], "nvrtcVersion")
    except (ImportError, RuntimeError) as exc:
        return f"NVRTC unusable ({type(exc).__name__}: {exc}): pip install {PACKAGES}"
    return None


def identity() -> str:
    """``nvrtcVersion`` and the banner of an empty program's PTX, e.g. ``nvrtc 13.0: ...;
    Compiler Build ID: CL-36424714; Cuda compilation tools, release 13.0, V13.0.88; ...``: the
    banner is what CuPy keys its own cache on, the version call alone cannot tell patch releases
    apart.

    Raises:
        RuntimeError: an NVRTC call failed.
    """
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    _, ptx = _nvrtc_compile("", (), "PTX")
    banner = [ln.lstrip("/ ").strip() for ln in ptx.decode(errors="replace").splitlines() if ln.startswith("//")]
    return f"nvrtc {major}.{minor}: " + "; ".join(b for b in banner if b)


def compile_options(t: ArchTraits) -> tuple[str, ...]:
    """The target, the runtime's options and ptxas -v, which only adds the resource lines to the log."""
    return (f"--gpu-architecture={t.offload_arch}", *RUNTIME_OPTIONS, *RUNTIME_ADDED_OPTIONS,
            "--ptxas-options=-v")


def code_object_options(t: ArchTraits) -> tuple[str, ...]:
    """``compile_options``: NVRTC writes the CUBIN itself."""
    return compile_options(t)


def compile_kernel(text: str, t: ArchTraits, entry: str, code_object: bool) -> tuple[Resources | None, bytes]:
    """Compile ``text`` to a CUBIN and read ``entry``'s resources from the ptxas report.

    Returns:
        The resources and the CUBIN; with ``code_object``, the resources are None when NVRTC
        printed no report (it reuses its ptxas result for a program it already compiled in this
        process) but the CUBIN holds the entry.

    Raises:
        CompileError: NVRTC rejected ``text``, wrote an empty CUBIN, or ``entry`` is not in its
            report.
        RuntimeError: an NVRTC API call other than the compile itself failed.
    """
    arch = t.name
    log, cubin = _nvrtc_compile(text, compile_options(t), "CUBIN", arch, entry)
    if not cubin:
        raise CompileError(arch, entry, log, "NVRTC produced an empty CUBIN")
    try:
        return _parse_ptxas(log, arch, entry, t.wave_size), cubin
    except CompileError:
        # NVRTC 13.0 reuses its ptxas result for a program it already compiled in this process and
        # then prints no -v report: a code object needs none, only its entry symbol.
        if code_object and b"\0" + entry.encode() + b"\0" in cubin:
            return None, cubin
        raise


def _check(result: object, call: str) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {result!r}")


def _out_buffer(size: int) -> bytearray:
    """A fresh zeroed buffer of ``size`` bytes (at least one) for an NVRTC call to write into
    (``char *`` in cuda-bindings, which takes a bytearray as well as bytes).

    Never a bytes object such as ``b" " * size``: bytes are immutable and CPython shares some of
    them (``b" " * 1`` is the one-byte ``b" "`` of the whole process), so NVRTC writing the
    terminating zero of an empty log into it turned every ``b" "`` of the process into ``b"\\0"``.
    At least one byte, because an empty bytearray's storage is a static CPython shares too.
    """
    return bytearray(max(size, 1))


def _nvrtc_compile(text: str, options: tuple[str, ...], output: str, arch: str = "",
                   entry: str = "") -> tuple[str, bytes]:
    """Compile ``text`` in memory with NVRTC; return the program log and the ``output``
    (``"CUBIN"`` or ``"PTX"``) image.

    Raises:
        CompileError: NVRTC rejected the source (``arch`` and ``entry`` only label the error).
        RuntimeError: an NVRTC API call other than the compile itself failed.
    """
    from cuda.bindings import nvrtc

    opts = list(options)
    source_name = f"{_SOURCE_STEM}.cu".encode()
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), source_name, 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (compiled,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(err, "nvrtcGetProgramLogSize")
        log_buf = _out_buffer(size)
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log_buf)
        _check(err, "nvrtcGetProgramLog")
        log = bytes(log_buf[:size]).rstrip(b"\0").decode(errors="replace")
        if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(arch, entry, log)
        err, size = getattr(nvrtc, f"nvrtcGet{output}Size")(prog)
        _check(err, f"nvrtcGet{output}Size")
        image_buf = _out_buffer(size)
        (err,) = getattr(nvrtc, f"nvrtcGet{output}")(prog, image_buf)
        _check(err, f"nvrtcGet{output}")
        image = bytes(image_buf[:size])
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return log, image


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
