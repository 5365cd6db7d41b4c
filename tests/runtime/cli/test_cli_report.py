"""The epgen command line on the CPU: report and diff (tables at 80 and 120 columns, JSON, CSV and Markdown,
the compiler releases, resource tables)."""

import io
import json
import re
import subprocess
import sys

import pytest

from epgen.cli import main
from epgen.codegen.arch import ARCHES
from epgen.codegen.tuning import defaults

from cli_helpers import OPS, _fake_report_rows, run


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


def test_diff_of_a_one_shape_folder_compares_that_shape(tmp_path, capsys, monkeypatch):
    """``diff -o DIR`` of a folder ``generate --hidden ... -o DIR`` wrote renders the specs its
    manifest lists (a handful), not the whole catalogue; an edited source is the one difference."""
    import epgen.codegen.catalogue as catalogue

    out = tmp_path / "one"
    shape = ["--hidden", "256", "--topk", "2", "--num-experts", "8", "--world-size", "2", "--max-tokens", "16",
             "--arch", "sm_90", "--kernel-family", "normal"]
    monkeypatch.setattr(catalogue, "report_rows", lambda specs, **kw: [])  # the sources alone: no compile
    assert main(["generate", *shape, "-o", str(out), "--quiet"]) == 0
    listed = json.loads((out / "manifest.json").read_text())["sources"]
    monkeypatch.setattr(catalogue, "catalogue_specs", lambda *a, **k: pytest.fail("diff rendered the catalogue"))
    assert main(["diff", "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    edited = out / listed[0]["file"]
    edited.write_text(edited.read_text().replace("constexpr int kUnroll", "constexpr int  kUnroll"))
    assert main(["diff", "-o", str(out), "--json"]) == 1
    assert [c["variant"] for c in json.loads(capsys.readouterr().out)] == [listed[0]["file"]]


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
