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
