"""EpConfig.from_hf_config: the MoE shape read from a transformers config (dict, file, directory)."""

import json

import pytest

from epgen.codegen.config import EpConfig
from epgen.codegen.errors import FieldError
from epgen.codegen.models import MODELS

# The MoE fields of the published config.json files (other fields left out; the names as the files
# spell them, which is what a user has on disk).
HF_CONFIGS = {
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "intermediate_size": 14336},
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "n_routed_experts": 256,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                    "moe_intermediate_size": 2048},
    "gpt-oss-120b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_local_experts": 128,
                     "experts_per_token": 4, "num_experts_per_tok": 4, "intermediate_size": 2880},
    "kimi-k2": {"model_type": "kimi_k2", "hidden_size": 7168, "n_routed_experts": 384, "n_shared_experts": 1,
                "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 2048},
    "llama4-maverick": {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "num_local_experts": 128, "num_experts_per_tok": 1}},
}
QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "num_experts": 512, "num_experts_per_tok": 10,
              "shared_expert_intermediate_size": 512, "moe_intermediate_size": 512}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_each_family_gives_the_catalogue_shape(name):
    cfg = EpConfig.from_hf_config(HF_CONFIGS[name], world_size=8, max_tokens_per_rank=256, layout="expert")
    m = MODELS[name]
    assert (cfg.hidden, cfg.num_experts, cfg.topk) == (m.hidden, m.num_experts, m.topk)
    assert (cfg.world_size, cfg.max_tokens_per_rank, cfg.layout) == (8, 256, "expert")
    assert cfg == EpConfig.for_model(name, world_size=8, max_tokens_per_rank=256, layout="expert")


def test_qwen3_next_top10_of_512():
    cfg = EpConfig.from_hf_config(QWEN3_NEXT, world_size=4, max_tokens_per_rank=64)
    assert (cfg.hidden, cfg.num_experts, cfg.topk, cfg.experts_per_rank) == (2048, 512, 10, 128)


def test_gpt_oss_file_with_only_experts_per_token():
    data = dict(HF_CONFIGS["gpt-oss-120b"])
    del data["num_experts_per_tok"]
    assert EpConfig.from_hf_config(data, world_size=2, max_tokens_per_rank=8).topk == 4


def test_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["deepseek-v3"]))
    by_file = EpConfig.from_hf_config(tmp_path / "config.json", world_size=8, max_tokens_per_rank=16)
    by_dir = EpConfig.from_hf_config(str(tmp_path), world_size=8, max_tokens_per_rank=16)
    assert by_file == by_dir and by_file.num_experts == 256


def test_loaded_transformers_config_objects():
    transformers = pytest.importorskip("transformers", reason="the optional transformers extra is not installed")
    for config, shape in ((transformers.Qwen3MoeConfig(), (2048, 128, 8)),
                          (transformers.DeepseekV3Config(), (7168, 256, 8)),
                          (transformers.GptOssConfig(), (2880, 128, 4)),
                          (transformers.MixtralConfig(), (4096, 8, 2))):
        cfg = EpConfig.from_hf_config(config, world_size=8, max_tokens_per_rank=32)
        assert (cfg.hidden, cfg.num_experts, cfg.topk) == shape, config.model_type


def test_dense_model_names_model_type_and_fields():
    with pytest.raises(ValueError, match=r"model_type 'llama' has no num_experts field \(looked for n_routed_experts, "
                                         r"num_local_experts, num_experts\)"):
        EpConfig.from_hf_config({"model_type": "llama", "hidden_size": 4096}, world_size=1, max_tokens_per_rank=8)


def test_missing_hidden_and_bad_values():
    with pytest.raises(ValueError, match=r"model_type 'mixtral' has no hidden field \(looked for hidden_size\)"):
        EpConfig.from_hf_config({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
                                world_size=1, max_tokens_per_rank=8)
    bad = dict(HF_CONFIGS["deepseek-v3"], num_experts_per_tok=0)
    with pytest.raises(ValueError, match=r"'deepseek_v3': num_experts_per_tok=0 must be a positive int \(it gives "
                                         r"EpConfig.topk\)"):
        EpConfig.from_hf_config(bad, world_size=8, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match=r"hidden_size='2048' must be a positive int"):
        EpConfig.from_hf_config(dict(QWEN3_NEXT, hidden_size="2048"), world_size=8, max_tokens_per_rank=8)


def test_epconfig_refusal_names_model_type_and_field():
    with pytest.raises(FieldError, match=r"from_hf_config \(kimi_k2\): EpConfig.num_experts=384: must be a multiple "
                                         r"of world_size=7") as e:
        EpConfig.from_hf_config(HF_CONFIGS["kimi-k2"], world_size=7, max_tokens_per_rank=8)
    assert e.value.field == "num_experts"


def test_shape_overrides_and_bad_sources_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\(qwen3_moe\): topk come from the model config"):
        EpConfig.from_hf_config(HF_CONFIGS["qwen3-30b-a3b"], world_size=8, max_tokens_per_rank=8, topk=4)
    with pytest.raises(FileNotFoundError, match="no such config.json"):
        EpConfig.from_hf_config(tmp_path, world_size=8, max_tokens_per_rank=8)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        EpConfig.from_hf_config(tmp_path, world_size=8, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="source must be a path, a dict or a PretrainedConfig, got int"):
        EpConfig.from_hf_config(3, world_size=8, max_tokens_per_rank=8)
