"""The AMD offline toolchain: clang 22 from the ``ziglang`` PyPI package.

It runs as ``python -m ziglang clang -x hip --cuda-device-only -nogpulib -nogpuinc -S``. The
resource counts come from the ``amdhsa.kernels`` entry of the AMDGPU metadata block in the
assembly (``.name``, ``.vgpr_count``, ``.agpr_count`` (only on targets with AGPRs, e.g.
gfx950), ``.sgpr_count``, ``.private_segment_fixed_size``, ``.group_segment_fixed_size``,
``.vgpr_spill_count``, ``.sgpr_spill_count``, ``.wavefront_size``). A code object is that
assembly assembled by the same clang and linked by its ``ld.lld`` into an ELF shared object
(``.hsaco``) of code object version ``CODE_OBJECT_VERSION``. Every step works on files in a
``tempfile.TemporaryDirectory``.

``compile_as_hiprtc`` compiles a source as CuPy-ROCm's hiprtc would (``HIPRTC_DEFAULTS``, then the
runtime's options, under a reproduction of hiprtc's built-in header, ``_PREAMBLE_TEXT``, over the
HIP runtime headers that ``hip_runtime_headers`` finds), which proves that the source defines nothing the predefined
HIP runtime also defines.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from epgen.codegen.arch import ArchTraits
from epgen.codegen.offline import elf
from epgen.codegen.offline.results import CompileError, Resources, ToolchainMissing
from epgen.codegen.render import RUNTIME_OPTIONS

PACKAGE = "ziglang==0.17.1"  # as pyproject.toml's dev extra pins it
RUNTIME_ADDED_OPTIONS = ("-fcuda-flush-denormals-to-zero",)
"""What CuPy appends to every hiprtc compile (cupy/cuda/compiler.py)."""
CODE_OBJECT_VERSION = 5
"""The AMD code object version of every offline compile (``-mcode-object-version``), which
``code_object_problem`` requires of a cached file (its ELF ``EI_ABIVERSION``). clang 22 writes v6
by default (checked: the assembly says ``.amdhsa_code_object_version 6``, the ELF's
``EI_ABIVERSION`` is 4). v6 adds generic targets (``gfx9-4-generic`` ...), which a loader must
know; v5 is the version clang made its default in reviews.llvm.org/D129818, ROCm 6.0 made its
compiler's default (release notes), and the ROCm 6.x and 7.x runtimes load. The kernels'
resource counts are the same with v5 as with v6 (generated/report.csv unchanged)."""
ELF = elf.amdgpu(CODE_OBJECT_VERSION)

_SOURCE_STEM = "kernel"
_CLANG = (sys.executable, "-m", "ziglang", "clang")
_LLD = (sys.executable, "-m", "ziglang", "ld.lld")


def status() -> str | None:
    """None when ``ziglang`` is installed, else the reason and the pip package."""
    if importlib.util.find_spec("ziglang") is None:
        return f"AMD offline compiler (clang) missing: pip install {PACKAGE}"
    return None


def identity() -> str:
    """The first line of ``clang --version`` and the package release, e.g.
    ``clang version 22.1.8 (ziglang 0.17.1)``.

    Raises:
        ToolchainMissing: ``clang --version`` failed.
    """
    proc = subprocess.run([*_CLANG, "--version"], capture_output=True, text=True, check=False)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines:
        raise ToolchainMissing(f"clang --version failed ({proc.returncode}): {proc.stderr.strip()[:200]}")
    return f"{lines[0].strip()} (ziglang {importlib.metadata.version('ziglang')})"


def compile_options(t: ArchTraits) -> tuple[str, ...]:
    """HIP device code only, no GPU libraries or headers, the runtime's options, the target, -O3,
    code object ``CODE_OBJECT_VERSION``."""
    return ("-x", "hip", *RUNTIME_OPTIONS, *RUNTIME_ADDED_OPTIONS, "--cuda-device-only", "-nogpulib",
            "-nogpuinc", f"--offload-arch={t.offload_arch}", "-O3", f"-mcode-object-version={CODE_OBJECT_VERSION}")


def _link_steps(t: ArchTraits) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Arguments of clang assembling the compiled assembly and of ld.lld linking the object."""
    return ("--target=amdgcn-amd-amdhsa", f"-mcpu={t.offload_arch}", "-c"), ("-shared", "--no-undefined")


def code_object_options(t: ArchTraits) -> tuple[str, ...]:
    """``compile_options`` and the assemble and link steps."""
    assemble, link = _link_steps(t)
    return (*compile_options(t), "assemble:", *assemble, "link:", *link)


def compile_kernel(text: str, t: ArchTraits, entry: str, code_object: bool) -> tuple[Resources, bytes | None]:
    """Compile to assembly (the resources come from its metadata); with ``code_object``, also
    assemble it and link the object into the loadable ELF shared object (else the image is None).

    Raises:
        CompileError: a step failed, or ``entry`` is not a kernel of the assembly.
    """
    return _compile(text, t, entry, compile_options(t), code_object)[:2]


def compile_assembly(text: str, t: ArchTraits, entry: str) -> tuple[Resources, str]:
    """``compile_kernel`` without the code object: the resources and the assembly they come from.

    Raises:
        CompileError: clang failed, or ``entry`` is not a kernel of the assembly.
    """
    resources, _, asm = _compile(text, t, entry, compile_options(t), False)
    return resources, asm


def _compile(text: str, t: ArchTraits, entry: str, options: tuple[str, ...], code_object: bool,
             beside: dict[str, str] | None = None) -> tuple[Resources, bytes | None, str]:
    """``compile_kernel`` with the compile step's ``options``, and the assembly; ``beside`` maps
    file names to the texts written next to the source (the compile's working directory)."""
    arch = t.name
    image = None
    with tempfile.TemporaryDirectory(prefix="epgen-offline-") as tmp:
        src = Path(tmp) / f"{_SOURCE_STEM}.hip"
        src.write_text(text)
        for name, content in (beside or {}).items():
            (Path(tmp) / name).write_text(content)
        asm_name, obj_name, hsaco_name = (f"{_SOURCE_STEM}{s}" for s in (".s", ".o", ".hsaco"))
        steps = [[*_CLANG, *options, "-S", src.name, "-o", asm_name]]
        if code_object:
            assemble, link = _link_steps(t)
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
    kernels = _metadata_kernels(asm)
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
    ), image, asm


HIPRTC_DEFAULTS = ("-O3", "-mcumode", "-std=c++14")
"""What hiprtc puts before the caller's options (DESIGN.md §2). The caller's options come after
them, and clang keeps the last of clashing options, so:

* ``-std=c++17`` (``RUNTIME_OPTIONS``) overrides ``-std=c++14`` only because it comes later; the
  catalogue also compiles as C++14 today (checked: every gfx950/gfx1250 source, 0 errors), so
  the order guards the next C++17 construct, it fixes nothing now.
* ``-O3`` is also the offline compile's level; ``RUNTIME_OPTIONS`` sets none, so none clashes.
* ``-mcumode`` changes nothing on our targets (checked with clang 22.1.8: the assembly with and
  without it differs only in the ``__hip_cuid_*`` symbol, whose hash covers the command line).
  gfx950 (gfx9) has no WGP mode, and clang 22 has none for gfx1250 either (``-mno-cumode`` is
  "not currently supported for processor 'gfx1250'"): a workgroup runs on one CU, its LDS and
  ``s_barrier`` are that CU's, and workgroup-scope atomics and fences are lowered for one CU.
  Were WGP mode added for gfx1250, hiprtc's ``-mcumode`` would keep it off at runtime while the
  offline compile (without the flag) would follow clang's default; that is when the offline
  options would need ``-mcumode`` too.
"""
HIP_INCLUDE_ENV = "EPGEN_HIP_INCLUDE"
_ROCM_INCLUDE = Path("/opt/rocm/include")
_VENDORED_HEADERS = Path(__file__).resolve().parents[3] / "shared" / "vendor" / "hip-headers"
_RUNTIME_HEADER = "hip/hip_runtime.h"
_PREAMBLE = "hiprtc_preamble.h"
_PREAMBLE_TEXT = """\
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __global__ __attribute__((global))
#define __constant__ __attribute__((constant))
#define __shared__ __attribute__((shared))
#define __align__(x) __attribute__((aligned(x)))
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __hip_img_chk__
typedef __SIZE_TYPE__ size_t;
typedef __SIZE_TYPE__ __hip_size_t;
#define __CLANG_HIP_RUNTIME_WRAPPER_INCLUDED__ 1
#define CHAR_BIT __CHAR_BIT__
#define INT_MAX __INTMAX_MAX__
#include "hip/hip_runtime.h"
#include "hip/hip_bfloat16.h"
#undef CHAR_BIT
#undef INT_MAX
#pragma clang diagnostic pop
"""
"""hiprtc's built-in header as clr's HIPRTC.cmake generates it: the macros hiprtc predefines,
``size_t``, then the HIP runtime preprocessed under ``__HIPCC_RTC__`` (here: included from the
headers folder). As ``shared/vendor/hip-headers/hiprtc_preamble.h`` with ``hiprtc_macros.h``,
less its push/pop of macros it leaves as they were; written beside each source, so any HIP
include folder (a ROCm install's too, which has no such file) can be used."""


def hip_runtime_headers() -> Path:
    """The folder of the HIP runtime headers for ``compile_as_hiprtc``: the first that holds
    ``hip/hip_runtime.h`` of ``$EPGEN_HIP_INCLUDE``, ``/opt/rocm/include`` and the test fixture
    ``shared/vendor/hip-headers`` beside the checkout.

    Raises:
        ToolchainMissing: none of them holds the headers (the message names each place).
    """
    env = os.environ.get(HIP_INCLUDE_ENV)
    places = ([Path(env)] if env else []) + [_ROCM_INCLUDE, _VENDORED_HEADERS]
    for place in places:
        if (place / _RUNTIME_HEADER).is_file():
            return place
    raise ToolchainMissing(f"HIP runtime headers ({_RUNTIME_HEADER}) not found in "
                           f"{', '.join(map(str, places))}: set ${HIP_INCLUDE_ENV} to a HIP include folder")


def hiprtc_options(t: ArchTraits, headers: Path) -> tuple[str, ...]:
    """The compile step of ``compile_as_hiprtc``: hiprtc's defaults, then the runtime's options
    and CuPy's, clang's HIP device-only mode without GPU libraries, ``__HIPCC_RTC__``, and
    ``_PREAMBLE_TEXT`` (which includes the HIP runtime of ``headers``) included first."""
    return ("-x", "hip", *HIPRTC_DEFAULTS, *RUNTIME_OPTIONS, *RUNTIME_ADDED_OPTIONS, "--cuda-device-only",
            "-nogpulib", "-nogpuinc", "-D__HIPCC_RTC__", "-D__HIP_PLATFORM_AMD__=1", f"-I{headers}",
            "-include", _PREAMBLE, f"--offload-arch={t.offload_arch}", f"-mcode-object-version={CODE_OBJECT_VERSION}")


def compile_as_hiprtc(text: str, t: ArchTraits, entry: str) -> Resources:
    """Compile ``text`` to assembly as hiprtc would (``hiprtc_options`` with
    ``hip_runtime_headers()``) and report ``entry``'s resources. A source that defines what the
    HIP runtime defines (``size_t``, ``dim3``, ...) fails here although it compiles bare.

    Raises:
        ToolchainMissing: no HIP runtime headers were found.
        CompileError: clang rejected ``text``, or ``entry`` is not a kernel of the assembly.
    """
    options = hiprtc_options(t, hip_runtime_headers())
    return _compile(text, t, entry, options, False, {_PREAMBLE: _PREAMBLE_TEXT})[0]


_METADATA_BLOCK = re.compile(
    r"^\s*\.amdgpu_metadata\s*$(.*?)^\s*\.end_amdgpu_metadata", re.M | re.S
)
# Scalar keys of one kernel map: the first key sits after "  - ", the rest at a 4-space indent.
_KERNEL_KEY = re.compile(r"^(  - |    )(\.[a-z_]+):\s*(\S*)\s*$")


def _metadata_kernels(asm: str) -> dict[str, dict[str, str]]:
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
