"""Ahead-of-time builds: a config's kernels compiled into a cache directory that ``load_kernel``
reads, so a serving process constructs its op without compiling.

Layout of a cache directory (``$EPGEN_CACHE_DIR``, default ``~/.cache/epgen``):

* ``<arch>/<key>.hsaco`` (gfx950, gfx1250: AMD code objects, clang 22 from ``ziglang``) and
  ``<arch>/<key>.cubin`` (sm_90: NVRTC CUBINs), where ``<key>`` is
  ``epgen.codegen.offline.code_object_key``: sha256 of the rendered text, the offline compile
  options (the runtime's, plus what CuPy appends) and the compiler's exact identity. Another
  compiler release or option is another key, so it misses instead of loading a stale binary.
* ``manifest.json``: per file its arch, key, entry name, spec, compiler, options, bytes, sha256
  and the cold compile seconds measured when it was built. Files of earlier builds stay listed
  while they exist. A ``manifest.json`` that is not epgen's stops ``build`` (``ManifestError``,
  before compiling) instead of being overwritten.

Files are written atomically (a temporary file renamed over the target), so a reader sees the
old file or the new one. The lookup computes the key with the offline compiler's identity, so
the serving environment needs that toolchain installed (``pip install -e .[dev]``); without it
the cache is skipped with a warning.

``time_imports`` (``epgen build --time-import``, GPU) measures, per variant, the warm import
(``load_kernel`` from the cache) against a cold runtime compile, each in fresh processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from .codegen.arch import ARCH_TRAITS, traits
from .codegen.offline import (CodeObject, CompileError, ToolchainMissing, code_object_key, code_object_problem,
                              compile_code_object, compile_many, compiler_identity, toolchain_status)
from .codegen.render import render
from .codegen.spec import KernelSpec, Op
from .config import EpConfig

CACHE_ENV = "EPGEN_CACHE_DIR"
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
WARM_IMPORT_TARGET_S = 0.1
"""Goal for one warm import (issue 6): under 100 ms per variant."""


def cache_dir() -> Path:
    """``$EPGEN_CACHE_DIR`` when set and not empty, else ``~/.cache/epgen``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "epgen"


def code_object_path(directory: Path, arch: str, key: str) -> Path:
    """``<directory>/<arch>/<key><.hsaco|.cubin>``."""
    return Path(directory) / arch / f"{key}{traits(arch).code_object_suffix}"


def config_specs(cfg: EpConfig, arches) -> list[KernelSpec]:
    """Every spec ``EpDispatchCombine(cfg)`` compiles at construction on each of ``arches`` (a
    sequence of arch names, or one name)
    (``EpConfig.variants``: each token bucket of dispatch, then of combine), without repeats.

    Raises:
        ValueError: a spec breaks an arch's limits (naming the field).
    """
    if isinstance(arches, str):  # one arch, e.g. "sm_90"
        arches = (arches,)
    return list(dict.fromkeys(s for arch in arches for op in Op for _, s in cfg.variants(arch, op)))


def find_code_object(text: str, arch: str, directory: Path | None = None) -> Path | None:
    """The cached code object of ``text`` for ``arch``, or None.

    Args:
        text: rendered kernel source.
        arch: the GPU's target name; an unknown one (no epgen target) is a miss.
        directory: cache directory (default ``cache_dir()``).

    Returns:
        The path of a file that passed ``code_object_problem`` for ``arch``; None when there is
        none, without querying any compiler if ``<directory>/<arch>`` does not exist. A file that
        cannot be read or fails the check, and a cache that cannot be keyed because the offline
        compiler is missing, are reported with ``warnings.warn`` (RuntimeWarning, naming the
        path and the reason) and are misses.
    """
    directory = cache_dir() if directory is None else Path(directory)
    if arch not in ARCH_TRAITS or not (directory / arch).is_dir():
        return None
    try:
        path = code_object_path(directory, arch, code_object_key(text, arch))
    except ToolchainMissing as e:
        _warn(f"{directory / arch}: ahead-of-time code objects not used, their key needs the offline compiler's "
              f"identity: {e}")
        return None
    try:
        image = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"{path}: cannot be read ({e.strerror or e}){_REBUILD}")
        return None
    problem = code_object_problem(image, arch)
    if problem is not None:
        _warn(f"{path}: {problem}{_REBUILD}")
        return None
    return path


_REBUILD = " (run epgen build again, or delete the file)"


def _warn(message: str) -> None:
    warnings.warn(f"{message}; compiling at runtime instead", RuntimeWarning, stacklevel=2)


def build(specs: list[KernelSpec], directory: Path | None = None, max_workers: int | None = None,
          on_done=None) -> list[dict]:
    """Compile ``specs`` into code objects under ``directory`` and update its manifest.

    Args:
        specs: what to build (e.g. ``config_specs``); every arch's toolchain must be installed.
        directory: cache directory (default ``cache_dir()``), created when missing.
        max_workers: parallel compiles (default: CPU count); ``compile_s`` is measured under
            that parallelism.
        on_done: called with no arguments after each compile.

    Returns:
        One row per spec, in order: ``status`` ("ok" or the compile error), ``arch``, ``op``,
        ``entry``, ``file`` (relative to ``directory``), ``key``, ``compiler``, ``options``,
        ``compile_s`` (wall seconds), ``bytes``, ``sha256``, ``spec`` (fields); a failed
        compile has only the first four and writes nothing.

    Raises:
        ToolchainMissing: an arch's offline compiler is not installed (before any compile).
        ManifestError: ``manifest.json`` there is not an epgen manifest (before any compile).
        OSError: the directory or a file cannot be written.
    """
    directory = cache_dir() if directory is None else Path(directory)
    read_manifest(directory)
    for arch in sorted({s.arch for s in specs}):
        reason = toolchain_status(arch)
        if reason:
            raise ToolchainMissing(f"{arch}: {reason}")
    sources = [render(s) for s in specs]
    results = compile_many([(src.text, s.arch, src.entry) for s, src in zip(specs, sources)], max_workers=max_workers,
                           on_done=on_done, compile_fn=compile_code_object)
    rows = []
    for spec, result in zip(specs, results):
        row = {"status": "ok", "arch": spec.arch, "op": spec.op.value, "entry": spec.name}
        if isinstance(result, CompileError):
            rows.append({**row, "status": str(result)})
            continue
        path = code_object_path(directory, spec.arch, result.key)
        _write_atomically(path, result.image)
        rows.append({**row, **_manifest_entry(directory, path, spec, result)})
    _update_manifest(directory, [r for r in rows if r["status"] == "ok"])
    return rows


def _manifest_entry(directory: Path, path: Path, spec: KernelSpec, co: CodeObject) -> dict:
    return {"file": path.relative_to(directory).as_posix(), "key": co.key, "compiler": co.compiler,
            "options": list(co.options), "compile_s": round(co.compile_s, 4), "bytes": len(co.image),
            "sha256": hashlib.sha256(co.image).hexdigest(), "spec": spec.as_dict()}


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a shared cache must be readable as open() would make it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ManifestError(ValueError):
    """A cache directory's ``manifest.json`` exists but is not an epgen manifest (garbage, another
    tool's JSON, a directory): the message names the file. ``build`` refuses to overwrite it, so an
    ``-o`` pointed at the wrong directory destroys nothing; delete the file to start afresh."""


def read_manifest(directory: Path) -> dict:
    """The ``code_objects`` entries of ``<directory>/manifest.json`` ({} when there is none).

    Raises:
        ManifestError: the file exists but cannot be read or is not an epgen manifest.
    """
    path = Path(directory) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return {}
    fix = "delete it or choose another cache directory"
    if not path.is_file():
        raise ManifestError(f"{path}: is not a file; {fix}")
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise ManifestError(f"{path}: not JSON ({e}); not an epgen manifest, {fix}") from None
    entries = doc.get("code_objects") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise ManifestError(f'{path}: not an epgen manifest (needs an object {{"code_objects": {{file: entry}}}}); '
                            f"{fix}")
    return entries


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; set it straight back
    os.umask(mask)
    return mask


def _update_manifest(directory: Path, rows: list[dict]) -> None:
    """Merge ``rows`` into ``manifest.json``, dropping entries whose file is gone (``ManifestError``
    when the existing file is not an epgen manifest)."""
    path = directory / MANIFEST
    entries = read_manifest(directory)
    entries = {f: e for f, e in entries.items() if (directory / f).is_file()}
    entries.update({r["file"]: {k: v for k, v in r.items() if k != "status"} for r in rows})
    doc = {"schema": MANIFEST_SCHEMA, "code_objects": dict(sorted(entries.items()))}
    _write_atomically(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


# ---- warm import against cold compile, on the GPU ---------------------------------------------

_WARMUP = 'extern "C" __global__ void epgen_runtime_compiler_warmup() {}\n'
_TIME_PROCESS = "import json, sys; from epgen.aot import _time_process; print(json.dumps(_time_process(*sys.argv[1:])))"


def time_imports(specs: list[KernelSpec], directory: Path, runs: int = 5, on_done=None) -> dict:
    """Time ``load_kernel`` per variant of this GPU's arch in fresh processes (GPU only).

    Each run starts two Python processes with a fresh, empty ``CUPY_CACHE_DIR`` (CuPy's own disk
    cache, else its ``~/.cupy/kernel_cache`` would turn a cold compile warm):

    * warm: ``EPGEN_CACHE_DIR=directory``; every variant should load from the cache;
    * cold: ``EPGEN_CACHE_DIR`` naming a directory that does not exist; every variant is compiled by
      CuPy (NVRTC/hiprtc) as a serving process without a build would.

    Each process creates its CUDA context first and pays its one-time cost untimed but
    reported (warm: the compiler identity that keys the lookup; cold: loading the runtime
    compiler with a trivial kernel); a variant's time is ``load_kernel`` plus one function
    attribute query (which makes CUDA's lazy loading load the function), its render is timed
    apart. The variant order rotates between runs so that no variant is always first.

    Args:
        specs: built specs; those of other arches are skipped (they cannot load here).
        directory: the cache directory they were built into.
        runs: processes per mode; times are medians over them.
        on_done: called with no arguments after each process.

    Returns:
        ``{"arch", "runs", "warm_once_s", "cold_once_s", "rows"}``, rows in ``specs`` order with
        ``entry``, ``op``, ``warm_s``, ``cold_s`` (medians, seconds), ``render_s`` (median of
        rendering the source, which the op does before either; both modes' runs),
        ``warm_from`` and ``cold_from`` (where ``load_kernel`` got the function over the runs:
        "cache", "compiled").

    Raises:
        ValueError: ``runs`` below 1.
        RuntimeError: no GPU, no spec for its arch, or a timing process failed.
    """
    import torch

    from .compile import device_arch

    if runs < 1:
        raise ValueError(f"runs={runs}: must be at least 1")
    if not torch.cuda.is_available():
        raise RuntimeError("timing imports needs a GPU (torch.cuda.is_available() is False)")
    arch = device_arch(torch.cuda.current_device())
    by_arch: dict[str, list[KernelSpec]] = {}
    for s in specs:
        by_arch.setdefault(s.arch, []).append(s)
    mine = by_arch.get(arch)
    if not mine:
        raise RuntimeError(f"no variant for this GPU's arch {arch} among the built ones")
    samples = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="epgen-import-") as tmp:
        for run in range(runs):
            order = mine[run % len(mine):] + mine[:run % len(mine)]
            job = Path(tmp) / f"job{run}.json"
            job.write_text(json.dumps([s.as_dict() for s in order]))
            for mode in ("warm", "cold"):
                fresh = Path(tmp) / f"{mode}{run}"
                env = dict(os.environ, CUPY_CACHE_DIR=str(fresh / "cupy"),
                           **{CACHE_ENV: str(Path(directory).resolve() if mode == "warm" else fresh / "empty")})
                proc = subprocess.run([sys.executable, "-c", _TIME_PROCESS, mode, str(job)], env=env,
                                      capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    raise RuntimeError(f"import timing process ({mode}, run {run}) failed:\n{proc.stderr[-3000:]}")
                samples[mode].append(json.loads(proc.stdout.splitlines()[-1]))
                if on_done is not None:
                    on_done()

    def median(field: str, name: str, modes=("warm", "cold")) -> float:
        return statistics.median(s["rows"][name][field] for m in modes for s in samples[m])

    def origins(mode: str, name: str) -> list[str]:
        return sorted({s["rows"][name]["origin"] for s in samples[mode]})

    rows = [{"entry": s.name, "op": s.op.value, "warm_s": median("seconds", s.name, ("warm",)),
             "cold_s": median("seconds", s.name, ("cold",)), "render_s": median("render_s", s.name),
             "warm_from": origins("warm", s.name), "cold_from": origins("cold", s.name)} for s in mine]
    return {"arch": arch, "runs": runs, "rows": rows,
            "warm_once_s": statistics.median(s["once_s"] for s in samples["warm"]),
            "cold_once_s": statistics.median(s["once_s"] for s in samples["cold"])}


def _time_process(mode: str, job: str) -> dict:
    """One timing process (see ``time_imports``): load every spec of ``job`` once."""
    import cupy

    from .compile import device_arch, load_kernel_from

    specs = [KernelSpec(**d) for d in json.loads(Path(job).read_text())]
    cupy.zeros(1)  # the CUDA context and torch's CUDA state (the op has both before it loads), untimed
    device_arch(cupy.cuda.runtime.getDevice())
    start = time.perf_counter()
    if mode == "warm":
        compiler_identity(specs[0].arch)
    else:
        load_kernel_from(_WARMUP, "epgen_runtime_compiler_warmup")
    once = time.perf_counter() - start
    rows = {}
    for spec in specs:
        t0 = time.perf_counter()
        src = render(spec)
        t1 = time.perf_counter()
        fn, origin = load_kernel_from(src.text, src.entry)
        fn.num_regs  # noqa: B018  (cuFuncGetAttribute: the function is loaded now)
        rows[src.entry] = {"render_s": t1 - t0, "seconds": time.perf_counter() - t1, "origin": origin}
    return {"once_s": once, "rows": rows}
