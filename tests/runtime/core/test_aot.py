"""Ahead-of-time builds: ``epgen build`` through NVRTC (sm_90) and clang (gfx950, gfx1250) into a
temporary cache, the variants it picks, the manifest, the cache lookup and its failure modes
(CPU); an op constructed from a build compiles nothing, and the import timing (GPU)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
import types
import warnings
from pathlib import Path

import attrs
import pytest

from epgen.codegen import planner
from epgen import aot, loader

from epgen.cli import import_timing
from epgen.aot import MANIFEST, config_specs
from epgen.cache import CACHE_ENV, cache_dir, code_object_path, find_code_object
from epgen.cli import main
from epgen.codegen import offline
from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.atomic import write_atomically
from epgen.codegen.render import RUNTIME_OPTIONS, render
from epgen.codegen.spec import KernelSpec
from epgen.codegen.config import EpConfig

MODEL = "qwen3-30b-a3b"  # no tuning-table entry on any arch: one variant per op and arch, small rows
CFG = EpConfig.for_model(MODEL, world_size=8, max_tokens_per_rank=4096)
"""What ``epgen build --model MODEL`` builds: kernel_family "auto", both families' kernels."""


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """One ``epgen build --json`` of MODEL for every arch."""
    for arch in ARCHES:
        if offline.toolchain_status(arch):
            pytest.skip(offline.toolchain_status(arch))
    out = tmp_path_factory.mktemp("aot")
    rc, stdout = _cli("build", "--model", MODEL, "-o", str(out), "--json")
    assert rc == 0
    return out, json.loads(stdout)


def test_build_writes_each_variant_and_the_manifest(built):
    out, doc = built
    specs = config_specs(CFG, ARCHES)
    assert doc["directory"] == str(out) and doc["import_times"] is None
    assert [r["entry"] for r in doc["code_objects"]] == [s.name for s in specs]
    built = [planner.plan(CFG, a).ops for a in ARCHES]  # "auto" dispatch_transport: no table bucket pulls, no pull kernels
    assert len(specs) == sum(len(planner.plan(CFG, a).specs()) for a in ARCHES)  # every bucket of every kernel
    assert all(len(b) == 2 + 6 for b in built)  # dispatch, combine; 6 low-latency
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["schema"] == 1 and set(manifest["code_objects"]) == {r["file"] for r in doc["code_objects"]}
    for spec, row in zip(specs, doc["code_objects"]):
        assert row["status"] == "ok" and row["arch"] == spec.arch and row["spec"] == spec.as_dict()
        path = out / row["file"]
        assert path == code_object_path(out, spec.arch, row["key"])
        assert path.suffix == traits(spec.arch).code_object_suffix
        image = path.read_bytes()
        assert len(image) == row["bytes"] and offline.code_object_problem(image, spec.arch) is None
        assert row["key"] == offline.code_object_key(render(spec).text, spec.arch)
        assert row["compiler"] == offline.compiler_identity(spec.arch) and row["compile_s"] > 0
        assert manifest["code_objects"][row["file"]] == {k: v for k, v in row.items() if k != "status"}
        assert find_code_object(render(spec).text, spec.arch, out) == path


def test_a_second_build_merges_into_the_manifest(built, tmp_path):
    out = tmp_path / "cache"
    shutil.copytree(built[0], out)
    rc, stdout = _cli("build", "--model", "mixtral-8x7b", "--arch", "sm_90", "-o", str(out), "--json")
    assert rc == 0
    files = json.loads((out / MANIFEST).read_text())["code_objects"]
    assert {r["file"] for r in built[1]["code_objects"]} | {r["file"] for r in json.loads(stdout)["code_objects"]} \
        == set(files)


def test_config_specs_are_the_op_variants_once_each():
    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=8192)  # measured sm_90 table
    per_op = [s for op in planner.ops(cfg) for _, s in planner.plan(cfg, "sm_90").variants.get((op, "push"), ())]
    specs = config_specs(cfg, ("sm_90",))
    assert specs == list(dict.fromkeys(per_op)) and len(specs) < len(per_op)  # two buckets share a geometry
    both = config_specs(cfg, ("sm_90", "gfx950"))  # arch by arch, in the order given
    assert both[: len(specs)] == specs and {s.arch for s in both[len(specs):]} == {"gfx950"}


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == Path.home() / ".cache" / "epgen"


def test_another_compiler_is_a_miss(built, monkeypatch):
    out, _ = built
    spec = config_specs(CFG, ("sm_90",))[0]
    monkeypatch.setattr(offline, "_vendor_identity", lambda vendor: "nvrtc 13.5: another build")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_code_object(render(spec).text, "sm_90", out) is None


def test_no_cache_for_the_arch_asks_no_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(offline, "toolchain_status", lambda arch: pytest.fail("compiler queried"))
    assert find_code_object("text", "sm_90", tmp_path) is None
    assert find_code_object("text", "sm_80", tmp_path) is None  # not an epgen target


def test_cache_without_its_compiler_warns_and_misses(built, monkeypatch):
    monkeypatch.setattr(offline, "toolchain_status", lambda arch: "NVRTC unusable: pip install cuda-bindings")
    with pytest.warns(RuntimeWarning, match=r"sm_90: ahead-of-time code objects not used.*pip install cuda-bindings"):
        assert find_code_object(render(config_specs(CFG, ("sm_90",))[0]).text, "sm_90", built[0]) is None


@pytest.mark.parametrize("damage, reason", [
    (lambda image, other: image[: len(image) // 2], "truncated: "),
    (lambda image, other: b"", "not an ELF file"),
    (lambda image, other: other, "ELF machine 224, not sm_90's 190"),
])
def test_damaged_or_foreign_file_warns_names_it_and_misses(built, tmp_path, damage, reason):
    out = tmp_path / "cache"
    shutil.copytree(built[0], out)
    text = render(config_specs(CFG, ("sm_90",))[0]).text
    path = find_code_object(text, "sm_90", out)
    gfx = out / next(r["file"] for r in built[1]["code_objects"] if r["arch"] == "gfx950")
    path.write_bytes(damage(path.read_bytes(), gfx.read_bytes()))
    match = rf"{re.escape(str(path))}: {re.escape(reason)}.*compiling at runtime instead"
    with pytest.warns(RuntimeWarning, match=match):
        assert find_code_object(text, "sm_90", out) is None


class _StandInCupy(types.ModuleType):
    """Records what load_kernel asks of CuPy; loads nothing. ``reject`` makes the 'driver' refuse
    every file (as CUDA does for an image it cannot use), which is what the fallback reacts to."""

    class _Kernel:
        def __init__(self, module, entry):
            self._module, self._entry = module, entry

        @property
        def kernel(self):
            if self._module.path is None and self._module.owner.compile_error is not None:
                raise self._module.owner.compile_error
            if self._module.path is not None and self._module.owner.reject:
                raise self._module.owner.cuda.driver.CUDADriverError("CUDA_ERROR_INVALID_IMAGE")
            return self

        num_regs = 32

    def __init__(self):
        super().__init__("cupy")
        self.reject = False
        self.compile_error = None  # raised by a runtime compile (RawModule(code=...)) when set
        self.calls = []
        driver = types.SimpleNamespace(CUDADriverError=type("CUDADriverError", (RuntimeError,), {}))
        self.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0), driver=driver)
        self.zeros = lambda n: None
        owner = self

        class RawModule:
            def __init__(self, *, code=None, path=None, options=()):
                self.owner, self.path = owner, path
                owner.calls.append(("path", path) if path is not None else ("code", options))

            def get_function(self, entry):
                return _StandInCupy._Kernel(self, entry)

        self.RawModule = RawModule


def _stand_in_cupy(monkeypatch, cache: Path, arch: str = "sm_90") -> _StandInCupy:
    cupy = _StandInCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(loader, "_FUNCTIONS", {})
    for module in (loader, import_timing):
        monkeypatch.setattr(module, "device_arch", lambda device: arch)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cupy


def test_load_kernel_lookup_order(built, monkeypatch):
    """Memo, then the cache through RawModule(path=...), then a compile with the runtime options;
    a file the driver rejects warns with its name and falls back to the compile."""
    out, _ = built
    cupy = _stand_in_cupy(monkeypatch, out)
    dispatch, combine = (render(s) for s in config_specs(CFG, ("sm_90",))[:2])
    path = find_code_object(dispatch.text, "sm_90", out)

    fn, origin = loader.load_kernel_from(dispatch.text, dispatch.entry)
    assert origin == "cache" and cupy.calls == [("path", str(path))]
    assert loader.load_kernel(dispatch.text, dispatch.entry) is fn and len(cupy.calls) == 1  # memo

    cupy.reject = True
    rejected = find_code_object(combine.text, "sm_90", out)
    with pytest.warns(RuntimeWarning, match=re.escape(f"{rejected}: the driver cannot load")):
        assert loader.load_kernel_from(combine.text, combine.entry)[1] == "compiled"
    assert cupy.calls[-1] == ("code", RUNTIME_OPTIONS)

    assert loader.load_kernel_from("// not built", "k")[1] == "compiled"  # a miss: no warning
    assert cupy.calls[-1] == ("code", RUNTIME_OPTIONS)


@pytest.mark.parametrize("arch", ["gfx950", "gfx1250"])
def test_rocm_without_hipcc_loads_the_op_kernels_from_the_cache(built, monkeypatch, arch):
    """CuPy-ROCm's runtime compile runs hipcc for include folders (cupy/_environment.py
    _get_hipcc_include_dirs), so on a ROCm image without hipcc it fails; the cache loads through
    RawModule(path=...), which compiles nothing: the op's kernels load, only a miss needs hipcc."""
    cupy = _stand_in_cupy(monkeypatch, built[0], arch)
    cupy.compile_error = RuntimeError("Subprocess command 'hipcc -x hip -E -v /dev/null' failed: hipcc not found")
    sources = [render(s) for s in config_specs(CFG, (arch,))]
    assert [loader.load_kernel_from(src.text, src.entry)[1] for src in sources] == ["cache"] * len(sources)
    assert cupy.calls == [("path", str(find_code_object(src.text, arch, built[0]))) for src in sources]
    with pytest.raises(RuntimeError, match="hipcc not found"):
        loader.load_kernel("// not built", "k")


def test_a_cached_amd_file_of_another_code_object_version_warns_and_misses(built, tmp_path):
    out = tmp_path / "cache"
    shutil.copytree(built[0], out)
    text = render(config_specs(CFG, ("gfx950",))[0]).text
    path = find_code_object(text, "gfx950", out)
    image = path.read_bytes()
    path.write_bytes(image[:8] + b"\x04" + image[9:])  # EI_ABIVERSION 4: clang 22's default, code object v6
    with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(path))}: ELF ABI version 4 \(code object v6\), not 3"):
        assert find_code_object(text, "gfx950", out) is None


def test_timing_process_loads_warm_from_the_cache_and_compiles_cold(built, monkeypatch, tmp_path):
    """The steps of one timing process, with the stand-in CuPy."""
    specs = config_specs(CFG, ("sm_90",))
    job = tmp_path / "job.json"
    job.write_text(json.dumps([s.as_dict() for s in specs]))
    for mode, cache, origin in (("warm", built[0], "cache"), ("cold", tmp_path / "empty", "compiled")):
        cupy = _stand_in_cupy(monkeypatch, cache)
        out = import_timing.time_process(mode, str(job))
        assert list(out["rows"]) == [s.name for s in specs] and out["once_s"] > 0
        assert all(r["origin"] == origin and r["seconds"] > 0 and r["render_s"] > 0 for r in out["rows"].values())
        assert [kind for kind, _ in cupy.calls] == (["path"] * len(specs) if mode == "warm"
                                                    else ["code"] * (len(specs) + 1))  # + warm-up


def test_time_imports_runs_fresh_processes_and_takes_medians(monkeypatch, tmp_path):
    """time_imports' processes (stood in for: they need a GPU) get fresh CuPy caches, the build
    (warm) or an empty directory (cold), a rotated variant order; the table shows medians."""
    import subprocess

    import torch
    from rich.console import Console

    from epgen.cli.import_timing import import_table as _import_table

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(import_timing, "device_arch", lambda device: "sm_90")
    envs = []

    def run(cmd, env, **kw):
        mode, job = cmd[-2:]
        envs.append((mode, env["CUPY_CACHE_DIR"], env[CACHE_ENV]))
        rows = {KernelSpec(**d).name: {"render_s": 0.001, "seconds": (i + 1) * (0.002 if mode == "warm" else 0.2),
                                       "origin": "cache" if mode == "warm" else "compiled"}
                for i, d in enumerate(json.loads(Path(job).read_text()))}
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"once_s": 0.05, "rows": rows}) + "\n", "")

    monkeypatch.setattr(import_timing.subprocess, "run", run)
    normal = attrs.evolve(CFG, kernel_family="normal")  # two variants per arch: the rotation below
    timing = import_timing.time_imports(config_specs(normal, ARCHES), tmp_path, runs=3)
    dispatch, combine = config_specs(normal, ("sm_90",))
    assert [r["entry"] for r in timing["rows"]] == [dispatch.name, combine.name]  # other arches skipped
    assert [r["warm_s"] for r in timing["rows"]] == [0.002, 0.004]  # first, second, first / second, first, second
    assert [r["cold_s"] for r in timing["rows"]] == [0.2, 0.4] and timing["warm_once_s"] == 0.05
    assert len({cupy for _, cupy, _ in envs}) == 6
    assert {cache for mode, _, cache in envs if mode == "warm"} == {str(tmp_path.resolve())}
    assert all(not Path(cache).exists() for mode, _, cache in envs if mode == "cold")
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(_import_table(timing, [{"entry": r["entry"], "compile_s": 0.15} for r in timing["rows"]]))
    table = console.export_text()
    assert "median of 3 fresh processes" in table and "100x" in table and "50 ms for the compiler identity" in table
    with pytest.raises(ValueError, match="runs=0: must be at least 1"):
        import_timing.time_imports([dispatch], tmp_path, runs=0)


def test_build_table_names_files_and_compilers(tmp_path):
    if offline.toolchain_status("sm_90"):
        pytest.skip(offline.toolchain_status("sm_90"))
    rc, stdout = _cli("build", "--model", MODEL, "--arch", "sm_90", "-o", str(tmp_path / "c"))
    assert rc == 0 and f"epgen build: {len(planner.plan(CFG, 'sm_90').ops)} code objects" in stdout and "nvrtc " in stdout
    assert all(s.name in stdout.replace("\n", "") for s in config_specs(CFG, ("sm_90",)))


@pytest.mark.parametrize("argv, message", [
    (["--runs", "3"], "--runs 3: only with --time-import"),
    (["--scale-bytes", "-1"], "EpConfig.scale_bytes=-1: must be an int >= 0 (--scale-bytes)"),
    (["--dispatch-geometry", "0x16"], "geometry '0x16': Geometry.blocks=0: must be a positive int"),
    (["--combine-geometry", "24"], "geometry '24': write BLOCKSxWARPS[uUNROLL]"),
    (["--hidden", "7170", "--topk", "8", "--num-experts", "256"], "KernelSpec.hidden=7170"),
    (["--world-size", "64", "--arch", "gfx1250"], "--world-size 64: must be at most 32, the smallest wave size "
                                                  "of the target arches (one lane per destination rank; gfx1250: 32)"),
    (["--model", "deepseek-v4"], "model='deepseek-v4': not in the catalogue"),
    (["--topk", "4"], "--topk needs --hidden"),
    (["--arch", "sm_80"], "argument --arch: invalid choice: 'sm_80'"),
    (["--runs", "0", "--time-import"], "argument --runs: 0: must be at least 1"),
])
def test_bad_arguments_name_argument_value_and_rule(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["build", "-o", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith("epgen build: error: ") and message in err[-1]


def test_output_must_be_a_directory(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        main(["build", "-o", str(f)])
    assert f"-o {f}: exists and is not a directory" in capsys.readouterr().err


def test_time_import_without_a_gpu_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the import timing runs there")
    rc, _ = _cli("build", "--arch", "sm_90", "-o", str(tmp_path / "c"), "--time-import", "--json")
    assert rc == 2 and not (tmp_path / "c").exists()


# ---- GPU ------------------------------------------------------------------------------------------


def _gpu_build(tmp_path, cfg):
    import torch

    from epgen.device import device_arch

    arch = device_arch(torch.cuda.current_device())
    rows = aot.build(config_specs(cfg, (arch,)), tmp_path)
    assert all(r["status"] == "ok" for r in rows), rows
    return arch, rows


def _recording_raw_module(monkeypatch):
    import cupy

    calls, real = [], cupy.RawModule

    def raw_module(**kw):
        calls.append("compile" if kw.get("code") is not None else "load")
        return real(**kw)

    monkeypatch.setattr(cupy, "RawModule", raw_module)
    monkeypatch.setattr(loader, "_FUNCTIONS", {})
    return calls


@pytest.mark.gpu
def test_op_from_a_build_compiles_nothing(tmp_path, monkeypatch):
    from epgen.harness.verify import run_round
    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model("deepseek-v3", world_size=1, max_tokens_per_rank=1000, kernel_family="normal")
    _gpu_build(tmp_path, cfg)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls = _recording_raw_module(monkeypatch)
    op = EpDispatchCombine(cfg, validate=True)
    assert calls and set(calls) == {"load"}, calls
    for seed, T in enumerate([0, 1, 1000]):
        run_round(op, cfg, [T], "uniform", seed)
    op.close()


@pytest.mark.gpu
def test_a_file_the_driver_rejects_is_compiled_instead(tmp_path, monkeypatch):
    """Another kernel's valid CUBIN under this kernel's key passes the ELF check; the driver then
    lacks the entry, the op warns naming the file and compiles."""
    from epgen.harness.verify import run_round
    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model("deepseek-v3", world_size=1, max_tokens_per_rank=1000, kernel_family="normal")
    _, rows = _gpu_build(tmp_path, cfg)
    dispatch, combine = (tmp_path / r["file"] for r in rows)
    dispatch.write_bytes(combine.read_bytes())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls = _recording_raw_module(monkeypatch)
    with pytest.warns(RuntimeWarning, match=re.escape(f"{dispatch}: the driver cannot load")):
        op = EpDispatchCombine(cfg, validate=True)
    assert calls.count("compile") == 1
    run_round(op, cfg, [1000], "uniform", 0)
    op.close()


@pytest.mark.gpu
def test_time_imports_loads_warm_and_compiles_cold(tmp_path):
    cfg = EpConfig.for_model("deepseek-v3", world_size=1, max_tokens_per_rank=1000, kernel_family="normal")
    arch, _ = _gpu_build(tmp_path, cfg)
    timing = import_timing.time_imports(config_specs(cfg, (arch,)), tmp_path, runs=1)
    assert timing["arch"] == arch and len(timing["rows"]) == 2
    for r in timing["rows"]:
        assert r["warm_from"] == ["cache"] and r["cold_from"] == ["compiled"] and 0 < r["warm_s"]


@pytest.mark.parametrize("content", ['{"code_objects": 5}', "[1, 2]", "garbage, not JSON", None])
def test_a_foreign_manifest_is_an_error_before_compiling(content, capsys, tmp_path):
    path = tmp_path / MANIFEST
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    rc = main(["build", "--model", MODEL, "--arch", "sm_90", "-o", str(tmp_path)])
    out, err = capsys.readouterr()
    assert out == ""  # the error goes to stderr, never into the verb's output
    assert rc == 2 and f"{path}:" in err.replace("\n", "") and "Traceback" not in err
    assert ("is not a file" if content is None else "not an epgen manifest") in err.replace("\n", " ")
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]  # nothing compiled, nothing replaced
    if content is not None:
        assert path.read_text() == content
    with pytest.raises(aot.ManifestError, match="manifest.json"):
        aot.build(config_specs(CFG, ("sm_90",)), tmp_path)


def test_cache_files_honour_the_umask(tmp_path):
    import os

    old = os.umask(0o027)
    try:
        write_atomically(tmp_path / "a" / "x.cubin", b"data")
        aot._update_manifest(tmp_path, [])
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "x.cubin").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / MANIFEST).stat().st_mode & 0o777 == 0o640


def test_config_specs_takes_one_arch_name():
    assert config_specs(CFG, "sm_90") == config_specs(CFG, ("sm_90",))


def test_a_cache_dir_longer_than_the_file_system_allows_warns_once_and_compiles(monkeypatch, tmp_path):
    """$EPGEN_CACHE_DIR with a component over NAME_MAX (every open or stat of it: ENAMETOOLONG):
    the loader documents falling back to a compile on cache problems, so the op's kernels are
    compiled, after one RuntimeWarning that names the variable, its value (abbreviated) and the
    rule; an explicit build into it is an OSError saying the same, before any compile."""
    import errno
    import os

    from epgen import cache

    name = "n" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 45)
    cupy = _stand_in_cupy(monkeypatch, tmp_path / name / "cache")
    monkeypatch.setattr(cache, "_REPORTED", set())
    sources = [render(s) for s in config_specs(CFG, ("sm_90",))[:3]]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert [loader.load_kernel_from(src.text, src.entry)[1] for src in sources] == ["compiled"] * 3
        assert find_code_object("text", "sm_90") is None
    assert [c[0] for c in cupy.calls] == ["code"] * 3
    (warning,) = [w for w in seen if issubclass(w.category, RuntimeWarning)]
    message = str(warning.message)
    assert message.startswith(f"EPGEN_CACHE_DIR={str(tmp_path)[:20]}") and name not in message
    assert (f"is {len(name)} bytes; a file or folder name may have at most {len(name) - 45} bytes on this file "
            "system (NAME_MAX); ahead-of-time code objects not used; compiling at runtime instead") in message
    with pytest.raises(OSError, match=r"EPGEN_CACHE_DIR=.*\(NAME_MAX\)") as info:
        aot.build(config_specs(CFG, ("sm_90",)))
    assert info.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError, match=rf"cache directory {re.escape(str(tmp_path)[:20])}.*\(NAME_MAX\)"):
        aot.build(config_specs(CFG, ("sm_90",)), tmp_path / name)
    assert list(tmp_path.iterdir()) == []
