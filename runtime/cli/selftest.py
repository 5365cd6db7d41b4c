"""``epgen selftest``: the first command on new hardware (AMD or NVIDIA, one GPU or more).

Builds and runs every kernel family (normal; low-latency, whole and split into its sending and
receiving halves), layout (rank, expert), dispatch transport (push, pull), payload dtype (bf16,
fp8, fp4) and combine wire (none, fp8_direct_cast, fp8_blockwise, fp4_blockwise) at small shapes
(``CASES``): on virtual ranks of one GPU (W = 2 and 4) and across W = 2 processes (one GPU each,
or both sharing cuda:0: ``epgen.harness.ranks``). Each case runs verified rounds
(``epgen.harness.verify.run_round``: every received row bit-equal to the reference's, every combined
element within its error bound; the expert layout: ``epgen.harness.expert_verify.run_expert_round``,
bit for bit), and the main ones are timed (``epgen.harness.timing.time_pairs_queued``, queued
launches). Cases that share a config share one op, so each kernel is compiled once (NVRTC or hiprtc
through CuPy, whose on-disk cache the processes then hit).

Prints a table and writes a report to attach to a bug report (JSON, or Markdown for a ``.md``
path; default ``selftest-<arch>.json`` in the working directory): versions (epgen, torch, CuPy,
HIP/CUDA runtime and driver), arch, GPU name and count, every case's result with its worst error
as a fraction of its bound, and every failure's message. Exit status 1 on any failure. Without a
GPU it prints the cases it would run and exits 0.

``--device cpu`` (``run(..., device="cpu", arch=...)``) runs the same cases on the host emulation
(``epgen.host``, docs/host.md): the real kernels of ``arch`` (default sm_90) on the CPU, virtual
ranks in this process and the ``processes`` cases as W processes over gloo, at the same shapes
(the expert-layout cases at the host's geometry). Nothing is timed there: the timed cases only
verify (the host models no timing). A case whose op plans a kernel of more than
``HOST_MAX_THREADS`` threads a rank (a GPU's geometry) is reported as skipped, naming the kernel.
The report is ``selftest-host-<arch>.json``, with no CuPy or GPU versions.
"""

from __future__ import annotations

import json
import platform as host
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import attrs

from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import COMBINE_QUANTS

HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 1024, 4, 4, 64
"""The shape of every rank-layout case: small, so compiles dominate and every case finishes in
seconds (fp4: two codes a byte, H even)."""

ROUNDS = (("uniform", "even"), ("invalid", "ragged"))
"""Each case's verified rounds: (routing kind of ``epgen.harness.ROUTINGS``, token pattern)."""

TIMING_ITERS = 20
"""Queued samples per timed case (their median is reported)."""

HOST_MAX_THREADS = 4096
"""The most threads a rank that one kernel's grid may have for a case to run on the host: each
thread is a fiber, and a launch's cost grows faster than its fibers (a grid of a GPU's geometry,
e.g. the local kernels' 132-264 blocks of 512 threads a rank, takes minutes a launch). The host's
own geometry (``epgen.host.GEOMETRY``, 2 blocks of 2 waves) is 64 to 128 threads a block; a case
whose op plans a larger kernel (one the host left at the tuning tables' GPU geometry) is reported
as skipped, naming the kernel and its threads, instead of running for an hour."""

HOST_NOTE = "timing is not measured on the host emulation (it models no timing): timed cases only verify"


@attrs.frozen
class Case:
    """One selftest case.

    Attributes:
        family: ``"normal"`` or ``"low_latency"`` (``EpConfig.kernel_family``).
        layout: ``"rank"`` or ``"expert"``.
        transport: ``"push"`` or ``"pull"`` (``EpConfig.dispatch_transport``).
        dtype: dispatch payload, ``"bf16"``, ``"fp8"`` or ``"fp4"``.
        wire: ``EpConfig.combine_quant``.
        world_size: W.
        where: ``"virtual"`` (all ranks in this process, one GPU) or ``"processes"`` (W processes).
        split: the low-latency calls split (``async_recv=True``, GPU work between the halves).
        timed: time dispatch + combine after the rounds (never on the host).
        host: the case as the host emulation runs it (``host_cases``): the expert layout at the
            host's geometry (``epgen.host.GEOMETRY``) instead of ``expert_config``'s GPU one.
    """

    family: str
    layout: str
    transport: str
    dtype: str
    wire: str
    world_size: int
    where: str
    split: bool = False
    timed: bool = False
    host: bool = False

    @property
    def name(self) -> str:
        return (f"{self.family}{' split' if self.split else ''} {self.layout} {self.transport} {self.dtype} "
                f"wire={self.wire}")

    @property
    def config(self) -> EpConfig:
        """The case's EpConfig (cases that differ only in ``split`` / ``timed`` share it)."""
        if self.layout == "expert":
            from epgen.harness.expert_verify import expert_config

            cfg = expert_config(self.world_size, kernel_family=self.family, dtype=self.dtype,
                                dispatch_transport=self.transport, combine_quant=self.wire)
            # expert_config's geometry is a GPU's (8 blocks of 8 warps); None: the op takes the host's
            return attrs.evolve(cfg, dispatch_geometry=None, combine_geometry=None) if self.host else cfg
        return EpConfig(world_size=self.world_size, hidden=HIDDEN, topk=TOPK,
                        num_experts=EXPERTS_PER_RANK * self.world_size, max_tokens_per_rank=MAX_TOKENS,
                        kernel_family=self.family, dispatch_transport=self.transport, dtype=self.dtype,
                        combine_quant=self.wire, timeout_s=10.0)

    def tokens(self, pattern: str) -> list[int]:
        """Tokens per rank of a round: ``even`` (every rank half the maximum) or ``ragged``
        (the maximum, none, and odd counts)."""
        if pattern == "even":
            return [MAX_TOKENS // 2] * self.world_size
        return [(MAX_TOKENS, 0, 7, 33)[r % 4] for r in range(self.world_size)]


def _cases() -> tuple[Case, ...]:
    v2 = dict(world_size=2, where="virtual")
    rank = [Case("normal", "rank", "push", "bf16", "none", **v2, timed=True)]
    rank += [Case("normal", "rank", "push", d, "none", **v2) for d in ("fp8", "fp4")]
    rank += [Case("normal", "rank", "pull", d, "none", **v2) for d in ("bf16", "fp4")]
    rank += [Case("normal", "rank", "push", "bf16", w, **v2) for w, q in COMBINE_QUANTS.items() if q.quantized]
    low = [Case("low_latency", "rank", "push", "bf16", "none", **v2, timed=True),
           Case("low_latency", "rank", "push", "bf16", "none", **v2, split=True),
           Case("low_latency", "rank", "push", "fp8", "none", **v2),
           Case("low_latency", "rank", "push", "bf16", "fp8_blockwise", **v2)]
    expert = [Case("normal", "expert", "push", "bf16", "none", **v2),
              Case("normal", "expert", "push", "fp8", "fp8_direct_cast", **v2)]
    v4 = [Case("normal", "rank", "push", "bf16", "none", 4, "virtual", timed=True),
          Case("low_latency", "rank", "push", "bf16", "none", 4, "virtual"),
          Case("low_latency", "rank", "push", "bf16", "none", 4, "virtual", split=True),
          Case("normal", "expert", "push", "bf16", "none", 4, "virtual")]
    p2 = [Case("normal", "rank", "push", "bf16", "none", 2, "processes", timed=True),
          Case("normal", "rank", "pull", "bf16", "none", 2, "processes"),
          Case("low_latency", "rank", "push", "bf16", "none", 2, "processes", timed=True),
          Case("low_latency", "rank", "push", "bf16", "none", 2, "processes", split=True)]
    return tuple(rank + low + expert + v4 + p2)


CASES = _cases()
"""Every case, in the order they run: virtual W = 2 (each family, transport, dtype, wire and
layout), virtual W = 4, then W = 2 processes."""


def host_cases() -> tuple[Case, ...]:
    """``CASES`` as the host emulation runs them (``--device cpu``): the same list and shapes, each
    with ``host=True`` (the expert layout at the host's geometry; timed cases only verify)."""
    return tuple(attrs.evolve(c, host=True) for c in CASES)


def _groups(cases) -> dict:
    """(config, where) -> its cases, in order: one op each."""
    groups = defaultdict(list)
    for c in cases:
        groups[(c.config, c.where)].append(c)
    return groups


def _result(case: Case, **fields) -> dict:
    return {"case": case.name, "world_size": case.world_size, "where": case.where, "ok": False, "error": None,
            "skipped": None, "rounds": 0, "bound_ratio": None, "combine_err": None, "wire_mismatches": 0,
            "dispatch_us": None, "combine_us": None, "seconds": 0.0, **fields}


def _host_skip(op) -> str | None:
    """Why the cases of ``op`` are skipped on the host emulation: a kernel of its plan with more
    than ``HOST_MAX_THREADS`` threads a rank; None where they run (always on a GPU)."""
    if op.device.type != "cpu":
        return None
    threads, name = max(((spec.blocks * spec.threads, spec.name) for variants in op.plan.variants.values()
                         for _, spec in variants), default=(0, ""))
    if threads <= HOST_MAX_THREADS:
        return None
    return (f"{name} runs {threads} threads a rank (a GPU's geometry; the host runs at most {HOST_MAX_THREADS}, "
            "each a fiber: minutes a launch)")


def _error(e: BaseException) -> str:
    last = traceback.format_exception_only(type(e), e)[-1].strip()
    return last if len(last) < 2000 else last[:2000] + " ..."


def _run_case(op, case: Case, seed: int) -> dict:
    """The rounds of ``case`` on ``op`` (and its timing); a result dict (``ok`` False with the
    error's message when a round failed)."""
    from epgen.harness.verify import run_round

    cfg = op.config
    started = time.perf_counter()
    out = _result(case)
    try:
        busy = _busy(op) if case.split else None  # work on the stream between the halves
        for i, (kind, pattern) in enumerate(ROUNDS):
            tokens = case.tokens(pattern)
            if case.layout == "expert":
                from epgen.harness.expert_verify import run_expert_round

                run_expert_round(op, cfg, tokens, seed + i)  # bit-equal to the reference: no error to bound
                out.update(bound_ratio=0.0, combine_err=0.0)
            else:
                stats = run_round(op, cfg, tokens, kind, seed + i, busy=busy)
                out.update(bound_ratio=max(out["bound_ratio"] or 0.0, stats["bound_ratio"]),
                           combine_err=max(out["combine_err"] or 0.0, stats["combine_err"]),
                           wire_mismatches=out["wire_mismatches"] + stats["wire_mismatches"])
            out["rounds"] += 1
        if case.timed and not case.host:  # the host models no timing
            out.update(_time(op, case, seed + 100))
        out["ok"] = True
    except Exception as e:  # noqa: BLE001  (every failure is reported, and the next case runs)
        out["error"] = _error(e)
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _busy(op):
    """Work for between the halves of a split call: a 1024 x 1024 fp32 matmul on the GPU's stream;
    on the host (where each half has finished when it returns) a small one."""
    from epgen.cli.stress import _matmul

    if op.device.type == "cpu":
        import torch

        a = torch.randn(64, 64)
        return lambda: a @ a
    return _matmul(op.device)


def _time(op, case: Case, seed: int) -> dict:
    """Median queued dispatch and combine times, microseconds, at the even token pattern."""
    from epgen.harness.timing import time_pairs_queued
    from epgen.harness.verify import make_inputs, op_arg, op_inputs

    tokens = case.tokens("even")
    args = op_inputs(op, make_inputs(op.config, tokens, "uniform", seed, device=op.device))
    for r in op.local_ranks:
        op.combine_input(r).normal_()
    ys = op_arg(op, [op.combine_input(r) for r in op.local_ranks])
    if not op.virtual:
        import torch.distributed as dist

        dist.barrier()
    pair = time_pairs_queued(lambda: op.dispatch(*args), lambda: op.combine(ys), iters=TIMING_ITERS)
    op.synchronize()
    return {"dispatch_us": round(pair.queued[0].median_us, 2), "combine_us": round(pair.queued[1].median_us, 2)}


def _run_virtual(cases, seed: int, report, op_kwargs=None) -> list[dict]:
    """The virtual cases, one op per config; ``op_kwargs``: more arguments of every op
    (``device="cpu", arch=...`` on the host)."""
    from epgen.op import EpDispatchCombine

    results = []
    for (cfg, _), group in _groups(cases).items():
        try:
            op = EpDispatchCombine(cfg, virtual=True, **(op_kwargs or {}))
        except Exception as e:  # noqa: BLE001
            for c in group:
                results.append(report(_result(c, error=f"building the op: {_error(e)}")))
            continue
        skip = _host_skip(op)
        for c in group:
            results.append(report(_result(c, ok=True, skipped=skip) if skip else _run_case(op, c, seed)))
        op.close()
    return results


def _process_rank(rank: int, world_size: int, cases, seed: int, out_dir: str, op_kwargs=None) -> None:
    """One rank of the ``processes`` cases (``epgen.harness.ranks.run_ranks``): one op per
    config (``op_kwargs``: more arguments of it); writes its results to ``out_dir/rank<r>.json``."""
    import torch.distributed as dist

    from epgen.op import EpDispatchCombine

    results = []
    for (cfg, _), group in _groups(cases).items():
        op = EpDispatchCombine(cfg, **(op_kwargs or {}))
        skip = _host_skip(op)  # the same on every rank: the plan is the config's
        for c in group:
            results.append(_result(c, ok=True, skipped=skip) if skip else _run_case(op, c, seed))
            if not results[-1]["ok"]:  # the peers may be stuck in the failed round: stop here
                Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
                raise AssertionError(f"rank {rank}: {results[-1]['case']}: {results[-1]['error']}")
        dist.barrier()  # every peer is done with this rank's arena
        op.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _run_processes(cases, seed: int, report, op_kwargs=None) -> list[dict]:
    """The ``processes`` cases: W processes a world size (``run_ranks``; over gloo without a GPU,
    for the host emulation, ``op_kwargs`` ``device="cpu"``), each rank's results merged per case."""
    from epgen.harness.ranks import run_ranks

    results = []
    by_world = defaultdict(list)
    for c in cases:
        by_world[c.world_size].append(c)
    for W, group in by_world.items():
        with tempfile.TemporaryDirectory() as out_dir:
            failure = None
            try:
                run_ranks(W, _process_rank, group, seed, out_dir, op_kwargs, timeout_s=300)
            except Exception as e:  # noqa: BLE001  (a rank failed or hung: its cases are reported)
                failure = _error(e)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
        for i, c in enumerate(group):
            got = [r[i] for r in ranks if i < len(r)]
            if len(got) == W and all(g["ok"] for g in got) and got[0]["skipped"]:
                merged = got[0]
            elif len(got) == W and all(g["ok"] for g in got):
                merged = dict(got[0], bound_ratio=max(g["bound_ratio"] for g in got),
                              combine_err=max(g["combine_err"] for g in got),
                              dispatch_us=max((g["dispatch_us"] for g in got if g["dispatch_us"] is not None),
                                              default=None),
                              combine_us=max((g["combine_us"] for g in got if g["combine_us"] is not None),
                                             default=None))
            else:
                errors = [g["error"] for g in got if g["error"]]
                merged = _result(c, error=errors[0] if errors else failure or "not run: an earlier case failed")
            results.append(report(merged))
    return results


def versions(gpu: bool = True) -> dict:
    """Versions of everything a bug report needs: epgen, Python, torch (and its CUDA / HIP build),
    CuPy, the GPU runtime and driver as CuPy reports them (CUDA: ``cudaRuntimeGetVersion`` /
    ``cudaDriverGetVersion``, e.g. 12080; ROCm: ``hipRuntimeGetVersion`` / ``hipDriverGetVersion``,
    e.g. 70051831 = HIP 7.0.51831). ``gpu=False`` (the host emulation): no CuPy, runtime or
    driver; the ``ziglang`` package (whose clang compiles the host kernels) and the OS instead."""
    import torch

    from epgen import __version__

    out = {"epgen": __version__, "python": host.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None)}
    if not gpu:
        from importlib import metadata

        try:
            zig = metadata.version("ziglang")
        except metadata.PackageNotFoundError:
            zig = None
        return {**out, "ziglang": zig, "os": f"{host.system()} {host.release()} {host.machine()}"}
    import cupy

    rt = cupy.cuda.runtime
    return {**out, "cupy": cupy.__version__, "runtime": rt.runtimeGetVersion(), "driver": rt.driverGetVersion()}


def run(output: str | None, seed: int, console, device: str | None = None, arch: str | None = None) -> int:
    """Run every case on this machine's GPU(s), print the table and write the report; returns the
    exit status (0: every case passed; 1: a failure). Without a GPU prints the cases and returns 2:
    nothing was verified, so a script that runs the selftest does not read it as passed.
    ``device="cpu"``: every case on the host emulation of ``arch`` (default ``epgen.op.HOST_ARCH``,
    sm_90) instead (``run_host``)."""
    import torch

    if device == "cpu":
        return run_host(output, seed, console, arch)
    if not torch.cuda.is_available():
        console.print(f"epgen selftest: no GPU here (torch.cuda.is_available() is False); on a GPU it would run "
                      f"these {len(CASES)} cases, compiling {len(_groups(CASES))} configs:")
        print_cases(console)
        console.print("`epgen selftest --device cpu` runs them on this CPU: the real kernels on the host emulation "
                      "(docs/host.md), for correctness, not speed; nothing was verified here (exit status 2)",
                      markup=False)
        return 2
    from epgen.device import device_arch

    arch = device_arch(torch.cuda.current_device())
    path = Path(output) if output else Path(f"selftest-{arch}.json")
    started = time.perf_counter()
    info = {"arch": arch, "gpu": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
            "versions": versions()}
    console.print(f"epgen selftest on {info['gpu_count']} x {info['gpu']} ({arch}); {len(CASES)} cases")
    return _run_all(CASES, seed, console, info, path, started)


def run_host(output: str | None, seed: int, console, arch: str | None = None) -> int:
    """Every case (``host_cases``) on the host emulation of ``arch`` (``epgen.host``; no GPU, no
    CuPy): the virtual cases in this process, the ``processes`` cases as W processes over gloo.
    Nothing is timed. The report (default ``selftest-host-<arch>.json``) says ``"device": "cpu"``
    and ``"timing"``: why there are no times. Returns the exit status (1 on a failure).

    Raises:
        ValueError: an arch epgen has no kernels for (``epgen.codegen.arch.ARCHES``).
    """
    from epgen.codegen.arch import traits
    from epgen.op import HOST_ARCH

    arch = traits(arch or HOST_ARCH).name
    cases = host_cases()
    path = Path(output) if output else Path(f"selftest-host-{arch}.json")
    started = time.perf_counter()
    info = {"arch": arch, "device": "cpu", "gpu": None, "gpu_count": 0, "timing": HOST_NOTE,
            "versions": versions(gpu=False)}
    console.print(f"epgen selftest on the host emulation of {arch} (the CPU; docs/host.md); {len(cases)} cases; "
                  f"{HOST_NOTE}")
    return _run_all(cases, seed, console, info, path, started, op_kwargs={"device": "cpu", "arch": arch})


def _run_all(cases, seed: int, console, info: dict, path: Path, started: float, op_kwargs=None) -> int:
    """Run ``cases`` (virtual, then processes), print each and the table, write the report; the exit status."""

    def report(result: dict) -> dict:
        mark = f"skipped: {result['skipped']}" if result.get("skipped") else (
            "ok" if result["ok"] else f"FAILED: {result['error']}")
        console.print(f"  {result['where']} W={result['world_size']} {result['case']}: {mark} "
                      f"({result['seconds']:.1f} s)", markup=False)
        return result

    results = _run_virtual([c for c in cases if c.where == "virtual"], seed, report, op_kwargs=op_kwargs)
    results += _run_processes([c for c in cases if c.where == "processes"], seed, report, op_kwargs=op_kwargs)
    info.update(seconds=round(time.perf_counter() - started, 1), results=results,
                failures=[{"case": r["case"], "where": r["where"], "world_size": r["world_size"], "error": r["error"]}
                          for r in results if not r["ok"]])
    skipped = sum(bool(r.get("skipped")) for r in results)
    _table(console, results, info)
    path.write_text(_markdown(info) if path.suffix == ".md" else json.dumps(info, indent=1) + "\n")
    console.print(f"{len(results) - len(info['failures']) - skipped} of {len(results)} cases passed"
                  f"{f', {skipped} skipped' if skipped else ''} in {info['seconds']} s; report: {path}")
    return 1 if info["failures"] else 0


def print_cases(console, device: str | None = None) -> None:
    """The case list as a table (no GPU needed); ``device="cpu"``: as the host emulation runs them."""
    from rich.table import Table

    on_host = device == "cpu"
    table = Table(title="epgen selftest cases" + (f" on the host emulation (--device cpu): nothing timed; skipped "
                                                  f"where a kernel runs more than {HOST_MAX_THREADS} threads a rank"
                                                  if on_host else ""))
    for col in ("where", "W", "family", "layout", "transport", "dtype", "wire", "timed"):
        table.add_column(col)
    for c in host_cases() if on_host else CASES:
        table.add_row(c.where, str(c.world_size), c.family + (" split" if c.split else ""), c.layout, c.transport,
                      c.dtype, c.wire, "yes" if c.timed and not c.host else "")
    console.print(table)


def _mark(result: dict) -> str:
    """A result's word in the table: ok, FAILED or skipped."""
    return "skipped" if result.get("skipped") else "ok" if result["ok"] else "FAILED"


def _title(info: dict) -> str:
    """Where the selftest ran: ``8 x AMD Instinct MI355X (gfx950)``, or ``the host emulation of gfx942 (CPU)``."""
    if info.get("device") == "cpu":
        return f"the host emulation of {info['arch']} (CPU)"
    return f"{info['gpu_count']} x {info['gpu']} ({info['arch']})"


def _table(console, results, info) -> None:
    from rich.table import Table

    table = Table(title=f"epgen selftest: {_title(info)}")
    for col in ("where", "W", "case", "result", "err / bound", "dispatch us", "combine us"):
        table.add_column(col)
    for r in results:
        table.add_row(r["where"], str(r["world_size"]), r["case"], _mark(r),
                      "" if r["bound_ratio"] is None else f"{r['bound_ratio']:.3f}",
                      "" if r["dispatch_us"] is None else f"{r['dispatch_us']:.1f}",
                      "" if r["combine_us"] is None else f"{r['combine_us']:.1f}")
    console.print(table)


def _markdown(info: dict) -> str:
    lines = [f"# epgen selftest: {_title(info)}", "",
             "| " + " | ".join(f"{k}: {v}" for k, v in info["versions"].items()) + " |", "", f"{info['seconds']} s", "",
             *([info["timing"], ""] if info.get("timing") else []),
             "| where | W | case | result | err / bound | max err | dispatch us | combine us |", "|---" * 8 + "|"]
    for r in info["results"]:
        lines.append(f"| {r['where']} | {r['world_size']} | {r['case']} | {_mark(r)} | "
                     f"{r['bound_ratio']} | {r['combine_err']} | {r['dispatch_us']} | {r['combine_us']} |")
    lines += ["", "## Failures", ""] + [f"- {f['where']} W={f['world_size']} {f['case']}: {f['error']}"
                                        for f in info["failures"]]
    skipped = [r for r in info["results"] if r.get("skipped")]
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {r['where']} W={r['world_size']} {r['case']}: {r['skipped']}"
                                           for r in skipped]
    return "\n".join(lines) + "\n"
