"""Input validation of dispatch/combine runs before any launch and needs no GPU: every bad input
raises naming the argument, its value and the rule."""

import pytest
import torch

from epgen.codegen.config import EpConfig
from epgen.op import check_combine_inputs, check_dispatch_inputs

CPU = torch.device("cpu")
CFG = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64)  # H 2880, K 4, E 128
SCALED = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64, scale_bytes=90)


def good(T=8, cfg=CFG):
    x = torch.randn(T, cfg.hidden).to(torch.bfloat16)
    w = torch.rand(T, cfg.topk)
    i = torch.randint(-1, cfg.num_experts, (T, cfg.topk), dtype=torch.int32)
    s = torch.zeros(T, cfg.scale_bytes, dtype=torch.uint8) if cfg.scale_bytes else None
    return x, w, i, s


def test_good_inputs_pass_and_return_tokens():
    assert check_dispatch_inputs(CFG, CPU, *good(8)) == 8
    assert check_dispatch_inputs(CFG, CPU, *good(0)) == 0
    assert check_dispatch_inputs(CFG, CPU, *good(64)) == 64  # T == max_tokens_per_rank passes
    assert check_dispatch_inputs(SCALED, CPU, *good(3, SCALED)) == 3


@pytest.mark.parametrize("mutate,expect", [
    (lambda x, w, i, s: (x.half(), w, i, s), ["x.dtype=torch.float16", "torch.bfloat16"]),
    (lambda x, w, i, s: (x[:, :2879], w, i, s), ["x.shape=[8, 2879]", "[*, 2880]"]),
    (lambda x, w, i, s: (x.t(), w, i, s), ["x.shape="]),
    (lambda x, w, i, s: (x.reshape(-1), w, i, s), ["x.shape=[23040]"]),
    (lambda x, w, i, s: (x, w.double(), i, s), ["weights.dtype=torch.float64", "torch.float32"]),
    (lambda x, w, i, s: (x, w[:7], i, s), ["weights.shape=[7, 4]", "[8, 4]"]),
    (lambda x, w, i, s: (x, w, i.long(), s), ["indices.dtype=torch.int64", "torch.int32"]),
    (lambda x, w, i, s: (x, w, i[:, :3], s), ["indices.shape=[8, 3]", "[8, 4]"]),
    (lambda x, w, i, s: (x, w, i, torch.zeros(8, 90, dtype=torch.uint8)), ["scales", "scale_bytes=0"]),
    (lambda x, w, i, s: (x[:, ::2].repeat(1, 2), w, i, s), []),  # a valid copy: passes
])
def test_bad_dispatch_inputs(mutate, expect):
    args = mutate(*good(8))
    if not expect:
        check_dispatch_inputs(CFG, CPU, *args)
        return
    with pytest.raises(ValueError) as e:
        check_dispatch_inputs(CFG, CPU, *args)
    for part in expect:
        assert part in str(e.value)


def test_too_many_tokens_names_the_limit():
    with pytest.raises(ValueError, match=r"x\.shape\[0\]=65: more tokens than max_tokens_per_rank=64"):
        check_dispatch_inputs(CFG, CPU, *good(65))


def test_non_contiguous_is_rejected_with_a_hint():
    x, w, i, s = good(8)
    x2 = torch.randn(8, 2 * CFG.hidden).to(torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        check_dispatch_inputs(CFG, CPU, x2, w, i, s)


def test_wrong_device_and_type():
    x, w, i, s = good(8)
    with pytest.raises(ValueError, match=r"x\.device=cpu: must be cuda:0"):
        check_dispatch_inputs(CFG, torch.device("cuda", 0), x, w, i, s)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got list"):
        check_dispatch_inputs(CFG, CPU, x.tolist(), w, i, s)


def test_scales_required_with_their_shape():
    x, w, i, _ = good(3, SCALED)
    with pytest.raises(TypeError, match="scales"):
        check_dispatch_inputs(SCALED, CPU, x, w, i, None)
    with pytest.raises(ValueError, match=r"scales\[rank 1\]\.shape=\[3, 89\]: must be \[3, 90\]"):
        check_dispatch_inputs(SCALED, CPU, x, w, i, torch.zeros(3, 89, dtype=torch.uint8), "[rank 1]")


def test_combine_inputs():
    y = torch.randn(10, CFG.hidden).to(torch.bfloat16)
    check_combine_inputs(CFG, CPU, y, None, 5)
    check_combine_inputs(CFG, CPU, y, torch.empty(5, CFG.hidden, dtype=torch.bfloat16), 5)
    with pytest.raises(ValueError, match=r"y\.dtype=torch\.float32"):
        check_combine_inputs(CFG, CPU, y.float(), None, 5)
    big = torch.zeros(129, CFG.hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"y\.shape\[0\]=129: more rows than the receive capacity 128"):
        check_combine_inputs(CFG, CPU, big, None, 5)
    with pytest.raises(ValueError, match=r"out\.shape=\[4, 2880\]: must be \[5, 2880\]"):
        check_combine_inputs(CFG, CPU, y, torch.empty(4, CFG.hidden, dtype=torch.bfloat16), 5)


@pytest.mark.parametrize("dtype,columns,torch_dtype", [("fp8", 2880, torch.float8_e4m3fn), ("fp4", 1440, torch.uint8)])
def test_quantized_payload_shapes(dtype, columns, torch_dtype):
    from epgen.verify import make_inputs, reference_dispatch
    from epgen.quant import scale_bytes

    # 2880 is not a multiple of fp8's 128-element block: the caller defines 23 fp32 scales (92 bytes)
    sbytes = 92 if dtype == "fp8" else scale_bytes("fp4_mx", 2880)
    cfg = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64, dtype=dtype, scale_bytes=sbytes)
    ins = make_inputs(cfg, [5, 3], "uniform", seed=1)
    assert ins[0].x.shape == (5, columns) and ins[0].x.dtype == torch_dtype
    assert ins[0].scales.shape == (5, cfg.scale_bytes)
    assert check_dispatch_inputs(cfg, CPU, ins[0].x, ins[0].weights, ins[0].indices, ins[0].scales) == 5
    with pytest.raises(ValueError, match=rf"x\.shape=\[5, 2880\]: must be \[\*, {columns}\]" if dtype == "fp4"
                       else r"x\.dtype=torch\.bfloat16"):
        bad = torch.zeros(5, 2880, dtype=torch.uint8 if dtype == "fp4" else torch.bfloat16)
        check_dispatch_inputs(cfg, CPU, bad, ins[0].weights, ins[0].indices, ins[0].scales)
    recv = reference_dispatch(cfg, ins)
    assert sum(r.num_rows for r in recv) >= 8 and recv[0].x.dtype == torch_dtype
