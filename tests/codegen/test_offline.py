"""CPU tests of the offline compilers: resources, errors and ordering for every target."""

from __future__ import annotations

import pytest

from epgen.codegen.arch import ARCHES, traits
from epgen.codegen import offline
from epgen.codegen.offline import (
    CodeObject,
    CompileError,
    Resources,
    ToolchainMissing,
    code_object_key,
    code_object_options,
    code_object_problem,
    compile_code_object,
    compile_many,
    compile_offline,
    compiler_identity,
    toolchain_status,
)

SHARED_FLOATS = 256  # the static shared array of the valid kernels: 256 * 4 = 1024 bytes
LOCAL_FLOATS = 512  # the runtime-indexed local array that forces scratch: 2048 bytes

_AMD_HEAD = 'extern "C" __attribute__((global)) void'
_NV_HEAD = 'extern "C" __global__ void'


def _valid(arch: str, entry: str = "k") -> str:
    if traits(arch).vendor == "amd":
        return f"""
{_AMD_HEAD} {entry}(float* out, const float* in) {{
  __attribute__((shared)) float buf[{SHARED_FLOATS}];
  unsigned t = __builtin_amdgcn_workitem_id_x();
  buf[t] = in[t];
  __builtin_amdgcn_s_barrier();
  out[t] = buf[(t + 1) % {SHARED_FLOATS}] * 2.0f;
}}
"""
    return f"""
{_NV_HEAD} {entry}(float* out, const float* in) {{
  __shared__ float buf[{SHARED_FLOATS}];
  unsigned t = threadIdx.x;
  buf[t] = in[t];
  __syncthreads();
  out[t] = buf[(t + 1) % {SHARED_FLOATS}] * 2.0f;
}}
"""


def _scratch(arch: str, entry: str = "k") -> str:
    head, tid = (
        (_AMD_HEAD, "__builtin_amdgcn_workitem_id_x()")
        if traits(arch).vendor == "amd"
        else (_NV_HEAD, "threadIdx.x")
    )
    return f"""
{head} {entry}(float* out, const float* in, int n) {{
  float a[{LOCAL_FLOATS}];
  unsigned t = {tid};
  for (int i = 0; i < {LOCAL_FLOATS}; ++i) a[i] = in[i * 64 + t];
  out[t] = a[n % {LOCAL_FLOATS}];
}}
"""


def _pressure(arch: str) -> str:
    """A kernel capped at 16 registers (raised to the target minimum) that must spill."""
    if traits(arch).vendor == "amd":
        head = 'extern "C" __attribute__((global, amdgpu_num_vgpr(16))) void'
        tid = "__builtin_amdgcn_workitem_id_x()"
    else:
        head, tid = 'extern "C" __global__ void __maxnreg__(16)', "threadIdx.x"
    return f"""
{head} k(float* out, const float* in) {{
  unsigned t = {tid};
  float a[32];
  #pragma unroll
  for (int i = 0; i < 32; ++i) a[i] = in[i * 1024 + t];
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < 32; ++i)
    #pragma unroll
    for (int j = 0; j < 32; ++j) s += a[i] * a[j] + (float)(i ^ j);
  #pragma unroll
  for (int i = 0; i < 32; ++i) out[i * 1024 + t] = a[i] * s;
}}
"""


def _syntax_error(arch: str, entry: str = "k") -> str:
    return _valid(arch, entry).replace("buf[t] = in[t];", "buf[t] = in[t]")


@pytest.fixture(params=ARCHES)
def arch(request: pytest.FixtureRequest) -> str:
    reason = toolchain_status(request.param)
    if reason is not None:
        pytest.skip(reason)
    return request.param


def test_valid_kernel_resources(arch: str) -> None:
    res = compile_offline(_valid(arch), arch, "k")
    assert res.arch == arch and res.entry == "k"
    assert res.registers > 0
    assert res.scratch_bytes == 0 and res.spill_bytes == 0 and res.ok
    assert res.shared_bytes == SHARED_FLOATS * 4
    assert res.wave_size == traits(arch).wave_size
    if traits(arch).vendor == "amd":
        assert res.sgprs is not None and res.sgprs > 0
    else:
        assert res.sgprs is None and res.agprs is None


def test_entry_picked_among_several(arch: str) -> None:
    text = _scratch(arch, "spilly") + _valid(arch, "plain")
    assert compile_offline(text, arch, "plain").scratch_bytes == 0
    assert compile_offline(text, arch, "spilly").scratch_bytes > 0


def test_assembly_of_an_amd_compile_with_its_resources(arch: str) -> None:
    """``compile_assembly``: one clang run gives the resources ``compile_offline`` reports and the
    assembly they are read from; AMD targets only."""
    text = _valid(arch)
    if traits(arch).vendor != "amd":
        with pytest.raises(ValueError, match=rf"arch='{arch}': compile_assembly needs an AMD target"):
            offline.compile_assembly(text, arch, "k")
        return
    resources, asm = offline.compile_assembly(text, arch, "k")
    assert resources == compile_offline(text, arch, "k")
    assert "\nk:" in asm and ".amdgpu_metadata" in asm


def test_missing_entry_raises(arch: str) -> None:
    with pytest.raises(CompileError, match=rf"arch={arch} entry=absent: entry not found.*'k'"):
        compile_offline(_valid(arch), arch, "absent")


def test_syntax_error_raises(arch: str) -> None:
    with pytest.raises(CompileError) as info:
        compile_offline(_syntax_error(arch), arch, "k")
    err = info.value
    assert err.arch == arch and err.entry == "k"
    assert f"arch={arch}" in str(err) and "entry=k" in str(err)
    assert "error" in str(err).lower() and "error" in err.log.lower()


def test_scratch_kernel_not_ok(arch: str) -> None:
    res = compile_offline(_scratch(arch), arch, "k")
    assert res.scratch_bytes >= LOCAL_FLOATS * 4
    assert not res.ok


def test_register_pressure_spills(arch: str) -> None:
    res = compile_offline(_pressure(arch), arch, "k")
    assert res.spill_bytes > 0 and res.spill_bytes % 4 == 0
    assert not res.ok


def test_compile_many_keeps_order() -> None:
    usable = [a for a in ARCHES if toolchain_status(a) is None]
    if not usable:
        pytest.skip("; ".join(str(toolchain_status(a)) for a in ARCHES))
    jobs = []
    for a in usable:
        jobs += [(_scratch(a), a, "k"), (_syntax_error(a), a, "k"), (_valid(a), a, "k")]
    results = compile_many(jobs, max_workers=2)
    assert len(results) == len(jobs)
    for (_, a, _), res, kind in zip(jobs, results, ["scratch", "error", "valid"] * len(usable)):
        if kind == "error":
            assert isinstance(res, CompileError) and res.arch == a
        else:
            assert isinstance(res, Resources) and res.arch == a
            assert res.ok == (kind == "valid")


def test_missing_toolchain_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from cuda.bindings import nvrtc

    real_find_spec = importlib.util.find_spec

    def no_lib() -> None:
        raise RuntimeError("libnvrtc not found")

    def find_spec(name: str, *args: object) -> object:
        return None if name == "ziglang" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(nvrtc, "nvrtcVersion", no_lib)
    for a in ARCHES:
        package = "ziglang" if traits(a).vendor == "amd" else "nvidia-cuda-nvrtc"
        reason = toolchain_status(a)
        assert reason is not None and package in reason and "\n" not in reason
        with pytest.raises(ToolchainMissing, match=package):
            compile_offline(_valid(a), a, "k")


# --------------------------------------------------------------------------------------------------
# Code objects (epgen build): the loadable image, its key and the check before a load
# --------------------------------------------------------------------------------------------------


def test_code_object_of_each_arch(arch: str) -> None:
    text = _valid(arch)
    co = compile_code_object(text, arch, "k")
    assert isinstance(co, CodeObject) and co.resources == compile_offline(text, arch, "k")
    assert co.key == code_object_key(text, arch) and len(co.key) == 64
    assert co.compiler == compiler_identity(arch) and co.options == code_object_options(arch)
    assert co.compiler.startswith("clang version" if traits(arch).vendor == "amd" else "nvrtc ")
    assert co.compile_s > 0 and code_object_problem(co.image, arch) is None
    for other in ARCHES:
        if traits(other).elf_mach != traits(arch).elf_mach:
            assert "not " + other in code_object_problem(co.image, other)
    for cut in (len(co.image) - 1, len(co.image) // 2):
        assert code_object_problem(co.image[:cut], arch).startswith("truncated: ")
    assert code_object_problem(b"not a code object", arch).startswith("not an ELF file")
    assert code_object_problem(co.image[:4] + b"\x01" + co.image[5:], arch) == "not a 64-bit little-endian ELF file"


def test_code_object_key_changes_with_text_options_and_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    if toolchain_status("sm_90"):
        pytest.skip(toolchain_status("sm_90"))
    text = _valid("sm_90")
    key = code_object_key(text, "sm_90")
    assert key == code_object_key(text, "sm_90") and key != code_object_key(text + "\n", "sm_90")
    assert "-ftz=true" in code_object_options("sm_90")  # CuPy appends it at runtime: the cubin matches
    with monkeypatch.context() as m:
        m.setattr(offline, "code_object_options", lambda arch: ("--gpu-architecture=sm_90", "-O0"))
        assert code_object_key(text, "sm_90") != key
    with monkeypatch.context() as m:
        m.setattr(offline, "_vendor_identity", lambda vendor: "nvrtc 13.5: another build of the same release")
        assert code_object_key(text, "sm_90") != key


def test_cubin_target_in_both_cuda_elf_abis() -> None:
    """ELF ABI version 7 keeps the SM in the low byte of e_flags, later ones in bits 8-15."""
    if toolchain_status("sm_90"):
        pytest.skip(toolchain_status("sm_90"))
    image = bytearray(compile_code_object(_valid("sm_90"), "sm_90", "k").image)
    assert image[8] != 7 and (image[48 + 1]) == 90  # this NVRTC writes the later ABI
    image[8], image[48:52] = 7, (0x5A).to_bytes(4, "little")
    assert code_object_problem(bytes(image), "sm_90") is None
    image[48] = 80
    assert code_object_problem(bytes(image), "sm_90") == "built for ELF target 0x50, not sm_90 (0x5a)"


@pytest.mark.parametrize("amd", ["gfx950", "gfx1250"])
def test_amd_code_objects_are_v5_and_clangs_default_v6_is_refused(amd: str) -> None:
    """clang 22 writes code object v6 unless told; the offline compile asks for v5 (what the ROCm
    6.x and 7.x loaders accept), the key covers that option, and the check before a load refuses
    any other version (EI_ABIVERSION: 2 = v4, 3 = v5, 4 = v6)."""
    if toolchain_status(amd):
        pytest.skip(toolchain_status(amd))
    from epgen.codegen.offline import clang_amd

    assert clang_amd.CODE_OBJECT_VERSION == 5 and "-mcode-object-version=5" in code_object_options(amd)
    image = compile_code_object(_valid(amd), amd, "k").image
    assert image[7] == 64 and image[8] == 3  # ELFOSABI_AMDGPU_HSA, ELFABIVERSION_AMDGPU_HSA_V5
    t = traits(amd)
    unversioned = tuple(o for o in clang_amd.compile_options(t) if not o.startswith("-mcode-object-version="))
    default = clang_amd._compile(_valid(amd), t, "k", unversioned, True)[1]
    assert default[8] == 4
    assert code_object_problem(default, amd) == (
        "ELF ABI version 4 (code object v6), not 3 (code object v5, the version epgen builds)")
    assert code_object_problem(image[:8] + b"\x02" + image[9:], amd).startswith("ELF ABI version 2 (code object v4)")
    assert code_object_problem(image[:8] + b"\x09" + image[9:], amd).startswith("ELF ABI version 9 (unknown)")


def test_nvrtc_writes_into_buffers_of_its_own() -> None:
    """NVRTC writes the log and the image into buffers the caller hands it. A bytes object there
    (``b" " * size``) is shared: for an empty log (size 1, the terminating zero alone) it is the
    process's one ``b" "``, which NVRTC zeroed, so ``b" ".join`` joined with a zero byte afterwards.
    A fresh interpreter, so that no earlier compile of this process hides the damage."""
    if toolchain_status("sm_90"):
        pytest.skip(toolchain_status("sm_90"))
    import subprocess
    import sys

    program = f"""
from epgen.codegen.offline import compile_code_object, compile_offline, compiler_identity
assert compiler_identity("sm_90").startswith("nvrtc ")  # an empty program: its log is empty
assert compile_offline({_valid("sm_90")!r}, "sm_90", "k").shared_bytes == {SHARED_FLOATS * 4}
assert compile_code_object({_valid("sm_90", "k2")!r}, "sm_90", "k2").image[:4] == b"\\x7fELF"
assert b" ".join([b"a", b"b"]) == b"a b", b" ".join([b"a", b"b"])
damaged = [i for i in range(256) if bytes([i])[0] != i]  # CPython shares every one-byte bytes object
assert not damaged, f"one-byte bytes objects changed: {{damaged}}"
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
