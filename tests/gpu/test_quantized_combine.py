"""GPU tests of the normal family's quantized combine: the quantize kernel before it, a rank's own
rows encoded where they are summed, the expert stage that writes the wire rows itself
(``combine_wire_input``), and a combine that needs no block of its own grid to be resident beside
another kernel (run on the device machine)."""

import pytest

from epgen.codegen.config import EpConfig, Geometry
from epgen.codegen.spec import Op
from epgen.harness.verify import PROCESS_WORLD_SIZES, model_config, op_arg, per_rank, run_round

WIRES = ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"]


def _op(world_size, mode, virtual, tmax=1024, validate=True, **kw):
    from epgen.op import EpDispatchCombine

    cfg = model_config("deepseek-v3", world_size, tmax, combine_quant=mode, kernel_family="normal", timeout_s=10.0,
                       **kw)
    return cfg, EpDispatchCombine(cfg, virtual=virtual, validate=validate)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", WIRES)
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_wire_is_bit_equal_to_the_wire_reference(world_size, mode):
    """Table geometry (its warps cut to what the registers allow), tokens per rank from 0 to Tmax,
    uniform / -1 / duplicate routing: every output element within its bound and bit-equal to the
    wire reference (the quantize kernel's rows and the own rows encoded in registers alike)."""
    cfg, op = _op(world_size, mode, virtual=world_size > 1)
    assert ((Op.COMBINE_QUANTIZE, "push") in op.plan.variants) is (world_size > 1)
    seed = 1600
    for tokens in ([1024] * world_size, [0, 1, 7, 1024, 300, 128, 1, 0][:world_size], [0] * world_size):
        for kind in ("uniform", "invalid", "duplicates", "skewed"):
            seed += 1
            stats = run_round(op, cfg, tokens, kind, seed)
            assert stats["wire_mismatches"] == 0, (tokens, kind, stats)
    op.close()


def _wire_rows_of(op, rank, rows):
    w = op.combine_wire_input(rank)
    return w.codes[:rows].clone(), None if w.scales is None else w.scales[:rows].clone()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", WIRES)
def test_the_quantize_kernel_writes_combine_wire_rows_for_rows_from_other_ranks(mode):
    """The wire rows peers read are exactly ``epgen.quant.combine_wire_rows`` of y (codes and
    scales; flushed blocks of negatives and -0.0 too); a rank's own rows are not written (the
    combine encodes them itself)."""
    import torch

    from epgen import quant
    from epgen.harness.verify import make_inputs, op_inputs

    cfg, op = _op(2, mode, virtual=True)
    inputs = make_inputs(cfg, [1024, 777], "uniform", 5, device=op.device)
    outs = op.dispatch(*op_inputs(op, inputs))
    gen = torch.Generator(device=op.device).manual_seed(6)
    ys, sentinel = [], []
    for r, o in zip(op.local_ranks, outs):
        n = int(o.num_recv)
        y = torch.randn(n, cfg.hidden, generator=gen, device=op.device).to(torch.bfloat16)
        y[::5, :256] = -(2.0**-90)  # flushed blocks of negatives and of -0.0: zero codes with the sign bit
        y[1::5, :256] = -0.0
        ys.append(y)
        w = op.combine_wire_input(r)
        w.codes.fill_(0xA5)  # any byte the kernel leaves is seen
        sentinel.append(w.codes[:n].clone())
    op.combine(op_arg(op, ys))
    op.synchronize()
    for r, o, y, before in zip(op.local_ranks, outs, ys, sentinel):
        n = int(o.num_recv)
        other = (o.recv_src[:n, 0] != r).cpu()
        codes, scales = _wire_rows_of(op, r, n)
        want_codes, want_scales = quant.combine_wire_rows(mode, y.cpu())
        assert torch.equal(codes.cpu()[other], want_codes[other]), f"rank {r}: wire codes differ"
        if want_scales is not None:
            assert torch.equal(scales.cpu()[other].view(torch.int32), want_scales[other].view(torch.int32))
        assert torch.equal(codes.cpu()[~other], before.cpu()[~other]), f"rank {r}: own rows were written"
        assert int(other.sum()) and int((~other).sum())
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", WIRES)
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_wire_rows_written_by_the_caller_give_the_same_output(world_size, mode):
    """An expert stage that writes its outputs already quantized (``combine_wire_input``, bytes from
    ``epgen.quant.combine_wire_rows``) gets the output combine(y) gives, bit for bit; no quantize
    kernel runs."""
    import torch

    from epgen import quant
    from epgen.harness.verify import make_inputs, op_inputs

    cfg, op = _op(world_size, mode, virtual=world_size > 1)
    virtual = world_size > 1
    tokens = [512, 0, 333, 512, 1, 512, 64, 200][:world_size]
    inputs = make_inputs(cfg, tokens, "duplicates", 9, device=op.device)
    results = []
    for by_wire in (False, True):
        outs = op.dispatch(*op_inputs(op, inputs))
        outs = outs if virtual else [outs]
        # the expert stage: a function of each received row alone, so both calls agree whatever
        # order their rows took
        ys = [(o.recv_x[:int(o.num_recv)].float() * (0.37 * (r + 1))).to(torch.bfloat16)
              for r, o in zip(op.local_ranks, outs)]
        if by_wire:
            wires = [op.combine_wire_input(r) for r in op.local_ranks]
            for w, y in zip(wires, ys):
                codes, scales = quant.combine_wire_rows(mode, y.cpu())
                w.codes[:y.shape[0]].copy_(codes)
                if scales is not None:
                    w.scales[:y.shape[0]].copy_(scales)
            got = op.combine(wires if virtual else wires[0])
        else:
            got = op.combine(op_arg(op, ys))
        results.append(got if virtual else [got])
    for r, g, f in zip(op.local_ranks, results[1], results[0]):
        assert torch.equal(g.view(torch.int16), f.view(torch.int16)), f"rank {r}"
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8_blockwise", "fp4_blockwise"])
def test_a_block_holding_nan_or_infinity_arrives_as_nan(mode):
    """A block of a received row holding a NaN or an infinity (which the reference refuses) has a
    NaN scale: every element of that block of its token's output is NaN, whether the row came from
    a peer (the quantize kernel) or is the token rank's own (rounded in registers); every other
    element equals the output with those blocks zeroed, bit for bit."""
    import torch

    from epgen.codegen.dtypes import COMBINE_QUANTS
    from epgen.harness.verify import make_inputs, op_inputs

    block = COMBINE_QUANTS[mode].block
    tokens = [512, 300]
    cfg, op = _op(2, mode, virtual=True)
    inputs = make_inputs(cfg, tokens, "uniform", 11, device=op.device)
    want_nan = [torch.zeros(n, cfg.hidden, dtype=torch.bool) for n in tokens]

    def expert_stage(poison: bool):
        """y of each received row from its source alone (both calls' rows may come in another
        order); every 7th source token's row gets, in block (token * 5) mod blocks, a NaN, +inf or
        -inf (poison) or zeros."""
        outs = op.dispatch(*op_inputs(op, inputs))
        ys = []
        for r, o in zip(op.local_ranks, outs):
            n = int(o.num_recv)
            src = o.recv_src[:n].cpu()
            y = (o.recv_x[:n].float() * (0.5 + r)).to(torch.bfloat16)
            hit = ((src[:, 1] % 7) == 0).nonzero().flatten().tolist()
            assert {int(src[i, 0]) for i in hit} == {0, 1}, "own and peer rows alike"
            for i in hit:
                s, tok = int(src[i, 0]), int(src[i, 1])
                b = (tok * 5) % (cfg.hidden // block)
                cols = slice(b * block, (b + 1) * block)
                if poison:
                    y[i, b * block + tok % block] = (float("nan"), float("inf"), -float("inf"))[tok % 3]
                    want_nan[s][tok, cols] = True
                else:
                    y[i, cols] = 0
            ys.append(y)
        return [g.clone() for g in op.combine(op_arg(op, ys))]

    got, ref = expert_stage(True), expert_stage(False)
    for r in op.local_ranks:
        g, f, m = got[r].cpu(), ref[r].cpu(), want_nan[r]
        assert bool(m.any()) and bool(g[m].isnan().all()), f"rank {r}: a poisoned block's elements are not all NaN"
        assert torch.equal(g[~m].view(torch.int16), f[~m].view(torch.int16)), f"rank {r}: other elements differ"
    op.close()


@pytest.mark.gpu
def test_combine_wire_input_is_refused_where_it_cannot_serve():
    import torch

    from epgen.op import EpDispatchCombine
    from epgen.harness.verify import make_inputs, op_inputs

    bf16 = EpDispatchCombine(EpConfig(world_size=1, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=8))
    with pytest.raises(RuntimeError, match="needs a quantized combine wire"):
        bf16.combine_wire_input()
    bf16.close()
    expert = EpDispatchCombine(EpConfig(world_size=1, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=8,
                                        layout="expert", combine_quant="fp8_blockwise"))
    with pytest.raises(RuntimeError, match="the expert layout's fold writes the wire rows"):
        expert.combine_wire_input()
    expert.close()
    cfg = EpConfig(world_size=2, hidden=256, topk=2, num_experts=4, max_tokens_per_rank=64,
                   combine_quant="fp8_blockwise")  # kernel_family "auto": decode sizes take the low-latency family
    op = EpDispatchCombine(cfg, virtual=True)
    inputs = make_inputs(cfg, [4, 4], "uniform", 1, device=op.device)
    op.dispatch(*op_inputs(op, inputs))
    wires = [op.combine_wire_input(r) for r in (0, 1)]
    with pytest.raises(ValueError, match=r"in that order; got \[1, 0\]"):
        op.combine(wires[::-1])
    with pytest.raises(ValueError, match="the low-latency combine encodes its rows as it sends them"):
        op.combine(wires)
    ys = [torch.zeros(64, 256, dtype=torch.bfloat16, device=op.device) for _ in range(2)]
    op.combine(ys)  # the refusals left the op usable
    op.synchronize()
    op.close()


def _matmul_round(op, cfg, tokens, seed):
    """One verified round (every wire element bit-equal) while a long matmul chain runs on a side
    stream, launched first so it holds the SMs; the matmul's result is checked too."""
    import torch

    a = torch.randn(4096, 4096, device=op.device, dtype=torch.bfloat16)
    want = a @ a
    side = torch.cuda.Stream(device=op.device)
    side.wait_stream(torch.cuda.current_stream(op.device))
    with torch.cuda.stream(side):
        products = [a @ a for _ in range(40)]  # ~10 ms of the whole GPU, queued before the op's kernels
    stats = run_round(op, cfg, tokens, "uniform", seed)
    torch.cuda.current_stream(op.device).wait_stream(side)
    assert all(torch.equal(p, want) for p in products)
    assert stats["wire_mismatches"] == 0
    return stats


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8_blockwise", "fp4_blockwise"])
def test_a_combine_with_more_blocks_than_the_gpu_holds_completes_beside_a_matmul(mode):
    """No kernel of the quantized combine waits for a block of its own grid: with 4 blocks per SM
    of 16 warps (more than the GPU holds at once, and a matmul on another stream holding SMs) the
    call completes, exactly. (Before, every block waited for the last one's release.)"""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    many = Geometry(blocks=4 * sms, warps_per_block=16, unroll=4)
    cfg, op = _op(1, mode, virtual=False, combine_geometry=many, dispatch_geometry=many)
    assert op.variant(Op.COMBINE, 1024).blocks == 4 * sms
    for seed, T in enumerate((1024, 1, 0, 777)):
        _matmul_round(op, cfg, [T], 40 + seed)
    op.close()


def _two_process_matmul_body(rank, world_size, mode):
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    many = Geometry(blocks=4 * sms, warps_per_block=16, unroll=4)
    cfg, op = _op(world_size, mode, virtual=False, combine_geometry=many)
    for seed, pattern in enumerate(([1024], [0, 512], [777, 1])):
        _matmul_round(op, cfg, per_rank(pattern, world_size), 50 + seed)
    torch.distributed.barrier()  # every peer is done reading this rank's arena
    op.close()


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_processes_with_a_matmul_beside_each(mode, world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _two_process_matmul_body, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_graph_replays_of_the_quantized_combine_take_fresh_inputs(layout):
    """dispatch, an expert stage and the quantized combine (quantize kernel, or the fold writing the
    wire rows) captured once and replayed with fresh tokens, routing and expert outputs: every
    replay bit-equal to the eager call on the same inputs."""
    import torch

    from epgen.harness.verify import make_inputs, op_inputs

    cfg, op = _op(4, "fp8_blockwise", virtual=True, tmax=256, validate=False, layout=layout)  # no sync in a capture
    static = make_inputs(cfg, [256] * 4, "uniform", 1, device=op.device)
    rows = op.arena_layout.expert_rows if layout == "expert" else op.arena_layout.capacity_rows
    ys = [torch.zeros(rows, cfg.hidden, dtype=torch.bfloat16, device=op.device) for _ in range(4)]
    scale = torch.ones(1, device=op.device)
    outs = {}

    def step():
        recv = op.dispatch(*op_inputs(op, static))
        for y, o in zip(ys, recv):
            x = o.x if layout == "expert" else o.recv_x
            torch.mul(x, scale.to(torch.bfloat16), out=y)  # the expert stage: y = x * scale
        outs["out"] = op.combine(ys)

    step()
    op.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    captured = outs["out"]  # the outputs every replay writes
    for i, kind in enumerate(("uniform", "duplicates", "invalid", "skewed") * 2):
        fresh = make_inputs(cfg, [256] * 4, kind, 100 + i, device=op.device)
        for s, f in zip(static, fresh):
            for name in ("x", "weights", "indices"):
                getattr(s, name).copy_(getattr(f, name))
        scale.fill_(0.5 + i)
        g.replay()
        op.synchronize()
        replayed = [o.clone() for o in captured]
        step()  # the same inputs, eagerly
        op.synchronize()
        for r, (a, b) in enumerate(zip(replayed, outs["out"])):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"replay {i} rank {r}"
    op.close()
