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

Both compile with the runtime's options (``RUNTIME_OPTIONS`` plus what CuPy appends,
``RUNTIME_ADDED_OPTIONS``), so that the report describes the code the runtime builds.
``compile_code_object`` also keeps the loadable code object: NVRTC's CUBIN, or for AMD the
assembly assembled by the same clang and linked by its ``ld.lld`` into an ELF shared object
(``.hsaco``), which ``epgen build`` writes into the ahead-of-time cache under
``code_object_key`` (text, options and ``compiler_identity``).

Sources must be self-contained: no GPU runtime headers are on the include path.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

from epgen.codegen.arch import traits
from epgen.codegen.render import RUNTIME_OPTIONS
from epgen.codegen.spec import sha256_key

_AMD_PACKAGE = "ziglang==0.17.1"
_NVIDIA_PACKAGES = "'cuda-bindings>=13' 'nvidia-cuda-nvrtc==13.5.37'"  # as pyproject.toml's dev extra pins them
_SOURCE_STEM = "kernel"
_ERROR_LINES = 5
_CLANG = (sys.executable, "-m", "ziglang", "clang")
_LLD = (sys.executable, "-m", "ziglang", "ld.lld")

RUNTIME_ADDED_OPTIONS = {
    "nvidia": ("-ftz=true", "--device-as-default-execution-space"),
    "amd": ("-fcuda-flush-denormals-to-zero",),
}
"""Options CuPy appends to every runtime compile, per vendor (cupy/cuda/compiler.py:
``-ftz=true`` always and ``--device-as-default-execution-space`` with NVRTC >= 12;
``-fcuda-flush-denormals-to-zero`` for hiprtc). The offline compiles pass them too."""


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


def compile_options(arch: str) -> tuple[str, ...]:
    """Options of the offline compile for ``arch``: the runtime's (``RUNTIME_OPTIONS`` and
    ``RUNTIME_ADDED_OPTIONS``), the target, and the toolchain's own (clang: HIP device code
    only, no GPU libraries or headers, -O3; NVRTC: ptxas -v, which only adds the resource lines
    to the log).

    Raises:
        ValueError: ``arch`` is not a known target.
    """
    t = traits(arch)
    if t.vendor == "amd":
        return ("-x", "hip", *RUNTIME_OPTIONS, *RUNTIME_ADDED_OPTIONS["amd"], "--cuda-device-only", "-nogpulib",
                "-nogpuinc", f"--offload-arch={t.offload_arch}", "-O3")
    return (f"--gpu-architecture={t.offload_arch}", *RUNTIME_OPTIONS, *RUNTIME_ADDED_OPTIONS["nvidia"],
            "--ptxas-options=-v")


def _amd_link_steps(arch: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Arguments of clang assembling the compiled assembly and of ld.lld linking the object."""
    return ("--target=amdgcn-amd-amdhsa", f"-mcpu={traits(arch).offload_arch}", "-c"), ("-shared", "--no-undefined")


def code_object_options(arch: str) -> tuple[str, ...]:
    """Every option that shapes ``arch``'s code object: ``compile_options`` and, on AMD, the
    assemble and link steps (NVRTC writes the CUBIN itself). Part of ``code_object_key``."""
    if traits(arch).vendor == "amd":
        assemble, link = _amd_link_steps(arch)
        return (*compile_options(arch), "assemble:", *assemble, "link:", *link)
    return compile_options(arch)


def compiler_identity(arch: str) -> str:
    """Name and exact release of the offline compiler of ``arch``'s vendor, e.g.
    ``clang version 22.1.8 (ziglang 0.17.1)`` (``clang --version`` and the package) or
    ``nvrtc 13.5: ...; Compiler Build ID: CL-39125733; Cuda compilation tools, release 13.5,
    V13.5.37; ...`` (``nvrtcVersion`` and the banner of an empty program's PTX, which is what
    CuPy keys its own cache on: the version call alone cannot tell patch releases apart).
    Computed once per process and vendor (about 20 to 50 ms).

    Raises:
        ValueError: ``arch`` is not a known target.
        ToolchainMissing: the compiler is not installed.
    """
    _require_toolchain(arch)
    return _vendor_identity(traits(arch).vendor)


@functools.lru_cache(maxsize=None)
def _vendor_identity(vendor: str) -> str:
    if vendor == "amd":
        proc = subprocess.run([*_CLANG, "--version"], capture_output=True, text=True, check=False)
        lines = proc.stdout.splitlines()
        if proc.returncode != 0 or not lines:
            raise ToolchainMissing(f"clang --version failed ({proc.returncode}): {proc.stderr.strip()[:200]}")
        return f"{lines[0].strip()} (ziglang {importlib.metadata.version('ziglang')})"
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    _, ptx = _nvrtc_compile("", (), "PTX")
    banner = [ln.lstrip("/ ").strip() for ln in ptx.decode(errors="replace").splitlines() if ln.startswith("//")]
    return f"nvrtc {major}.{minor}: " + "; ".join(b for b in banner if b)


def code_object_key(text: str, arch: str) -> str:
    """The identity of ``text``'s code object for ``arch``: sha256 of the text, every option
    that shapes it (``code_object_options``) and the compiler (``compiler_identity``), so a
    different compiler release or option is another key (a cache miss), never a stale binary.

    Raises:
        ValueError: ``arch`` is not a known target.
        ToolchainMissing: the compiler is not installed (its identity is part of the key).
    """
    return sha256_key(text, (*code_object_options(arch), f"compiler={compiler_identity(arch)}"))


@attrs.frozen
class CodeObject:
    """A kernel compiled into what the GPU driver loads: an AMD code object (an ELF shared
    object, ``.hsaco``) or an NVIDIA CUBIN (``.cubin``).

    Attributes:
        resources: the entry's ``Resources``, as ``compile_offline`` reports them; None when the
            compiler printed no report (NVRTC reusing its own result within one process).
        image: the code object's bytes.
        key: ``code_object_key`` of the source (the file name in the ahead-of-time cache).
        compiler: ``compiler_identity`` of the arch.
        options: ``code_object_options`` of the arch.
        compile_s: wall seconds the compile took here (every tool invocation of it).
    """

    resources: Resources | None
    image: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    key: str
    compiler: str
    options: tuple[str, ...]
    compile_s: float


def compile_code_object(text: str, arch: str, entry: str) -> CodeObject:
    """Compile ``text`` for ``arch`` into a loadable code object; as ``compile_offline``, plus
    the image, its key and the compile time.

    Raises:
        ValueError: ``arch`` is not a known target.
        ToolchainMissing: the compiler for the arch's vendor is not installed.
        CompileError: the compiler rejected ``text``, ``entry`` is not a kernel in its output,
            or the image it wrote is not a complete code object for ``arch``.
    """
    _require_toolchain(arch)
    start = time.perf_counter()
    resources, image = _compile(text, arch, entry, code_object=True)
    seconds = time.perf_counter() - start
    problem = code_object_problem(image, arch)
    if problem is not None:
        raise CompileError(arch, entry, "", f"the compiler wrote an unusable code object: {problem}")
    return CodeObject(resources=resources, image=image, key=code_object_key(text, arch),
                      compiler=compiler_identity(arch), options=code_object_options(arch), compile_s=seconds)


_ELF_MACHINE = {"amd": (224, "EM_AMDGPU"), "nvidia": (190, "EM_CUDA")}
_ELFABIVERSION_CUDA_V1 = 7  # CUBINs of this ELF ABI keep the SM in the low byte of e_flags
_SHT_NOBITS = 8


def code_object_problem(image: bytes, arch: str) -> str | None:
    """Why ``image`` is not a complete code object for ``arch``, or None when it is.

    Checks the ELF header (64-bit little-endian, the vendor's ``e_machine``, the arch's target
    number in ``e_flags``: ``ArchTraits.elf_mach``) and that the program and section header
    tables and every section lie inside ``image``, which catches a truncated file. It does not
    checksum the contents: the driver's own load is the last check.

    Raises:
        ValueError: ``arch`` is not a known target.
    """
    t = traits(arch)
    if len(image) < 64 or image[:4] != b"\x7fELF":
        return f"not an ELF file ({len(image)} bytes)"
    if image[4] != 2 or image[5] != 1:
        return "not a 64-bit little-endian ELF file"
    (machine,) = struct.unpack_from("<H", image, 18)
    expected, name = _ELF_MACHINE[t.vendor]
    if machine != expected:
        return f"ELF machine {machine}, not {arch}'s {expected} ({name})"
    phoff, shoff, flags = struct.unpack_from("<QQI", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 54)
    legacy_byte = t.vendor == "amd" or image[8] == _ELFABIVERSION_CUDA_V1
    mach = flags & 0xFF if legacy_byte else (flags >> 8) & 0xFF
    if mach != t.elf_mach:
        return f"built for ELF target {mach:#x}, not {arch} ({t.elf_mach:#x})"
    tables_end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    if tables_end > len(image):
        return f"truncated: {len(image)} bytes, but its header tables end at byte {tables_end}"
    for i in range(shnum):
        (kind,) = struct.unpack_from("<I", image, shoff + i * shentsize + 4)
        offset, size = struct.unpack_from("<QQ", image, shoff + i * shentsize + 24)
        if kind != _SHT_NOBITS and offset + size > len(image):
            return f"truncated: {len(image)} bytes, but section {i} ends at byte {offset + size}"
    return None


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
    _require_toolchain(arch)
    return _compile(text, arch, entry, code_object=False)[0]


def _require_toolchain(arch: str) -> None:
    missing = toolchain_status(arch)
    if missing is not None:
        raise ToolchainMissing(missing)


def _compile(text: str, arch: str, entry: str, code_object: bool) -> tuple[Resources, bytes | None]:
    if traits(arch).vendor == "amd":
        return _compile_amd(text, arch, entry, code_object)
    return _compile_nvidia(text, arch, entry, code_object)


def compile_many(
    jobs: list[tuple[str, str, str]], max_workers: int | None = None, on_done=None, compile_fn=compile_offline
) -> list:
    """Compile ``(text, arch, entry)`` jobs in parallel threads.

    Args:
        jobs: ``(text, arch, entry)`` triples as taken by ``compile_offline``.
        max_workers: thread count; None means ``os.cpu_count()``.
        on_done: called with no arguments after each job finishes (e.g. to advance a progress bar).
        compile_fn: ``compile_offline`` (resources) or ``compile_code_object`` (code objects).

    Returns:
        One item per job, in input order: what ``compile_fn`` returned, or the ``CompileError``
        it raised.

    Raises:
        ValueError: a job names an unknown arch.
        ToolchainMissing: a job's toolchain is not installed.
    """

    def run(job: tuple[str, str, str]):
        try:
            return compile_fn(*job)
        except CompileError as exc:
            return exc
        finally:
            if on_done is not None:
                on_done()

    with ThreadPoolExecutor(max_workers=max_workers or os.cpu_count()) as pool:
        return list(pool.map(run, jobs))


def _compile_amd(text: str, arch: str, entry: str, code_object: bool) -> tuple[Resources, bytes | None]:
    """Compile to assembly (the resources come from its metadata); with ``code_object``, also
    assemble it and link the object into the loadable ELF shared object."""
    image = None
    with tempfile.TemporaryDirectory(prefix="epgen-offline-") as tmp:
        src = Path(tmp) / f"{_SOURCE_STEM}.hip"
        src.write_text(text)
        asm_name, obj_name, hsaco_name = (f"{_SOURCE_STEM}{s}" for s in (".s", ".o", ".hsaco"))
        steps = [[*_CLANG, *compile_options(arch), "-S", src.name, "-o", asm_name]]
        if code_object:
            assemble, link = _amd_link_steps(arch)
            steps += [[*_CLANG, *assemble, asm_name, "-o", obj_name], [*_LLD, *link, obj_name, "-o", hsaco_name]]
        log = ""
        for cmd in steps:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, check=False)
            log += proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise CompileError(arch, entry, log)
        asm = (Path(tmp) / asm_name).read_text()
        if code_object:
            image = (Path(tmp) / hsaco_name).read_bytes()
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
    ), image


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
        err, size = getattr(nvrtc, f"nvrtcGet{output}Size")(prog)
        _check_nvrtc(err, f"nvrtcGet{output}Size")
        image = b" " * size
        (err,) = getattr(nvrtc, f"nvrtcGet{output}")(prog, image)
        _check_nvrtc(err, f"nvrtcGet{output}")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return log, image


def _compile_nvidia(text: str, arch: str, entry: str, code_object: bool = False) -> tuple[Resources | None, bytes]:
    log, cubin = _nvrtc_compile(text, compile_options(arch), "CUBIN", arch, entry)
    if not cubin:
        raise CompileError(arch, entry, log, "NVRTC produced an empty CUBIN")
    try:
        return _parse_ptxas(log, arch, entry, traits(arch).wave_size), cubin
    except CompileError:
        # NVRTC 13.0 reuses its ptxas result for a program it already compiled in this process and
        # then prints no -v report: a code object needs none, only its entry symbol.
        if code_object and b"\0" + entry.encode() + b"\0" in cubin:
            return None, cubin
        raise


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
