"""Compile a rendered kernel source without a GPU and report the resources its entry uses.

One offline toolchain per vendor, chosen by ``traits(arch).vendor`` in ``_TOOLCHAINS`` (the
only place that looks at the vendor):

* ``amd`` (``clang_amd``): clang 22 from the ``ziglang`` PyPI package; the resources come from
  the AMDGPU metadata of the assembly, the code object is that assembly linked by ``ld.lld``.
* ``nvidia`` (``nvrtc``): NVRTC through ``cuda-bindings`` plus ``nvidia-cuda-nvrtc``; the
  resources come from ptxas's ``-v`` report, the code object is the CUBIN.

Both compile with the runtime's options (``RUNTIME_OPTIONS`` plus what CuPy appends,
``RUNTIME_ADDED_OPTIONS``), so that the report describes the code the runtime builds.
``compile_code_object`` also keeps the loadable code object, which ``epgen build`` writes into
the ahead-of-time cache under ``code_object_key`` (text, options and ``compiler_identity``);
``code_object_problem`` (``elf``) checks one before it is cached or loaded; an AMD one must be
code object version ``clang_amd.CODE_OBJECT_VERSION``. ``compile_as_hiprtc`` compiles an AMD source
as CuPy-ROCm's hiprtc would (its default options first, the HIP runtime predefined);
``compile_assembly`` returns an AMD compile's assembly with its resources.

Sources must be self-contained: no GPU runtime headers are on the include path.
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import attrs

from epgen.codegen.arch import traits
from epgen.codegen.offline import clang_amd, elf, nvrtc
from epgen.codegen.offline.results import CompileError, Resources, ToolchainMissing
from epgen.codegen.spec import sha256_key

__all__ = [
    "RUNTIME_ADDED_OPTIONS", "CodeObject", "CompileError", "Resources", "ToolchainMissing", "code_object_key",
    "code_object_options", "code_object_problem", "compile_as_hiprtc", "compile_assembly", "compile_code_object", "compile_many",
    "compile_offline", "compile_options", "compiler_identity", "toolchain_status",
]

_TOOLCHAINS = {"amd": clang_amd, "nvidia": nvrtc}
"""Vendor (``ArchTraits.vendor``) -> its toolchain module: ``status``, ``identity``,
``compile_options``, ``code_object_options``, ``compile_kernel``, ``ELF``, ``RUNTIME_ADDED_OPTIONS``."""

_PACKAGES = {"amd": clang_amd.PACKAGE, "nvidia": nvrtc.PACKAGES}
"""Vendor -> the pip package(s) of its toolchain, as pyproject.toml's dev extra pins them."""

RUNTIME_ADDED_OPTIONS = {vendor: tc.RUNTIME_ADDED_OPTIONS for vendor, tc in _TOOLCHAINS.items()}
"""Options CuPy appends to every runtime compile, per vendor (cupy/cuda/compiler.py:
``-ftz=true`` always and ``--device-as-default-execution-space`` with NVRTC >= 12;
``-fcuda-flush-denormals-to-zero`` for hiprtc). The offline compiles pass them too."""


def _toolchain(arch: str):
    """The toolchain module of ``arch``'s vendor; ValueError for an unknown ``arch`` or a vendor
    without a toolchain."""
    vendor = traits(arch).vendor
    try:
        return _TOOLCHAINS[vendor]
    except KeyError:
        raise ValueError(f"vendor={vendor!r} (arch {arch!r}): no offline toolchain; known: {', '.join(_TOOLCHAINS)}") from None


def toolchain_status(arch: str) -> str | None:
    """Say whether the offline compiler for ``arch`` is usable: installed, and it reports its
    release (``compiler_identity``; e.g. a broken ``ziglang`` whose ``clang --version`` fails
    counts as missing).

    Returns:
        None when usable, else a one-line reason naming the pip package(s) to install.

    Raises:
        ValueError: ``arch`` is not a known target.
    """
    reason = _toolchain(arch).status()
    if reason is None:
        try:
            _vendor_identity(traits(arch).vendor)
        except (ToolchainMissing, RuntimeError) as exc:
            return f"offline compiler unusable ({exc}): pip install --force-reinstall {_PACKAGES[traits(arch).vendor]}"
    return reason


def compile_options(arch: str) -> tuple[str, ...]:
    """Options of the offline compile for ``arch``: the runtime's (``RUNTIME_OPTIONS`` and
    ``RUNTIME_ADDED_OPTIONS``), the target, and the toolchain's own (clang: HIP device code
    only, no GPU libraries or headers, -O3, code object
    ``clang_amd.CODE_OBJECT_VERSION``; NVRTC: ptxas -v, which only adds the resource lines
    to the log).

    Raises:
        ValueError: ``arch`` is not a known target.
    """
    return _toolchain(arch).compile_options(traits(arch))


def code_object_options(arch: str) -> tuple[str, ...]:
    """Every option that shapes ``arch``'s code object: ``compile_options`` and, on AMD, the
    assemble and link steps (NVRTC writes the CUBIN itself). Part of ``code_object_key``."""
    return _toolchain(arch).code_object_options(traits(arch))


def compiler_identity(arch: str) -> str:
    """Name and exact release of the offline compiler of ``arch``'s vendor, as the compile checks
    and code objects use it, e.g. ``clang version 22.1.8 (ziglang 0.17.1)`` (``clang --version``
    and the package) or ``nvrtc 13.0: ...; Cuda compilation tools, release 13.0, V13.0.88; ...``
    (``nvrtcVersion`` and the banner of an empty program's PTX, which is what CuPy keys its own
    cache on: the version call alone cannot tell patch releases apart). Computed once per
    process and vendor (about 20 to 50 ms).

    Raises:
        ValueError: ``arch`` is not a known target.
        ToolchainMissing: the compiler is not installed.
    """
    _require_toolchain(arch)
    return _vendor_identity(traits(arch).vendor)


@functools.lru_cache(maxsize=None)
def _vendor_identity(vendor: str) -> str:
    return _TOOLCHAINS[vendor].identity()


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
    resources, image = _toolchain(arch).compile_kernel(text, traits(arch), entry, True)
    seconds = time.perf_counter() - start
    problem = code_object_problem(image, arch)
    if problem is not None:
        raise CompileError(arch, entry, "", f"the compiler wrote an unusable code object: {problem}")
    return CodeObject(resources=resources, image=image, key=code_object_key(text, arch),
                      compiler=compiler_identity(arch), options=code_object_options(arch), compile_s=seconds)


def code_object_problem(image: bytes, arch: str) -> str | None:
    """Why ``image`` is not a complete code object for ``arch``, or None when it is.

    Checks the ELF header (64-bit little-endian, the vendor's ``e_machine``, the arch's target
    number in ``e_flags``: ``ArchTraits.elf_mach``) and that the program and section header
    tables and every section lie inside ``image``, which catches a truncated file. It does not
    checksum the contents: the driver's own load is the last check.

    Raises:
        ValueError: ``arch`` is not a known target.
    """
    return elf.problem(image, arch, traits(arch).elf_mach, _toolchain(arch).ELF)


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
    return _toolchain(arch).compile_kernel(text, traits(arch), entry, False)[0]


def compile_assembly(text: str, arch: str, entry: str) -> tuple[Resources, str]:
    """Compile AMD kernel source ``text`` for ``arch`` as ``compile_offline`` does and return
    ``entry``'s resources with the assembly they are read from (one clang run for both).

    Raises:
        ValueError: ``arch`` is not a known AMD target.
        ToolchainMissing: clang is not installed.
        CompileError: clang rejected ``text``, or ``entry`` is not a kernel in its output.
    """
    t = _amd_traits(arch, "compile_assembly")
    _require_toolchain(arch)
    return clang_amd.compile_assembly(text, t, entry)


def _amd_traits(arch: str, name: str):
    t = traits(arch)
    if t.vendor != "amd":
        raise ValueError(f"arch={arch!r}: {name} needs an AMD target (vendor 'amd'), not {t.vendor!r}")
    return t


def compile_as_hiprtc(text: str, arch: str, entry: str) -> Resources:
    """Compile AMD kernel source ``text`` for ``arch`` as CuPy-ROCm's hiprtc would and report
    ``entry``'s resources: hiprtc's defaults (``clang_amd.HIPRTC_DEFAULTS``) before the runtime's
    options, ``__HIPCC_RTC__`` and the HIP runtime headers included first
    (``clang_amd.hiprtc_options``), to assembly. A source that defines what the HIP runtime
    defines fails here although ``compile_offline`` accepts it. Usable as ``compile_many``'s
    ``compile_fn``.

    Raises:
        ValueError: ``arch`` is not a known AMD target.
        ToolchainMissing: clang is not installed, or no HIP runtime headers were found
            (``clang_amd.hip_runtime_headers``: ``$EPGEN_HIP_INCLUDE``, ``/opt/rocm/include``,
            ``shared/vendor/hip-headers`` beside the checkout).
        CompileError: clang rejected ``text``, or ``entry`` is not a kernel in its output.
    """
    t = _amd_traits(arch, "compile_as_hiprtc")
    _require_toolchain(arch)
    return clang_amd.compile_as_hiprtc(text, t, entry)


def _require_toolchain(arch: str) -> None:
    missing = toolchain_status(arch)
    if missing is not None:
        raise ToolchainMissing(missing)


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
