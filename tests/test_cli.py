"""The epgen command line, on the CPU."""

import json
import subprocess
import sys

import pytest

from epgen.cli import main


def run(*argv):
    return subprocess.run([sys.executable, "-m", "epgen", *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("verb", ["generate", "check", "demo"])
def test_help_on_every_verb(verb):
    r = run(verb, "--help")
    assert r.returncode == 0 and "usage: epgen " + verb in r.stdout


def test_generate_check_passes_on_repo():
    r = run("generate", "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_generate_one_model(tmp_path):
    assert main(["generate", "--model", "gpt-oss-120b", "--arch", "sm_90", "-o", str(tmp_path), "--quiet"]) == 0
    files = sorted(p.name for p in (tmp_path / "sm_90").iterdir())
    assert len(files) == 2 and all(f.endswith(".cu") and "_h2880_k4_" in f for f in files)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {s["spec"]["op"] for s in manifest["sources"]} == {"dispatch", "combine"}


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
    assert len(rows) == 6 and all(row["ok"] for row in rows)


def test_demo_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU demo runs on the device instead")
    r = run("demo", "--model", "mixtral-8x7b")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU here" in r.stdout and "epgen_dispatch_sm90" in r.stdout.replace("\n", "")
