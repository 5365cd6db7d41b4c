"""The epgen command line, on the CPU."""

import io
import json
import os
import re
import subprocess
import sys

import attrs
import pytest

from epgen.cli import main
from epgen.codegen.arch import ARCHES
from epgen.codegen.spec import LOW_LATENCY_OPS, CALLS
from epgen.codegen.tuning import defaults

OPS = [op.value for op in CALLS + LOW_LATENCY_OPS]
"""The kernels of one rank-layout shape (EpConfig's default kernel_family "auto": both families), in order."""


def run(*argv):
    return subprocess.run([sys.executable, "-m", "epgen", *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("verb", ["generate", "check", "report", "diff", "build", "demo", "bench", "tune", "stress",
                                  "selftest"])
def test_help_on_every_verb(verb):
    r = run(verb, "--help")
    assert r.returncode == 0 and "usage: epgen " + verb in r.stdout


def test_help_names_every_arch(capsys):
    """``epgen --help`` names every row of ARCH_TRAITS (the description is built from the table)."""
    from epgen.codegen.arch import ARCHES

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert len(ARCHES) == 4 and all(arch in text for arch in ARCHES), text


def test_generate_check_passes_on_repo():
    r = run("generate", "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_generate_one_model(tmp_path):
    assert main(["generate", "--model", "gpt-oss-120b", "--arch", "sm_90", "-o", str(tmp_path), "--quiet"]) == 0
    files = sorted(p.name for p in (tmp_path / "sm_90").iterdir())
    assert len(files) == len(OPS) and all(f.endswith(".cu") and "_h2880_k4_" in f for f in files)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["spec"]["op"] for s in manifest["sources"]] == OPS


def test_generate_the_expert_layout_with_a_receive_cap(tmp_path):
    assert main(["generate", "--model", "gpt-oss-120b", "--layout", "expert", "--expert-alignment", "16",
                 "--max-recv-tokens", "5000", "--arch", "sm_90", "-o", str(tmp_path), "--quiet"]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["spec"]["op"] for s in manifest["sources"]] == OPS + ["expand_plan", "expand", "fold"]
    assert all(s["spec"]["recv_tokens"] == 5000 and s["spec"]["expert_alignment"] == 16 for s in manifest["sources"])


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt-oss-120b", "--expert-alignment", "16"],
     r"EpConfig.expert_alignment=16: applies to layout='expert' only .*\(--expert-alignment\)"),
    (["--model", "gpt-oss-120b", "--layout", "expert", "--expert-alignment", "3"],
     r"EpConfig.expert_alignment=3: must be a power of two from 1 to 256 rows \(--expert-alignment\)"),
    (["--model", "gpt-oss-120b", "--max-recv-tokens", "40000"],
     r"EpConfig.max_recv_tokens=40000: must be None or an int in \[1, .* = 32768\] \(--max-recv-tokens\)"),
    (["--layout", "expert"], "--layout expert: the catalogue is fixed"),
])
def test_layout_flags_errors_name_the_flag(argv, message):
    r = run("generate", *argv, "-o", "/nonexistent-epgen-out")
    assert r.returncode == 2 and re.search(message, r.stderr), r.stderr


def test_generate_custom_shape_and_check_detects_drift(tmp_path):
    argv = ["generate", "--hidden", "3072", "--topk", "6", "--num-experts", "64", "--world-size", "4",
            "--arch", "gfx950", "-o", str(tmp_path)]
    assert main(argv + ["--quiet"]) == 0
    assert main(argv + ["--check", "--quiet"]) == 0
    next(tmp_path.rglob("*.hip")).write_text("// edited\n")
    assert main(argv + ["--check", "--quiet"]) == 1


def test_unknown_model_suggests_close_names():
    r = run("generate", "--model", "deepseek-v4", "-o", "/tmp/x")
    assert r.returncode == 2 and "deepseek-v3" in r.stderr


def test_bad_shape_names_the_rule():
    r = run("generate", "--hidden", "7170", "--topk", "8", "--num-experts", "256", "-o", "/tmp/x")
    assert r.returncode == 2 and "KernelSpec.hidden=7170" in r.stderr and "multiple of 16 bytes" in r.stderr


def test_check_one_model_json():
    r = run("check", "--model", "mixtral-8x7b", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == len(ARCHES) * len(OPS) and all(row["status"] == "ok" for row in rows)


def test_demo_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU demo runs on the device instead")
    r = run("demo", "--model", "mixtral-8x7b")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU here" in r.stdout and "epgen_dispatch_sm90" in r.stdout.replace("\n", "")


def test_list_models():
    r = run("generate", "--list-models")
    assert r.returncode == 0 and "deepseek-v3" in r.stdout and "llama4-maverick" in r.stdout


def test_report_json_has_occupancy_per_arch():
    r = run("report", "--model", "deepseek-v3", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(x["arch"], x["op"]) for x in rows} == {(a, o) for a in ARCHES
                                                   for o in OPS}
    assert all(x["status"] == "ok" and x["occupancy"] >= 1 for x in rows)
    units = {x["arch"]: x["occupancy_unit"] for x in rows}
    assert units == {"gfx942": "waves/SIMD", "gfx950": "waves/SIMD", "gfx1250": "waves/SIMD", "sm_90": "blocks/SM"}


def test_report_writes_markdown_and_csv(tmp_path):
    md, csv_path = tmp_path / "r.md", tmp_path / "r.csv"
    assert main(["report", "--model", "mixtral-8x7b", "--arch", "sm_90", "--markdown", str(md), "--csv",
                 str(csv_path), "--quiet"]) == 0
    assert "epgen_dispatch_sm90" in md.read_text() and csv_path.read_text().startswith("arch,op,entry")


def test_diff_two_specs_exits_1_and_groups_by_variant():
    r = run("diff", "--model", "deepseek-v3", "--arch", "sm_90", "--a", "unroll=2", "--b", "unroll=8")
    assert r.returncode == 1
    assert "=== dispatch sm_90" in r.stdout and "=== combine sm_90" in r.stdout
    assert "-constexpr int kUnroll = 2;" in r.stdout and "+constexpr int kUnroll = 8;" in r.stdout


def test_diff_identical_specs_exits_0():
    r = run("diff", "--model", "deepseek-v3", "--arch", "gfx950", "--a", "unroll=4", "--b", "unroll=4")
    assert r.returncode == 0 and "no differences" in r.stdout


def test_diff_arch_against_arch():
    r = run("diff", "--model", "gpt-oss-120b", "--arch", "gfx950", "--a", "arch=gfx950", "--b", "arch=gfx1250")
    assert r.returncode == 1 and "ballot_w64" in r.stdout and "ballot_w32" in r.stdout


def test_diff_bad_field_names_the_rule():
    r = run("diff", "--model", "deepseek-v3", "--a", "unrol=2", "--b", "unroll=8")
    assert r.returncode == 2 and "FIELD=VALUE" in r.stderr
    r = run("diff", "--model", "deepseek-v3", "--a", "unroll=0", "--b", "unroll=8")
    assert r.returncode == 2 and "KernelSpec.unroll=0" in r.stderr


def test_output_files_that_cannot_be_written_are_refused_before_the_run(tmp_path, capsys):
    same = tmp_path / "r.txt"
    r = run("report", "--model", "deepseek-v3", "--arch", "sm_90", "--markdown", str(same), "--csv", str(same))
    assert r.returncode == 2 and f"--markdown and --csv name the same file {same}: give each output its own" in r.stderr
    # a file that exists but cannot be written (os.access as a non-root user sees a read-only file)
    import argparse

    from epgen.cli import flags

    ro = tmp_path / "ro.csv"
    ro.write_text("")
    real = os.access
    denied = lambda path, mode: False if (str(path) == str(ro) and mode == os.W_OK) else real(path, mode)  # noqa: E731
    parser = argparse.ArgumentParser(prog="epgen")
    with pytest.MonkeyPatch.context() as m, pytest.raises(SystemExit):
        m.setattr(flags.os, "access", denied)
        flags.check_output_files([("--csv", ro)], parser)
    assert f"--csv {ro}: exists and is not writable" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as m, pytest.raises(SystemExit):
        m.setattr(flags.os, "access", denied)
        flags.check_output(str(tmp_path / "ro"), parser)
    assert f"{ro} exists and is not writable" in capsys.readouterr().err
    (tmp_path / "d.env.txt").mkdir()
    with pytest.raises(SystemExit):
        flags.check_output(str(tmp_path / "d"), parser)
    assert f"{tmp_path / 'd.env.txt'} is a directory" in capsys.readouterr().err


def test_diff_across_combine_wires_keeps_the_quantized_combines_rule():
    shape = ("--model", "deepseek-v3", "--world-size", "2", "--kernel-family", "normal", "--arch", "sm_90")
    r = run("diff", *shape, "--a", "combine_quant=none", "--b", "combine_quant=fp8_blockwise")
    assert r.returncode == 2 and "KernelSpec.warps_per_block=32: 1024 threads; a combine with a quantized wire" in r.stderr
    r = run("diff", *shape, "--a", "combine_quant=none", "warps_per_block=16", "--b", "combine_quant=fp8_blockwise",
            "warps_per_block=16")
    assert r.returncode == 1 and "+++ epgen_combine_sm90_bf16_w2_h7168_k8_l128_t4096_16x16_u4_qfp8b" in r.stdout
    assert "+EP_DEVICE void ep_wire_add_roundtrip(" in r.stdout


def test_diff_committed_catalogue_is_clean():
    r = run("diff")
    assert r.returncode == 0, r.stdout[-2000:]


def test_conflicting_shape_flags_are_errors():
    r = run("generate", "--model", "mixtral-8x7b", "--hidden", "2048", "--topk", "4", "--num-experts", "16", "-o", "/tmp/x")
    assert r.returncode == 2 and "--model mixtral-8x7b fixes the shape" in r.stderr
    r = run("generate", "--topk", "8", "--num-experts", "64", "-o", "/tmp/x")
    assert r.returncode == 2 and "--num-experts needs --hidden" in r.stderr


def test_catalogue_refuses_arch_subset_and_output_into_a_file(tmp_path):
    r = run("generate", "--arch", "sm_90")
    assert r.returncode == 2 and "catalogue covers every arch" in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = run("generate", "--model", "mixtral-8x7b", "-o", str(f))
    assert r.returncode == 2 and "is not a directory" in r.stderr


def test_catalogue_needs_a_checkout_or_output(tmp_path):
    r = subprocess.run([sys.executable, "-m", "epgen", "generate", "--check"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and "give -o DIR" in r.stderr
    assert not (tmp_path / "generated").exists()


def test_bad_numbers_are_rejected_by_the_parser():
    r = run("check", "--jobs", "-3")
    assert r.returncode == 2 and "must be at least 1" in r.stderr
    r = run("demo", "--world-size", "3")
    assert r.returncode == 2 and "multiple of world_size=3" in r.stderr


DISPATCHES = {"dispatch", "dispatch_ll", "dispatch_ll_send", "dispatch_ll_recv"}  # both families'
COMBINES = {"combine", "combine_ll", "combine_ll_send", "combine_ll_recv"}


@pytest.mark.parametrize("argv,ops,token,count", [  # 8 models, mixtral's 8 experts below top-k 9
    (["--quant", "fp8_blockwise", "--arch", "sm_90"], COMBINES | {"combine_quantize"}, "_qfp8b", 40),
    (["--dtype", "fp4", "--arch", "gfx1250"], DISPATCHES, "_fp4_", 32),
    (["--topk", "9", "--arch", "gfx950"], DISPATCHES | COMBINES, "_k9_", 56),
    (["--topk", "10", "--quant", "fp4_blockwise", "--arch", "gfx950"], COMBINES | {"combine_quantize"}, "_k10_", 35),
])
def test_check_selectors_pick_catalogue_variants(argv, ops, token, count, capsys):
    from epgen.codegen.offline import toolchain_status

    reason = toolchain_status(argv[-1])
    if reason:
        pytest.skip(reason)
    assert main(["check", *argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == count and {r["op"] for r in rows} == ops
    assert all(token in r["entry"] + "_" and r["status"] == "ok" for r in rows)


def test_selector_errors_name_the_flag():
    r = run("check", "--num-experts", "64")
    assert r.returncode == 2 and "--num-experts needs --hidden" in r.stderr
    # gfx950 left out: its low-latency dispatch spills 40-56 bytes at top-k 16 (clang 22;
    # docs/measurements/import-and-compile.md#known-spills), so check exits 1 there
    r = run("check", "--topk", "16", "--world-size", "8", "--max-tokens", "8", "--arch", "sm_90", "--arch", "gfx1250")
    assert r.returncode == 0, r.stderr
    r = run("check", "--quant", "fp16")
    assert r.returncode == 2 and "--quant: invalid choice: 'fp16'" in r.stderr


def _usage_error(argv, capsys) -> str:
    """Run ``epgen argv`` in-process; assert it is a usage error (exit 2, no traceback); its stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err


def test_world_size_over_the_wave_size_is_a_parser_error(capsys):
    err = _usage_error(["demo", "--world-size", "64"], capsys)
    assert "--world-size 64: must be at most 32, the smallest wave size" in err and "gfx1250: 32" in err
    err = _usage_error(["check", "--model", "deepseek-v3", "--world-size", "48"], capsys)
    assert "--world-size 48: must be at most 32" in err and "--arch gfx950 allows more" in err
    err = _usage_error(["demo", "--model", "bogus"], capsys)
    assert "--model bogus:" in err and "--world-size" not in err.splitlines()[-1]


def test_report_output_paths_are_checked_before_compiling(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _usage_error(["report", "--model", "deepseek-v3", "--csv", str(tmp_path / "no" / "dir" / "x.csv")], capsys)
    assert "--csv " in err and "does not exist" in err
    err = _usage_error(["report", "--model", "deepseek-v3", "--markdown", str(afile / "x.md")], capsys)
    assert f"--markdown {afile / 'x.md'}: parent directory {afile} is not a directory" in err


@pytest.mark.parametrize("argv, message", [
    (["check", "--world-size", "16"], "--world-size 16: the catalogue is fixed at W=8 / Tmax=4096; name --model"),
    (["report", "--max-tokens", "8"], "--max-tokens 8: the catalogue is fixed at W=8 / Tmax=4096"),
    (["generate", "--world-size", "4", "--max-tokens", "8"], "--world-size 4 --max-tokens 8: the catalogue is fixed"),
    (["diff", "--world-size", "4"], "--world-size: only with --a/--b"),
    (["check", "--dtype", "fp8", "--world-size", "16"], "--world-size 16: catalogue model mixtral-8x7b has 8 experts"),
    (["check", "--model", "deepseek-v3", "--world-size", "24"],
     "multiple of world_size=24 (--world-size 24 with --model deepseek-v3)"),
    (["build", "--dispatch-geometry", "24x33"], "KernelSpec.warps_per_block=33: must be in [1, 32] (--dispatch-geometry 24x33u4)"),
    (["diff", "--model", "deepseek-v3", "--a", "unroll=abc", "--b", "unroll=2"], "--a unroll=abc: KernelSpec.unroll"),
    (["diff", "--model", "deepseek-v3", "--a", "unroll=2", "unroll=4", "--b", "unroll=2"],
     "--a 'unroll=4': unroll is already set to 2"),
    (["diff", "-U", "-1"], "argument -U/--context: -1: must be at least 0"),
])
def test_usage_errors_name_the_flag_the_user_gave(argv, message, capsys):
    assert message in _usage_error(argv, capsys).splitlines()[-1]


def test_build_output_errors_name_where_the_directory_came_from(capsys, tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _usage_error(["build", "-o", str(afile / "sub")], capsys)
    assert f"-o {afile / 'sub'}: {afile} exists and is not a directory" in err
    monkeypatch.setenv("EPGEN_CACHE_DIR", str(afile))
    err = _usage_error(["build"], capsys)
    assert f"EPGEN_CACHE_DIR={afile}: exists and is not a directory" in err


def test_list_models_and_diff_print_json(capsys):
    assert main(["generate", "--list-models", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    assert {"name": "deepseek-v3", "hidden": 7168, "num_experts": 256, "topk": 8} in models
    assert main(["diff", "--model", "deepseek-v3", "--arch", "sm_90", "--a", "unroll=2", "--b", "unroll=8",
                 "--json"]) == 1
    chunks = json.loads(capsys.readouterr().out)
    assert [c["variant"] for c in chunks] == [f"{op} sm_90" for op in OPS]
    assert all("+constexpr int kUnroll = 8;" in c["diff"] and re.search(r"_u2(_ll\d+)?$", c["a"]) for c in chunks)


def test_missing_compiler_hint_keeps_its_brackets_and_pins(monkeypatch, capsys):
    from epgen.cli import commands as cli
    from epgen.codegen import offline

    monkeypatch.setattr(offline, "toolchain_status", lambda arch: f"NVRTC unusable: pip install {offline.nvrtc.PACKAGES}")
    assert cli._compilers_missing(["sm_90"], "check")
    out, text = capsys.readouterr()
    text = " ".join(text.split())  # stderr, unwrapped
    assert out == "" and text.startswith("epgen check: offline compilers missing")
    assert "pip install -e '.[dev]'" in text and "'nvidia-cuda-nvrtc==13.0.88'" in text
    assert "'cuda-bindings>=13,<14'" in text


def test_diff_keeps_its_status_when_the_reader_stops_early():
    r = subprocess.run(f"{sys.executable} -m epgen diff --model deepseek-v3 --arch sm_90 --a unroll=2 --b unroll=8 "
                       "| head -3; exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and r.stdout.startswith("=== dispatch sm_90") and "Traceback" not in r.stderr


def test_report_rows_use_null_and_tables_read_at_80_and_120_columns(capsys):
    """The table shows a short variant label per row (payload, the shape fields that differ,
    geometry) on one line, nothing cut; the full entry names are in --json and the CSV."""
    from rich.console import Console

    from epgen.codegen.report import resource_table, to_csv

    assert main(["check", "--model", "mixtral-8x7b", "--arch", "sm_90", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["agprs"] is None and r["sgprs"] is None for r in rows)
    assert all(r["entry"] in to_csv(rows) for r in rows)
    for width in (80, 120):
        console = Console(width=width, record=True)
        console.print(resource_table(rows, "t"))
        text = console.export_text()
        assert "…" not in text and all(len(line) <= width for line in text.splitlines())
        lines = [line for line in text.splitlines() if line.startswith("sm_90 ")]
        assert [line.split()[1:4] for line in lines] == [["dispatch", "bf16", "24x32u4"], ["combine", "bf16", "24x32u4"]] + [
            [op, "bf16", str(defaults("sm_90", "dispatch_ll", 4096)[0].geometry)] for op in OPS[2:]]  # no table entry for the shape
        assert "every row: w8 h4096 k2 l1 t4096" in text


def test_catalogue_table_labels_stay_short_at_80_columns():
    """Across models the label adds the shape fields that differ; a row takes at most two lines."""
    from rich.console import Console

    from epgen.codegen.catalogue import catalogue_specs
    from epgen.codegen.report import resource_table, variant_labels

    specs = [s.as_dict() for s in catalogue_specs(arches=("sm_90",))]
    labels, common = variant_labels(specs)
    told = {(s["op"], label) for s, label in zip(specs, labels)}
    assert common == "w8 t4096" and len(told) == len(specs)  # the op and the label tell every variant apart
    assert labels[0] == "bf16 h7168 k8 l32 24x32u4"
    rows = [{"arch": "sm_90", "op": s["op"], "entry": "x", "spec": s, "registers": 1, "agprs": None, "sgprs": None,
             "scratch_bytes": 0, "spill_bytes": 0, "shared_bytes": 0, "occupancy": 1, "occupancy_unit": "blocks/SM",
             "status": "ok"} for s in specs]
    console = Console(width=80, record=True)
    console.print(resource_table(rows, "t"))
    body = [line for line in console.export_text().splitlines()[3:] if not line.startswith(("every", "scratch"))]
    assert len(body) <= 2 * len(rows) + 2


def _fake_report_rows(specs) -> list[dict]:
    """Report rows of ``specs`` (KernelSpecs) from made-up resources shaped like the offline
    compilers' (3-digit VGPRs, AGPRs on gfx950, SGPRs on AMD), so no compiler is needed."""
    return [{"arch": s.arch, "op": s.op.value, "entry": s.name, "spec": s.as_dict(), "compiler": f"{s.arch} compiler 1.0",
             "registers": 100 + i % 28, "agprs": 0 if s.arch == "gfx950" else None,
             "sgprs": None if s.arch == "sm_90" else 40 + i % 30, "scratch_bytes": 0, "spill_bytes": 0,
             "shared_bytes": 104, "occupancy": 1 + i % 16, "occupancy_unit": "blocks/SM", "status": "ok"}
            for i, s in enumerate(specs)]


@pytest.mark.parametrize("width", [80, 120])
def test_whole_catalogue_table_reads_at_80_and_120_columns(width, capsys, monkeypatch):
    """COLUMNS=80 (or 120) epgen check over the whole catalogue: every line fits, nothing cut, one
    line a row; scratch, spill and status are in the caption, a row that spills named there too."""
    from rich.console import Console

    from epgen.cli import commands as cli
    from epgen.codegen import catalogue
    from epgen.codegen.report import resource_table

    specs = catalogue.catalogue_specs()
    rows = _fake_report_rows(specs)
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setattr(cli, "_compilers_missing", lambda arches, verb: False)
    monkeypatch.setattr(catalogue, "report_rows", lambda specs, max_workers=None, on_done=None: rows)
    assert main(["check", "--quiet"]) == 0 and capsys.readouterr().out == ""  # quiet and ok: no table
    assert main(["check"]) == 0
    text = capsys.readouterr().out
    assert "…" not in text and all(len(line) <= width for line in text.splitlines())
    assert "every row: w8 t4096; scratch 0, spill 0, status ok" in " ".join(text.split())
    head = next(line for line in text.splitlines() if line.startswith("arch "))
    assert head.split() == ["arch", "op", "variant", "regs", "AGPR", "SGPR", "LDS", "occ"]
    body = [line for line in text.splitlines() if line.startswith(tuple(a + " " for a in ARCHES))]
    assert len(body) == len(rows)
    assert next(line for line in body if line.startswith("gfx950 ")).split()[:7] == ["gfx950", "dispatch", "bf16", "h7168", "k8", "l32", "2048x16u2"]

    rows[0] = {**rows[0], "spill_bytes": 8, "scratch_bytes": 16, "status": "scratch/spill"}
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(resource_table(rows, "t"))
    text = console.export_text()
    assert "…" not in text and all(len(line) <= width for line in text.splitlines())
    head = next(line for line in text.splitlines() if line.startswith("arch "))
    assert head.split() == ["arch", "op", "variant", "regs", "AGPR", "SGPR", "LDS", "occ"]
    assert "status scratch/spill" in " ".join(text.split()) and "every row: w8 t4096" in text


def _matplotlib(monkeypatch, present: bool) -> None:
    """Make ``importlib.util.find_spec('matplotlib')`` find it (or not), whatever is installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if present else None) if name == "matplotlib" else real(name, *a))


@pytest.mark.parametrize("argv, message", [
    (["bench", "--model", "nope"], "--model nope: model='nope': not in the catalogue"),
    (["bench", "--world-size", "3"], "multiple of world_size=3 (--world-size 3"),
    (["bench", "-o", "/proc/nope/x"], "-o /proc/nope/x: folder /proc/nope does not exist"),
    (["tune", "--world-size", "3"], "multiple of world_size=3 (--world-size 3"),
    (["tune", "--tokens", "99999999"], "max_tokens_per_rank=99999999: must be in [1, 1048576]"),
    (["stress", "--model", "nope"], "--model nope:"),
    (["diff", "-o", "/nonexistent"], "-o /nonexistent: not a directory"),
    (["bench", "--family", "low_latency", "--tokens", "8", "70000"], "EpConfig.max_tokens_per_rank=70000: "
     "kernel_family='low_latency' holds at most 65535 tokens a rank (use 'auto' or 'normal') (--world-size 2, the "
     "low_latency family with tokens up to 70000, with --model deepseek-v3)"),
    (["tune", "--low-latency-tokens", "1", "70000"], "(--world-size 2, the low_latency family with tokens up to 70000"),
    (["tune", "--family", "normal", "--low-latency-tokens", "8"],
     "--low-latency-tokens: only with --family low_latency or both"),
    (["tune", "--family", "normal", "--low-latency-geometry", "8x16u2"],
     "--low-latency-geometry: only with --family low_latency or both"),
    (["tune", "--quant", "fp8_blockwise"], "--quant fp8_blockwise: only with --family normal"),
    (["bench", "--nodes", "2", "--cpu", "--world-size", "4", "-o", "/nonexistent/x"],
     "-o /nonexistent/x: folder /nonexistent does not exist"),
    (["bench", "--nodes", "2", "--cpu", "--world-size", "4", "--combine-geometry", "24x16"],
     "--combine-geometry: not with --nodes"),
    (["stress", "--kernel-family", "low_latency", "--max-tokens", "70000"],
     "EpConfig.max_tokens_per_rank=70000: kernel_family='low_latency' holds at most 65535 tokens a rank (use 'auto' "
     "or 'normal') (--max-tokens)"),
    (["bench", "--family", "fast"], "argument --family: invalid choice: 'fast'"),
    (["stress", "--kernel-family", "both"], "argument --kernel-family: invalid choice: 'both'"),
])
def test_gpu_verbs_check_their_arguments_before_the_gpu(argv, message, capsys):
    """bench, tune and stress reject bad arguments as usage errors on any machine, GPU or not."""
    assert message in _usage_error(argv, capsys).splitlines()[-1]


def test_gpu_verbs_without_a_gpu_say_so_on_stderr(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _matplotlib(monkeypatch, present=True)
    for argv in (["bench", "-o", str(tmp_path / "b")], ["tune"], ["stress"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and f"epgen {argv[0]}: needs a GPU (torch.cuda.is_available() is False)" in err


def test_bench_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU is asked for first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _matplotlib(monkeypatch, present=False)
    assert main(["bench", "-o", str(tmp_path / "b")]) == 2
    assert "the plot needs matplotlib: pip install -e '.[bench]'" in capsys.readouterr().err


def test_gpu_verbs_need_as_many_gpus_as_ranks(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _matplotlib(monkeypatch, present=True)
    assert main(["bench", "--world-size", "2", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--world-size 2 needs 2 GPUs (one process per GPU), this machine has 1; --virtual runs all ranks" in err
    assert main(["tune", "--world-size", "4"]) == 2
    assert "--world-size 4 needs 4 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--virtual", "--world-size", "2", "--dispatch-geometry", "24x64u4"],
     "KernelSpec.warps_per_block=64: must be in [1, 32] (--dispatch-geometry 24x64u4)"),
    (["bench", "--virtual", "--world-size", "2", "--combine-geometry", "24x32u999"],
     "KernelSpec.unroll=999: must be in [1, 16] (--combine-geometry 24x32u999)"),
    (["tune", "--world-size", "1", "--geometry", "24x32u4", "24x64u4"], "(--geometry 24x64u4 on every arch)"),
    (["stress", "--virtual", "--world-size", "64"], "(--world-size 64 on this GPU's arch sm_90)"),
    (["bench", "--virtual", "--world-size", "2", "--low-latency-geometry", "16x64u2"],
     "KernelSpec.warps_per_block=64: must be in [1, 32] (--low-latency-geometry 16x64u2)"),
    (["bench", "--virtual", "--world-size", "2", "--low-latency-geometry", "600x16u2"],
     "world_size x blocks = 1200, at most 1024; at most 512 blocks (--low-latency-geometry 600x16u2)"),
    (["bench", "--virtual", "--world-size", "2", "--family", "low_latency", "--dispatch-geometry", "24x32u4"],
     "--dispatch-geometry 24x32u4: applies to the normal family's kernels, which this run does not build"),
    (["bench", "--virtual", "--world-size", "2", "--family", "normal", "--low-latency-geometry", "16x16u2"],
     "--low-latency-geometry 16x16u2: applies to the low-latency family's kernels, which this run does not build"),
    (["tune", "--virtual", "--world-size", "4", "--low-latency-geometry", "16x16u2", "600x16u2"],
     "(--low-latency-geometry 600x16u2 on every arch)"),  # --virtual: 4 ranks on the 2 GPUs are fine
    (["stress", "--virtual", "--kernel-family", "normal", "--low-latency-geometry", "16x16u2"],
     "applies to kernel_family 'auto' or 'low_latency' (kernel_family='normal' builds no low-latency kernels) "
     "(--low-latency-geometry)"),
    (["stress", "--virtual", "--world-size", "8", "--kernel-family", "low_latency", "--low-latency-geometry",
      "256x16u2"], "at most 128 blocks (--low-latency-geometry 256x16u2)"),
])
def test_gpu_verbs_check_geometry_and_world_size_against_the_gpus_arch(argv, message, capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("epgen.device.device_arch", lambda index: "sm_90")
    _matplotlib(monkeypatch, present=True)
    if argv[0] == "bench":
        argv = argv + ["-o", str(tmp_path / "b")]
    assert message in _usage_error(argv, capsys).splitlines()[-1]


def test_a_geometry_some_arch_runs_is_checked_against_the_gpus_arch(capsys, monkeypatch, tmp_path):
    """16 warps of a quantized wire's combine: 512 threads on sm_90 and gfx1250, 1024 on gfx950."""
    import torch

    argv = ["bench", "--virtual", "--world-size", "2", "--quant", "fp8_blockwise", "--combine-geometry", "24x16u4",
            "-o", str(tmp_path / "b")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("epgen.device.device_arch", lambda index: "gfx950")
    _matplotlib(monkeypatch, present=True)
    err = _usage_error(argv, capsys).splitlines()[-1]
    assert "16 warps of 64 lanes are 1024 threads on gfx950" in err
    assert err.endswith("(--combine-geometry 24x16u4 on this GPU's arch gfx950)")


def test_a_geometry_no_arch_runs_is_refused_without_a_gpu(capsys):
    err = _usage_error(["bench", "--virtual", "--world-size", "2", "--low-latency-geometry", "1024x8"], capsys)
    assert err.splitlines()[-1].endswith("world_size x blocks = 2048, at most 1024; at most 512 blocks "
                                         "(--low-latency-geometry 1024x8u4)")


@pytest.mark.parametrize("argv", [["diff", "-o", ""], ["bench", "-o", ""], ["generate", "-o", " "], ["build", "-o", ""]])
def test_an_empty_output_path_is_refused(argv, capsys):
    assert "must name a path" in _usage_error(argv, capsys).splitlines()[-1]


def test_bench_output_is_a_prefix_not_a_folder(capsys, tmp_path):
    for out in (str(tmp_path), str(tmp_path) + "/"):
        err = _usage_error(["bench", "-o", out], capsys)
        assert f"-o {out}: a path prefix for the .csv/.png/.env.txt files, not a folder" in err


def test_help_and_cpu_verbs_load_neither_torch_nor_cupy(tmp_path):
    code = f"""
import contextlib, io, sys
from epgen.cli import main
for argv in (["--help"], ["bench", "--help"], ["generate", "--model", "mixtral-8x7b", "--arch", "sm_90", "-o",
             {str(tmp_path / 'g')!r}, "--quiet"], ["check", "--model", "mixtral-8x7b", "--arch", "sm_90", "--json"],
             ["report", "--model", "mixtral-8x7b", "--arch", "sm_90", "--quiet"],
             ["diff", "--model", "mixtral-8x7b", "--arch", "sm_90", "--a", "unroll=2", "--b", "unroll=8", "--quiet"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(sorted(m for m in ("torch", "cupy") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_check_report_and_demo_print_the_compiler_releases(capsys):
    from epgen.codegen.offline import compiler_identity, toolchain_status

    if toolchain_status("sm_90"):
        pytest.skip(toolchain_status("sm_90"))
    release = compiler_identity("sm_90")
    for verb in ("check", "report"):
        assert main([verb, "--model", "mixtral-8x7b", "--arch", "sm_90"]) == 0
        assert f"sm_90: {release}" in " ".join(capsys.readouterr().out.split())
    assert main(["check", "--model", "mixtral-8x7b", "--arch", "sm_90", "--json"]) == 0
    assert {r["compiler"] for r in json.loads(capsys.readouterr().out)} == {release}
    from epgen.cli.demo import run_demo  # the demo prints the same table
    from epgen.codegen.config import EpConfig
    from rich.console import Console

    console = Console(width=120, record=True, file=io.StringIO())
    run_demo(EpConfig.for_model("mixtral-8x7b", world_size=8, max_tokens_per_rank=4096), "mixtral-8x7b", 1, console)
    assert f"sm_90: {release}" in " ".join(console.export_text().split())


@pytest.mark.parametrize("verb", ["generate", "check", "report", "diff", "build", "demo", "bench", "tune", "stress"])
def test_an_empty_model_is_an_error_not_no_model(verb, capsys):
    assert "argument --model: '': must name a catalogue model" in _usage_error([verb, "--model", ""], capsys)


def _generate(out, *extra) -> int:
    return main(["generate", "--model", "mixtral-8x7b", "--arch", "sm_90", "-o", str(out), "--quiet", *extra])


def test_generate_leaves_files_it_did_not_write(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    (foreign / "sm_90").mkdir(parents=True)
    (foreign / "manifest.json").write_text('{"schema": 1, "code_objects": {}}\n')  # a build cache's manifest
    (foreign / "sm_90" / "epgen_mine.cu").write_text("// someone's file")
    assert _generate(foreign) == 2
    assert "not a manifest epgen generate wrote" in capsys.readouterr().err
    assert (foreign / "manifest.json").read_text() == '{"schema": 1, "code_objects": {}}\n'
    assert sorted(p.name for p in (foreign / "sm_90").iterdir()) == ["epgen_mine.cu"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "REPORT.md").write_text("my notes")
    assert _generate(bare) == 2
    err = capsys.readouterr().err
    assert err.startswith("epgen generate: -o ") and "REPORT.md: exists" in " ".join(err.split())
    assert (bare / "REPORT.md").read_text() == "my notes" and not (bare / "manifest.json").exists()
    ours = tmp_path / "ours"
    assert _generate(ours) == 0
    (ours / "sm_90" / "epgen_mine.txt").write_text("not a source")
    assert main(["generate", "--model", "gpt-oss-120b", "--arch", "sm_90", "-o", str(ours), "--quiet"]) == 0
    names = sorted(p.name for p in (ours / "sm_90").iterdir())
    assert len(names) == len(OPS) + 1 and "epgen_mine.txt" in names
    assert all("_h2880_" in n for n in names if n.endswith(".cu"))


def test_a_repeated_arch_counts_once(tmp_path, capsys):
    assert _generate(tmp_path, "--arch", "sm_90") == 0
    assert len(json.loads((tmp_path / "manifest.json").read_text())["sources"]) == len(OPS)
    from epgen.codegen.offline import toolchain_status

    if not toolchain_status("sm_90"):
        assert main(["check", "--model", "mixtral-8x7b", "--arch", "sm_90", "--arch", "sm_90", "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)) == len(OPS)


@pytest.mark.parametrize("argv, message", [
    (["check", "--hidden", "4096", "--topk", "8", "--num-experts", "99999992"],
     "KernelSpec.experts_per_rank=12499999: must be in [1, 65536] (--num-experts 99999992 / --world-size 8)"),
    (["generate", "--model", "deepseek-v3", "--scale-bytes", "-2", "-o", "/tmp/x"],
     "EpConfig.scale_bytes=-2: must be an int >= 0 (--scale-bytes)"),
    (["check", "--scale-bytes", "16"], "--scale-bytes 16: the catalogue is fixed"),
    (["report", "--topk", "99999", "--arch", "sm_90"], "--topk 99999: no catalogue model has that many experts"),
    (["check", "--hidden", "4096", "--topk", "17", "--num-experts", "32"], "KernelSpec.topk=17: must be in [1, 16] (--topk)"),
])
def test_errors_of_derived_values_name_the_flag_given(argv, message, capsys):
    assert message in _usage_error(argv, capsys).splitlines()[-1]


def test_scale_bytes_reach_check_report_and_generate(tmp_path, capsys):
    assert _generate(tmp_path, "--scale-bytes", "16") == 0
    assert all(re.search(r"_s16(_ll\d+)?\.cu$", p.name) for p in (tmp_path / "sm_90").iterdir())
    from epgen.codegen.offline import toolchain_status

    if not toolchain_status("sm_90"):
        assert main(["report", "--model", "mixtral-8x7b", "--arch", "sm_90", "--scale-bytes", "16", "--json"]) == 0
        assert {r["spec"]["scale_bytes"] for r in json.loads(capsys.readouterr().out)} == {16}


def test_gpu_verbs_ask_for_a_gpu_before_matplotlib(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _matplotlib(monkeypatch, present=False)
    assert main(["bench", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "epgen bench: needs a GPU" in err and "matplotlib" not in err


def test_time_import_without_a_gpu_errs_on_stderr_with_the_verb(capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["build", "--arch", "sm_90", "-o", str(tmp_path / "c"), "--time-import"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("epgen build: --time-import: needs a GPU and CuPy")


def test_a_broken_compiler_reads_as_missing(monkeypatch, capsys, tmp_path):
    """A ``ziglang`` whose ``clang --version`` fails (exit 126) is reported like an absent one:
    the one-line ``offline compilers missing`` error or the skipped report, the same exit status,
    no traceback."""
    from epgen.codegen import offline
    from epgen.codegen.offline import ToolchainMissing, clang_amd, toolchain_status

    def outcomes():
        results = []
        for argv in (["check", "--model", "mixtral-8x7b", "--arch", "gfx950"],
                     ["generate", "--model", "mixtral-8x7b", "--arch", "gfx950", "-o", str(tmp_path / str(len(results)))]):
            rc = main(argv)
            out, err = capsys.readouterr()
            results.append((rc, " ".join((out + err).split())))
        return results

    monkeypatch.setattr(clang_amd, "status", lambda: f"AMD offline compiler (clang) missing: pip install {clang_amd.PACKAGE}")
    absent = outcomes()
    monkeypatch.undo()
    real = offline._vendor_identity

    def broken(vendor):
        if vendor == "amd":
            raise ToolchainMissing("clang --version failed (126): permission denied")
        return real(vendor)

    monkeypatch.setattr(offline, "_vendor_identity", broken)
    reason = toolchain_status("gfx950")
    assert "clang --version failed (126)" in reason and clang_amd.PACKAGE in reason
    broken_runs = outcomes()
    assert [rc for rc, _ in broken_runs] == [rc for rc, _ in absent]
    check_text, generate_text = (text for _, text in broken_runs)
    assert "epgen check: offline compilers missing" in check_text and "(126)" in check_text
    assert "resource report skipped: gfx950:" in generate_text and "(126)" in generate_text
    assert absent[0][1].startswith("epgen check: offline compilers missing")


def test_generate_names_the_kernels_that_spill():
    """generate's summary names the report's kernels that use scratch or spill (only REPORT.md
    held them)."""
    from epgen.cli.commands import _spilling
    from epgen.codegen.catalogue import REPORT_CSV

    report = "entry,status\na,ok\nb,scratch/spill\n"
    assert _spilling({REPORT_CSV: report}) == ["b"] and _spilling({}) == []


def test_bench_transport_pull_is_refused_for_the_low_latency_family(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--transport", "pull", "--family", "low_latency"])
    assert e.value.code == 2
    assert "--transport pull: the low-latency family pushes (pull is the normal family's dispatch" in capsys.readouterr().err


def test_bench_outside_a_checkout_defaults_to_the_current_directory(capsys, monkeypatch, tmp_path):
    """Without -o, outside an epgen checkout, bench asks for the GPU (not for tools/results/) and,
    with one, writes bench-ep<W>-<gpu>.* in the current directory; in the checkout, under tools/results/."""
    import torch

    from epgen.cli.bench import default_output

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _matplotlib(monkeypatch, present=True)
    assert main(["bench"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "epgen bench: needs a GPU (torch.cuda.is_available() is False)" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    _matplotlib(monkeypatch, present=False)  # past the -o checks: the next thing asked for
    assert main(["bench"]) == 2
    assert "the plot needs matplotlib" in capsys.readouterr().err
    assert default_output(2, False, in_checkout=False) == "bench-ep2-h200"
    assert default_output(8, True, in_checkout=True) == os.path.join("tools", "results", "bench-ep8v-h200")


@pytest.mark.parametrize("width", [80, 120])
def test_build_table_honours_the_console_width(width, capsys, monkeypatch, tmp_path):
    """COLUMNS=80 (or 120) epgen build: the table fits, in the resource report's style (a rule under
    the header, no frame), every entry name whole once the folds are joined, a compile error in red."""
    from epgen import aot
    from epgen.cli import commands as cli

    built = []

    def fake_build(specs, directory, max_workers=None, on_done=None):
        built.extend(specs)
        rows = [{"status": "ok", "arch": s.arch, "op": s.op.value, "entry": s.name, "key": f"{i:064x}",
                 "compiler": f"{s.arch} compiler 1.0", "bytes": 12345, "compile_s": 0.25} for i, s in enumerate(specs)]
        rows[-1] = {**{k: rows[-1][k] for k in ("arch", "op", "entry")}, "status": "error: x.cu(1): expected a ';'"}
        return rows

    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setattr(cli, "_compilers_missing", lambda arches, verb: False)
    monkeypatch.setattr(aot, "build", fake_build)
    assert main(["build", "--model", "mixtral-8x7b", "-o", str(tmp_path / "c")]) == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "…" not in text and all(len(line) <= width for line in lines)
    head = next(i for i, line in enumerate(lines) if line.startswith("arch "))  # the title may take two lines
    assert not any(c in text for c in "┏┃│└") and set(lines[head + 1].strip()) == {"─"}  # report.styled_table's look
    assert lines[head].split() == ["arch", "entry", "key", "bytes", "compile", "s", "status"]
    entries = "".join(line.split()[1] if line.startswith(("gfx", "sm_")) else line.split()[0]
                      for line in lines[head + 2:] if line.startswith(("gfx", "sm_", " ")) and line.split())
    assert {(s.arch, s.op.value) for s in built} == {(a, op) for a in ARCHES for op in OPS}  # every bucket of each
    assert all(s.name in entries for s in built)
    assert "00000000" in text and "compiles in parallel" in text and "expected a ';'" in " ".join(text.split())


def test_demo_moe_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the MoE demo runs on the device instead")
    r = run("demo", "--moe")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU here (torch.cuda.is_available() is False): the MoE layer demo runs on a GPU" in " ".join(
        r.stdout.split())
    r = run("demo", "--moe", "--experts", "64", "--intermediate", "512", "--world-size", "4", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert summary["gpu"] is None and "no GPU here" in summary["gpu_skipped"]
    assert {k: summary[k] for k in ("model", "world_size", "tokens", "experts", "intermediate")} == {
        "model": "deepseek-v3", "world_size": 4, "tokens": 1024, "experts": 64, "intermediate": 512}


def test_demo_moe_defaults(monkeypatch):
    import epgen.cli.moe_demo

    seen = {}
    monkeypatch.setattr(epgen.cli.moe_demo, "run_moe_demo", lambda cfg, model, intermediate, *a, **k: seen.update(
        cfg=cfg, model=model, intermediate=intermediate) or 0)
    assert main(["demo", "--moe"]) == 0
    cfg = seen["cfg"]
    assert (cfg.layout, cfg.world_size, cfg.max_tokens_per_rank, cfg.num_experts, cfg.hidden, cfg.topk) == (
        "expert", 8, 1024, 256, 7168, 8)
    assert cfg.expert_alignment == 16
    assert seen["intermediate"] == 2048 and seen["model"] == "deepseek-v3"
    assert main(["demo", "--moe", "--tokens", "96", "--experts", "16", "--world-size", "2"]) == 0
    assert (seen["cfg"].max_tokens_per_rank, seen["cfg"].num_experts, seen["cfg"].world_size) == (96, 16, 2)


@pytest.mark.parametrize("argv, message", [
    (["demo", "--experts", "8"], "--experts: only with --moe"),
    (["demo", "--intermediate", "256", "--experts", "8"], "--experts --intermediate: only with --moe"),
    (["demo", "--moe", "--experts", "12"],
     "EpConfig.num_experts=12: must be a multiple of world_size=8 (--experts 12 with --model deepseek-v3 --moe)"),
    (["demo", "--moe", "--world-size", "2", "--experts", "4"],
     "EpConfig.topk=8: must be at most num_experts=4 (--experts 4 with --model deepseek-v3 --moe)"),
    (["demo", "--moe", "--world-size", "3"], "must be a multiple of world_size=3 (--world-size 3 with --model "
     "deepseek-v3 --moe)"),
    (["demo", "--moe", "--experts", "1000000"],
     "KernelSpec.experts_per_rank=125000: must be in [1, 65536] (--experts 1000000 with --model deepseek-v3 --moe)"),
    (["demo", "--moe", "--tokens", "2000000"],
     "KernelSpec.max_tokens_per_rank=2000000: must be in [1, 1048576] (--tokens 2000000 with --model deepseek-v3 "
     "--moe)"),
    (["demo", "--moe", "--intermediate", "0"], "argument --intermediate: "),
])
def test_demo_moe_flag_errors_name_the_flag(argv, message, capsys):
    assert message in " ".join(_usage_error(argv, capsys).split())


@pytest.mark.gpu
def test_demo_moe_on_the_gpu_passes_and_times_every_stage(capsys):
    assert main(["demo", "--moe", "--experts", "16", "--intermediate", "256", "--tokens", "64", "--world-size", "2",
                 "--iters", "5", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu"]
    assert gpu["passed"] and gpu["bound_ratio"] <= 1.0 and gpu["expanded_rows"] > 0
    assert set(gpu["stages"]) == {"dispatch", "expand", "experts", "fold", "combine", "forward"}
    assert all(s["median_us"] > 0 for s in gpu["stages"].values())


def _parse(argv):
    from epgen.cli.commands import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    return args, args.parser


def test_kernel_family_flags_reach_the_specs_of_the_shape_verbs():
    from epgen.cli import flags
    from epgen.codegen.spec import LOW_LATENCY_OPS, Op

    base = ["--model", "gpt-oss-120b", "--arch", "sm_90"]
    for verb in ("generate", "check", "report", "diff", "build"):
        args, parser = _parse([verb, *base, "--kernel-family", "low_latency", "--low-latency-geometry", "16x16u2"])
        specs = flags.specs_from(args, parser)
        assert [s.op for s in specs] == list(LOW_LATENCY_OPS), verb
        assert {(s.blocks, s.warps_per_block, s.unroll, s.ll_tokens) for s in specs} == {(16, 16, 2, 4096)}
        args, parser = _parse([verb, *base, "--kernel-family", "normal"])
        assert [(s.op, s.ll_tokens) for s in flags.specs_from(args, parser)] == [(Op.DISPATCH, 0), (Op.COMBINE, 0)]


@pytest.mark.parametrize("argv, message", [
    (["generate", "--kernel-family", "normal", "-o", "/nonexistent-epgen-out"],
     "--kernel-family normal: the catalogue is fixed"),
    (["generate", "--low-latency-geometry", "16x16u2", "-o", "/nonexistent-epgen-out"],
     "--low-latency-geometry 16x16u2: the catalogue is fixed"),
    (["check", "--dtype", "fp8", "--kernel-family", "low_latency"],
     "--kernel-family low_latency: needs a shape (--model or --hidden); the selectors"),
    (["generate", "--model", "gpt-oss-120b", "--low-latency-geometry", "600x16u2", "-o", "/nonexistent-epgen-out"],
     "KernelSpec.blocks=600: the low-latency family raises one flag per (rank, block), world_size x blocks = 4800, "
     "at most 1024; at most 128 blocks (--low-latency-geometry 600x16u2)"),
    (["check", "--model", "gpt-oss-120b", "--kernel-family", "low_latency", "--max-tokens", "70000"],
     "kernel_family='low_latency' holds at most 65535 tokens a rank (use 'auto' or 'normal') (--max-tokens)"),
    (["build", "--kernel-family", "fast"], "argument --kernel-family: invalid choice: 'fast'"),
    (["diff", "--kernel-family", "normal"], "--kernel-family: only with --a/--b"),
    (["diff", "--layout", "expert", "--low-latency-geometry", "8x16u2"],
     "--layout --low-latency-geometry: only with --a/--b"),
    (["demo", "--moe", "--kernel-family", "normal"], "--kernel-family: only without --moe"),
    (["demo", "--kernel-family", "low_latency", "--tokens", "70000"],
     "holds at most 65535 tokens a rank (use 'auto' or 'normal') (--tokens 70000 with --model deepseek-v3)"),
    (["demo", "--low-latency-geometry", "600x16u2"],
     "world_size x blocks = 4800, at most 1024; at most 128 blocks (--low-latency-geometry 600x16u2 with --model "
     "deepseek-v3)"),
])
def test_kernel_family_flag_errors_name_the_flag(argv, message, capsys):
    assert message in " ".join(_usage_error(argv, capsys).split())


def _fake_gpu(monkeypatch, gpus=2):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("epgen.device.device_arch", lambda index: "sm_90")
    _matplotlib(monkeypatch, present=True)


def test_gpu_verbs_pass_the_families_and_the_low_latency_geometry_on(monkeypatch, tmp_path):
    """bench, tune and stress hand their verb the EpConfig the flags build (config_from) and
    options of the verb's own; demo its config too."""
    import epgen.cli.bench
    import epgen.cli.demo
    import epgen.cli.stress
    import epgen.cli.tune
    from epgen.codegen.tuning import Geometry
    from epgen.cli.options import LOW_LATENCY_SWEEP

    _fake_gpu(monkeypatch, gpus=1)
    seen = {}
    for module in (epgen.cli.bench, epgen.cli.tune, epgen.cli.stress):
        monkeypatch.setattr(module, "run", lambda cfg, opts, name=module.__name__: seen.__setitem__(name, (cfg, opts)))
    monkeypatch.setattr(epgen.cli.demo, "run_demo", lambda cfg, *a, **kw: seen.__setitem__("demo", (cfg, kw)) or 0)
    out = ["-o", str(tmp_path / "b")]
    assert main(["bench", "--world-size", "1", *out]) == 0
    cfg, b = seen["epgen.cli.bench"]
    assert (b.family, cfg.low_latency_geometry, cfg.world_size, cfg.hidden) == ("both", None, 1, 7168)
    assert main(["bench", "--world-size", "2", "--virtual", "--family", "low_latency", "--tokens", "1", "256",
                 "--low-latency-geometry", "16x16u2", "--quant", "fp8_blockwise", *out]) == 0
    cfg, b = seen["epgen.cli.bench"]
    assert (b.family, cfg.low_latency_geometry, b.tokens, b.virtual, cfg.combine_quant) == (
        "low_latency", Geometry(16, 16, 2), (1, 256), True, "fp8_blockwise")
    assert main(["tune", "--world-size", "1"]) == 0
    cfg, t = seen["epgen.cli.tune"]
    assert (t.family, t.low_latency_tokens, t.low_latency_geometries, t.virtual) == ("both", LOW_LATENCY_SWEEP, None,
                                                                                     False)
    assert cfg.low_latency_geometry is None  # tune's --low-latency-geometry lists candidates, not the config's
    assert main(["tune", "--world-size", "2", "--virtual", "--family", "low_latency", "--low-latency-tokens", "4",
                 "16", "--low-latency-geometry", "8x16u2", "16x16u4", "--dry-run"]) == 0
    cfg, t = seen["epgen.cli.tune"]
    assert (t.family, t.low_latency_tokens, t.virtual, t.write, cfg.world_size) == ("low_latency", (4, 16), True,
                                                                                    False, 2)
    assert t.low_latency_geometries == (Geometry(8, 16, 2), Geometry(16, 16, 4))
    assert main(["stress", "--world-size", "1"]) == 0
    cfg, _ = seen["epgen.cli.stress"]
    assert (cfg.kernel_family, cfg.low_latency_geometry, cfg.max_tokens_per_rank) == ("auto", None, 4096)
    assert main(["stress", "--world-size", "4", "--virtual", "--kernel-family", "low_latency",
                 "--low-latency-geometry", "8x16u2", "--max-tokens", "64", "--fault-every", "5"]) == 0
    cfg, st = seen["epgen.cli.stress"]
    assert (cfg.kernel_family, cfg.low_latency_geometry, cfg.max_tokens_per_rank, st.fault_every) == (
        "low_latency", Geometry(8, 16, 2), 64, 5)
    assert main(["demo", "--kernel-family", "normal"]) == 0
    cfg, kw = seen["demo"]
    assert (cfg.kernel_family, cfg.low_latency_geometry, kw) == ("normal", None, {"quiet": False, "as_json": False})


def _too_long_name(folder) -> str:
    """A file or folder name 45 bytes over what the file system of ``folder`` allows (NAME_MAX)."""
    return "n" * (os.pathconf(folder, "PC_NAME_MAX") + 45)


@pytest.mark.parametrize("argv, flag, where", [
    (["generate", "--model", "mixtral-8x7b", "--arch", "sm_90", "-o", "{long}/out"], "-o", "{long}/out"),
    (["generate", "-o", "{long}"], "-o", "{long}"),  # the catalogue into a folder of its own
    (["build", "--model", "mixtral-8x7b", "--arch", "sm_90", "-o", "{long}"], "-o", "{long}"),
    (["report", "--model", "mixtral-8x7b", "--arch", "sm_90", "--csv", "{long}.csv"], "--csv", "{long}.csv"),
    (["report", "--model", "mixtral-8x7b", "--markdown", "{long}/r.md"], "--markdown", "{long}/r.md"),
    (["diff", "-o", "{long}"], "-o", "{long}"),
    (["bench", "-o", "{long}"], "-o", "{long}"),
])
def test_an_output_name_longer_than_the_file_system_allows_is_a_usage_error(argv, flag, where, capsys, tmp_path):
    """A component over NAME_MAX (ENAMETOOLONG) is refused before any work, naming the flag, the
    path (abbreviated: the name alone is 45 bytes over NAME_MAX) and the rule, where it used to
    be an OSError traceback."""
    name = _too_long_name(tmp_path)
    long = str(tmp_path / name)
    err = _usage_error([a.format(long=long) for a in argv], capsys).splitlines()[-1]
    given = where.format(long=long)
    assert err.startswith(f"epgen {argv[0]}: error: {flag} {given[:20]}") and name not in err, err
    size = len(name) + (len(".env.txt") if argv[0] == "bench" else len(".csv") if flag == "--csv" else 0)
    assert f"is {size} bytes; a file or folder name may have at most {len(name) - 45} bytes on this file system " \
           "(NAME_MAX)" in err
    assert len(err) < 300 and list(tmp_path.iterdir()) == []


def test_epgen_cache_dir_longer_than_the_file_system_allows_stops_build(capsys, tmp_path, monkeypatch):
    name = _too_long_name(tmp_path)
    monkeypatch.setenv("EPGEN_CACHE_DIR", str(tmp_path / name / "cache"))
    err = _usage_error(["build", "--model", "mixtral-8x7b", "--arch", "sm_90"], capsys).splitlines()[-1]
    assert err.startswith(f"epgen build: error: EPGEN_CACHE_DIR={str(tmp_path)[:20]}") and name not in err
    assert "/cache: the name 'nnnn" in err and err.endswith(
        f"is {len(name)} bytes; a file or folder name may have at most {len(name) - 45} bytes on this file system "
        "(NAME_MAX)")
    assert list(tmp_path.iterdir()) == []


def test_path_name_problem_rules(tmp_path):
    from epgen.codegen.atomic import abbreviate, name_too_long, path_name_problem

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    assert name_too_long(tmp_path / ("n" * limit)) is None  # at the limit: fine
    assert name_too_long(tmp_path / "missing" / "deeper" / ("n" * limit)) is None
    assert f"is {limit + 1} bytes" in name_too_long(tmp_path / "missing" / ("n" * (limit + 1)))
    accents = "é" * (limit // 2 + 1)  # at most limit characters, but more bytes: é is two
    assert f"is {2 * len(accents)} bytes" in name_too_long(tmp_path / accents / "x")
    path_max = os.pathconf(".", "PC_PATH_MAX")
    deep = "d/" * (path_max // 2 + 2)  # short names, relative (what the system calls would get), over PATH_MAX
    assert name_too_long(deep) == (f"the path is {len(deep)} bytes; a path may have at most {path_max - 1} bytes "
                                   f"(PATH_MAX {path_max}, its terminating zero included)")
    assert path_name_problem("-o", tmp_path) is None
    assert path_name_problem("EPGEN_CACHE_DIR=", deep).startswith("EPGEN_CACHE_DIR=d/d/d/")
    prefix = tmp_path / ("x" * (limit - 4))  # bench -o PREFIX: PREFIX.csv fits, PREFIX.env.txt does not
    assert path_name_problem("-o", prefix, suffix=".csv") is None
    assert path_name_problem("-o", prefix, suffix=".env.txt") == (
        f"-o {abbreviate(str(prefix))}: the name '{abbreviate(prefix.name + '.env.txt')}' is {limit + 4} bytes; a "
        f"file or folder name may have at most {limit} bytes on this file system (NAME_MAX)")
    assert len(abbreviate("y" * 1000)) == 60 and abbreviate("y" * 60) == "y" * 60


@pytest.mark.parametrize("verb", ["bench", "tune", "stress"])
@pytest.mark.parametrize("flag", ["--json", "--quiet"])
def test_gpu_verbs_refuse_the_output_flags_they_do_not_honour(verb, flag, capsys):
    """bench, tune and stress print their own output (and write files): --json and --quiet are
    usage errors that say what the verb prints instead, before any GPU is looked for, and neither
    shows in the verb's help."""
    err = _usage_error([verb, flag], capsys)
    assert f"epgen {verb}: error: {flag}: epgen {verb} does not take it: it prints" in err
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    assert "--json" not in capsys.readouterr().out


def test_generate_check_and_diff_refuse_a_folder_before_rendering(tmp_path, capsys, monkeypatch):
    """generate --check -o MISSING, and generate or diff -o on another tool's folder, stop before
    the catalogue is rendered (a minute of compiling), naming the folder and the rule."""
    from epgen.codegen import catalogue

    def no_render(*a, **kw):
        raise AssertionError("rendered before refusing")

    monkeypatch.setattr(catalogue, "render_files", no_render)
    missing = tmp_path / "missing"
    err = _usage_error(["generate", "--check", "-o", str(missing)], capsys)
    assert f"-o {missing}: does not exist; --check compares a directory epgen generate wrote" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"schema": 1, "code_objects": {}}\n')  # a build cache's
    for argv in (["generate", "-o", str(foreign)], ["generate", "--check", "-o", str(foreign)],
                 ["diff", "-o", str(foreign)]):
        assert main(argv) == 2
        assert "manifest.json: not a manifest epgen generate wrote" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    err = _usage_error(["diff", "-o", str(bare)], capsys)
    assert f"-o {bare}: has no manifest.json, so epgen generate did not write it" in err
    assert f"-o {missing}: not a directory" in _usage_error(["diff", "-o", str(missing)], capsys)


def test_check_takes_the_geometry_flags(capsys, monkeypatch):
    """epgen check/report --dispatch-geometry/--combine-geometry: one variant's resources; a bad
    geometry names its flag, and the flags need a shape."""
    from epgen.cli import commands as cli
    from epgen.codegen import catalogue

    seen = []
    monkeypatch.setattr(cli, "_compilers_missing", lambda arches, verb: False)
    monkeypatch.setattr(catalogue, "report_rows", lambda specs, max_workers=None, on_done=None:
                        seen.extend(specs) or _fake_report_rows(specs))
    for verb in ("check", "report"):
        seen.clear()
        assert main([verb, "--model", "mixtral-8x7b", "--arch", "sm_90", "--dispatch-geometry", "8x4u2",
                     "--combine-geometry", "16x8", "--json"]) == 0
        geometry = {s.op.value: (s.blocks, s.warps_per_block, s.unroll) for s in seen}
        assert geometry["dispatch"] == (8, 4, 2) and geometry["combine"][:2] == (16, 8)
    err = _usage_error(["check", "--model", "mixtral-8x7b", "--arch", "sm_90", "--dispatch-geometry", "8x64u2"], capsys)
    assert "--dispatch-geometry" in err.splitlines()[-1]
    err = _usage_error(["check", "--quant", "fp8_blockwise", "--combine-geometry", "16x8"], capsys)
    assert "--combine-geometry 16x8u4: needs a shape (--model or --hidden)" in err


def test_the_wire_diff_hint_leads_to_a_command_that_works():
    """The bf16-vs-fp8 combine diff: the refusal names the --quant flag to add, and that command
    works, showing the quantize kernel, which only the quantized wire builds, whole on its side."""
    shape = ("--model", "deepseek-v3", "--world-size", "2", "--kernel-family", "normal", "--arch", "sm_90")
    r = run("diff", *shape, "--b", "combine_quant=fp8_blockwise")
    assert r.returncode == 2 and "add --quant fp8_blockwise: both sides then start from" in r.stderr
    r = run("diff", *shape, "--quant", "fp8_blockwise", "--a", "combine_quant=none")
    assert r.returncode == 1, r.stderr
    assert "=== combine_quantize sm_90\n--- (no combine_quantize kernel with combine_quant=none)" in r.stdout
    assert re.search(r"^\+\+\+ epgen_combine_sm90_bf16_\S+_qfp8b$", r.stdout, re.M)


@pytest.mark.parametrize("spill", [False, True])
def test_resource_table_fits_80_columns_when_a_row_spills(spill):
    """The whole catalogue's table at 80 columns: one line a row, with or without a spilling row;
    the spilling row's scratch, spill and status are in the caption, named by its label."""
    from rich.console import Console

    from epgen.codegen import catalogue
    from epgen.codegen.report import resource_table, variant_labels

    rows = _fake_report_rows(catalogue.catalogue_specs())
    if spill:
        rows[0] = {**rows[0], "spill_bytes": 8, "scratch_bytes": 16, "status": "scratch/spill"}
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(resource_table(rows, "t"))
    lines = console.export_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("arch "))
    assert lines[head].split() == ["arch", "op", "variant", "regs", "AGPR", "SGPR", "LDS", "occ"]
    body = lines[head + 2:head + 2 + len(rows)]
    assert all(line.startswith(tuple(a + " " for a in ARCHES)) for line in body)  # nothing folded
    assert all(len(line) <= 80 for line in lines)
    caption = " ".join(" ".join(lines[head + 2 + len(rows):]).split())
    if spill:
        label = variant_labels([r["spec"] for r in rows])[0][0]
        assert (f"scratch 0, spill 0, status ok, except these (red in the table): {rows[0]['arch']} dispatch {label}: "
                "scratch 16, spill 8, status scratch/spill") in caption
    else:
        assert "scratch 0, spill 0, status ok scratch, spill" in caption


def test_demo_explains_its_notation_and_what_to_run_next(monkeypatch):
    from rich.console import Console

    from epgen.cli import demo

    monkeypatch.setattr(demo, "toolchain_status", lambda arch: None)
    monkeypatch.setattr(demo, "report_rows", _fake_report_rows)
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    console = Console(width=100, record=True, file=io.StringIO())
    cfg = demo.EpConfig.for_model("mixtral-8x7b", world_size=8, max_tokens_per_rank=4096)
    assert demo.run_demo(cfg, "mixtral-8x7b", 1, console) == 0
    text = " ".join(console.export_text().split())
    assert "a variant is PAYLOAD BLOCKSxWARPSuUNROLL" in text and "w world size (ranks), h hidden size" in text
    assert "`epgen generate --model mixtral-8x7b -o DIR` writes their sources" in text
    assert "next: `epgen check --model mixtral-8x7b --arch ARCH`" in text and "`epgen demo --moe`" in text
    console = Console(width=100, record=True, file=io.StringIO())
    assert demo.run_demo(cfg, "mixtral-8x7b", 1, console, quiet=True) == 0
    assert console.export_text() == ""


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


def test_selftest_without_a_gpu_lists_its_cases_and_succeeds():
    r = subprocess.run([sys.executable, "-m", "epgen", "selftest"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})  # the table's rows whole
    if r.returncode == 0 and "no GPU here" not in r.stdout:
        pytest.skip("a GPU is present: the selftest ran (tests/gpu covers its kernels)")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and r.stderr == "", r.stderr
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
