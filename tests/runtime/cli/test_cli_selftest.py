"""The epgen command line on the CPU: selftest (its cases, its report, the ranks' results, the host subset)."""

import io
import json
import os
import subprocess
import sys

import attrs
import pytest

from epgen.cli import main
from epgen.codegen.arch import ARCHES

from cli_helpers import _usage_error, run


def test_selftest_cases_cover_every_family_layout_transport_dtype_and_wire_and_build_for_every_arch():
    from epgen.aot import config_specs
    from epgen.cli.selftest import CASES, _groups
    from epgen.codegen.arch import ARCH_TRAITS
    from epgen.codegen.config import DISPATCH_TRANSPORTS, KERNEL_FAMILIES, LAYOUTS
    from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES

    assert {c.family for c in CASES} == set(KERNEL_FAMILIES) - {"auto"}  # "auto" picks one of the two per call
    assert {c.layout for c in CASES} == set(LAYOUTS)
    assert {c.transport for c in CASES} == set(DISPATCH_TRANSPORTS) - {"auto"}
    assert {c.dtype for c in CASES} == set(DTYPES) and {c.wire for c in CASES} == set(COMBINE_QUANTS)
    where = {(c.where, c.world_size) for c in CASES}
    assert where == {("virtual", 2), ("virtual", 4), ("processes", 2)}
    for w in where:  # the low-latency family whole and split, and a timed case, in each setting
        mine = [c for c in CASES if (c.where, c.world_size) == w]
        assert {c.split for c in mine if c.family == "low_latency"} == {False, True}, w
        assert any(c.timed for c in mine), w
    assert len({c.name for c in CASES if c.where == "virtual" and c.world_size == 2}) == len(
        [c for c in CASES if c.where == "virtual" and c.world_size == 2])
    assert len(_groups(CASES)) == 19  # configs compiled: cases that differ in split/timing share an op
    for cfg, _ in _groups(CASES):
        for arch in ARCH_TRAITS:  # every config's kernels exist on every arch (its geometry defaults included)
            assert config_specs(cfg, arch), (cfg, arch)


def test_selftest_without_a_gpu_lists_its_cases_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "epgen", "selftest"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})  # the table's rows whole
    if "no GPU here" not in r.stdout:
        pytest.skip("a GPU is present: the selftest ran (tests/gpu covers its kernels)")
    text = " ".join(r.stdout.split())
    assert r.returncode == 2 and r.stderr == "", r.stderr  # nothing verified: not read as passed
    assert "nothing was verified here (exit status 2)" in text
    assert "epgen selftest: no GPU here (torch.cuda.is_available() is False); on a GPU it would run these 22 cases, " \
           "compiling 19 configs:" in text
    assert "│ processes │ 2 │ low_latency split │ rank │ push │ bf16 │ none │" in text
    listed = run("selftest", "--list")
    assert listed.returncode == 0 and "epgen selftest cases" in listed.stdout
    refused = run("selftest", "--json")
    assert refused.returncode == 2 and "epgen selftest does not take it" in refused.stderr


def test_selftest_refuses_an_unwritable_report_before_any_case(tmp_path, capsys):
    err = _usage_error(["selftest", "-o", str(tmp_path / "missing" / "report.json")], capsys)
    assert f"-o {tmp_path / 'missing' / 'report.json'}: parent directory {tmp_path / 'missing'} does not exist" in err
    assert "is a directory" in _usage_error(["selftest", "-o", str(tmp_path)], capsys)


def test_selftest_reports_every_result_writes_the_report_and_fails_on_a_failure(monkeypatch, tmp_path):
    """The GPU path's reporting with the GPU and the cases' runs replaced: the table, the JSON and
    Markdown reports, and the exit status."""
    from rich.console import Console

    from epgen.cli import selftest

    monkeypatch.setattr(selftest, "versions", lambda: {"epgen": "0.1.0", "cupy": "14.2.0", "runtime": 70051831})
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda device=None: "AMD Instinct MI355X")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.setattr("epgen.device.device_arch", lambda index: "gfx950")

    def fake_runs(fail):
        def runs(cases, seed, report, op_kwargs=None):
            return [report(selftest._result(c, ok=not (fail and i == 0), rounds=2, bound_ratio=0.25,
                                            combine_err=1e-3, error="rank 1: combine out[3, 5] above its bound"
                                            if fail and i == 0 else None))
                    for i, c in enumerate(cases)]
        return runs

    for fail, name, status in ((False, "report.json", 0), (True, "report.md", 1)):
        monkeypatch.setattr(selftest, "_run_virtual", fake_runs(fail))
        monkeypatch.setattr(selftest, "_run_processes", fake_runs(False))
        console = Console(width=200, record=True, file=io.StringIO())
        assert selftest.run(str(tmp_path / name), 0, console) == status
        text = console.export_text()
        assert "epgen selftest on 8 x AMD Instinct MI355X (gfx950); 22 cases" in text
        assert f"{22 - fail} of 22 cases passed" in text and f"report: {tmp_path / name}" in text
        written = (tmp_path / name).read_text()
        if name.endswith(".json"):
            report = json.loads(written)
            assert report["arch"] == "gfx950" and report["versions"]["runtime"] == 70051831
            assert len(report["results"]) == 22 and report["failures"] == []
            assert {r["bound_ratio"] for r in report["results"]} == {0.25}
        else:
            assert written.startswith("# epgen selftest: 8 x AMD Instinct MI355X (gfx950)")
            assert "- virtual W=2 normal rank push bf16 wire=none: rank 1: combine out[3, 5] above its bound" in written


def test_selftest_merges_the_ranks_results_and_reports_a_failed_rank(monkeypatch):
    """``_run_processes`` with ``run_ranks`` replaced: each rank's file merged (worst error, slowest
    time); a rank that failed makes its case and the cases after it fail with the message."""
    from epgen.cli import selftest
    from epgen.harness import ranks

    cases = [c for c in selftest.CASES if c.where == "processes"]

    def fake_run_ranks(W, fn, group, seed, out_dir, op_kwargs, timeout_s=None):
        for r in range(W):
            got = [selftest._result(c, ok=True, rounds=2, bound_ratio=0.1 * (r + 1), combine_err=0.01,
                                    dispatch_us=10.0 + r if c.timed else None, combine_us=None) for c in group]
            if fail:
                got = got[:1] + [selftest._result(group[1], error="rank 1: a received row differs")] if r else got[:1]
            (Path(out_dir) / f"rank{r}.json").write_text(json.dumps(got))
        if fail:
            raise RuntimeError("process 1 terminated with exit code 1")

    from pathlib import Path

    monkeypatch.setattr(ranks, "run_ranks", fake_run_ranks)
    fail = False
    got = selftest._run_processes(cases, 0, lambda r: r)
    assert [r["ok"] for r in got] == [True] * 4 and got[0]["bound_ratio"] == 0.2 and got[0]["dispatch_us"] == 11.0
    fail = True
    got = selftest._run_processes(cases, 0, lambda r: r)
    assert [r["ok"] for r in got] == [True, False, False, False]
    assert got[1]["error"] == "rank 1: a received row differs"
    assert got[2]["error"] == got[3]["error"] == "RuntimeError: process 1 terminated with exit code 1"


# --- epgen selftest --device cpu: the host emulation --------------------------------------------


def test_selftest_device_and_arch_refused_with_the_reason(capsys):
    err = _usage_error(["selftest", "--arch", "gfx942"], capsys)
    assert "--arch gfx942: only with --device cpu (the host emulation runs that arch's kernels)" in err
    err = _usage_error(["selftest", "--device", "cpu", "--arch", "gfx90a"], capsys)
    assert f"--arch gfx90a: unknown arch; epgen has kernels for {', '.join(ARCHES)}" in err
    assert "invalid choice: 'tpu'" in _usage_error(["selftest", "--device", "tpu"], capsys)


def test_selftest_lists_the_host_cases_and_skips_a_kernel_of_a_gpus_geometry(capsys):
    """``--device cpu --list``: the same cases (the expert layout at the host's geometry), none timed;
    a case whose op plans a kernel of more than HOST_MAX_THREADS threads a rank is skipped, naming it."""
    import types

    import torch

    from epgen.cli import selftest
    from epgen.codegen.config import EpConfig
    from epgen.host import GEOMETRY
    from epgen.plan import Plan

    assert main(["selftest", "--device", "cpu", "--list"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (f"on the host emulation (--device cpu): nothing timed; skipped where a kernel runs more than "
            f"{selftest.HOST_MAX_THREADS} threads a rank") in out and "yes" not in out
    cases = selftest.host_cases()
    assert [attrs.evolve(c, host=False) for c in cases] == list(selftest.CASES)  # the same list and shapes
    assert all(c.config.dispatch_geometry is None for c in cases if c.layout == "expert")  # the host's geometry
    assert f"more than {selftest.HOST_MAX_THREADS} threads a rank (a GPU's geometry) is skipped" in " ".join(
        run("selftest", "--help").stdout.split())

    def op(**kw):
        cfg = EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=16, kernel_family="normal",
                       dispatch_geometry=GEOMETRY, combine_geometry=GEOMETRY, **kw)
        return types.SimpleNamespace(device=torch.device("cpu"), plan=Plan.build(cfg, "sm_90", 2))

    assert selftest._host_skip(op()) is None
    assert selftest._host_skip(op(combine_quant="fp8_blockwise")) == (
        "epgen_combine_quantize_sm90_bf16_w2_h256_k2_l2_t16_264x16_u2_qfp8b runs 135168 threads a rank (a GPU's "
        f"geometry; the host runs at most {selftest.HOST_MAX_THREADS}, each a fiber: minutes a launch)")


@pytest.mark.slow
def test_selftest_on_the_host_runs_a_subset_reports_without_timing_and_fails_on_a_failure(monkeypatch, tmp_path):
    """``epgen selftest --device cpu`` on three of its cases (a timed virtual one, the low-latency
    split, a timed W = 2 processes one): the real kernels of gfx1250 on the host emulation,
    verified, no times, a report without CuPy; exit status 1 when a round fails; sm_90 by default."""
    from epgen.cli import selftest
    from epgen.harness import verify

    want = [("virtual", "normal", False, True), ("virtual", "low_latency", True, False),
            ("processes", "normal", False, True)]
    picked = [next(c for c in selftest.host_cases() if (c.where, c.family, c.split, c.timed) == w and c.world_size == 2
                   and (c.layout, c.transport, c.dtype, c.wire) == ("rank", "push", "bf16", "none")) for w in want]
    monkeypatch.setattr(selftest, "host_cases", lambda: tuple(picked))
    report = tmp_path / "host.json"
    assert main(["selftest", "--device", "cpu", "--arch", "gfx1250", "-o", str(report)]) == 0
    info = json.loads(report.read_text())
    assert (info["device"], info["arch"], info["gpu_count"]) == ("cpu", "gfx1250", 0)
    assert "timing is not measured on the host emulation" in info["timing"] and info["failures"] == []
    assert "cupy" not in info["versions"] and info["versions"]["ziglang"]
    got = [(r["where"], r["ok"], r["rounds"], r["dispatch_us"], r["combine_us"]) for r in info["results"]]
    assert got == [("virtual", True, 2, None, None)] * 2 + [("processes", True, 2, None, None)]
    assert all(0 < r["bound_ratio"] <= 1 for r in info["results"])

    def failing(op, cfg, tokens, kind, seed, busy=None):
        raise AssertionError("rank 1: combine out[3, 5] above its bound")

    monkeypatch.setattr(verify, "run_round", failing)
    monkeypatch.setattr(selftest, "host_cases", lambda: tuple(picked[1:2]))  # its op is compiled already
    assert main(["selftest", "--device", "cpu", "--arch", "gfx1250", "-o", str(tmp_path / "host.md")]) == 1
    written = (tmp_path / "host.md").read_text()
    assert written.startswith("# epgen selftest: the host emulation of gfx1250 (CPU)")
    assert "- virtual W=2 low_latency split rank push bf16 wire=none: AssertionError: rank 1: combine out[3, 5] " \
           "above its bound" in written
    monkeypatch.setattr(selftest, "host_cases", lambda: ())
    monkeypatch.chdir(tmp_path)
    assert main(["selftest", "--device", "cpu"]) == 0  # the default arch and report name
    assert json.loads((tmp_path / "selftest-host-sm_90.json").read_text())["arch"] == "sm_90"
