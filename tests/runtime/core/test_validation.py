"""Input validation of dispatch/combine runs before any launch and needs no GPU: every bad input
raises naming the argument, its value and the rule."""

import pytest
import torch

from epgen.codegen import planner
from epgen.codegen import tuning
from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import dtype_info
from epgen.codegen.spec import Op
from epgen.codegen.tuning import Geometry
from epgen.op import check_combine_inputs, check_dispatch_inputs
from epgen.plan import Plan

CPU = torch.device("cpu")
CFG = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64)  # H 2880, K 4, E 128
CAP = CFG.world_size * CFG.max_tokens_per_rank  # receive rows
SCALED = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64, scale_bytes=90)


def good(T=8, cfg=CFG):
    x = torch.randn(T, cfg.hidden).to(torch.bfloat16)
    w = torch.rand(T, cfg.topk)
    i = torch.randint(-1, cfg.num_experts, (T, cfg.topk), dtype=torch.int32)
    s = torch.zeros(T, cfg.scale_bytes, dtype=torch.uint8) if cfg.scale_bytes else None
    return x, w, i, s


def test_good_inputs_pass_and_return_tokens():
    assert check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, *good(8)) == 8
    assert check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, *good(0)) == 0
    assert check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, *good(64)) == 64  # T == max_tokens_per_rank passes
    assert check_dispatch_inputs(SCALED, dtype_info(SCALED.dtype), CPU, *good(3, SCALED)) == 3


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
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, *args)
        return
    with pytest.raises(ValueError) as e:
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, *args)
    for part in expect:
        assert part in str(e.value)


def test_too_many_tokens_names_the_limit():
    with pytest.raises(ValueError, match=r"x\.shape\[0\]=65: more tokens than max_tokens_per_rank=64"):
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, *good(65))


def test_non_contiguous_is_rejected_with_a_hint():
    x, w, i, s = good(8)
    x2 = torch.randn(8, 2 * CFG.hidden).to(torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, x2, w, i, s)


def test_wrong_device_and_type():
    x, w, i, s = good(8)
    with pytest.raises(ValueError, match=r"x\.device=cpu: must be cuda:0"):
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), torch.device("cuda", 0), x, w, i, s)
    with pytest.raises(TypeError, match="x: must be a torch.Tensor, got list"):
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, x.tolist(), w, i, s)


def test_scales_required_with_their_shape():
    x, w, i, _ = good(3, SCALED)
    with pytest.raises(TypeError, match="scales"):
        check_dispatch_inputs(SCALED, dtype_info(SCALED.dtype), CPU, x, w, i, None)
    with pytest.raises(ValueError, match=r"scales\[rank 1\]\.shape=\[3, 89\]: must be \[3, 90\]"):
        check_dispatch_inputs(SCALED, dtype_info(SCALED.dtype), CPU, x, w, i, torch.zeros(3, 89, dtype=torch.uint8), "[rank 1]")


def test_combine_inputs():
    y = torch.randn(10, CFG.hidden).to(torch.bfloat16)
    check_combine_inputs(CFG, CPU, y, None, 5, CAP)
    check_combine_inputs(CFG, CPU, y, torch.empty(5, CFG.hidden, dtype=torch.bfloat16), 5, CAP)
    with pytest.raises(ValueError, match=r"y\.dtype=torch\.float32"):
        check_combine_inputs(CFG, CPU, y.float(), None, 5, CAP)
    big = torch.zeros(129, CFG.hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"y\.shape\[0\]=129: more rows than the receive capacity .*, 128"):
        check_combine_inputs(CFG, CPU, big, None, 5, CAP)
    with pytest.raises(ValueError, match=r"out\.shape=\[4, 2880\]: must be \[5, 2880\]"):
        check_combine_inputs(CFG, CPU, y, torch.empty(4, CFG.hidden, dtype=torch.bfloat16), 5, CAP)


@pytest.mark.parametrize("dtype,columns,torch_dtype", [("fp8", 2880, torch.float8_e4m3fn), ("fp4", 1440, torch.uint8)])
def test_quantized_payload_shapes(dtype, columns, torch_dtype):
    from epgen.harness.verify import make_inputs, reference_dispatch
    from epgen.quant import scale_bytes

    # 2880 is not a multiple of fp8's 128-element block: the caller defines 23 fp32 scales (92 bytes)
    sbytes = 92 if dtype == "fp8" else scale_bytes("fp4_mx", 2880)
    cfg = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64, dtype=dtype, scale_bytes=sbytes)
    ins = make_inputs(cfg, [5, 3], "uniform", seed=1)
    assert ins[0].x.shape == (5, columns) and ins[0].x.dtype == torch_dtype
    assert ins[0].scales.shape == (5, cfg.scale_bytes)
    assert check_dispatch_inputs(cfg, dtype_info(cfg.dtype), CPU, ins[0].x, ins[0].weights, ins[0].indices, ins[0].scales) == 5
    with pytest.raises(ValueError, match=rf"x\.shape=\[5, 2880\]: must be \[\*, {columns}\]" if dtype == "fp4"
                       else r"x\.dtype=torch\.bfloat16"):
        bad = torch.zeros(5, 2880, dtype=torch.uint8 if dtype == "fp4" else torch.bfloat16)
        check_dispatch_inputs(cfg, dtype_info(cfg.dtype), CPU, bad, ins[0].weights, ins[0].indices, ins[0].scales)
    recv = reference_dispatch(cfg, ins)
    assert sum(r.num_rows for r in recv) >= 8 and recv[0].x.dtype == torch_dtype


def _offset_view(base: torch.Tensor, offset_elements: int, shape) -> torch.Tensor:
    """A contiguous view of ``shape`` starting ``offset_elements`` into a flat copy of ``base``'s
    dtype (torch's CPU allocator aligns the storage itself to at least 16 bytes)."""
    n = 1
    for d in shape:
        n *= d
    flat = torch.zeros(n + offset_elements, dtype=base.dtype)
    assert flat.data_ptr() % 16 == 0
    return flat[offset_elements:].view(*shape)


def test_misaligned_x_is_rejected_naming_the_address():
    x, w, i, s = good(8)
    bad = _offset_view(x, 1, x.shape)  # bf16: 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError) as e:
        check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, bad, w, i, s, tag="[rank 1]")
    msg = str(e.value)
    assert f"x[rank 1].data_ptr()={bad.data_ptr():#x}: 2 bytes past a 16-byte boundary" in msg
    assert "16-byte vector" in msg
    assert check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, _offset_view(x, 8, x.shape), w, i, s) == 8  # 16 bytes in: aligned
    assert check_dispatch_inputs(CFG, dtype_info(CFG.dtype), CPU, _offset_view(x, 1, (0, CFG.hidden)), w[:0], i[:0], None) == 0


def test_fp8_x_is_checked_in_the_targets_flavour():
    # The op passes its dispatch spec's dtype_info: fp8 in the arch's flavour (ArchTraits.fp8).
    # gfx942's (e4m3fnuz) refuses e4m3fn rows and takes its own.
    cfg = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64, dtype="fp8")
    fnuz = planner.plan(cfg, "gfx942").variant(Op.DISPATCH, 64).dtype_info
    assert fnuz.torch_dtype == torch.float8_e4m3fnuz
    _, w, i, s = good(8, cfg)
    ocp = torch.zeros(8, cfg.hidden, dtype=torch.float8_e4m3fn)
    assert check_dispatch_inputs(cfg, dtype_info("fp8"), CPU, ocp, w, i, s) == 8
    with pytest.raises(ValueError, match=r"x\.dtype=torch\.float8_e4m3fn: must be torch\.float8_e4m3fnuz"):
        check_dispatch_inputs(cfg, fnuz, CPU, ocp, w, i, s)
    assert check_dispatch_inputs(cfg, fnuz, CPU, ocp.view(torch.float8_e4m3fnuz), w, i, s) == 8


def test_misaligned_fp8_x_is_rejected():
    cfg = EpConfig.for_model("gpt-oss-120b", world_size=2, max_tokens_per_rank=64, dtype="fp8")
    x, w, i, s = good(8, cfg)
    x = _offset_view(torch.zeros(1, dtype=torch.float8_e4m3fn), 5, (8, cfg.hidden))
    with pytest.raises(ValueError, match=r"x\.data_ptr\(\)=0x[0-9a-f]+: 5 bytes past a 16-byte boundary"):
        check_dispatch_inputs(cfg, dtype_info(cfg.dtype), CPU, x, w, i, s)


def test_weights_indices_scales_need_only_their_element_alignment():
    # The kernels read weights and indices per 4-byte element and scales per byte.
    x, w, i, s = good(8, SCALED)
    w, i, s = _offset_view(w, 1, w.shape), _offset_view(i, 1, i.shape), _offset_view(s, 3, s.shape)
    assert (w.data_ptr() % 16, i.data_ptr() % 16, s.data_ptr() % 16) == (4, 4, 3)
    assert check_dispatch_inputs(SCALED, dtype_info(SCALED.dtype), CPU, x, w, i, s) == 8


def test_misaligned_out_is_rejected_and_y_is_not():
    y = _offset_view(torch.zeros(1, dtype=torch.bfloat16), 3, (5, CFG.hidden))  # copied into the arena
    check_combine_inputs(CFG, CPU, y, None, tokens=8, capacity=CAP)
    out = _offset_view(y, 4, (8, CFG.hidden))
    with pytest.raises(ValueError, match=r"out\[rank 0\]\.data_ptr\(\)=0x[0-9a-f]+: 8 bytes past a 16-byte"):
        check_combine_inputs(CFG, CPU, torch.zeros(5, CFG.hidden, dtype=torch.bfloat16), out, tokens=8, capacity=CAP, tag="[rank 0]")


def test_a_layer_across_nodes_is_refused_before_anything_else():
    from epgen.op import EpDispatchCombine

    cfg = EpConfig(world_size=4, hidden=256, topk=2, num_experts=8, max_tokens_per_rank=8, nodes=2, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"^EpConfig.nodes=2: a layer across nodes runs as "
                                         r"epgen.hierarchical.HierarchicalEp"):
        EpDispatchCombine(cfg)


def test_ranks_without_a_process_group_are_refused_naming_the_way_out():
    from epgen.op import EpDispatchCombine

    cfg = EpConfig(world_size=2, hidden=64, topk=2, num_experts=8, max_tokens_per_rank=8)
    with pytest.raises(RuntimeError, match=r"^EpConfig.world_size=2: needs torch.distributed initialized with one "
                                           r"process per rank \(gloo, on the host emulation\), or virtual=True"):
        EpDispatchCombine(cfg, device="cpu")


@pytest.mark.parametrize("virtual,transport,want", [
    (True, "auto", "pull"), (False, "auto", "push"), (False, "pull", "pull"), (True, "push", "push"),
])
def test_auto_pulls_only_where_one_process_decides_for_every_rank(table_dir, virtual, transport, want):
    """With one rank a process each process sees only its own x and token count, and ranks must
    take the same transport: "auto" pushes there even where the bucket says pull and x is
    dispatch_input; "pull" pulls on every rank."""
    from epgen.op import EpDispatchCombine

    cfg = EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=64, kernel_family="normal",
                   dispatch_transport=transport)
    if transport == "auto":  # a pull bucket
        tuning.write_entry(planner.tuning_key(cfg, "sm_90", Op.DISPATCH), [(64, Geometry(4, 4, 2))], "test", {},
                           transports={64: "pull"})
    op = object.__new__(EpDispatchCombine)  # the decision alone: no GPU
    region = torch.zeros(64, 256, dtype=torch.bfloat16)
    op.local_ranks = [0, 1] if virtual else [1]
    op.plan = Plan.build(cfg, "sm_90", len(op.local_ranks))
    op.dispatch_input = lambda rank=None: region
    assert op._transport(64, [region[:64]] * len(op.local_ranks)) == want


def test_check_tensor_names_the_first_rule_broken():
    """epgen.tensors.check_tensor: the one check behind the op, the references and the layers."""
    from epgen.tensors import check_tensor

    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert check_tensor("x", t, dtype=torch.bfloat16, shape=(None, 8), device=CPU, contiguous=True,
                        vector_bytes=16) is t
    with pytest.raises(TypeError, match=r"^x: must be a torch.Tensor, got list$"):
        check_tensor("x", [1.0])
    with pytest.raises(ValueError, match=r"^x\.dtype=torch.bfloat16: must be torch.float32 or torch.float16$"):
        check_tensor("x", t, dtype=(torch.float32, torch.float16), dim=3)  # dtype before dims
    with pytest.raises(ValueError, match=r"^x\.shape=\[4, 8\]: must be 3-D$"):
        check_tensor("x", t, dim=3)
    with pytest.raises(ValueError, match=r"^x\.shape=\[4, 8\]: must be \[\*, 7\]$"):
        check_tensor("x", t, shape=(None, 7))
    with pytest.raises(ValueError, match=r"^x\.shape=\[4, 8\]: must be \[4, 8, \*\]$"):
        check_tensor("x", t, shape=(4, 8, None))
    with pytest.raises(ValueError, match=r"^x\.device=cpu: must be meta$"):
        check_tensor("x", t, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"^x: must be contiguous \(call \.contiguous\(\) first\)$"):
        check_tensor("x", t.t(), contiguous=True)
    with pytest.raises(ValueError, match=r"^x\.data_ptr\(\)=0x[0-9a-f]+: 2 bytes past a 16-byte boundary"):
        check_tensor("x", t.view(-1)[1:], vector_bytes=16)
    assert check_tensor("x", t.view(-1)[1:1], vector_bytes=16).numel() == 0  # an empty view is not read
