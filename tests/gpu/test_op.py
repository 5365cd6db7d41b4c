"""GPU tests of dispatch and combine against the torch reference (run on the device machine).

W = 1; W = 4 and 8 as virtual ranks on one GPU; W = 2, 3 and 4 as processes (``epgen.harness.ranks``).
"""

import pytest
import torch

from epgen.codegen import planner
from epgen.harness.verify import PROCESS_WORLD_SIZES, model_config, per_rank, run_round
from epgen.codegen.spec import Op
from epgen.codegen.config import EpConfig, Geometry

SHAPES = ["deepseek-v3", "gpt-oss-120b"]
TMAX = 4096


def _op(model, world_size, virtual, geo=Geometry(blocks=16, warps_per_block=16, unroll=4)):
    """The normal family with one process a rank: these rounds put ranks on both sides of the
    low-latency threshold in one call, and every process must take the same family."""
    from epgen.op import EpDispatchCombine

    cfg = model_config(model, world_size, TMAX, dispatch_geometry=geo, combine_geometry=geo, timeout_s=10.0,
                       kernel_family="auto" if virtual or world_size == 1 else "normal")
    return cfg, EpDispatchCombine(cfg, virtual=virtual, validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("model", SHAPES)
def test_single_rank(model):
    cfg, op = _op(model, 1, False, geo=None)  # geometry from the tuning table
    for seed, T in enumerate([0, 1, 128, 4096]):
        for kind in ("uniform", "invalid", "duplicates"):
            run_round(op, cfg, [T], kind, seed)
    op.close()


CASES = {
    4: [[0, 1, 128, 4096], [4096] * 4, [0] * 4, [5, 0, 0, 0]],
    8: [[4096] * 8, [0, 1, 128, 4096, 4096, 128, 1, 0], [0] * 8],
}


@pytest.mark.gpu
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("world_size", [4, 8])
def test_virtual_ranks(model, world_size):
    cfg, op = _op(model, world_size, True)
    seed = 0
    for tokens in CASES[world_size]:  # explicit geometry: W x 16 blocks resident at once
        for kind in ("uniform", "invalid", "duplicates"):
            seed += 1
            run_round(op, cfg, tokens, kind, seed)
    op.close()


def _two_process_body(rank, world_size, model):
    cfg, op = _op(model, world_size, False)
    seed = 0
    for pattern in ([1024], [1024, 128], [0, 1], [0]):  # the virtual tests take the shapes to 4096 tokens
        for kind in ("uniform", "invalid"):
            seed += 1
            run_round(op, cfg, per_rank(pattern, world_size), kind, seed)
    torch.distributed.barrier()  # every peer is done reading this rank's arena
    op.close()


@pytest.mark.processes
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_processes(model, world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _two_process_body, model)


def _quantized_body(rank, world_size, dtype, virtual):
    from epgen.op import EpDispatchCombine
    from epgen.quant import scale_bytes

    mode = {"fp8": "fp8_blockwise", "fp4": "fp4_mx"}[dtype]
    cfg = model_config("deepseek-v3", world_size, TMAX, dtype=dtype, scale_bytes=scale_bytes(mode, 7168), timeout_s=10.0,
                       dispatch_geometry=Geometry(16, 16, 4), combine_geometry=Geometry(16, 16, 4),
                       kernel_family="auto" if virtual else "normal")  # processes: one family a call (see _op)
    op = EpDispatchCombine(cfg, virtual=virtual, validate=True)
    seed = 40
    rounds = ([4096] * world_size, [0, 1, 128, 4096, 4096, 128, 1, 0][:world_size], [0] * world_size)
    kinds = ("uniform", "invalid", "duplicates")
    if not virtual:  # processes: the cross-process paths, at sizes the time-sliced GPU runs fast
        rounds, kinds = ([1024] * world_size, [0, 1, 128, 1024][:world_size]), ("uniform",)
    for tokens in rounds:
        for kind in kinds:
            seed += 1
            run_round(op, cfg, tokens, kind, seed)  # payload and scale rows bit-equal; bf16 combine
    if not virtual:
        torch.distributed.barrier()
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
def test_quantized_dispatch_virtual_8(dtype):
    _quantized_body(0, 8, dtype, True)


@pytest.mark.processes
@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_quantized_dispatch_processes(dtype, world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _quantized_body, dtype, False)


COMBINE_WIRES = ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"]


def _combine_wire_body(rank, world_size, mode, model, virtual):
    """Every combine wire against the reference within its documented bound; with the fp8_blockwise
    wire the payload is fp8 with scales (quantized dispatch and combine in one op)."""
    from epgen.op import EpDispatchCombine

    hidden = model_config(model, world_size, 1).hidden
    fp8 = mode == "fp8_blockwise"
    cfg = model_config(model, world_size, TMAX, combine_quant=mode, dtype="fp8" if fp8 else "bf16",
                       scale_bytes=4 * -(-hidden // 128) if fp8 else 0, dispatch_geometry=Geometry(16, 16, 4),
                       combine_geometry=Geometry(16, 16, 4), timeout_s=10.0,
                       kernel_family="auto" if virtual else "normal")  # processes: one family a call (see _op)
    op = EpDispatchCombine(cfg, virtual=virtual, validate=True)
    worst = {"combine_err": 0.0, "bound_ratio": 0.0, "wire_mismatches": 0}
    seed = 70
    rounds = ([4096] * world_size, [0, 1, 128, 4096, 4096, 128, 1, 0][:world_size], [0] * world_size)
    kinds = ("uniform", "invalid", "duplicates")
    if not virtual:  # processes: the cross-process paths, at sizes the time-sliced GPU runs fast
        rounds, kinds = ([1024] * world_size, [0, 1, 128, 1024][:world_size]), ("uniform", "invalid")
    for tokens in rounds:
        for kind in kinds:
            seed += 1
            stats = run_round(op, cfg, tokens, kind, seed)
            worst = {k: max(worst[k], stats[k]) for k in worst}
    if not virtual:
        torch.distributed.barrier()
    op.close()
    if rank == 0:
        print(f"combine wire {mode} ({model}, {'virtual ' if virtual else ''}W={world_size}, dispatch {cfg.dtype}): "
              f"max error {worst['combine_err']:.4g}, worst {worst['bound_ratio']:.3f} of the documented bound, "
              f"{worst['wire_mismatches']} elements differ from the bit-exact wire reference")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", COMBINE_WIRES)
@pytest.mark.parametrize("model", SHAPES)
def test_combine_wire_virtual_8(mode, model):
    _combine_wire_body(0, 8, mode, model, True)


@pytest.mark.processes
@pytest.mark.parametrize("mode", COMBINE_WIRES)
@pytest.mark.parametrize("world_size", PROCESS_WORLD_SIZES)
def test_combine_wire_processes(mode, world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _combine_wire_body, mode, "deepseek-v3", False)


# ---- resident blocks: epgen's occupancy formula against the CUDA driver's ----------------------

def _driver_blocks(fn, spec) -> int:
    from cupy_backends.cuda.api import driver

    return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, spec.threads, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "fp8_blockwise"])
def test_resident_blocks_of_every_variant_the_op_builds_equal_the_drivers(quant):
    """The op computes resident blocks from the arch traits and the kernel's attributes (CuPy-ROCm
    has no occupancy call); on the H200 the figure equals the driver's for every variant it built
    (tuning-table geometries, so several token buckets per op; the quantized combine too)."""
    import torch

    from epgen.op import EpDispatchCombine

    cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=TMAX, combine_quant=quant)
    op = EpDispatchCombine(cfg, virtual=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    checked = 0
    for variants in op.plan.variants.values():
        for _, spec in variants:
            fn = op._kernels[spec]
            assert op.resident_blocks(fn, spec) == _driver_blocks(fn, spec) * sms, spec.name
            checked += 1
    op.close()
    assert checked >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", ["dispatch", "combine"])
@pytest.mark.parametrize("warps", [1, 4, 8, 16, 32])
def test_resident_blocks_formula_equals_the_driver_across_block_sizes(op_name, warps):
    import cupy

    from epgen.codegen.occupancy import resident_blocks
    from epgen.codegen.render import render
    from epgen.loader import load_kernel

    from epgen.codegen.spec import QUANTIZED_COMBINE_THREADS

    # the fp4 wire's combine holds the most registers, up to the threads a quantized combine may run
    quant = "fp4_blockwise" if warps * 32 <= QUANTIZED_COMBINE_THREADS else "none"
    cfg = EpConfig.for_model("deepseek-v3", world_size=8, max_tokens_per_rank=TMAX, combine_quant=quant)
    spec = planner.explicit_spec(cfg, "sm_90", Op(op_name), Geometry(16, warps, 4))
    src = render(spec)
    with cupy.cuda.Device(0):
        fn = load_kernel(src.text, src.entry)
    assert resident_blocks(spec.arch, warps, fn.num_regs, fn.shared_size_bytes) == _driver_blocks(fn, spec), \
        (spec.name, fn.num_regs, fn.shared_size_bytes)
