"""The epgen command line on the CPU: demo and demo --moe."""

import io
import json

import pytest

from epgen.cli import main

from cli_helpers import _fake_report_rows, _usage_error, run


def test_demo_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU demo runs on the device instead")
    r = run("demo", "--model", "mixtral-8x7b")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU here" in r.stdout and "epgen_dispatch_sm90" in r.stdout.replace("\n", "")


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
     "EpConfig.num_experts=12: must be a multiple of world_size=8 (--experts 12 with the default model deepseek-v3, "
     "--moe)"),
    (["demo", "--moe", "--world-size", "2", "--experts", "4"],
     "EpConfig.topk=8: must be at most num_experts=4 (--experts 4 with the default model deepseek-v3, --moe)"),
    (["demo", "--moe", "--world-size", "3"], "must be a multiple of world_size=3 (--world-size 3 with the default "
     "model deepseek-v3, --moe)"),
    (["demo", "--moe", "--experts", "1000000"],
     "KernelSpec.experts_per_rank=125000: must be in [1, 65536] (--experts 1000000 with the default model "
     "deepseek-v3, --moe)"),
    (["demo", "--moe", "--tokens", "2000000"],
     "KernelSpec.max_tokens_per_rank=2000000: must be in [1, 1048576] (--tokens 2000000 with the default model "
     "deepseek-v3, --moe)"),
    (["demo", "--moe", "--model", "deepseek-v3", "--experts", "12"],
     "EpConfig.num_experts=12: must be a multiple of world_size=8 (--experts 12 with --model deepseek-v3, --moe)"),
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
