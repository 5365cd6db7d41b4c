"""EpConfig.from_hf_config: the MoE shape read from a transformers config (dict, file, directory)."""

import json
import re

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
    with pytest.raises(ValueError, match=r"the config has no routed experts field \(EpConfig.num_experts\): looked for "
                                         r"n_routed_experts, num_local_experts, num_experts, moe_num_experts in "
                                         r"model_type 'llama'; a dense model has no expert layers"):
        EpConfig.from_hf_config({"model_type": "llama", "hidden_size": 4096}, world_size=1, max_tokens_per_rank=8)


def test_missing_hidden_and_bad_values():
    with pytest.raises(ValueError, match=r"no hidden size field \(EpConfig.hidden\): looked for hidden_size, d_model in "
                                         r"model_type 'mixtral'; model_type 'mixtral' has routed experts"):
        EpConfig.from_hf_config({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
                                world_size=1, max_tokens_per_rank=8)
    bad = dict(HF_CONFIGS["deepseek-v3"], num_experts_per_tok=0)
    with pytest.raises(ValueError, match=r"'deepseek_v3': num_experts_per_tok=0 must be a positive int \(it gives "
                                         r"EpConfig.topk\)"):
        EpConfig.from_hf_config(bad, world_size=8, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match=r"hidden_size='2048' must be a positive int"):
        EpConfig.from_hf_config(dict(QWEN3_NEXT, hidden_size="2048"), world_size=8, max_tokens_per_rank=8)


def test_epconfig_refusal_names_model_type_and_field():
    with pytest.raises(FieldError, match=r"from_hf_config\(<dict>\) \(kimi_k2\): EpConfig.num_experts=384: must be a multiple "
                                         r"of world_size=7") as e:
        EpConfig.from_hf_config(HF_CONFIGS["kimi-k2"], world_size=7, max_tokens_per_rank=8)
    assert e.value.field == "num_experts"


def test_shape_overrides_and_bad_sources_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\(qwen3_moe\): topk come from the model config"):
        EpConfig.from_hf_config(HF_CONFIGS["qwen3-30b-a3b"], world_size=8, max_tokens_per_rank=8, topk=4)
    with pytest.raises(FileNotFoundError, match="a directory with no config.json in it"):
        EpConfig.from_hf_config(tmp_path, world_size=8, max_tokens_per_rank=8)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for source, why in ((tmp_path / "missing.json", "no such file or directory"),
                        (tmp_path / "loop", r"a symbolic link to nothing \(dangling, or a loop of links\)"),
                        ("/dev/null", r"not a regular file \(a device, pipe or socket\)")):
        with pytest.raises(FileNotFoundError, match=rf"from_hf_config\('{source}'\): {why}"):
            EpConfig.from_hf_config(source, world_size=8, max_tokens_per_rank=8)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").symlink_to(linked / "config.json")
    with pytest.raises(FileNotFoundError, match=r"a directory whose config.json is a symbolic link to nothing"):
        EpConfig.from_hf_config(linked, world_size=8, max_tokens_per_rank=8)
    nested = tmp_path / "nested"
    (nested / "config.json").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"a directory whose config.json is a directory, not a file"):
        EpConfig.from_hf_config(nested, world_size=8, max_tokens_per_rank=8)
    (tmp_path / "digits.json").write_text('{"num_experts": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=r"digits.json'\): not a config.json's JSON \(Exceeds the limit"):
        EpConfig.from_hf_config(tmp_path / "digits.json", world_size=8, max_tokens_per_rank=8)
    (tmp_path / "twice.json").write_text('{"model_type": "qwen3_moe", "num_experts": 8, "num_experts": 128}')
    with pytest.raises(ValueError, match=r"twice.json'\): the key 'num_experts' appears twice in one object"):
        EpConfig.from_hf_config(tmp_path / "twice.json", world_size=8, max_tokens_per_rank=8)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        EpConfig.from_hf_config(tmp_path, world_size=8, max_tokens_per_rank=8)
    with pytest.raises(TypeError, match=r"^foo=1: not an EpConfig field \(its fields: world_size, hidden"):
        EpConfig.from_hf_config(HF_CONFIGS["qwen3-30b-a3b"], world_size=8, max_tokens_per_rank=8, foo=1)
    with pytest.raises(ValueError, match="source must be a path, a dict or a PretrainedConfig, got int"):
        EpConfig.from_hf_config(3, world_size=8, max_tokens_per_rank=8)


# The families whose configs name the fields otherwise, as their published config.json files lay them out
# (the field names as transformers 5.25's config classes store them and to_dict() writes them; the values of
# the public checkpoints named, the class defaults where a checkpoint's were not at hand).
RENAMED = {
    # baidu/ERNIE-4.5-21B-A3B-PT: attribute_map num_experts -> moe_num_experts, num_experts_per_tok -> moe_k
    "ernie4_5_moe": ({"model_type": "ernie4_5_moe", "hidden_size": 2560, "moe_num_experts": 64, "moe_k": 6,
                      "moe_num_shared_experts": 2, "moe_intermediate_size": 1536}, (2560, 64, 6)),
    # tencent/Hunyuan-A13B-Instruct: moe_topk one per layer; attribute_map num_local_experts -> num_experts
    "hunyuan_v1_moe": ({"model_type": "hunyuan_v1_moe", "hidden_size": 4096, "num_experts": 64, "moe_topk": [8] * 32,
                        "num_shared_expert": [1] * 32, "moe_intermediate_size": [3072] * 32}, (4096, 64, 8)),
    # meituan-longcat/LongCat-Flash-Chat: 512 routed experts and 256 zero (identity) experts, top-12
    "longcat_flash": ({"model_type": "longcat_flash", "hidden_size": 6144, "n_routed_experts": 512, "moe_topk": 12,
                       "zero_expert_num": 256, "expert_ffn_hidden_size": 2048}, (6144, 512, 12)),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct: attribute_map num_experts_per_tok -> num_experts_per_token
    "kimi_linear": ({"model_type": "kimi_linear", "hidden_size": 2304, "num_experts": 256, "num_experts_per_token": 8,
                     "num_shared_experts": 1, "moe_intermediate_size": 1024}, (2304, 256, 8)),
    # inclusionAI/Ling-3.0-Flash (BailingHybridConfig's defaults)
    "bailing_hybrid": ({"model_type": "bailing_hybrid", "hidden_size": 2560, "num_experts": 512,
                        "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 768},
                       (2560, 512, 8)),
    # rhymes-ai/Aria: the language model's config under text_config (aria_text)
    "aria": ({"model_type": "aria", "text_config": {"model_type": "aria_text", "hidden_size": 2560,
                                                    "moe_num_experts": 64, "moe_topk": 6, "moe_num_shared_experts": 2,
                                                    "moe_intermediate_size": 1664}}, (2560, 64, 6)),
    # google/gemma-4-26b-a4b: the MoE form of gemma4_text (enable_moe_block), top_k_experts
    "gemma4": ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "hidden_size": 2816,
                                                        "enable_moe_block": True, "num_experts": 128,
                                                        "top_k_experts": 8, "moe_intermediate_size": 704}},
               (2816, 128, 8)),
    # databricks/dbrx-instruct: d_model, the experts in ffn_config
    "dbrx": ({"model_type": "dbrx", "d_model": 6144, "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4,
                                                                     "ffn_hidden_size": 10752}}, (6144, 16, 4)),
}


@pytest.mark.parametrize("family", sorted(RENAMED))
def test_families_that_name_the_fields_otherwise(family, tmp_path):
    data, shape = RENAMED[family]
    cfg = EpConfig.from_hf_config(data, world_size=2, max_tokens_per_rank=8)
    assert (cfg.hidden, cfg.num_experts, cfg.topk) == shape
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert EpConfig.from_hf_config(tmp_path, world_size=2, max_tokens_per_rank=8) == cfg


STORED = {"ernie4_5_moe": ("moe_num_experts", "moe_k"), "hunyuan_v1_moe": ("num_experts", "moe_topk"),
          "longcat_flash": ("n_routed_experts", "moe_topk"), "kimi_linear": ("num_experts", "num_experts_per_token"),
          "bailing_hybrid": ("num_experts", "num_experts_per_token"), "aria": ("moe_num_experts", "moe_topk")}
"""The experts and top-k of each family's config class, as it stores them."""


@pytest.mark.parametrize("family", sorted(STORED) + ["gemma4"])
def test_the_config_classes_own_configs(family):
    """A loaded config of each family (transformers' class, its defaults) gives its own experts and top-k;
    gemma4's default is its dense form, named as dense."""
    transformers = pytest.importorskip("transformers", reason="the optional transformers extra is not installed")
    config = transformers.AutoConfig.for_model(family)
    if family == "gemma4":
        with pytest.raises(ValueError, match=r"no routed experts field .* a dense model"):
            EpConfig.from_hf_config(config, world_size=1, max_tokens_per_rank=8)
        config.text_config.enable_moe_block, config.text_config.num_experts, config.text_config.top_k_experts = True, 16, 4
        cfg = EpConfig.from_hf_config(config, world_size=1, max_tokens_per_rank=8)
        assert (cfg.hidden, cfg.num_experts, cfg.topk) == (config.text_config.hidden_size, 16, 4)
        return
    text = config.get_text_config()
    cfg = EpConfig.from_hf_config(config, world_size=1, max_tokens_per_rank=8)
    experts, top = (getattr(text, n) for n in STORED[family])
    assert (cfg.hidden, cfg.num_experts, cfg.topk) == (text.hidden_size, experts, top[0] if isinstance(top, list) else top)


def test_attribute_map_of_an_unlisted_family(monkeypatch):
    """A model_type outside FAMILY_FIELDS whose class aliases the common names to others: read through the
    class's attribute_map."""
    from epgen.codegen import hfconfig

    monkeypatch.setitem(hfconfig.FAMILY_FIELDS, "ernie4_5_moe", {})
    monkeypatch.setattr(hfconfig, "FIELDS", {**hfconfig.FIELDS, "topk": ("num_experts_per_tok",),
                                             "num_experts": ("num_experts",)})
    pytest.importorskip("transformers", reason="the optional transformers extra is not installed")
    data, shape = RENAMED["ernie4_5_moe"]
    cfg = EpConfig.from_hf_config(data, world_size=1, max_tokens_per_rank=8)
    assert (cfg.hidden, cfg.num_experts, cfg.topk) == shape


def test_a_moe_family_with_a_field_missing_is_not_called_dense():
    data = dict(RENAMED["ernie4_5_moe"][0])
    del data["moe_k"]
    with pytest.raises(ValueError, match=r"the config has no top-k field \(EpConfig.topk\): looked for "
                                         r"moe_k, num_experts_per_tok, .* in model_type 'ernie4_5_moe'; model_type "
                                         r"'ernie4_5_moe' has routed experts") as e:
        EpConfig.from_hf_config(data, world_size=1, max_tokens_per_rank=8)
    assert "dense" not in str(e.value)
    with pytest.raises(ValueError, match=r"model_type 'qwen9_moe' has routed experts"):  # unknown, but experts named
        EpConfig.from_hf_config({"model_type": "qwen9_moe", "hidden_size": 64, "num_experts": 8}, world_size=1,
                                max_tokens_per_rank=8)


def test_per_layer_top_k_must_agree():
    data = dict(RENAMED["hunyuan_v1_moe"][0], moe_topk=[8, 8, 4])
    with pytest.raises(ValueError, match=r"moe_topk=\[8, 8, 4\] differs across layers"):
        EpConfig.from_hf_config(data, world_size=1, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match=r"moe_topk=\[\] gives no top-k"):
        EpConfig.from_hf_config(dict(data, moe_topk=[]), world_size=1, max_tokens_per_rank=8)


@pytest.mark.parametrize("content,message", [
    (b"[" * 100_000 + b"]" * 100_000, r"JSON nested deeper than the parser takes; a config.json nests at most 64 levels"),
    (b'{"a": ' * 70 + b"1" + b"}" * 70, r"JSON nested 70 levels deep; a config.json nests at most 64 levels"),
    (b'{"model_type": "qwen3_moe", "name": "\xff\xfe"}', r"not UTF-8 text \(byte 0xff at offset 37\); a config.json is "
                                                          r"UTF-8 JSON"),
    (b'{"model_type": "qwen3_moe",}', r"not valid JSON \(Expecting property name enclosed in double quotes at line 1, "
                                      r"column 28\)"),
    (b"", r"not valid JSON \(Expecting value at line 1, column 1\)"),
], ids=["deep", "deeper-than-64", "latin-1", "not-json", "empty"])
def test_unreadable_files_refused_naming_the_file_and_the_rule(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"EpConfig.from_hf_config({str(path)!r}): ") + message):
        EpConfig.from_hf_config(tmp_path, world_size=1, max_tokens_per_rank=8)


def test_every_error_of_a_file_names_it(tmp_path):
    path = tmp_path / "config.json"
    named = re.escape(f"EpConfig.from_hf_config({str(path)!r})")
    for data, message in (({"model_type": "llama", "hidden_size": 64}, "dense model"),
                          (dict(QWEN3_NEXT, hidden_size=0), "must be a positive int"),
                          (QWEN3_NEXT, "must be a multiple of world_size=3")):
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=named + ".*" + message):
            EpConfig.from_hf_config(path, world_size=3, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match=named + r" \(qwen3_next\): topk come from the model config"):
        EpConfig.from_hf_config(path, world_size=2, max_tokens_per_rank=8, topk=2)
