"""Every AMD source of the catalogue compiles as CuPy-ROCm's hiprtc would compile it (hiprtc's
default options first, the HIP runtime predefined under ``__HIPCC_RTC__``), to assembly, with
the same resources as the bare offline compile; and the emulation is not vacuous: a source that
defines what the HIP runtime defines compiles bare and fails under it.

The full compile (to assembly, not ``-fsyntax-only``) also runs clang's code generation under
hiprtc's options, where target-feature checks of builtins and the backend's own errors show, and
yields the resources to compare with ``generated/report.csv``; it takes about 0.3 s of CPU a source
(``-fsyntax-only`` would take a third of that and prove only the first part, that the
declarations do not clash)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from epgen.codegen import offline
from epgen.codegen.arch import ARCH_TRAITS, traits
from epgen.codegen.catalogue import catalogue_specs
from epgen.codegen.offline import clang_amd
from epgen.codegen.render import RUNTIME_OPTIONS, render

AMD_ARCHES = tuple(name for name, t in ARCH_TRAITS.items() if t.vendor == "amd")
REPO = Path(__file__).resolve().parents[2]


def _headers_or_skip():
    reason = offline.toolchain_status("gfx950")
    if reason:
        pytest.skip(reason)
    try:
        return clang_amd.hip_runtime_headers()
    except offline.ToolchainMissing as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_every_amd_catalogue_source_compiles_as_hiprtc_with_the_bare_resources(progress):
    _headers_or_skip()
    specs = catalogue_specs(arches=AMD_ARCHES)
    assert {s.arch for s in specs} == set(AMD_ARCHES)
    sources = [render(s) for s in specs]
    jobs = [(src.text, s.arch, src.entry) for s, src in zip(specs, sources)]
    progress(f"compiling the {len(jobs)} AMD catalogue sources as hiprtc would")
    emulated = offline.compile_many(jobs, compile_fn=offline.compile_as_hiprtc)
    failed = [f"{job[2]}: {r}" for job, r in zip(jobs, emulated) if isinstance(r, offline.CompileError)]
    assert not failed, "\n".join(failed[:5])
    with (REPO / "generated" / "report.csv").open() as f:  # the bare compile's resources, committed
        bare = {row["entry"]: row for row in csv.DictReader(f)}
    fields = ("registers", "agprs", "sgprs", "scratch_bytes", "spill_bytes", "shared_bytes")
    differ = [r.entry for r in emulated
              if [str(getattr(r, k) if getattr(r, k) is not None else "") for k in fields]
              != [bare[r.entry][k] for k in fields]]
    assert differ == []  # the predefined runtime changes no register, LDS, scratch or spill count


def test_hiprtc_options_put_its_defaults_before_ours():
    headers = _headers_or_skip()
    opts = clang_amd.hiprtc_options(traits("gfx1250"), headers)
    defaults = [opts.index(o) for o in clang_amd.HIPRTC_DEFAULTS]
    assert defaults == sorted(defaults) and max(defaults) < opts.index(RUNTIME_OPTIONS[0])
    # clang keeps the last -std: ours, so the source is C++17 as RUNTIME_OPTIONS says
    assert [o for o in opts if o.startswith("-std=")][-1] == "-std=c++17"
    assert "-D__HIPCC_RTC__" in opts and f"-I{headers}" in opts


_KERNEL = 'extern "C" __attribute__((global)) void k(float* out) { out[0] = 1.0f; }\n'


@pytest.mark.parametrize("arch", AMD_ARCHES)
@pytest.mark.parametrize("clash, message", [
    ("typedef unsigned int size_t;\n", "typedef redefinition with different types"),
    ("struct dim3 { unsigned x, y, z; };\n", "redefinition of 'dim3'"),
])
def test_a_clash_with_the_hip_runtime_fails_under_hiprtc_only(arch, clash, message):
    """Unguarded definitions of what hiprtc predefines: bare clang accepts them (no HIP headers),
    the emulation rejects them, as hiprtc would. (A macro such as ``__device__`` redefined the
    same way is legal C++, and redefined otherwise only warns: types are what can clash.)"""
    _headers_or_skip()
    text = clash + _KERNEL
    assert offline.compile_offline(text, arch, "k").wave_size == traits(arch).wave_size
    with pytest.raises(offline.CompileError) as info:
        offline.compile_as_hiprtc(text, arch, "k")
    assert message in info.value.log


def test_a_rocm_include_folder_needs_no_preamble_of_its_own(monkeypatch, tmp_path):
    """/opt/rocm/include has the HIP headers but no hiprtc_preamble.h: the emulation brings its
    own reproduction of hiprtc's built-in header, so the headers alone are enough."""
    headers = _headers_or_skip()
    (tmp_path / "hip").symlink_to(headers / "hip")
    monkeypatch.setenv(clang_amd.HIP_INCLUDE_ENV, str(tmp_path))
    spec = catalogue_specs(arches=("gfx1250",))[0]
    src = render(spec)
    assert offline.compile_as_hiprtc(src.text, spec.arch, src.entry) == offline.compile_offline(src.text, spec.arch,
                                                                                               src.entry)


def test_the_same_definition_guarded_compiles_under_both():
    _headers_or_skip()
    text = "#ifndef __device__\n#define __device__ __attribute__((device))\n#endif\n" + _KERNEL
    assert offline.compile_as_hiprtc(text, "gfx950", "k") == offline.compile_offline(text, "gfx950", "k")


def test_headers_found_in_the_environment_first_or_missing_named(monkeypatch, tmp_path):
    (tmp_path / "hip").mkdir()
    (tmp_path / "hip" / "hip_runtime.h").write_text("")
    monkeypatch.setenv(clang_amd.HIP_INCLUDE_ENV, str(tmp_path))
    assert clang_amd.hip_runtime_headers() == tmp_path
    assert f"-I{tmp_path}" in clang_amd.hiprtc_options(traits("gfx950"), tmp_path)
    empty = tmp_path / "none"
    monkeypatch.setenv(clang_amd.HIP_INCLUDE_ENV, str(empty))
    monkeypatch.setattr(clang_amd, "_ROCM_INCLUDE", tmp_path / "rocm")
    monkeypatch.setattr(clang_amd, "_VENDORED_HEADERS", tmp_path / "vendor")
    with pytest.raises(offline.ToolchainMissing, match=rf"hip/hip_runtime.h\) not found in {empty}, .*rocm, "
                                                       rf".*vendor: set \$EPGEN_HIP_INCLUDE"):
        clang_amd.hip_runtime_headers()


def test_hiprtc_needs_an_amd_target():
    with pytest.raises(ValueError, match="arch='sm_90': compile_as_hiprtc needs an AMD target"):
        offline.compile_as_hiprtc(_KERNEL, "sm_90", "k")
