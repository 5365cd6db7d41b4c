"""The epgen command line on the CPU: generate, check, build, plan and the catalogue (rendering, drift,
selectors, shape flags, kernel-family flags, the models list)."""

import json
import re
import subprocess
import sys

import pytest

from epgen.cli import main
from epgen.codegen.arch import ARCHES

from cli_helpers import OPS, _fake_report_rows, _usage_error, run


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


def test_generate_custom_shape_and_check_detects_drift(tmp_path):
    argv = ["generate", "--hidden", "3072", "--topk", "6", "--num-experts", "64", "--world-size", "4",
            "--arch", "gfx950", "-o", str(tmp_path)]
    assert main(argv + ["--quiet"]) == 0
    assert main(argv + ["--check", "--quiet"]) == 0
    next(tmp_path.rglob("*.hip")).write_text("// edited\n")
    assert main(argv + ["--check", "--quiet"]) == 1


def test_check_one_model_json():
    r = run("check", "--model", "mixtral-8x7b", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == len(ARCHES) * len(OPS) and all(row["status"] == "ok" for row in rows)


def test_list_models():
    r = run("generate", "--list-models")
    assert r.returncode == 0 and "deepseek-v3" in r.stdout and "llama4-maverick" in r.stdout


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


@pytest.mark.parametrize("verb", ["plan", "generate", "selftest"])
def test_ctrl_c_in_any_verb_prints_one_line_and_exits_130(verb, monkeypatch, capsys):
    """KeyboardInterrupt anywhere in a verb: 'epgen VERB: interrupted' on stderr, status 130 (as the
    shell reports SIGINT), no traceback."""
    from epgen.cli import commands

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, {"plan": "cmd_plan", "generate": "cmd_generate", "selftest": "cmd_selftest"}[verb],
                        interrupted)
    assert main([verb, "--list"] if verb == "selftest" else [verb]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"epgen {verb}: interrupted"


def test_ctrl_c_in_a_subprocess_exits_130():
    """The installed command: SIGINT while a verb runs gives one line and status 130."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", "import sys, time, epgen.cli.commands as c; "
                          "c.cmd_plan = lambda *a: (print('started', flush=True), time.sleep(60)); "
                          "sys.exit(c.main(['plan']))"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "started"
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip() == "epgen plan: interrupted", err


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


def test_scale_bytes_reach_check_report_and_generate(tmp_path, capsys):
    assert _generate(tmp_path, "--scale-bytes", "16") == 0
    assert all(re.search(r"_s16(_ll\d+)?\.cu$", p.name) for p in (tmp_path / "sm_90").iterdir())
    from epgen.codegen.offline import toolchain_status

    if not toolchain_status("sm_90"):
        assert main(["report", "--model", "mixtral-8x7b", "--arch", "sm_90", "--scale-bytes", "16", "--json"]) == 0
        assert {r["spec"]["scale_bytes"] for r in json.loads(capsys.readouterr().out)} == {16}


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
     "at most 1024; at most 128 blocks (--low-latency-geometry 600x16u2 on every arch)"),
    (["check", "--model", "gpt-oss-120b", "--kernel-family", "low_latency", "--max-tokens", "70000"],
     "kernel_family='low_latency' holds at most 65535 tokens a rank (use 'auto' or 'normal') (--max-tokens)"),
    (["build", "--kernel-family", "fast"], "argument --kernel-family: invalid choice: 'fast'"),
    (["diff", "--kernel-family", "normal"], "--kernel-family: only with --a/--b"),
    (["diff", "--layout", "expert", "--low-latency-geometry", "8x16u2"],
     "--layout --low-latency-geometry: only with --a/--b"),
    (["demo", "--moe", "--kernel-family", "normal"], "--kernel-family: only without --moe"),
    (["demo", "--kernel-family", "low_latency", "--tokens", "70000"],
     "holds at most 65535 tokens a rank (use 'auto' or 'normal') (--tokens 70000 with the default model deepseek-v3)"),
    (["demo", "--low-latency-geometry", "600x16u2"],
     "world_size x blocks = 4800, at most 1024; at most 128 blocks (--low-latency-geometry 600x16u2 with the default "
     "model deepseek-v3)"),
])
def test_kernel_family_flag_errors_name_the_flag(argv, message, capsys):
    assert message in " ".join(_usage_error(argv, capsys).split())


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
