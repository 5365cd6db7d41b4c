"""The AMD offline toolchain: clang 22 from the ``ziglang`` PyPI package.

It runs as ``python -m ziglang clang -x hip --cuda-device-only -nogpulib -nogpuinc -S``. The
resource counts come from the ``amdhsa.kernels`` entry of the AMDGPU metadata block in the
assembly (``.name``, ``.vgpr_count``, ``.agpr_count`` (only on targets with AGPRs, e.g.
gfx950), ``.sgpr_count``, ``.private_segment_fixed_size``, ``.group_segment_fixed_size``,
``.vgpr_spill_count``, ``.sgpr_spill_count``, ``.wavefront_size``). A code object is that
assembly assembled by the same clang and linked by its ``ld.lld`` into an ELF shared object
(``.hsaco``). Every step works on files in a ``tempfile.TemporaryDirectory``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
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
ELF = elf.AMDGPU

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
    """HIP device code only, no GPU libraries or headers, the runtime's options, the target, -O3."""
    return ("-x", "hip", *RUNTIME_OPTIONS, *RUNTIME_ADDED_OPTIONS, "--cuda-device-only", "-nogpulib",
            "-nogpuinc", f"--offload-arch={t.offload_arch}", "-O3")


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
    arch = t.name
    image = None
    with tempfile.TemporaryDirectory(prefix="epgen-offline-") as tmp:
        src = Path(tmp) / f"{_SOURCE_STEM}.hip"
        src.write_text(text)
        asm_name, obj_name, hsaco_name = (f"{_SOURCE_STEM}{s}" for s in (".s", ".o", ".hsaco"))
        steps = [[*_CLANG, *compile_options(t), "-S", src.name, "-o", asm_name]]
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
    ), image


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
