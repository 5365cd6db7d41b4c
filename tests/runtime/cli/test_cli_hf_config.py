"""``epgen generate --hf-config``: a model's kernels from its transformers config.json."""

import json
import re

import pytest

from epgen.cli import main

QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "num_experts": 512, "num_experts_per_tok": 10}


def test_generate_from_a_config_file_equals_the_shape_flags(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    by_config, by_flags = tmp_path / "a", tmp_path / "b"
    common = ["--world-size", "8", "--max-tokens", "256", "--arch", "sm_90", "--quiet"]
    assert main(["generate", "--hf-config", str(tmp_path), "-o", str(by_config)] + common) == 0
    assert main(["generate", "--hidden", "2048", "--topk", "10", "--num-experts", "512", "-o", str(by_flags)]
                + common) == 0
    assert json.loads((by_config / "manifest.json").read_text()) == json.loads((by_flags / "manifest.json").read_text())
    assert all("_h2048_k10_l64_" in p.name for p in (by_config / "sm_90").iterdir())


@pytest.mark.parametrize("argv,message", [
    (["--model", "deepseek-v3"], r"--hf-config \S+ gives the shape: drop --model"),
    (["--world-size", "3"], r"EpConfig.num_experts=512: must be a multiple of world_size=3"),
])
def test_generate_hf_config_errors(tmp_path, capsys, argv, message):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--hf-config", str(tmp_path / "config.json"), "-o", str(tmp_path / "out")] + argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_generate_hf_config_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--hf-config", str(tmp_path / "none.json"), "-o", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "EpConfig.from_hf_config(" in capsys.readouterr().err


# The config.json field layouts of families that name the experts and top-k otherwise (tests/codegen/
# test_hf_config.py's RENAMED: the names as published), each with the flags it must equal.
LAYOUTS = {
    "ernie4_5_moe": ({"model_type": "ernie4_5_moe", "hidden_size": 2560, "moe_num_experts": 64, "moe_k": 6}, (2560, 6, 64)),
    "hunyuan_v1_moe": ({"model_type": "hunyuan_v1_moe", "hidden_size": 4096, "num_experts": 64, "moe_topk": [8] * 32},
                       (4096, 8, 64)),
    "longcat_flash": ({"model_type": "longcat_flash", "hidden_size": 6144, "n_routed_experts": 512, "moe_topk": 12,
                       "zero_expert_num": 256}, (6144, 12, 512)),
    "kimi_linear": ({"model_type": "kimi_linear", "hidden_size": 2304, "num_experts": 256, "num_experts_per_token": 8},
                    (2304, 8, 256)),
    "bailing_hybrid": ({"model_type": "bailing_hybrid", "hidden_size": 2560, "num_experts": 512,
                        "num_experts_per_token": 8}, (2560, 8, 512)),
    "aria": ({"model_type": "aria", "text_config": {"model_type": "aria_text", "hidden_size": 2560,
                                                    "moe_num_experts": 64, "moe_topk": 6}}, (2560, 6, 64)),
    "gemma4": ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "hidden_size": 2816,
                                                        "enable_moe_block": True, "num_experts": 128,
                                                        "top_k_experts": 8}}, (2816, 8, 128)),
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_generate_reads_each_familys_layout(tmp_path, family):
    data, (hidden, topk, experts) = LAYOUTS[family]
    (tmp_path / "config.json").write_text(json.dumps(data))
    by_config, by_flags = tmp_path / "a", tmp_path / "b"
    common = ["--world-size", "8", "--max-tokens", "64", "--arch", "sm_90", "--quiet"]
    assert main(["generate", "--hf-config", str(tmp_path), "-o", str(by_config)] + common) == 0
    assert main(["generate", "--hidden", str(hidden), "--topk", str(topk), "--num-experts", str(experts), "-o",
                 str(by_flags)] + common) == 0
    assert json.loads((by_config / "manifest.json").read_text()) == json.loads((by_flags / "manifest.json").read_text())


@pytest.mark.parametrize("content,message", [
    (b"[" * 50_000, r"JSON nested deeper than the parser takes; a config.json nests at most 64 levels"),
    (b'{"model_type": "mixtral", "x": "\xe9"}', r"not UTF-8 text \(byte 0xe9 at offset 32\)"),
    (b'{"model_type": mixtral}', r"not valid JSON \(Expecting value at line 1, column 16\)"),
    (b'{"model_type": "ernie4_5_moe", "hidden_size": 64, "moe_num_experts": 8}',
     r"no top-k field \(EpConfig.topk\): looked for moe_k, .*'ernie4_5_moe' has routed experts"),
], ids=["deep", "latin-1", "not-json", "no-top-k"])
def test_generate_hf_config_names_the_file_in_every_error(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--hf-config", str(path), "-o", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--hf-config: EpConfig.from_hf_config({str(path)!r}): " in err and re.search(message, err), err
    assert "Traceback" not in err


# --- every verb of one shape takes --hf-config and says what it read ----------------------------

READ = ("--hf-config {}: hidden 2048, top-10 of 512 routed experts (as --hidden 2048 --topk 10 --num-experts 512)")


@pytest.fixture
def qwen3_next(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    return str(tmp_path / "config.json")


def test_plan_and_diff_take_hf_config_and_print_the_shape_read(qwen3_next, capsys):
    assert main(["plan", "--hf-config", qwen3_next, "--arch", "sm_90", "--world-size", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    assert READ.format(qwen3_next) in err
    assert all("_h2048_k10_l64_" in r["spec"] for r in json.loads(out)[0]["launches"])
    assert main(["plan", "--hf-config", qwen3_next, "--arch", "sm_90", "--world-size", "8", "--quiet"]) == 0
    assert capsys.readouterr().err == "", "--quiet prints nothing"
    assert main(["diff", "--hf-config", qwen3_next, "--arch", "sm_90", "--a", "unroll=2", "--b", "unroll=4",
                 "--json"]) == 1
    out, err = capsys.readouterr()
    assert READ.format(qwen3_next) in err and all("_h2048_k10_l64_" in c["a"] for c in json.loads(out))


def test_check_report_build_and_demo_take_hf_config(qwen3_next, capsys, monkeypatch, tmp_path):
    """The verbs that compile get the specs of the config's shape (the compile itself stubbed)."""
    import epgen.aot
    import epgen.cli.demo
    import epgen.codegen.catalogue

    seen = {}
    monkeypatch.setattr(epgen.codegen.catalogue, "report_rows", lambda specs, **kw: seen.setdefault("report", specs)
                        and [])
    monkeypatch.setattr(epgen.aot, "build", lambda specs, out, **kw: seen.setdefault("build", specs) and [])
    monkeypatch.setattr(epgen.cli.demo, "run_demo", lambda cfg, model, *a, **kw: seen.setdefault("demo", (cfg, model))
                        and 0)
    import epgen.cli.commands as commands
    monkeypatch.setattr(commands, "_compilers_missing", lambda arches, verb: False)
    for argv in (["check"], ["report", "--markdown", str(tmp_path / "r.md")], ["build", "-o", str(tmp_path / "c")]):
        seen.clear()
        assert main(argv + ["--hf-config", qwen3_next, "--arch", "sm_90", "--world-size", "8"]) == 0, argv
        specs = seen["build" if argv[0] == "build" else "report"]
        assert specs and all(s.hidden == 2048 and s.topk == 10 and s.num_experts == 512 for s in specs), argv
        assert READ.format(qwen3_next) in capsys.readouterr().err, argv
    assert main(["demo", "--hf-config", qwen3_next, "--world-size", "8"]) == 0
    cfg, label = seen["demo"]
    assert (cfg.hidden, cfg.topk, cfg.num_experts, label) == (2048, 10, 512, qwen3_next)
    assert READ.format(qwen3_next) in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--world-size", "3"], "EpConfig.num_experts=512: must be a multiple of world_size=3 (--world-size 3 "
                                    "with --hf-config {})"),
    (["plan", "--topk", "4"], "--hf-config {} gives the shape: drop --topk"),
    (["check", "--model", "deepseek-v3"], "--hf-config {} gives the shape: drop --model"),
    (["demo", "--moe"], "--hf-config {}: not with --moe"),
    (["demo", "--world-size", "3"], "must be a multiple of world_size=3 (--world-size 3 with --hf-config {})"),
    (["plan", "--hf-config", "other.json"], "--hf-config given twice ({} and other.json): give it once"),
])
def test_hf_config_errors_name_the_flags_given(qwen3_next, capsys, argv, message):
    """Errors name --hf-config and the flags given, never --model or --num-experts the user did not write."""
    with pytest.raises(SystemExit) as e:
        main([argv[0], "--hf-config", qwen3_next] + argv[1:])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.format(qwen3_next) in err, err
    assert "--num-experts" not in err and (not re.search(r"--model [a-z]", err) or "--model" in argv)


def test_gpu_verbs_take_hf_config(qwen3_next, capsys, monkeypatch):
    """tune and stress build their config from --hf-config as from --model (the GPU stubbed: an
    sm_90 device that runs nothing); without a shape flag they take the default model."""
    import torch

    import epgen.cli.stress
    import epgen.cli.tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("epgen.device.device_arch", lambda index: "sm_90")
    seen = {}
    for module in (epgen.cli.tune, epgen.cli.stress):
        monkeypatch.setattr(module, "run", lambda cfg, opts, name=module.__name__: seen.__setitem__(name, cfg))
    for verb, module in (("tune", "epgen.cli.tune"), ("stress", "epgen.cli.stress")):
        assert main([verb, "--hf-config", qwen3_next, "--world-size", "2"]) == 0, verb
        cfg = seen[module]
        assert (cfg.hidden, cfg.topk, cfg.num_experts, cfg.world_size) == (2048, 10, 512, 2), verb
        assert READ.format(qwen3_next) in capsys.readouterr().err
        assert main([verb, "--world-size", "2"]) == 0
        assert (seen[module].hidden, seen[module].num_experts) == (7168, 256), "the default model"
    with pytest.raises(SystemExit):
        main(["stress", "--hf-config", qwen3_next, "--model", "deepseek-v3"])
    assert f"--hf-config {qwen3_next} gives the shape: drop --model" in capsys.readouterr().err
