"""The epgen command line on the CPU: the GPU verbs bench, tune, stress and --time-import (their arguments
checked before the GPU, and what they say without one)."""

import os

import pytest

from epgen.cli import main

from cli_helpers import _usage_error


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
     "low_latency family with tokens up to 70000, with the default model deepseek-v3)"),
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


def test_bench_output_is_a_prefix_not_a_folder(capsys, tmp_path):
    for out in (str(tmp_path), str(tmp_path) + "/"):
        err = _usage_error(["bench", "-o", out], capsys)
        assert f"-o {out}: a path prefix for the .csv/.png/.env.txt files, not a folder" in err


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
