"""Occupancy arithmetic of the resource report, hand-worked, and its variant labels."""

from epgen.codegen import planner
from epgen.codegen.offline import Resources
from epgen.codegen.occupancy import occupancy, resident_blocks
from epgen.codegen.spec import KernelSpec


def spec(arch, warps, **kw):
    return KernelSpec(op="combine", arch=arch, dtype="bf16", world_size=8, hidden=7168, topk=8, experts_per_rank=32,
                      max_tokens_per_rank=4096, blocks=24, warps_per_block=warps, unroll=4, **kw)


def res(arch, regs, shared, agprs=None, wave=32):
    return Resources(arch=arch, entry="k", registers=regs, agprs=agprs, sgprs=None, scratch_bytes=0, spill_bytes=0,
                     shared_bytes=shared, wave_size=wave)


def test_sm90_blocks_per_sm():
    # 64 regs x 32 lanes = 2048 per warp -> 32 warps -> 2 blocks of 16 warps; threads allow 4; smem 202
    assert occupancy(spec("sm_90", 16), res("sm_90", 64, 40)) == (2, "blocks/SM")
    # 60 regs -> 1920 rounded to 2048 per warp -> 32 warps -> 1 block of 32 warps
    assert occupancy(spec("sm_90", 32), res("sm_90", 60, 40)) == (1, "blocks/SM")
    # shared memory limits: 100 KiB + 1 KiB reserved per block -> 2 blocks in 228 KiB
    assert occupancy(spec("sm_90", 4), res("sm_90", 32, 100 * 1024)) == (2, "blocks/SM")


def test_gfx950_waves_per_simd():
    # 66 VGPRs -> 72 -> 512 // 72 = 7 waves per SIMD; a 16-wave block puts 4 on each SIMD -> 1 block
    assert occupancy(spec("gfx950", 16), res("gfx950", 66, 104, agprs=0, wave=64)) == (4, "waves/SIMD")
    # AGPRs count against the unified file: 40 + 40 = 80 -> 6 waves; 4-wave blocks (1 per SIMD) -> 6
    assert occupancy(spec("gfx950", 4), res("gfx950", 40, 0, agprs=40, wave=64)) == (6, "waves/SIMD")


def test_gfx1250_lds_limit():
    # 32 VGPRs -> 1024 // 32 = 32, capped at 16 waves; 8-wave blocks put 2 per SIMD -> 8 blocks by VGPRs;
    # LDS 100 KiB -> 3 blocks per CU -> 6 waves per SIMD
    assert occupancy(spec("gfx1250", 8), res("gfx1250", 32, 100 * 1024)) == (6, "waves/SIMD")


def test_resident_blocks_per_cu_or_sm():
    """The figure the op uses at runtime (blocks per CU/SM) behind the report's occupancy."""
    assert resident_blocks("sm_90", 16, registers=64, shared_bytes=40) == 2
    assert resident_blocks("sm_90", 32, registers=62, shared_bytes=104) == 1
    assert resident_blocks("sm_90", 1, registers=16, shared_bytes=0) == 32  # max_blocks_per_cu
    # registers are allocated per sub-partition: 4 x floor(16384 / 3072) = 20 one-warp blocks of 96
    # registers (the H200's driver says 20; one pool of 65536 would give 21)
    assert resident_blocks("sm_90", 1, registers=96, shared_bytes=40) == 20
    assert resident_blocks("gfx950", 16, registers=66, shared_bytes=104) == 1  # 7 waves/SIMD, 4 a block
    assert resident_blocks("gfx950", 4, registers=40, shared_bytes=0, agprs=40) == 6
    assert resident_blocks("gfx1250", 8, registers=32, shared_bytes=100 * 1024) == 3  # LDS-bound


def test_variant_labels_name_each_kernels_payload_or_wire():
    """The dispatch kernels (both families) and the expert layout's expansion show the payload
    dtype, the combine kernels (both families) and fold the combine wire."""
    from epgen.codegen.config import EpConfig
    from epgen.codegen.report import variant_labels

    cfg = EpConfig(world_size=2, hidden=2048, topk=4, num_experts=8, max_tokens_per_rank=64, dtype="fp8",
                   combine_quant="fp8_blockwise", layout="expert", expert_alignment=16)
    specs = [s.as_dict() for s in planner.specs(cfg, "sm_90")]
    labels, _ = variant_labels(specs)
    payload = {s["op"]: label.split()[0] for s, label in zip(specs, labels)}
    assert payload == {"dispatch": "fp8", "dispatch_ll": "fp8", "dispatch_ll_send": "fp8", "dispatch_ll_recv": "fp8",
                       "expand_plan": "fp8", "expand": "fp8", "combine": "qfp8b", "combine_ll": "qfp8b",
                       "combine_ll_send": "qfp8b", "combine_ll_recv": "qfp8b", "fold": "qfp8b"}
