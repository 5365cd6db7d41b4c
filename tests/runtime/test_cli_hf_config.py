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
