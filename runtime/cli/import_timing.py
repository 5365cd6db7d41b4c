"""Warm import against cold compile, on the GPU: ``epgen build --time-import``.

``time_imports`` starts fresh Python processes (``python -m epgen.cli.import_timing MODE JOB``), each of
which runs ``time_process`` and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from epgen.cache import CACHE_ENV
from epgen.codegen.offline import compiler_identity
from epgen.codegen.render import render
from epgen.codegen.spec import KernelSpec
from epgen.device import device_arch
from epgen.loader import load_kernel_from

WARM_IMPORT_TARGET_S = 0.1
"""Goal for one warm import: under 100 ms per variant."""

_WARMUP = 'extern "C" __global__ void epgen_runtime_compiler_warmup() {}\n'


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
                proc = subprocess.run([sys.executable, "-m", "epgen.cli.import_timing", mode, str(job)], env=env,
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


def time_process(mode: str, job: str) -> dict:
    """One timing process (see ``time_imports``): load every spec of ``job`` once."""
    import cupy

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


if __name__ == "__main__":
    print(json.dumps(time_process(*sys.argv[1:])))


def import_table(timing: dict, rows: list[dict]):
    """A rich table of ``time_imports``' result: per variant the build's CPU compile seconds
    (``rows``: ``epgen.aot.build`` rows), render, cold compile and warm import milliseconds, the
    speed-up, where the warm import came from and whether it met ``WARM_IMPORT_TARGET_S``."""
    from rich.table import Table

    compile_s = {r["entry"]: r["compile_s"] for r in rows}
    t = Table(title=f"load_kernel on {timing['arch']}: median of {timing['runs']} fresh processes each, CuPy's "
                    "kernel cache empty (CUPY_CACHE_DIR fresh)",
              caption=f"once per process, not in the rows: {timing['warm_once_s'] * 1e3:.0f} ms for the compiler "
                      f"identity of the cache key (warm), {timing['cold_once_s'] * 1e3:.0f} ms runtime compiler "
                      "warm-up (cold)")
    for c in ("op", "entry", "build s (CPU)", "render ms", "cold compile ms", "warm import ms", "speed-up",
              "warm from", f"warm < {WARM_IMPORT_TARGET_S * 1e3:.0f} ms"):
        t.add_column(c, overflow="fold")
    for r in timing["rows"]:
        met = r["warm_s"] < WARM_IMPORT_TARGET_S and r["warm_from"] == ["cache"]
        t.add_row(r["op"], r["entry"], f"{compile_s[r['entry']]:.2f}", f"{r['render_s'] * 1e3:.1f}",
                  f"{r['cold_s'] * 1e3:.1f}", f"{r['warm_s'] * 1e3:.1f}", f"{r['cold_s'] / r['warm_s']:.0f}x",
                  ", ".join(r["warm_from"]), "yes" if met else "[red]no[/red]")
    return t
