"""The epgen command line on the CPU: what every verb shares (help, usage errors that name the flag given,
output paths, the import cost of the CPU verbs)."""

import os
import re
import subprocess
import sys

import pytest

from epgen.cli import main

from cli_helpers import _usage_error, run


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


def test_unknown_model_suggests_close_names():
    r = run("generate", "--model", "deepseek-v4", "-o", "/tmp/x")
    assert r.returncode == 2 and "deepseek-v3" in r.stderr


def test_bad_shape_names_the_rule():
    r = run("generate", "--hidden", "7170", "--topk", "8", "--num-experts", "256", "-o", "/tmp/x")
    assert r.returncode == 2 and "KernelSpec.hidden=7170" in r.stderr and "multiple of 16 bytes" in r.stderr


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


@pytest.mark.parametrize("flag", ["selftest -o", "report --markdown", "report --csv"])
def test_an_output_path_in_a_symbolic_link_loop_is_one_clear_error(flag, tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    verb, option = flag.split()
    argv = [verb, option, str(tmp_path / "a")] + (["--model", "deepseek-v3", "--arch", "sm_90"] if verb == "report"
                                                   else [])
    err = _usage_error(argv, capsys).strip().splitlines()
    assert err[-1] == (f"epgen {verb}: error: {option} {tmp_path / 'a'}: a symbolic link loop (it, or a link it goes "
                       "through, points back at itself); name a file")


@pytest.mark.parametrize("argv, message", [
    (["check", "--world-size", "16"], "--world-size 16: the catalogue is fixed at W=8 / Tmax=4096; name --model"),
    (["report", "--max-tokens", "8"], "--max-tokens 8: the catalogue is fixed at W=8 / Tmax=4096"),
    (["generate", "--world-size", "4", "--max-tokens", "8"], "--world-size 4 --max-tokens 8: the catalogue is fixed"),
    (["diff", "--world-size", "4"], "--world-size: only with --a/--b"),
    (["check", "--dtype", "fp8", "--world-size", "16"], "--world-size 16: catalogue model mixtral-8x7b has 8 experts"),
    (["check", "--model", "deepseek-v3", "--world-size", "24"],
     "multiple of world_size=24 (--world-size 24 with --model deepseek-v3)"),
    (["build", "--dispatch-geometry", "24x33"],
     "KernelSpec.warps_per_block=33: must be in [1, 32] (--dispatch-geometry 24x33u4 on every arch)"),
    # a shape flag alone does not blame the default model
    (["plan", "--topk", "4"], "--topk needs --hidden and --num-experts (plan takes one shape: --model, --hf-config"),
    (["build", "--topk", "4"], "--topk needs --hidden and --num-experts (build takes one shape"),
    # a geometry is checked on the arches asked for, and named with them
    (["plan", "--model", "deepseek-v3", "--arch", "sm_90", "--quant", "fp8_blockwise", "--combine-geometry", "24x32"],
     "32 warps of 32 lanes are 1024 threads on sm_90; a combine with a quantized wire (fp8_blockwise) runs at most "
     "512 threads"),
    (["plan", "--model", "deepseek-v3", "--arch", "sm_90", "--combine-geometry", "24x33"],
     "KernelSpec.warps_per_block=33: must be in [1, 32] (--combine-geometry 24x33u4 on sm_90)"),
    # a geometry of kernels the family does not build
    (["plan", "--model", "deepseek-v3", "--kernel-family", "low_latency", "--dispatch-geometry", "24x16"],
     "--dispatch-geometry 24x16u4: applies to the normal family's kernels, which this run does not build"),
    (["generate", "--model", "deepseek-v3", "--kernel-family", "normal", "--low-latency-geometry", "16x16", "-o",
      "/tmp/never"], "--low-latency-geometry 16x16u4: applies to the low-latency family's kernels, which this run"),
    (["check", "--model", "deepseek-v3", "--kernel-family", "low_latency", "--dispatch-geometry", "24x16"],
     "--dispatch-geometry 24x16u4: applies to the normal family's kernels, which this run does not build"),
    (["plan", "--model", "deepseek-v3", "--kernel-family", "normal", "--low-latency-geometry", "16x16"],
     "--low-latency-geometry 16x16u4: applies to the low-latency family's kernels, which this run does not build"),
    # a config error names the flags given
    (["plan", "--hidden", "7168", "--topk", "8", "--num-experts", "256", "--world-size", "3"],
     "multiple of world_size=3 (--num-experts 256, --world-size 3)"),
    # a flag given twice, an empty output file
    (["plan", "--model", "deepseek-v3", "--model", "qwen3-30b-a3b"],
     "--model given twice (deepseek-v3 and qwen3-30b-a3b): give it once"),
    (["bench", "--model", "deepseek-v3", "--model", "qwen3-30b-a3b"], "--model given twice"),
    (["report", "--model", "deepseek-v3", "--markdown", ""], "argument --markdown: '': must name a path"),
    (["report", "--model", "deepseek-v3", "--csv", " "], "argument --csv: ' ': must name a path"),
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


@pytest.mark.parametrize("argv", [["diff", "-o", ""], ["bench", "-o", ""], ["generate", "-o", " "], ["build", "-o", ""]])
def test_an_empty_output_path_is_refused(argv, capsys):
    assert "must name a path" in _usage_error(argv, capsys).splitlines()[-1]


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


@pytest.mark.parametrize("verb", ["generate", "check", "report", "diff", "build", "demo", "bench", "tune", "stress"])
def test_an_empty_model_is_an_error_not_no_model(verb, capsys):
    assert "argument --model: '': must name a catalogue model" in _usage_error([verb, "--model", ""], capsys)


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
