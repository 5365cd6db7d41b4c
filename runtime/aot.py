"""Ahead-of-time builds: a config's kernels compiled into a cache directory that ``load_kernel``
reads, so a serving process constructs its op without compiling.

Layout of a cache directory (``$EPGEN_CACHE_DIR``, default ``~/.cache/epgen``):

* ``<arch>/<key>.hsaco`` (gfx942, gfx950, gfx1250: AMD code objects, clang 22 from ``ziglang``) and
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

The lookup itself is ``epgen.cache``; ``epgen.cli.import_timing`` (``epgen build --time-import``, GPU)
measures, per variant, the warm import (``load_kernel`` from the cache) against a cold runtime
compile, each in fresh processes.
"""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

from epgen.cache import cache_dir, code_object_path, directory_problem
from epgen.codegen.atomic import write_atomically
from epgen.codegen.config import EpConfig
from epgen.codegen.offline import CodeObject, CompileError, ToolchainMissing, compile_code_object, compile_many, toolchain_status
from epgen.codegen.planner import plan
from epgen.codegen.render import render
from epgen.codegen.spec import KernelSpec

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1


def config_specs(cfg: EpConfig, arches) -> list[KernelSpec]:
    """Every spec ``EpDispatchCombine(cfg)`` compiles at construction on each of ``arches`` (a
    sequence of arch names, or one name)
    (``epgen.codegen.planner.KernelPlan.specs``: each token bucket of each kernel), without repeats.

    Raises:
        ValueError: a spec breaks an arch's limits (naming the field).
    """
    if isinstance(arches, str):  # one arch, e.g. "sm_90"
        arches = (arches,)
    return list(dict.fromkeys(s for arch in arches for s in plan(cfg, arch).specs()))


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
        OSError: the directory or a file cannot be written; errno ``ENAMETOOLONG``, before
            anything is read or compiled, when the file system cannot name the directory
            (``epgen.cache.directory_problem``: the message names ``EPGEN_CACHE_DIR`` when the
            directory came from it, its value and the rule).
    """
    problem = directory_problem(directory)
    if problem is not None:
        raise OSError(errno.ENAMETOOLONG, problem)
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
        write_atomically(path, result.image)
        rows.append({**row, **_manifest_entry(directory, path, spec, result)})
    _update_manifest(directory, [r for r in rows if r["status"] == "ok"])
    return rows


def _manifest_entry(directory: Path, path: Path, spec: KernelSpec, co: CodeObject) -> dict:
    return {"file": path.relative_to(directory).as_posix(), "key": co.key, "compiler": co.compiler,
            "options": list(co.options), "compile_s": round(co.compile_s, 4), "bytes": len(co.image),
            "sha256": hashlib.sha256(co.image).hexdigest(), "spec": spec.as_dict()}


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


def _update_manifest(directory: Path, rows: list[dict]) -> None:
    """Merge ``rows`` into ``manifest.json``, dropping entries whose file is gone (``ManifestError``
    when the existing file is not an epgen manifest)."""
    path = directory / MANIFEST
    entries = read_manifest(directory)
    entries = {f: e for f, e in entries.items() if (directory / f).is_file()}
    entries.update({r["file"]: {k: v for k, v in r.items() if k != "status"} for r in rows})
    doc = {"schema": MANIFEST_SCHEMA, "code_objects": dict(sorted(entries.items()))}
    write_atomically(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

