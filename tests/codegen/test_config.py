"""EpConfig, the layer's configuration as a value: its validation (every error names the field, its
value and the rule), its constructors (``EpConfig(...)``, ``for_model``) and its derived fields
(``experts_per_rank``, ``node_config``, ``node_scale_bytes``). ``from_hf_config`` reads a
transformers config.json: tests/codegen/test_hf_config.py."""

from __future__ import annotations

import re

import pytest

from epgen.codegen import planner
from epgen.codegen.arch import ARCHES
from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.dtypes import DTYPES
from epgen.codegen.models import MODELS
from epgen.codegen.spec import Op

CFG = dict(world_size=8, hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=4096)


def cfg(**changes) -> EpConfig:
    return EpConfig(**{**CFG, **changes})


def test_config_builds_and_derives():
    c = cfg()
    assert c.experts_per_rank == 32
    for arch in ARCHES:
        specs = planner.specs(c, arch)
        assert [s.op for s in specs] == list(planner.plan(c, arch).ops)
        for s in specs:
            assert s.arch == arch
            assert (s.hidden, s.topk, s.world_size, s.max_tokens_per_rank) == (7168, 8, 8, 4096)
            assert s.experts_per_rank == 32 and s.num_experts == 256
            assert s.dtype == (c.dtype if s.op.payload else "bf16")
            assert s.ll_tokens == planner.plan(c, arch).low_latency_tokens


def test_node_config():
    cfg = EpConfig.for_model("deepseek-v3", world_size=16, nodes=2, max_tokens_per_rank=4096, scale_bytes=56)
    node = cfg.node_config()
    assert (node.world_size, node.num_experts, node.max_tokens_per_rank, node.scale_bytes, node.nodes) == \
        (8, 128, 8192, 4 * 8 + 8 + 56, 1)
    assert EpConfig(world_size=320, hidden=7168, topk=8, num_experts=320, nodes=40,
                    max_tokens_per_rank=128).node_config().world_size == 8  # W beyond one kernel's 64 ranks
    assert EpConfig(world_size=4, nodes=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=16,
                    scale_bytes=3).node_scale_bytes == 16 + 8 + 3 + 1
    # the layer's kernels are the node-local op's: no flat 16-rank (or, at 320 ranks, impossible) specs
    for query in (lambda: planner.ops(cfg), lambda: planner.specs(cfg, "sm_90"), lambda: planner.plan(cfg, "sm_90").variants.get((Op.COMBINE, "push"), ())):
        with pytest.raises(ValueError, match=r"^EpConfig.nodes=2: a layer across nodes compiles the kernels of its "
                                             r"node_config\(\) \(8 ranks a node\), not flat ones of world_size=16"):
            query()
    assert [s.world_size for s in planner.specs(node, "sm_90")] == [8] * len(planner.specs(node, "sm_90"))
    for kw, field, match in [
        (dict(nodes=3), "nodes", r"EpConfig.nodes=3: must divide world_size=16"),
        (dict(nodes=0), "nodes", r"EpConfig.nodes=0: must be a positive int"),
        (dict(nodes=2, gpus_per_node=4), "gpus_per_node", r"gpus_per_node=4: nodes x gpus_per_node must be "
                                                           r"world_size=16 \(nodes=2\)"),
        (dict(nodes=2, scale_bytes=4060), "scale_bytes", r"scale_bytes=4060: with nodes=2 .* \(4100 in all\), at most"),
        (dict(nodes=2, kernel_family="low_latency", max_tokens_per_rank=40000), "max_tokens_per_rank",
         r"the node-local layer \(node_config\(\)\) is invalid: EpConfig.max_tokens_per_rank=80000"),
    ]:
        kw.setdefault("max_tokens_per_rank", 64)
        with pytest.raises(ValueError, match=match) as e:
            EpConfig.for_model("deepseek-v3", world_size=16, **kw)
        assert e.value.field == field


BAD_CONFIGS = [
    (dict(world_size=0), ["EpConfig.world_size=0", "positive int"]),
    (dict(world_size=8.0), ["EpConfig.world_size=8.0", "positive int"]),
    (dict(hidden=-8), ["EpConfig.hidden=-8", "positive int"]),
    (dict(hidden=7168.0), ["EpConfig.hidden=7168.0", "positive int"]),
    (dict(topk=True), ["EpConfig.topk=True", "positive int"]),
    (dict(num_experts=0), ["EpConfig.num_experts=0", "positive int"]),
    (dict(num_experts="256"), ["EpConfig.num_experts='256'", "positive int"]),
    (dict(max_tokens_per_rank=None), ["EpConfig.max_tokens_per_rank=None", "positive int"]),
    (dict(num_experts=250), ["EpConfig.num_experts=250", "multiple of world_size=8"]),
    (dict(world_size=3), ["EpConfig.num_experts=256", "multiple of world_size=3"]),
    (dict(dtype="fp16"), ["EpConfig.dtype='fp16'", *DTYPES]),
    (dict(scale_bytes=-1), ["EpConfig.scale_bytes=-1", ">= 0"]),
    (dict(scale_bytes=1.0), ["EpConfig.scale_bytes=1.0", "int"]),
    (dict(timeout_s=0), ["EpConfig.timeout_s=0", "[0.001, 3600]"]),
    (dict(timeout_s=-1.0), ["EpConfig.timeout_s=-1.0", "[0.001, 3600]"]),
    (dict(timeout_s=1e-12), ["EpConfig.timeout_s=1e-12", "[0.001, 3600]", "whole nanoseconds"]),
    (dict(timeout_s=3601), ["EpConfig.timeout_s=3601", "[0.001, 3600]"]),
    (dict(timeout_s=float("nan")), ["EpConfig.timeout_s=nan", "[0.001, 3600]"]),
    (dict(timeout_s="5"), ["EpConfig.timeout_s='5'", "must be a Python int or float (seconds)"]),
    (dict(timeout_s=True), ["EpConfig.timeout_s=True", "must be a Python int or float (seconds)"]),
]


@pytest.mark.parametrize("changes,parts", BAD_CONFIGS, ids=[repr(c) for c, _ in BAD_CONFIGS])
def test_config_bad_field_message(changes, parts):
    with pytest.raises(ValueError) as info:
        cfg(**changes)
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


@pytest.mark.parametrize("changes,field", [(dict(scale_bytes=True), "scale_bytes"), (dict(timeout_s=True), "timeout_s")])
def test_config_rejects_bool_with_own_field_name(changes, field):
    with pytest.raises(ValueError, match=rf"EpConfig\.{field}=True"):
        cfg(**changes)


def test_ep_config_takes_numpy_integers_and_still_rejects_bools_and_floats():
    import numpy as np

    from epgen.codegen.config import EpConfig
    from epgen.codegen.errors import FieldError

    cfg = EpConfig(world_size=np.int64(8), hidden=np.int32(4096), topk=np.uint8(2), num_experts=np.int64(8),
                   max_tokens_per_rank=np.int16(128), scale_bytes=np.int64(16))
    assert cfg == EpConfig(world_size=8, hidden=4096, topk=2, num_experts=8, max_tokens_per_rank=128, scale_bytes=16)
    assert all(type(getattr(cfg, f)) is int for f in ("world_size", "hidden", "topk", "max_tokens_per_rank"))
    for bad in (True, np.bool_(True), 8.0, np.float64(8)):
        with pytest.raises(FieldError, match="EpConfig.world_size=.*: must be a positive int") as e:
            EpConfig(world_size=bad, hidden=4096, topk=2, num_experts=8, max_tokens_per_rank=128)
        assert e.value.field == "world_size"


def test_config_derived_spec_errors_name_the_spec_field():
    # Documented: the derived KernelSpecs are validated on construction too.
    with pytest.raises(ValueError, match=r"KernelSpec\.hidden=7172.*multiple of 16 bytes"):
        cfg(hidden=7172)
    with pytest.raises(ValueError, match=r"Geometry\.blocks=0: must be a positive int"):
        cfg(dispatch_geometry=Geometry(blocks=0))
    with pytest.raises(ValueError, match=r"KernelSpec\.blocks=70000"):
        cfg(dispatch_geometry=Geometry(blocks=70000))
    with pytest.raises(ValueError, match=r"EpConfig\.combine_geometry='24x16u4': must be None"):
        cfg(combine_geometry="24x16u4")
    with pytest.raises(ValueError, match=r"EpConfig\.topk=9: must be at most num_experts=8"):
        cfg(topk=9, num_experts=8)


@pytest.mark.parametrize("name,suggest", [
    ("deepseek-v4", "deepseek-v3"), ("kimi-k3", "kimi-k2"), ("qwen3-235b", "qwen3-235b-a22b"),
    ("mixtral", "mixtral-8x7b"), ("gpt-oss", "gpt-oss-120b"),
])
def test_for_model_unknown_suggests_close_names(name, suggest):
    with pytest.raises(ValueError) as info:
        EpConfig.for_model(name, world_size=8, max_tokens_per_rank=4096)
    msg = str(info.value)
    assert repr(name) in msg
    assert "did you mean" in msg
    assert suggest in msg.split("did you mean", 1)[1]


def test_for_model_unknown_without_close_names_lists_catalogue():
    with pytest.raises(ValueError) as info:
        EpConfig.for_model("zzzzzzzzzzzz", world_size=8, max_tokens_per_rank=4096)
    msg = str(info.value)
    assert "did you mean" not in msg
    for n in MODELS:
        assert n in msg


@pytest.mark.parametrize("name", list(MODELS))
def test_every_catalogue_model_builds(name):
    m = MODELS[name]
    assert m.name == name
    for w in (1, 2, 4, 8):
        c = EpConfig.for_model(name, world_size=w, max_tokens_per_rank=4096)
        assert (c.hidden, c.topk, c.num_experts, c.world_size, c.max_tokens_per_rank) == (
            m.hidden, m.topk, m.num_experts, w, 4096)
        assert c.experts_per_rank * w == m.num_experts
        assert c.experts_per_rank == m.num_experts // w
        for arch in ARCHES:
            specs = planner.specs(c, arch)
            assert [s.op for s in specs] == list(planner.plan(c, arch).ops)
            assert all(s.num_experts == m.num_experts for s in specs)


def test_for_model_passes_keywords():
    c = EpConfig.for_model("deepseek-v3", world_size=4, max_tokens_per_rank=128, scale_bytes=56, timeout_s=1.5,
                           dispatch_geometry=Geometry(blocks=4))
    assert (c.scale_bytes, c.timeout_s, c.dispatch_geometry.blocks) == (56, 1.5, 4)
    with pytest.raises(ValueError, match=r"EpConfig\.num_experts=8.*multiple of world_size=3"):
        EpConfig.for_model("mixtral-8x7b", world_size=3, max_tokens_per_rank=128)


def test_the_expert_layout_refuses_more_local_experts_than_expand_counts():
    EpConfig(world_size=1, hidden=256, topk=2, num_experts=6143, max_tokens_per_rank=8, layout="expert")
    with pytest.raises(ValueError, match=r"experts_per_rank=6144: .* more than 49152; at most 6143 local experts"):
        EpConfig(world_size=1, hidden=256, topk=2, num_experts=6144, max_tokens_per_rank=8, layout="expert")
    EpConfig(world_size=1, hidden=256, topk=2, num_experts=60000, max_tokens_per_rank=8)  # the rank layout has no limit


@pytest.mark.parametrize("value", ["fast", "", "Normal", None, 1, ("auto",)])
def test_kernel_family_must_be_one_of_three(value):
    with pytest.raises(ValueError) as info:
        cfg(kernel_family=value)
    msg = str(info.value)
    assert msg.startswith(f"EpConfig.kernel_family={value!r}: must be one of auto, normal, low_latency"), msg


def test_the_low_latency_family_holds_at_most_65535_tokens_a_rank():
    c = EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=65535, kernel_family="low_latency")
    assert planner.plan(c, "gfx950").low_latency_tokens == 65535
    with pytest.raises(ValueError, match=r"^EpConfig.max_tokens_per_rank=65536: kernel_family='low_latency' holds at "
                                         r"most 65535 tokens a rank \(use 'auto' or 'normal'\)"):
        EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=65536, kernel_family="low_latency")
    for family in ("auto", "normal"):  # auto caps T_ll instead
        c = EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=65536, kernel_family=family)
        assert planner.plan(c, "gfx950").low_latency_tokens == (0 if family == "normal" else 128)


@pytest.mark.parametrize("value", ["64x8u2", (64, 8, 2), 64])
def test_low_latency_geometry_must_be_a_geometry(value):
    with pytest.raises(ValueError, match=rf"^EpConfig.low_latency_geometry={re.escape(repr(value))}: must be None "
                                         r"\(tuning table\) or an epgen.codegen.tuning.Geometry"):
        cfg(low_latency_geometry=value)


@pytest.mark.parametrize("value", ["both", "", "Pull", None, 1])
def test_dispatch_transport_must_be_one_of_three(value):
    with pytest.raises(ValueError, match=r"^EpConfig.dispatch_transport=.*: must be one of auto, push, pull"):
        cfg(dispatch_transport=value)


def test_pull_refused_with_the_low_latency_family_alone():
    with pytest.raises(ValueError, match=r"^EpConfig.dispatch_transport='pull': applies to the normal family"):
        cfg(dispatch_transport="pull", kernel_family="low_latency")
    c = cfg(kernel_family="low_latency", dispatch_transport="auto")
    assert Op.DISPATCH_PULL not in planner.ops(c) and planner.dispatch_transport(c, "sm_90", 1) == "push"
