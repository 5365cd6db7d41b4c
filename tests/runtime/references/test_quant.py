"""CPU tests of epgen.quant: decode tables, RNE ties, saturation, round trips, block quantizers' bounds."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.dtypes import (COMBINE_FLUSH_LOG2, COMBINE_QUANTS, FP8_FLAVOURS, MINIFLOATS, MX_BLOCK, CombineQuant,
                                  MiniFloat, dtype_info, element_format)
from epgen.quant.quantizers import MODE_SCALES
from epgen.quant.wire import WIRE_CODECS, combine_error_bound
from epgen.quant import (
    FP4_E2M1,
    FP4_E2M1_MAX,
    FP8_E4M3,
    FP8_E4M3_MAX,
    MODES,
    arch_fp8_flavour,
    combine_roundtrip,
    combine_wire_rows,
    dequantize_fp4_blockwise,
    dequantize_fp4_mx,
    dequantize_fp8_blockwise,
    dequantize_fp8_direct,
    e8m0_decode,
    e8m0_encode,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_direct_cast,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    pack_fp4,
    quantize_fp4_blockwise,
    quantize_fp4_mx,
    quantize_fp8_blockwise,
    scale_bytes,
    unpack_fp4,
)

U8 = torch.uint8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: intra-op threads only add contention on a shared 2-core box (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

ALL_CODES = torch.arange(256, dtype=U8)
FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def torch_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).view(U8)


def finite_fp8_values() -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values) of the 254 non-NaN e4m3fn codes."""
    codes = ALL_CODES[(ALL_CODES & 0x7F) != 0x7F]
    return codes, fp8_e4m3_decode(codes)


def fp8_midpoints() -> torch.Tensor:
    """Exact midpoints of adjacent non-negative e4m3 values (every one is a float32), ascending."""
    vals = fp8_e4m3_decode(torch.arange(0x7F, dtype=U8)).double()
    return ((vals[1:] + vals[:-1]) / 2).float()


def next_up(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x moved by `steps` float32 ulps (positive finite x only)."""
    return (bits(x) + steps).view(torch.float32)


def fp4_reference(x: torch.Tensor) -> torch.Tensor:
    """Brute force e2m1 encode: nearest grid value in float64, ties to the even code, saturating."""
    a = x.double().abs().clamp(max=6.0)
    grid = torch.tensor(FP4_GRID, dtype=torch.float64)
    dist = (a[:, None] - grid[None, :]).abs()
    cand = dist == dist.min(dim=1, keepdim=True).values
    score = cand.to(torch.int64) * (2 - torch.arange(8) % 2)  # prefer the even code among the two
    mag = score.argmax(dim=1)
    return (mag | torch.signbit(x).to(torch.int64) << 3).to(U8)


# --- fp8 e4m3 ------------------------------------------------------------------------------------


def test_fp8_decode_all_256_codes_match_torch():
    ours = fp8_e4m3_decode(ALL_CODES)
    ref = ALL_CODES.view(torch.float8_e4m3fn).float()
    assert ours.dtype == torch.float32 and ours.shape == (256,)
    assert torch.equal(ours.isnan(), ref.isnan())
    assert ours.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF]
    fin = ~ref.isnan()
    assert torch.equal(bits(ours[fin]), bits(ref[fin]))  # bit-equal: -0.0 included
    assert ours[0x7E].item() == 448.0 and ours[0xFE].item() == -448.0
    assert ours[0x01].item() == 2.0**-9 and ours[0x08].item() == 2.0**-6 and ours[0x38].item() == 1.0


def test_fp8_encode_round_trips_every_finite_value():
    codes, vals = finite_fp8_values()
    assert torch.equal(fp8_e4m3_encode(vals), codes)  # 0x80 <- -0.0 included
    assert torch.equal(fp8_e4m3_encode(vals.to(torch.bfloat16)), codes)  # every e4m3 value is a bf16
    assert torch.equal(fp8_e4m3_encode(vals.half()), codes)


def test_fp8_encode_matches_torch_on_dense_sweep():
    # Every 127th float32 in [0, 448] by bit pattern (~8.9M values, all binades alike), both signs.
    top = bits(f32([FP8_E4M3_MAX])).item()
    pos = torch.arange(0, top + 1, 127, dtype=torch.int32).view(torch.float32)
    x = torch.cat([pos, -pos, f32([FP8_E4M3_MAX, -FP8_E4M3_MAX, 0.0, -0.0])])
    assert torch.equal(fp8_e4m3_encode(x), torch_fp8(x))


def test_fp8_encode_ties_go_to_even_code():
    mids = fp8_midpoints()  # 126 ties, between codes i and i+1
    lo = torch.arange(126, dtype=U8)
    even = torch.where(lo % 2 == 0, lo, lo + 1)
    got = fp8_e4m3_encode(mids)
    assert torch.equal(got, even)
    assert torch.equal(fp8_e4m3_encode(-mids), even | 0x80)
    assert torch.equal(got, torch_fp8(mids))
    # Hand-picked ties: subnormal/normal boundary, 1 + 1/16, top binade.
    assert fp8_e4m3_encode(f32([15 * 2.0**-10, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 432.0])).tolist() == [
        0x08, 0x00, 0x02, 0x38, 0x3A, 0x7E,
    ]
    # One float32 ulp either side of each tie rounds to the nearer value.
    m, i = mids, lo
    assert torch.equal(fp8_e4m3_encode(next_up(m, -1)), i)
    assert torch.equal(fp8_e4m3_encode(next_up(m, 1)), i + 1)
    assert torch.equal(fp8_e4m3_encode(next_up(m, 1)), torch_fp8(next_up(m, 1)))
    assert torch.equal(fp8_e4m3_encode(next_up(m, -1)), torch_fp8(next_up(m, -1)))


def test_fp8_encode_saturates_and_maps_nan():
    big = f32([448.0001, 449.0, 463.9, 464.0, 464.5, 480.0, 1e6, 3.4e38, math.inf])
    assert fp8_e4m3_encode(big).tolist() == [0x7E] * len(big)
    assert fp8_e4m3_encode(-big).tolist() == [0xFE] * len(big)
    nan = f32([math.nan])
    assert fp8_e4m3_encode(nan).item() == 0x7F
    assert fp8_e4m3_encode(-nan).item() == 0xFF  # the sign bit of NaN is kept
    assert fp8_e4m3_encode(f32([-0.0, -1e-30, 2.0**-11, -(2.0**-11)])).tolist() == [0x80, 0x80, 0x00, 0x80]
    assert fp8_e4m3_encode(torch.empty(0)).shape == (0,)
    x = f32([[1.0, -2.0], [0.3, 500.0]])
    assert fp8_e4m3_encode(x).shape == (2, 2)


def test_fp8_e4m3fnuz_all_256_codes_decode_and_round_trip():
    """gfx942's flavour (ArchTraits.fp8 = "e4m3fnuz"): every code decodes as torch.float8_e4m3fnuz
    does, bit for bit, 0x80 alone is NaN, and encode(decode(c)) is c for every other code."""
    ours = fp8_e4m3_decode(ALL_CODES, "e4m3fnuz")
    ref = ALL_CODES.view(torch.float8_e4m3fnuz).float()
    assert ours.isnan().nonzero().flatten().tolist() == [0x80] and ref.isnan().nonzero().flatten().tolist() == [0x80]
    fin = ~ref.isnan()
    assert torch.equal(bits(ours[fin]), bits(ref[fin]))
    assert ours[0x7F].item() == 240.0 and ours[0xFF].item() == -240.0 and ours[0x01].item() == 2.0**-10
    assert ours[0x40].item() == 1.0 and ours[0x08].item() == 2.0**-7
    codes = ALL_CODES[fin]
    assert torch.equal(fp8_e4m3_encode(ours[fin], "e4m3fnuz"), codes)
    assert torch.equal(fp8_e4m3_encode(ours[fin].to(torch.bfloat16), "e4m3fnuz"), codes)


def test_fp8_e4m3fnuz_encode_matches_torch_on_dense_sweep():
    """Inside [-240, 240] the encoder is torch's cast to float8_e4m3fnuz (round to nearest even,
    -0.0 and negatives rounding to zero give 0x00); past it, NaN and -0.0 as documented."""
    top = bits(f32([240.0])).item()
    pos = torch.arange(0, top + 1, 127, dtype=torch.int32).view(torch.float32)
    x = torch.cat([pos, -pos, f32([240.0, -240.0, 0.0, -0.0, -1e-30])])
    assert torch.equal(fp8_e4m3_encode(x, "e4m3fnuz"), x.to(torch.float8_e4m3fnuz).view(U8))
    big = f32([240.0001, 247.9, 248.0, 1e6, math.inf])
    assert fp8_e4m3_encode(big, "e4m3fnuz").tolist() == [0x7F] * 5
    assert fp8_e4m3_encode(-big, "e4m3fnuz").tolist() == [0xFF] * 5
    assert fp8_e4m3_encode(f32([math.nan, -math.nan, -0.0]), "e4m3fnuz").tolist() == [0x80, 0x80, 0x00]
    with pytest.raises(ValueError, match=r"flavour='e5m2': unknown fp8 flavour; known: e4m3fn, e4m3fnuz"):
        fp8_e4m3_encode(x, "e5m2")


def test_fp8_element_error_bound():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200_000, generator=g) * 10 ** (torch.rand(200_000, generator=g) * 6 - 4)
    x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    err = (fp8_e4m3_decode(fp8_e4m3_encode(x)).double() - x.double()).abs()
    a = x.double().abs()
    assert bool((err <= torch.maximum(a * 2**-4, torch.full_like(a, 2**-10))).all())
    normal = a >= 2**-6
    assert float((err[normal] / a[normal]).max()) <= 1 / 17  # the sharp relative constant


# --- fp4 e2m1 ------------------------------------------------------------------------------------


def test_fp4_decode_table_by_hand():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = fp4_e2m1_decode(torch.arange(16, dtype=U8))
    assert got.dtype == torch.float32 and got.tolist() == table
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_fp4_encode_round_trips_every_value():
    codes = torch.arange(16, dtype=U8)
    assert torch.equal(fp4_e2m1_encode(fp4_e2m1_decode(codes)), codes)


def test_fp4_encode_ties_and_neighbours():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0, 2, 2, 4, 4, 6, 6]  # 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0
    assert fp4_e2m1_encode(f32(ties)).tolist() == want
    assert fp4_e2m1_encode(-f32(ties)).tolist() == [w | 8 for w in want]
    t = f32(ties)
    assert fp4_e2m1_encode(next_up(t, -1)).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert fp4_e2m1_encode(next_up(t, 1)).tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_fp4_encode_matches_brute_force_sweep():
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor(FP4_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.cat([grid, mids, next_up(mids, 1), next_up(mids, -1), f32([6.5, 7.0, 8.0, 1e30])])
    sweep = torch.cat([torch.linspace(-9, 9, 100_001), torch.rand(50_000, generator=g) * 16 - 8])
    x = torch.cat([sweep, special, -special])
    assert torch.equal(fp4_e2m1_encode(x), fp4_reference(x))


def test_fp4_encode_saturation_signed_zero_and_nan():
    assert fp4_e2m1_encode(f32([6.0001, 7.0, 100.0, math.inf])).tolist() == [7] * 4
    assert fp4_e2m1_encode(f32([-6.0001, -7.0, -100.0, -math.inf])).tolist() == [15] * 4
    assert fp4_e2m1_encode(f32([-0.0, -0.1, -0.25, 0.1])).tolist() == [8, 8, 8, 0]
    assert fp4_e2m1_encode(f32([1.0]).to(torch.bfloat16)).tolist() == [2]
    with pytest.raises(ValueError, match=r"x\[1, 0\]=nan.*no NaN"):
        fp4_e2m1_encode(f32([[1.0, 2.0], [math.nan, 0.0]]))


def test_fp4_element_error_bound():
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(200_000, generator=g) * 12 - 6)
    err = (fp4_e2m1_decode(fp4_e2m1_encode(x)).double() - x.double()).abs()
    a = x.double().abs()
    assert bool((err <= torch.clamp(a, min=1.0) * 2**-2).all())
    assert float((err[a >= 1] / a[a >= 1]).max()) <= 1 / 5


def test_pack_order_and_round_trip():
    assert pack_fp4(torch.tensor([1, 2], dtype=U8)).tolist() == [0x21]
    assert pack_fp4(torch.tensor([[0xF, 0x0, 0x3, 0xC]], dtype=U8)).tolist() == [[0x0F, 0xC3]]
    assert unpack_fp4(torch.tensor([0x21, 0xF0], dtype=U8)).tolist() == [1, 2, 0, 15]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=U8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == U8
    assert torch.equal(unpack_fp4(packed), codes)
    allbytes = torch.arange(256, dtype=U8)
    assert torch.equal(pack_fp4(unpack_fp4(allbytes)), allbytes)
    assert pack_fp4(torch.empty(4, 0, dtype=U8)).shape == (4, 0)


@pytest.mark.parametrize(
    "fn,arg,pattern",
    [
        (pack_fp4, torch.tensor([1, 2, 3], dtype=U8), r"codes: shape \(3,\).*even"),
        (pack_fp4, torch.tensor([1, 16], dtype=U8), r"codes\[1\]=16.*\[0, 15\]"),
        (pack_fp4, torch.tensor(3, dtype=U8), r"codes: shape \(\).*even"),
        (pack_fp4, torch.tensor([1, 2], dtype=torch.int32), r"codes\.dtype=torch.int32: must be torch.uint8"),
        (unpack_fp4, torch.tensor(3, dtype=U8), r"packed: shape \(\).*1-D"),
        (unpack_fp4, [1, 2], r"packed: must be a torch.Tensor, got list"),
        (fp4_e2m1_decode, torch.tensor([[0, 15], [16, 200]], dtype=U8),
         r"codes\[1, 0\]=16 \(1 more\).*\[0, 15\]"),
        (fp8_e4m3_decode, torch.tensor([1.0]), r"codes\.dtype=torch.float32: must be torch.uint8"),
        (fp8_e4m3_encode, torch.tensor([1.0], dtype=torch.float64),
         r"x\.dtype=torch.float64: must be torch.float32 or"),
        (fp8_e4m3_encode, torch.tensor([1], dtype=torch.int32), r"x\.dtype=torch.int32: must be"),
        (fp4_e2m1_encode, 1.5, r"x: must be a torch.Tensor, got float"),
    ],
)
def test_element_codec_bad_inputs(fn, arg, pattern):
    with pytest.raises(TypeError if "torch.Tensor, got" in pattern else ValueError, match=pattern):
        fn(arg)


# --- e8m0 ----------------------------------------------------------------------------------------


def test_e8m0_decode_selected_codes_and_torch():
    codes = torch.tensor([0, 1, 2, 100, 126, 127, 128, 200, 254, 255], dtype=U8)
    got = e8m0_decode(codes)
    want = [2.0**-127, 2.0**-126, 2.0**-125, 2.0**-27, 0.5, 1.0, 2.0, 2.0**73, 2.0**127]
    assert got[:-1].tolist() == want and math.isnan(got[-1].item())
    ref = ALL_CODES.view(torch.float8_e8m0fnu).float()
    ours = e8m0_decode(ALL_CODES)
    assert torch.equal(ours.isnan(), ref.isnan()) and torch.equal(bits(ours[:255]), bits(ref[:255]))


def test_e8m0_encode_exact_floor_ceil():
    codes = torch.arange(255, dtype=U8)
    assert torch.equal(e8m0_encode(e8m0_decode(codes)), codes)  # every finite code round trips
    x = f32([3.0, 0.75, 1.0, 2.0**-127 * 1.5, 2.0**126 * 1.9])
    assert e8m0_encode(x, rounding="floor").tolist() == [128, 126, 127, 0, 253]
    assert e8m0_encode(x, rounding="ceil").tolist() == [129, 127, 127, 1, 254]
    assert e8m0_encode(f32([[1.0, 4.0]]).to(torch.bfloat16)).tolist() == [[127, 129]]


@pytest.mark.parametrize(
    "scale,rounding,pattern",
    [
        (f32([1.0, 0.0]), "exact", r"scale\[1\]=0.0: e8m0 scales must be finite and > 0"),
        (f32([-2.0]), "floor", r"scale\[0\]=-2.0: .*> 0"),
        (f32([math.nan]), "floor", r"scale\[0\]=nan"),
        (f32([math.inf]), "ceil", r"scale\[0\]=inf"),
        (f32([1.0, 3.0]), "exact", r"scale\[1\]=3.0: must be a power of two"),
        (f32([2.0**-130]), "floor", r"scale\[0\]=.*\[-127, 127\]"),
        (f32([3e38]), "ceil", r"\[-127, 127\]"),
        (f32([1.0]), "nearest", r"rounding='nearest': must be 'exact', 'floor' or 'ceil'"),
        (torch.tensor([1.0], dtype=torch.float64), "exact", r"scale\.dtype=torch.float64"),
    ],
)
def test_e8m0_encode_bad_inputs(scale, rounding, pattern):
    with pytest.raises(ValueError, match=pattern):
        e8m0_encode(scale, rounding=rounding)


# --- block quantizers: data ----------------------------------------------------------------------

SEEDS = [0, 1, 2, 3]
DISTS = ["normal", "heavy", "row_scaled", "outliers"]
DTYPES = [torch.float32, torch.bfloat16]


def make_x(dist: str, seed: int, dtype: torch.dtype, tokens: int = 48, hidden: int = 1024) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    if dist == "heavy":  # randn * 10**U(-3, 3), element-wise
        x = x * 10 ** (torch.rand(tokens, hidden, generator=g) * 6 - 3)
    elif dist == "row_scaled":  # token magnitudes spread over 10 decades
        x = x * 10 ** (torch.rand(tokens, 1, generator=g) * 10 - 5)
    elif dist == "outliers":
        mask = torch.rand(tokens, hidden, generator=g) < 0.002
        x = torch.where(mask, x * 1000, x)
    return x.to(dtype)


def per_element(scales: torch.Tensor, block: int) -> torch.Tensor:
    return scales.double().repeat_interleave(block, dim=1)


# --- fp8 blockwise -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_blockwise_scales_codes_and_bound(seed, dist, dtype):
    x = make_x(dist, seed, dtype)
    codes, scales = quantize_fp8_blockwise(x)
    assert codes.dtype == U8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (x.shape[0], x.shape[1] // 128)
    x64 = x.double()
    amax = x64.abs().reshape(x.shape[0], -1, 128).amax(dim=-1)
    assert torch.equal(scales, (amax / 448).float())  # correctly rounded float32 quotient
    # Codes: torch's own e4m3 cast of the correctly rounded quotient x / s.
    y = (x64 / per_element(scales, 128)).float()
    assert float(y.abs().max()) < 464
    assert torch.equal(codes, torch_fp8(y))
    dq = dequantize_fp8_blockwise(codes, scales)
    assert dq.dtype == torch.float32 and dq.shape == x.shape
    assert torch.equal(dq, (fp8_e4m3_decode(codes).double() * per_element(scales, 128)).float())
    err = (x64 - dq.double()).abs()
    bound = 2**-4 * x64.abs() + 2**-10 * per_element(scales, 128)
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.75  # the bound is not vacuous


def test_fp8_blockwise_subnormal_ties_need_the_sum_form():
    # Elements placed so x / s lands on subnormal ties (odd multiples of 2^-10), s not a power of 2.
    g = torch.Generator().manual_seed(5)
    n = 20_000
    amax = (448 * (1 + 3 * torch.rand(n, generator=g, dtype=torch.float64))).float()
    s = (amax.double() / 448).float().double()
    t = (2 * torch.randint(0, 8, (n,), generator=g) + 1).double() * 2**-10
    x = torch.zeros(n, 128)
    x[:, 0], x[:, 1] = amax, (t * s).float()
    codes, scales = quantize_fp8_blockwise(x)
    assert torch.equal(scales.double()[:, 0], s)
    err = (x[:, 1].double() - dequantize_fp8_blockwise(codes, scales)[:, 1].double()).abs()
    a = x[:, 1].double().abs()
    assert bool((err <= 2**-4 * a + 2**-10 * s).all())
    # The max form is exceeded by float32 rounding at these ties, as the docstring says.
    assert bool((err > torch.maximum(2**-4 * a, 2**-10 * s)).any())


def test_fp8_blockwise_exact_round_trip_of_representable_blocks():
    g = torch.Generator().manual_seed(1)
    fin_codes, _ = finite_fp8_values()
    codes = fin_codes[torch.randint(0, len(fin_codes), (16, 512), generator=g)]
    cols = torch.randint(0, 128, (16, 4), generator=g) + torch.arange(0, 512, 128)
    top = torch.where(torch.rand(16, 4, generator=g) < 0.5, 0x7E, 0xFE).to(U8)
    codes.scatter_(1, cols, top)  # a +-448 in every block
    k = torch.randint(-20, 20, (16, 4), generator=g)
    x = fp8_e4m3_decode(codes) * torch.exp2(k.float()).repeat_interleave(128, dim=1)
    got_codes, scales = quantize_fp8_blockwise(x)
    assert torch.equal(scales, torch.exp2(k.float()))
    assert torch.equal(got_codes, codes)
    assert torch.equal(bits(dequantize_fp8_blockwise(got_codes, scales)), bits(x))


def test_fp8_blockwise_zero_and_tiny_blocks():
    x = torch.zeros(3, 256)
    x[0, 128:] = torch.linspace(-2, 2, 128)
    x[1, :128] = -0.0
    x[2, :128] = 1e-45  # smallest subnormal: amax / 448 underflows to 0 -> scale 1.0
    x[2, 128:] = 1e-40  # subnormal amax: a subnormal scale, no bound claimed, but finite
    codes, scales = quantize_fp8_blockwise(x)
    assert scales[0, 0].item() == 1.0 and scales[1, 1].item() == 1.0 and scales[2, 0].item() == 1.0
    assert scales[0, 1].item() == (torch.tensor(2.0, dtype=torch.float64) / 448).float().item()
    assert bool((codes[0, :128] == 0).all()) and bool((codes[1, :128] == 0x80).all())
    assert bool((codes[2, :128] == 0).all())
    assert 0 < scales[2, 1].item() < 2.0**-126
    dq = dequantize_fp8_blockwise(codes, scales)
    assert bool(torch.isfinite(dq).all())
    assert bool((dq[0, :128] == 0).all()) and bool(torch.signbit(dq[1, :128]).all())
    empty_codes, empty_scales = quantize_fp8_blockwise(torch.empty(0, 256, dtype=torch.bfloat16))
    assert empty_codes.shape == (0, 256) and empty_scales.shape == (0, 2)


def test_fp8_blockwise_custom_block():
    x = make_x("heavy", 9, torch.float32, tokens=8, hidden=96)
    codes, scales = quantize_fp8_blockwise(x, block=32)
    assert scales.shape == (8, 3)
    dq = dequantize_fp8_blockwise(codes, scales, block=32)
    err = (x.double() - dq.double()).abs()
    assert bool((err <= 2**-4 * x.double().abs() + 2**-10 * per_element(scales, 32)).all())


# --- fp8 direct ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_direct_cast_bound_and_saturation(dtype):
    for seed in SEEDS:
        x = (make_x("heavy", seed, torch.float32) * 0.5).to(dtype)  # spans 1e-4 .. 1e4: some saturate
        codes = fp8_direct_cast(x)
        assert codes.dtype == U8 and codes.shape == x.shape
        assert torch.equal(codes, fp8_e4m3_encode(x.float()))
        dq = dequantize_fp8_direct(codes)
        a = x.double().abs()
        err = (x.double() - dq.double()).abs()
        inside = a <= FP8_E4M3_MAX
        assert bool((~inside).any())
        ai = a[inside]
        assert bool((err[inside] <= torch.maximum(2**-4 * ai, torch.full_like(ai, 2**-10))).all())
        assert torch.equal(err[~inside], a[~inside] - FP8_E4M3_MAX)
        assert torch.equal(codes[inside], torch_fp8(x.float()[inside]))
    odd = f32([[math.nan, -math.inf, math.inf, -0.0]])
    assert fp8_direct_cast(odd).tolist() == [[0x7F, 0xFE, 0x7E, 0x80]]


# --- fp4 MX --------------------------------------------------------------------------------------


def mx_reference(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(e8m0 codes, element codes) by float64 log2 and the brute-force e2m1 encoder."""
    t, h = x.shape
    amax = x.double().abs().reshape(t, -1, block).amax(dim=-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.where(amax > 0, torch.floor(torch.log2(safe)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    y = x.double() / torch.exp2(e).repeat_interleave(block, dim=1)
    return (e + 127).to(U8), fp4_reference(y.float().flatten()).reshape(t, h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_fp4_mx_scales_codes_and_bound(seed, dist, dtype):
    x = make_x(dist, seed, dtype)
    packed, scales = quantize_fp4_mx(x)
    assert packed.dtype == U8 and packed.shape == (x.shape[0], x.shape[1] // 2)
    assert scales.dtype == U8 and scales.shape == (x.shape[0], x.shape[1] // 32)
    ref_scales, ref_codes = mx_reference(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(unpack_fp4(packed), ref_codes)
    dq = dequantize_fp4_mx(packed, scales)
    assert dq.dtype == torch.float32 and dq.shape == x.shape
    s = e8m0_decode(scales).double().repeat_interleave(32, dim=1)
    a, err = x.double().abs(), (x.double() - dq.double()).abs()
    assert torch.equal(dq.double(), fp4_e2m1_decode(unpack_fp4(packed)).double() * s)  # exact product
    assert bool((err <= 2**-2 * torch.maximum(a, s)).all())
    unclipped = a <= 6 * s
    assert bool((err[unclipped] <= torch.maximum(a[unclipped] / 5, s[unclipped] / 4)).all())
    clipped = ~unclipped
    assert bool(clipped.any())  # the MX rule does clip on random data
    assert torch.equal(dq.double().abs()[clipped], 6 * s[clipped])


def test_fp4_mx_extreme_magnitudes_and_zero_blocks():
    x = torch.zeros(4, 64)
    x[0, :32] = torch.linspace(-1, 1, 32) * 3e38  # floor(log2 3e38) = 127 -> e = 125, clips to 6 * 2^125
    x[0, 32:] = torch.linspace(-1, 1, 32) * 1e-39  # subnormal amax: e clamped to -127 (code 0)
    x[1, 32:] = -0.0
    x[2, :32] = 2.0**-125  # floor(log2) - 2 = -127: not clamped, code 0, y = 4
    x[3, :] = torch.linspace(-1, 1, 64) * 2.0**-140
    packed, scales = quantize_fp4_mx(x)
    assert scales.tolist() == [[252, 0], [0, 0], [0, 0], [0, 0]]
    codes = unpack_fp4(packed)
    assert bool((codes[1, :32] == 0).all()) and bool((codes[1, 32:] == 8).all())
    assert bool((codes[2, :32] == 6).all())  # 4.0
    dq = dequantize_fp4_mx(packed, scales)
    assert bool(torch.isfinite(dq).all())
    assert dq[0, 31].item() == 6 * 2.0**125
    s = e8m0_decode(scales).double().repeat_interleave(32, dim=1)
    a, err = x.double().abs(), (x.double() - dq.double()).abs()
    assert bool((err <= 2**-2 * torch.maximum(a, s)).all())
    assert dq[2, 0].item() == 2.0**-125


def test_fp4_mx_exact_round_trip_of_representable_blocks():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (16, 256), generator=g, dtype=U8)
    cols = torch.randint(0, 32, (16, 8), generator=g) + torch.arange(0, 256, 32)
    top = torch.where(torch.rand(16, 8, generator=g) < 0.5, 7, 15).to(U8)
    codes.scatter_(1, cols, top)  # a +-6 in every block
    k = torch.randint(-120, 120, (16, 8), generator=g)
    x = fp4_e2m1_decode(codes) * torch.exp2(k.float()).repeat_interleave(32, dim=1)
    packed, scales = quantize_fp4_mx(x)
    assert torch.equal(scales, (k + 127).to(U8))
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(bits(dequantize_fp4_mx(packed, scales)), bits(x))


def test_fp4_mx_nan_scale_propagates():
    packed = torch.full((1, 16), 0x22, dtype=U8)
    dq = dequantize_fp4_mx(packed, torch.tensor([[255]], dtype=U8))
    assert bool(dq.isnan().all())


# --- fp4 blockwise -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_fp4_blockwise_scales_codes_and_bound(seed, dist, dtype):
    x = make_x(dist, seed, dtype)
    packed, scales = quantize_fp4_blockwise(x)
    assert packed.dtype == U8 and packed.shape == (x.shape[0], x.shape[1] // 2)
    assert scales.dtype == torch.float32 and scales.shape == (x.shape[0], x.shape[1] // 32)
    x64 = x.double()
    amax = x64.abs().reshape(x.shape[0], -1, 32).amax(dim=-1)
    assert torch.equal(scales, (amax / 6).float())
    s = per_element(scales, 32)
    y = (x64 / s).float()
    assert torch.equal(unpack_fp4(packed), fp4_reference(y.flatten()).reshape(x.shape))
    dq = dequantize_fp4_blockwise(packed, scales)
    assert dq.dtype == torch.float32
    assert torch.equal(dq, (fp4_e2m1_decode(unpack_fp4(packed)).double() * s).float())
    err = (x64 - dq.double()).abs()
    bound = 2**-2 * x64.abs() + 2**-2 * s
    assert bool((err <= bound).all())
    big = y.double().abs() >= 1
    assert float((err[big] / x64.abs()[big]).max()) <= 1 / 5 + 2**-20  # the sharp constant


def test_fp4_blockwise_exact_round_trip_and_zero_blocks():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (8, 128), generator=g, dtype=U8)
    codes[:, ::32] = 7  # a 6 per block
    k = torch.randint(-30, 30, (8, 4), generator=g)
    x = fp4_e2m1_decode(codes) * torch.exp2(k.float()).repeat_interleave(32, dim=1)
    packed, scales = quantize_fp4_blockwise(x)
    assert torch.equal(scales, torch.exp2(k.float()))
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(bits(dequantize_fp4_blockwise(packed, scales)), bits(x))
    z = torch.zeros(2, 64, dtype=torch.bfloat16)
    z[0, 32:] = 3.0
    packed, scales = quantize_fp4_blockwise(z)
    assert scales.tolist() == [[1.0, 0.5], [1.0, 1.0]]
    assert unpack_fp4(packed)[0, 32:].tolist() == [7] * 32 and bool((unpack_fp4(packed)[1] == 0).all())


# --- validation ----------------------------------------------------------------------------------

QUANTIZERS = [quantize_fp8_blockwise, quantize_fp4_mx, quantize_fp4_blockwise]


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "x,kwargs,pattern",
    [
        ([[1.0]], {}, r"x: must be a torch.Tensor, got list"),
        (torch.zeros(128), {}, r"x\.shape=\[128\]: must be 2-D"),
        (torch.zeros(2, 2, 128), {}, r"x\.shape=\[2, 2, 128\]: must be 2-D"),
        (torch.zeros(2, 128, dtype=torch.float64), {},
         r"x\.dtype=torch.float64: must be torch.float32 or torch.bfloat16"),
        (torch.zeros(2, 128, dtype=torch.float16), {}, r"x\.dtype=torch.float16: must be"),
        (torch.zeros(2, 128, dtype=torch.int32), {}, r"x\.dtype=torch.int32: must be"),
        (torch.zeros(2, 128), {"block": 0}, r"block=0: must be a positive"),
        (torch.zeros(2, 128), {"block": True}, r"block=True: must be an int"),
        (torch.zeros(2, 128), {"block": 32.0}, r"block=32.0: must be an int"),
    ],
)
def test_quantizer_bad_inputs(quantize, x, kwargs, pattern):
    with pytest.raises(TypeError if "torch.Tensor, got" in pattern else ValueError, match=pattern):
        quantize(x, **kwargs)


@pytest.mark.parametrize("quantize", QUANTIZERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantizer_rejects_non_finite(quantize, bad):
    x = torch.zeros(3, 128)
    x[2, 70] = bad
    with pytest.raises(ValueError, match=rf"x\[2, 70\]={bad!r}: must be finite"):
        quantize(x)


@pytest.mark.parametrize("quantize", [quantize_fp4_mx, quantize_fp4_blockwise], ids=lambda f: f.__name__)
def test_fp4_quantizers_need_even_block(quantize):
    with pytest.raises(ValueError, match=r"block=3: must be a positive even int"):
        quantize(torch.zeros(1, 6), block=3)


@pytest.mark.parametrize(
    "fn,args,pattern",
    [
        (dequantize_fp8_blockwise, (torch.zeros(2, 256, dtype=U8), torch.ones(2, 2, dtype=torch.float64)),
         r"scales\.dtype=torch.float64: must be torch.float32"),
        (dequantize_fp8_blockwise, (torch.zeros(2, 256, dtype=U8), torch.ones(2, 3)),
         r"scales: shape \(2, 3\) must be \[2, 2\]"),
        (dequantize_fp8_blockwise, (torch.zeros(2, 200, dtype=U8), torch.ones(2, 1)),
         r"scales: shape \(2, 1\) must be \[2, 2\]"),
        (dequantize_fp8_blockwise, (torch.zeros(256, dtype=U8), torch.ones(2, 2)),
         r"codes\.shape=\[256\]: must be 2-D"),
        (dequantize_fp8_blockwise, (torch.zeros(2, 256), torch.ones(2, 2)),
         r"codes\.dtype=torch.float32: must be torch.uint8"),
        (dequantize_fp4_mx, (torch.zeros(2, 64, dtype=U8), torch.ones(2, 4)),
         r"scales\.dtype=torch.float32: must be torch.uint8"),
        (dequantize_fp4_mx, (torch.zeros(2, 64, dtype=U8), torch.ones(2, 2, dtype=U8)),
         r"scales: shape \(2, 2\) must be \[2, 4\]"),
        (dequantize_fp4_mx, (torch.zeros(2, 24, dtype=U8), torch.ones(2, 1, dtype=U8)),
         r"scales: shape \(2, 1\) must be \[2, 2\] .*packed of shape \(2, 24\) and block=32"),
        (dequantize_fp4_blockwise, (torch.zeros(2, 64, dtype=U8), torch.ones(2, 4, dtype=U8)),
         r"scales\.dtype=torch.uint8: must be torch.float32"),
        (dequantize_fp4_blockwise, (torch.zeros(3, 64, dtype=U8), torch.ones(2, 4)),
         r"scales: shape \(2, 4\) must be \[3, 4\]"),
        (dequantize_fp8_direct, (torch.zeros(4, dtype=U8),), r"codes\.shape=\[4\]: must be 2-D"),
        (fp8_direct_cast, (torch.zeros(4),), r"x\.shape=\[4\]: must be 2-D"),
        (fp8_direct_cast, (torch.zeros(1, 4, dtype=torch.float64),), r"x\.dtype=torch.float64"),
    ],
)
def test_dequantizer_bad_inputs(fn, args, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn(*args)


# --- scale_bytes ---------------------------------------------------------------------------------


def test_scale_bytes_values_and_consistency():
    assert scale_bytes("fp8_blockwise", 7168) == 224
    assert scale_bytes("fp4_mx", 7168) == 224
    assert scale_bytes("fp4_blockwise", 7168) == 896
    assert scale_bytes("fp8_direct_cast", 7168) == 0
    assert scale_bytes("fp8_blockwise", 4096, block=64) == 256
    assert set(MODES) == {"fp8_blockwise", "fp8_direct_cast", "fp4_mx", "fp4_blockwise"}
    x = make_x("normal", 0, torch.bfloat16, tokens=3, hidden=2048)
    for mode, quantize in (("fp8_blockwise", quantize_fp8_blockwise), ("fp4_mx", quantize_fp4_mx),
                           ("fp4_blockwise", quantize_fp4_blockwise)):
        _, scales = quantize(x)
        assert scales.shape[1] * scales.element_size() == scale_bytes(mode, 2048)


@pytest.mark.parametrize(
    "args,kwargs,pattern",
    [
        (("fp16", 128), {}, r"mode='fp16': must be one of 'fp8_blockwise'"),
        (("fp4_blockwise", 101), {}, r"hidden=101: must be even for mode 'fp4_blockwise'"),
        (("fp4_mx", 0), {}, r"hidden=0: must be a positive int"),
        (("fp4_mx", 64.0), {}, r"hidden=64.0: must be a positive int"),
        (("fp4_mx", 66), {"block": 33}, r"block=33: must be a positive even int"),
        (("fp8_direct_cast", 128), {"block": 128}, r"block=128: must be None for mode 'fp8_direct_cast'"),
    ],
)
def test_scale_bytes_bad_inputs(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        scale_bytes(*args, **kwargs)


def test_constants():
    assert FP8_E4M3_MAX == fp8_e4m3_decode(torch.tensor([0x7E], dtype=U8)).item()
    assert FP4_E2M1_MAX == fp4_e2m1_decode(torch.tensor([7], dtype=U8)).item()


def test_numbers_come_from_the_codegen_table():
    """The reference computes with epgen.codegen.dtypes' numbers, the ones the kernels print."""
    fp8, fp4 = MINIFLOATS["fp8"], MINIFLOATS["fp4"]
    assert FP8_E4M3 is fp8 and FP4_E2M1 is fp4
    assert FP8_E4M3_MAX == fp8.max == torch.finfo(torch.float8_e4m3fn).max
    assert FP4_E2M1_MAX == fp4.max
    for name, decode in (("fp8", fp8_e4m3_decode), ("fp4", fp4_e2m1_decode)):
        fmt = MINIFLOATS[name]
        assert fmt.bits == dtype_info(name).bits
        values = decode(torch.arange(1 << fmt.bits, dtype=torch.int32).to(U8))
        finite = values[~torch.isnan(values)]
        assert float(finite.abs().max()) == fmt.max == decode(torch.tensor([fmt.max_code], dtype=U8)).item()
        assert decode(torch.tensor([1 << fmt.mbits], dtype=U8)).item() == 2.0**fmt.emin  # smallest normal
        assert math.copysign(1.0, decode(torch.tensor([1 << fmt.sign_shift], dtype=U8)).item()) == -1.0  # -0.0
        assert bool(torch.isnan(values).any()) == fmt.has_nan
        if fmt.has_nan:
            assert math.isnan(decode(torch.tensor([fmt.nan_code], dtype=U8)).item())
    for name, q in COMBINE_QUANTS.items():
        if name in MODES:
            assert MODES[name] == q.block
    assert MODES["fp4_mx"] == MX_BLOCK
    assert set(MODE_SCALES) == set(MODES)
    assert all(mode.startswith(element) for mode, (element, _) in MODE_SCALES.items())


def test_every_quantized_wire_has_a_reference_codec():
    assert set(WIRE_CODECS) == {name for name, q in COMBINE_QUANTS.items() if q.quantized}


@pytest.mark.parametrize("fn", [combine_roundtrip, combine_wire_rows, combine_error_bound])
def test_a_wire_without_a_reference_codec_is_refused(monkeypatch, fn):
    """A new wire in COMBINE_QUANTS is not quantized as another wire's format: every combine wire
    function refuses it until WIRE_CODECS has its row."""
    monkeypatch.setitem(COMBINE_QUANTS, "fp8_block32", CombineQuant(name="fp8_block32", element="fp8", block=32,
                                                                    tag="qfp8b32"))
    y = torch.ones(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"mode='fp8_block32': the combine wire reference has no codec for this wire; "
                                         r"known: fp8_direct_cast, fp8_blockwise, fp4_blockwise"):
        fn("fp8_block32", y)


@pytest.mark.parametrize("mode", ["fp8_blockwise", "fp4_blockwise"])
def test_combine_wire_flushes_below_the_tables_threshold(mode):
    tiny = torch.full((128,), 2.0**COMBINE_FLUSH_LOG2)
    y = torch.stack([tiny, torch.nextafter(tiny, torch.zeros(128))])  # at the threshold, one float32 below
    dq = combine_roundtrip(mode, y)
    assert bool((dq[0] > 0).all()) and bool((dq[1] == 0).all())
    # a flushed block's zeros keep their elements' signs, as the kernels encode x / 1: zero codes
    # with the sign bit (-0.0 and tiny negatives), scale 1
    neg = torch.stack([-torch.nextafter(tiny, torch.zeros(128)), torch.full((128,), -0.0)])
    codes, scales = combine_wire_rows(mode, neg)
    assert set(codes.flatten().tolist()) == ({0x80} if mode == "fp8_blockwise" else {0x88})
    assert bool((scales == 1).all()) and bool(torch.signbit(combine_roundtrip(mode, neg)).all())


# --- the combine wire ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("hidden", [2880, 7168, 8])
def test_combine_roundtrip_within_its_bound(mode, hidden):
    from epgen.quant import combine_error_bound, combine_roundtrip

    g = torch.Generator().manual_seed(hidden)
    y = (torch.randn(33, hidden, generator=g) * torch.logspace(-3, 3, 33)[:, None]).to(torch.bfloat16)
    y[0] = 0.0
    y[1, : min(hidden, 40)] = 1e-35  # a tiny block travels as zeros (and stays inside the bound)
    dq, bound = combine_roundtrip(mode, y), combine_error_bound(mode, y)
    assert dq.dtype == torch.float32 and dq.shape == y.shape == bound.shape
    err = (dq - y.float()).abs()
    assert bool((err <= bound).all())
    if mode == "none":
        assert torch.equal(dq, y.float())
    else:
        assert float(err.max()) > 0 and float((err / bound.clamp(min=1e-30)).max()) > 0.3  # the bound is not loose


@pytest.mark.parametrize("mode", ["none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_combine_wire_of_no_rows(mode):
    from epgen.quant import combine_error_bound, combine_roundtrip

    y = torch.zeros(0, 2880, dtype=torch.bfloat16)  # a rank that received nothing
    assert combine_roundtrip(mode, y).shape == combine_error_bound(mode, y).shape == (0, 2880)


def test_combine_roundtrip_partial_block_is_its_own_block():
    from epgen.quant import combine_roundtrip

    y = torch.randn(4, 2880).to(torch.bfloat16)  # 22 whole blocks of 128 and one of 64
    dq = combine_roundtrip("fp8_blockwise", y)
    whole = dequantize_fp8_blockwise(*quantize_fp8_blockwise(y[:, :2816]))
    last = dequantize_fp8_blockwise(*quantize_fp8_blockwise(y[:, 2816:], block=64), block=64)
    assert torch.equal(dq, torch.cat([whole, last], dim=1))
    dq4 = combine_roundtrip("fp4_blockwise", y)  # 2880 = 90 blocks of 32: no partial block
    assert torch.equal(dq4, dequantize_fp4_blockwise(*quantize_fp4_blockwise(y)))


def test_combine_wire_rejects_bad_arguments():
    from epgen.quant import combine_error_bound, combine_roundtrip, combine_wire_rows

    with pytest.raises(ValueError, match=r"combine_quant='fp4_mx': must be one of none, fp8_direct_cast"):
        combine_roundtrip("fp4_mx", torch.zeros(2, 32))
    with pytest.raises(ValueError, match=r"y\.shape=\[4\]: must be 2-D"):
        combine_error_bound("fp8_blockwise", torch.zeros(4))
    with pytest.raises(ValueError, match=r"y\[0, 0\]=inf \(127 more\): must be finite for mode 'fp8_blockwise'"):
        combine_roundtrip("fp8_blockwise", torch.full((1, 128), float("inf")))
    with pytest.raises(ValueError, match=r"y\[0, 3\]=nan: must be finite"):
        combine_error_bound("fp4_blockwise", torch.tensor([[1.0, 2.0, 3.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"hidden size H must be positive"):
        combine_roundtrip("none", torch.zeros(4, 0))
    for fn in (combine_roundtrip, combine_wire_rows, combine_error_bound):
        with pytest.raises(ValueError, match=r"^y: shape \(3, 7\): hidden size H=7 must be even for mode 'fp4_blockwise'"):
            fn("fp4_blockwise", torch.zeros(3, 7))
    y = torch.ones(2, 8)
    assert combine_roundtrip("none", y).data_ptr() != y.data_ptr()  # a copy, never the input


@pytest.mark.parametrize("hidden", [2880, 200, 33 * 2])
def test_quantizers_take_a_partial_last_block(hidden):
    """Any H works (even for fp4): the last block is its own block; scales [T, ceil(H / block)]."""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(torch.bfloat16)
    for quantize, dequantize, mode in ((quantize_fp8_blockwise, dequantize_fp8_blockwise, "fp8_blockwise"),
                                       (quantize_fp4_mx, dequantize_fp4_mx, "fp4_mx"),
                                       (quantize_fp4_blockwise, dequantize_fp4_blockwise, "fp4_blockwise")):
        block = MODES[mode]
        codes, scales = quantize(x)
        assert scales.shape == (5, -(-hidden // block))
        assert scales.shape[1] * scales.element_size() == scale_bytes(mode, hidden)
        whole = hidden // block * block
        if whole:  # the whole blocks quantize as they would alone
            wc, ws = quantize(x[:, :whole])
            assert torch.equal(ws, scales[:, : whole // block])
            width = whole if mode.startswith("fp8") else whole // 2
            assert torch.equal(wc, codes[:, :width])
        assert dequantize(codes, scales).shape == (5, hidden)


def _kernel_grid(q: torch.Tensor, element: str, saturating: bool,
                 fmt: MiniFloat | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The software codec's rounding to the grid (templates/common/wire/_codec.j2) in float32 as the
    kernels compute it: (ep_grid_code(q) as int32, fp8's encoder; ep_grid_round(q), with the
    saturation of an unscaled wire or without it, a scaled wire's), in ``element``'s format or
    ``fmt`` (an fp8 flavour's numbers; without negative zero, the branch that drops the sign of a
    zero code and of a zero rounding)."""
    fmt = fmt or MINIFLOATS[element]
    u = q.view(torch.int32)
    a = q.abs()
    emin_bits, step_bits = (127 + fmt.emin) << 23, (23 - fmt.mbits) << 23
    t = torch.maximum(u & 0x7F800000, torch.tensor(emin_bits, dtype=torch.int32))
    k = (t + step_bits).view(torch.float32)  # int32 wraps where the C++ u32 does: the same bits
    total = a + k
    sign = (u >> 31) & 1
    code = total.view(torch.int32) - (t + step_bits) + ((t - emin_bits) >> (23 - fmt.mbits))
    mag = torch.where(a > fmt.max, fmt.max_code, torch.where(a == a, code, fmt.nan_code))
    code = mag | (sign << fmt.sign_shift) if fmt.negative_zero else mag | torch.where(mag != 0, sign << fmt.sign_shift, 0)
    r = total - k
    m = torch.where(a > fmt.max, torch.tensor(fmt.max), r) if saturating else r
    sign_bits = u & torch.tensor(-0x80000000, dtype=torch.int32)
    if not fmt.negative_zero:  # (r != 0.0f ? u & 0x80000000u : 0u)
        sign_bits = torch.where(r != 0, sign_bits, 0)
    value = (m.view(torch.int32) | sign_bits).view(torch.float32)
    return code, value


def _kernel_decode_fp8(codes: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """ep_decode_pair's software path (templates/common/wire/_codec.j2) per code, as the kernels
    compute it: the NaN test of the flavour (e4m3fn: magnitude 0x7F; e4m3fnuz: the code 0x80), else
    ep_decode_minifloat<mbits, ebits, bias>: the integer significand times a normal power of two,
    then the sign bit OR-ed in."""
    out = []
    for c in codes.tolist():
        nan = (c & 0x7F) == fmt.nan_code if fmt.negative_zero else c == fmt.nan_code
        e, m = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1), c & ((1 << fmt.mbits) - 1)
        mag = float(m | (1 << fmt.mbits) if e else m) * 2.0 ** ((e or 1) - fmt.bias - fmt.mbits)
        value = torch.tensor(math.nan if nan else mag, dtype=torch.float32)
        bits_ = value.view(torch.int32).item() | (0 if nan else (c >> fmt.sign_shift) << 31)
        out.append(torch.tensor(bits_ if bits_ < 2**31 else bits_ - 2**32, dtype=torch.int32).view(torch.float32))
    return torch.stack(out)


def _kernel_e2m1_magnitude(q: torch.Tensor) -> torch.Tensor:
    """ep_e2m1_magnitude(q) less 2^23's bits (templates/common/wire/_codec.j2), in float32 as the
    kernels compute it (each line one rounding: 2a and a / 2 are exact, so a float32 add is the
    FMA), as int32."""
    a = q.abs()
    lines = [(a * 2.0 + 2.0**23), (a + (2.0**23 + 2)), (a * 0.5 + (2.0**23 + 4))]
    n = torch.stack([line.view(torch.int32) for line in lines]).amin(dim=0)
    return torch.minimum(n, torch.tensor(0x4B000007, dtype=torch.int32)) - 0x4B000000


def _grid_probes(element: str) -> torch.Tensor:
    """Every float32 within 2 ulps of each value, midpoint between values and binade boundary of the
    format (both signs), float32 subnormals, zeros, values past the saturation, infinity, float32
    binades whose k's bits overflow, and a spread over twice the format's range."""
    fmt = MINIFLOATS[element]
    decode = fp8_e4m3_decode if element == "fp8" else fp4_e2m1_decode
    grid = decode(torch.arange(fmt.max_code + 1, dtype=U8)).double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    probes = torch.cat([grid.float(), mids, torch.tensor([2.0**e for e in range(-140, 128)] + [1e-40, 3e38])])
    b = probes.view(torch.int32)
    near = torch.cat([b + d for d in (-2, -1, 0, 1, 2)] + [torch.tensor([0, 1, 0x7F800000], dtype=torch.int32)])
    near = near[(near >= 0) & (near <= 0x7F800000)].view(torch.float32)
    return torch.cat([near, -near, torch.linspace(-2 * fmt.max, 2 * fmt.max, 200001, dtype=torch.float32)])


def _scaled_probes(element: str) -> torch.Tensor:
    """The probes a scaled wire's quotient can be: |q| <= max (1 + 2^-22) (s = fl(amax / max))."""
    q = _grid_probes(element)
    return q[q.abs() <= MINIFLOATS[element].max * (1 + 2.0**-22)]


@pytest.mark.parametrize("element", ["fp8", "fp4"])
def test_the_kernels_grid_rounding_equals_the_reference(element):
    """The software codec's grid rounding (the value a rank's own row adds where it is summed: fp4
    on every arch, fp8 where the arch has no conversion instructions) in float32 as the kernels
    compute it equals decode(encode(q)) of the reference bit for bit: on a scaled wire's quotients
    without the saturation, on every probe of ``_grid_probes`` with it (fp8_direct_cast); and fp8's
    encoder, ep_grid_code, equals encode on every probe, NaN giving the NaN code with its sign."""
    encode, decode = (fp8_e4m3_encode, fp8_e4m3_decode) if element == "fp8" else (fp4_e2m1_encode, fp4_e2m1_decode)
    q = _scaled_probes(element)
    _, value = _kernel_grid(q, element, saturating=False)
    assert torch.equal(value.view(torch.int32), decode(encode(q)).view(torch.int32))
    if element == "fp4":
        return  # fp4 has only a scaled wire, and its own encoder (the next test)
    q = _grid_probes(element)
    code, value = _kernel_grid(q, element, saturating=True)
    assert torch.equal(code.to(U8), encode(q))
    assert torch.equal(value.view(torch.int32), decode(encode(q)).view(torch.int32))
    code, value = _kernel_grid(torch.tensor([float("nan"), -float("nan")], dtype=torch.float32), element, True)
    fmt = MINIFLOATS[element]
    assert code.tolist() == [fmt.nan_code, fmt.nan_code | 1 << fmt.sign_shift] and torch.isnan(value).all()


def test_the_kernels_e4m3fnuz_codec_is_exact_on_every_code():
    """gfx942's branch of the software codec (e4m3fnuz, ArchTraits.fp8 there), as the kernels compute
    it: every one of the 256 codes decodes to torch.float8_e4m3fnuz's value bit for bit (0x80 alone
    NaN); ep_grid_code of each decoded finite value is its code (encode(decode(c)) = c; 0x80 comes
    back only from NaN); and on every probe of the fnuz grid ep_grid_code is the reference's encode
    and ep_grid_round its decode(encode(q)), with and without the saturation."""
    fmt = FP8_FLAVOURS["e4m3fnuz"].numbers
    decoded = _kernel_decode_fp8(ALL_CODES, fmt)
    ref = ALL_CODES.view(torch.float8_e4m3fnuz).float()
    assert decoded.isnan().nonzero().flatten().tolist() == [0x80] and torch.equal(ref.isnan(), decoded.isnan())
    fin = ~ref.isnan()
    assert torch.equal(bits(decoded[fin]), bits(ref[fin]))
    code, value = _kernel_grid(decoded[fin], "fp8", True, fmt)
    assert torch.equal(code.to(U8), ALL_CODES[fin]) and torch.equal(bits(value), bits(ref[fin]))
    code, _ = _kernel_grid(f32([math.nan, -math.nan]), "fp8", True, fmt)
    assert code.tolist() == [0x80, 0x80]
    grid = ref[:0x80].double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    b = torch.cat([grid.float(), mids, f32([2.0**e for e in range(-140, 128)])]).view(torch.int32)
    near = torch.cat([b + d for d in (-2, -1, 0, 1, 2)])
    near = near[(near >= 0) & (near <= 0x7F800000)].view(torch.float32)
    q = torch.cat([near, -near, torch.linspace(-2 * fmt.max, 2 * fmt.max, 200001, dtype=torch.float32)])
    want = fp8_e4m3_encode(q, "e4m3fnuz")
    code, value = _kernel_grid(q, "fp8", True, fmt)
    assert torch.equal(code.to(U8), want)
    assert torch.equal(bits(value), bits(fp8_e4m3_decode(want, "e4m3fnuz")))
    scaled = q[q.abs() <= fmt.max * (1 + 2.0**-22)]
    _, value = _kernel_grid(scaled, "fp8", False, fmt)
    assert torch.equal(bits(value), bits(fp8_e4m3_decode(fp8_e4m3_encode(scaled, "e4m3fnuz"), "e4m3fnuz")))


def _kernel_e2m1_signs(words: list[int]) -> int:
    """ep_e2m1_signs of the 4 words (8 bf16, element 2j in word j's low half) as the kernels compute it."""
    p = _byte_perm(words[0], words[1], 0x5173)
    q = _byte_perm(words[2], words[3], 0x7351)
    return (p & 0x8080) | (q & 0x80800000) | ((((p >> 20) | (q << 12)) & 0xFFFFFFFF) & 0x08080808)


def test_the_kernels_fp4_encoder_equals_the_reference():
    """The kernels' fp4 encoder (ep_wire_encode of templates/common/wire/fp4_blockwise.j2): the
    least of its three lines is the reference's magnitude code on every probe (the magnitude is
    exact on all 2^31 non-negative float32 too: one CPU run, docs/measurements/quantized-combine.md#fp4-encoder), NaN and
    infinity saturate to 7; and on random bf16 vectors with their quotients, the sign gather and the
    packing (magnitudes with 2^23's bits cancelled mod 2^32) give the reference's packed codes."""
    q = _grid_probes("fp4")
    assert torch.equal(_kernel_e2m1_magnitude(q), (fp4_e2m1_encode(q) & 7).to(torch.int32))
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    assert _kernel_e2m1_magnitude(special).tolist() == [7, 7, 7, 7]
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(4096, 8, generator=g) * torch.logspace(-3, 3, 8)).to(torch.bfloat16)
    x[0] = torch.tensor([0.0, -0.0, 1.0, -1.0, 6.0, -6.0, 0.25, -0.25])
    s = torch.rand(4096, 1, generator=g) * 100 + 1e-3
    quotients = x.float() / s
    words = (x.view(torch.int16).to(torch.int64) & 0xFFFF).view(-1, 4, 2)
    words = (words[..., 0] | words[..., 1] << 16).tolist()
    magnitudes = (_kernel_e2m1_magnitude(quotients) + 0x4B000000).tolist()
    want = pack_fp4(fp4_e2m1_encode(quotients)).view(-1, 4).to(torch.int64)
    for i in range(x.shape[0]):
        codes = (0 - 0x4B000000 * 17) % 2**32
        for k in range(8):
            codes = (codes + (magnitudes[i][k] << 4 * k)) % 2**32
        codes |= _kernel_e2m1_signs(words[i])
        assert codes == sum(int(b) << 8 * j for j, b in enumerate(want[i])), i


def _byte_perm(lo: int, hi: int, sel: int) -> int:
    """NVIDIA's PRMT / __byte_perm: byte n = byte (sel's bits 4n..4n+2) of {hi, lo}."""
    data = lo | hi << 32
    return sum(((data >> 8 * ((sel >> 4 * n) & 7)) & 0xFF) << 8 * n for n in range(4))


def _v_perm(src0: int, src1: int, sel: int) -> int:
    """AMD's V_PERM_B32 for selector bytes 0-7: byte n = byte (sel's byte n) of {src0, src1}."""
    data = src1 | src0 << 32
    return sum(((data >> 8 * ((sel >> 8 * n) & 0xFF)) & 0xFF) << 8 * n for n in range(4))


def test_the_kernels_fp4_decoder_permutes_an_f16_table():
    """The kernels' fp4 decoder (ep_decode_pair of templates/common/wire/_codec.j2) equals the
    reference for both codes of every byte value at each of a word's four pair positions (the other
    bytes random): the selector and sign permutations of the word and its shift by 4, the byte
    permutation of the binary16 table, the widening; and the AMD form of the table permutation
    (nibbles spread to v_perm_b32's selector bytes) equals NVIDIA's."""
    fmt = MINIFLOATS["fp4"]
    hb = fmt.f16_high_bytes
    lo_table = sum(b << 8 * k for k, b in enumerate(hb[:4]))
    hi_table = sum(b << 8 * k for k, b in enumerate(hb[4:]))
    g = torch.Generator().manual_seed(16)
    others = torch.randint(0, 2**32, (256, 4), generator=g, dtype=torch.int64).tolist()
    for j in range(4):
        for byte in range(256):
            word = (others[byte][j] & ~(0xFF << 8 * j) | byte << 8 * j) & 0xFFFFFFFF
            shifted = (word << 4) & 0xFFFFFFFF
            sel = _byte_perm(shifted & 0x70707070, word & 0x70707070, 0x4040 + 0x1111 * j)
            sign = _byte_perm(shifted, word, 0x4400 + 0x1111 * j) & 0x80008000
            h = _byte_perm(lo_table, hi_table, sel) | sign
            n = sel & 0x7777
            assert n == sel & 0xFFFF, (j, byte)  # every selector nibble below 8: PRMT's default mode
            v = (n & 0xF) | (n & 0xF0) << 4 | (n & 0xF00) << 8 | (n & 0xF000) << 12
            assert _v_perm(hi_table, lo_table, v) == h & 0x7FFF7FFF
            got = torch.tensor([h & 0xFFFF, h >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16).float()
            want = fp4_e2m1_decode(torch.tensor([byte & 0xF, byte >> 4], dtype=U8))
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (j, byte)


# --- zero codes keep the sign: each arch's encoders, emulated, against the reference --------------


def _flush32(v: float) -> float:
    """-ftz=true on a float32 operand or result: a subnormal becomes the zero of its sign."""
    return math.copysign(0.0, v) if 0 < abs(v) < 2.0**-126 else v


def _round32(v: Fraction) -> float:
    """Nonzero rational -> float32 (as a Python float), to nearest even, steps of 2^-149 below 2^-126."""
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e -= Fraction(2) ** e > a  # floor(log2 a)
    step = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(a, step)
    n += 2 * rem > step or (2 * rem == step and n % 2)
    assert n * step < 2**128, v  # no overflow among the probes
    return float(n * step) if v > 0 else -float(n * step)


def _fma32(a: float, b: float, c: float) -> float:
    """fma.rn.ftz.f32: a b + c rounded once, subnormal operands and result flushed to zeros of their
    signs; an exact zero is -0 only for a zero product and c both -0 (IEEE 754 6.3, round to
    nearest). ``_fma32(x, y, -0.0)`` is mul.rn.ftz.f32."""
    a, b, c = _flush32(a), _flush32(b), _flush32(c)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        negative_product = a * b == 0 and math.copysign(1.0, a) * math.copysign(1.0, b) < 0
        return -0.0 if negative_product and c == 0 and math.copysign(1.0, c) < 0 else 0.0
    return _flush32(_round32(exact))


def _sm90_div_rn(x: float, s: float, r0: float | None = None, residual_subtracted: bool = True) -> float:
    """ep_div_rn of templates/platform/nvidia.j2 (tests/codegen/test_combine_wire.py pins its text),
    compiled with -ftz=true: r0 = rcp.approx.ftz.f32(s) (RN(1/s) unless given: a test passes its
    neighbours too), one Newton step, q = x r, then q - (s q - x) r; with residual_subtracted=False
    the former q + (x - s q) r."""
    r0 = float(torch.tensor(1.0) / torch.tensor(s)) if r0 is None else r0
    r = _fma32(_fma32(-s, r0, 1.0), r0, r0)
    q = _fma32(x, r, -0.0)
    if residual_subtracted:
        return _fma32(-_fma32(s, q, -x), r, q)
    return _fma32(_fma32(-s, q, x), r, q)


def _amd_div_rn(x: float, s: float) -> float:
    """ep_div_rn of templates/platform/amd.j2: x / s, IEEE (clang lowers it correctly rounded),
    a subnormal quotient flushed (-fcuda-flush-denormals-to-zero) to the zero of its sign."""
    return _flush32(float(torch.tensor(x) / torch.tensor(s)))


def _signbit(v: float) -> bool:
    return math.copysign(1.0, v) < 0


def _f32_neighbours(v: float) -> list[float]:
    t = torch.tensor(v)
    return [v, float(torch.nextafter(t, torch.tensor(0.0))), float(torch.nextafter(t, torch.tensor(math.inf)))]


def test_the_sm90_division_is_the_quotient_and_keeps_a_zero_sign():
    """sm_90's ep_div_rn, emulated in exact arithmetic under -ftz=true, on bf16 elements (zeros of
    both signs, flushed-block negatives 2^-90, bf16 subnormals, normals over a wide range) and the
    scales a block can have (1 for a flushed block, fl(amax / max) otherwise), whichever of RN(1/s)
    and its two neighbours the approximate reciprocal gives: the quotient is x / s bit for bit, but
    where x or x / s is a float32 subnormal (flushed: then a zero, and x / s below every format's
    smallest nonzero code too); in every case its sign is x's. The former form, the residual
    x - s q added, made -0.0 a +0 quotient (x / 1 of a block of -0.0: the code 0x00 an H200 wrote
    where the reference writes 0x80) but kept -2^-90 (a nonzero quotient)."""
    g = torch.Generator().manual_seed(90)
    special = [0.0, 2.0**-90, 2.0**-130, 2.0**-133, 2.0**-126, 2.0**-80, 1.0, 448.0, 3.0e38]
    spread = (torch.randn(96, generator=g) * torch.logspace(-30, 30, 96)).tolist()
    xs = torch.tensor(special + [-v for v in special] + spread).to(torch.bfloat16).float().tolist()
    amaxes = torch.tensor([2.0**-80, 3.7e-20, 1.0, 0.0123, 7.5, 3.0e38]).to(torch.bfloat16).float()
    scales = [1.0] + (amaxes / FP8_E4M3_MAX).tolist() + (amaxes / FP4_E2M1_MAX).tolist()
    checked = 0
    for s in scales:
        for r0 in _f32_neighbours(float(torch.tensor(1.0) / torch.tensor(s))):
            for x in xs:
                if abs(x) > s * FP8_E4M3_MAX * 2:
                    continue  # not an element of a block of this scale
                got, want = _sm90_div_rn(x, s, r0), float(torch.tensor(x) / torch.tensor(s))
                assert _signbit(got) == _signbit(want) == _signbit(x), (x, s, r0, got)
                if 0 < abs(x) < 2.0**-126 or 0 < abs(want) < 2.0**-126:  # flushed: a zero, as x / s encodes
                    assert got == 0 and abs(want) < 2.0**-10, (x, s, r0, got, want)
                else:
                    assert got == want, (x, s, r0, got, want)
                checked += 1
    assert checked > 1000
    assert not _signbit(_sm90_div_rn(-0.0, 1.0, residual_subtracted=False))
    assert _sm90_div_rn(-(2.0**-90), 1.0, residual_subtracted=False) == -(2.0**-90)


def _zero_sign_rows() -> torch.Tensor:
    """bf16 [4, 256] rows of the four cases: blocks of -0.0, blocks of +0.0, flushed blocks of
    negatives (-2^-90), and blocks mixing -0.0, +0.0, -2^-90 and a bf16 subnormal (-2^-130) with
    normal values."""
    y = torch.zeros(4, 256)
    y[0] = -0.0
    y[2] = -(2.0**-90)
    y[3] = torch.randn(256, generator=torch.Generator().manual_seed(4))
    y[3, 0::8], y[3, 1::8], y[3, 2::8], y[3, 3::8] = -0.0, 0.0, -(2.0**-90), -(2.0**-130)
    return y.to(torch.bfloat16)


def _kernel_wire_rows(arch: str, mode: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The codes and scales ``arch``'s encoder writes for bf16 rows ``y`` (ep_wire_encode of
    templates/common/wire/), element by element: the block scale (amax below 2^-80: 1), the
    quotient by the platform's ep_div_rn, and the element codec, fp8 by the conversion instruction
    where the arch has one (cvt.rn.satfinite.e4m3x2.f32, taken as the reference encoder: round to
    nearest even, saturating, the sign copied, as PTX and cuda_fp8.hpp's own conversion of the
    same operation have it) or ``_kernel_grid`` (ep_grid_code), fp4 by ``_kernel_e2m1_magnitude``
    and the bf16 element's sign bit (ep_e2m1_signs gathers exactly those). fp8 is the arch's
    flavour (``ArchTraits.fp8``: the scale amax / 240 and the e4m3fnuz branch on gfx942)."""
    t = traits(arch)
    q = COMBINE_QUANTS[mode]
    fmt = element_format(q.element, t.fp8)
    div = _sm90_div_rn if t.vendor == "nvidia" else _amd_div_rn
    x = y.float()
    if q.block:
        amax = x.abs().reshape(x.shape[0], -1, q.block).amax(dim=-1)
        scales = torch.tensor([[div(a, fmt.max) if a >= 2.0**COMBINE_FLUSH_LOG2 else 1.0 for a in row]
                               for row in amax.tolist()])
        per = scales.repeat_interleave(q.block, dim=1)
        quotients = torch.tensor([[div(e, s) for e, s in zip(xr, sr)] for xr, sr in zip(x.tolist(), per.tolist())])
    else:
        scales, quotients = None, x
    if q.element == "fp4":
        codes = (_kernel_e2m1_magnitude(quotients) | torch.signbit(x).to(torch.int32) << 3).to(U8)
        return pack_fp4(codes), scales
    if t.hw_fp8_convert:
        return fp8_e4m3_encode(quotients, t.fp8), scales
    return _kernel_grid(quotients, "fp8", saturating=True, fmt=fmt)[0].to(U8), scales


@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("arch", ARCHES)
def test_every_arch_writes_the_reference_zero_codes(arch, mode):
    """The rule of epgen.quant.codecs, the sign bit copied from the input always, on every arch's
    encoder (emulated: ``_kernel_wire_rows``) and in the reference in the arch's fp8 flavour alike,
    byte for byte: a block of -0.0 and a flushed block of negatives give the negative-zero code
    (0x80, fp4 8) with scale 1, a block of +0.0 the code 0, and in a block of normal values a -0.0
    or a negative rounding to zero gives the negative-zero code, a +0.0 the code 0. e4m3fnuz
    (gfx942's fp8) has no negative zero: there every zero is the code 0."""
    y = _zero_sign_rows()
    codes, scales = _kernel_wire_rows(arch, mode, y)
    want_codes, want_scales = combine_wire_rows(mode, y, fp8_flavour=arch_fp8_flavour(arch))
    assert torch.equal(codes, want_codes)
    if want_scales is None:
        assert scales is None
    else:
        assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
        assert bool((scales[:3] == 1).all())
    element = unpack_fp4(codes) if mode == "fp4_blockwise" else codes
    negative_zero = 8 if mode == "fp4_blockwise" else 0x80 if FP8_FLAVOURS[traits(arch).fp8].numbers.negative_zero else 0
    assert bool((element[0] == negative_zero).all()) and bool((element[1] == 0).all())
    assert bool((element[2] == negative_zero).all())
    assert bool((element[3, 0::8] == negative_zero).all()) and bool((element[3, 1::8] == 0).all())
    assert bool((element[3, 2::8] == negative_zero).all()) and bool((element[3, 3::8] == negative_zero).all())


# --- the combine wire in the arch's fp8 flavour --------------------------------------------------


def _near_saturation_rows(seed: int, hidden: int = 512) -> torch.Tensor:
    """bf16 [12, hidden] fresh random rows (seed) around both fp8 flavours' saturation points and
    subnormal ranges: normal samples scaled by 10^[-3, 3]; every bf16 value in [200, 520] (240 and
    448 with their bf16 neighbours, the midpoints 232 and 248 and 464 among them); each sign; rows
    of one block whose amax is 240 or 448 exactly; and values in the subnormal ranges (2^-12 to
    2^-6)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(hidden, generator=g) * 10.0 ** float(torch.empty(()).uniform_(-3, 3, generator=g))
            for _ in range(4)]
    grid = torch.arange(200.0, 520.0, 0.5).to(torch.bfloat16).unique().float()
    pick = grid[torch.randint(len(grid), (hidden,), generator=g)]
    rows += [pick, -pick, pick * torch.where(torch.rand(hidden, generator=g) < 0.5, -1.0, 1.0)]
    for peak in (240.0, 448.0):
        row = torch.randn(hidden, generator=g) * peak / 8
        row[torch.randint(hidden, (4,), generator=g)] = torch.tensor([peak, -peak, peak * (1 - 2.0**-8), peak])
        rows.append(row)
    tiny = torch.ldexp(torch.rand(hidden, generator=g) + 0.5, torch.randint(-12, -5, (hidden,), generator=g))
    rows += [tiny * torch.where(torch.rand(hidden, generator=g) < 0.5, -1.0, 1.0), tiny * 2.0**-3]
    rest = hidden - len(grid)  # every grid value once, then powers of two 2^-14 .. 2^-5
    rows.append(torch.cat([grid, torch.ldexp(torch.ones(rest), torch.randint(-14, -4, (rest,), generator=g))]))
    return torch.stack(rows).to(torch.bfloat16)


def _kernel_wire_decode(arch: str, mode: str, codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """What ``arch``'s readers add for wire rows (codes, scales) (ep_wire_add of
    templates/common/wire/_wire_rows.j2): ep_decode_pair's software path per code in the arch's fp8
    flavour (``_kernel_decode_fp8``), times the block's scale, one float32 rounding (1 without scales)."""
    q = COMBINE_QUANTS[mode]
    fmt = element_format(q.element, traits(arch).fp8)
    table = _kernel_decode_fp8(torch.arange(256, dtype=U8), fmt)
    vals = table[codes.to(torch.int64)]
    if scales is None:
        return vals
    return vals * scales.repeat_interleave(q.block, dim=1)[:, : vals.shape[1]]


def _kernel_own_rows(arch: str, mode: str, y: torch.Tensor) -> torch.Tensor:
    """What ``arch`` adds for a rank's own row where it is summed (ep_wire_add_roundtrip): the
    grid rounding of each quotient (``_kernel_grid``'s value, saturating only for the unscaled
    wire) in the arch's fp8 flavour, times the scale; the quotients and scales as
    ``_kernel_wire_rows`` forms them."""
    q = COMBINE_QUANTS[mode]
    fmt = element_format(q.element, traits(arch).fp8)
    _, scales = _kernel_wire_rows(arch, mode, y)
    if scales is None:
        return _kernel_grid(y.float(), "fp8", saturating=True, fmt=fmt)[1]
    per = scales.repeat_interleave(q.block, dim=1)
    quotients = torch.tensor([[_amd_div_rn(e, s) for e, s in zip(xr, sr)]
                              for xr, sr in zip(y.float().tolist(), per.tolist())])
    return _kernel_grid(quotients, "fp8", saturating=False, fmt=fmt)[1] * per


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise"])
def test_gfx942_wire_rows_decode_to_the_e4m3fnuz_reference(mode, seed):
    """gfx942's fp8 combine wire as its kernels write it (``_kernel_wire_rows``: scale amax / 240,
    the software codec's e4m3fnuz branch) and read it (``_kernel_wire_decode``; a rank's own rows
    ``_kernel_own_rows``), on fresh random rows around both flavours' saturation points: codes and
    scales are combine_wire_rows(fp8_flavour="e4m3fnuz")'s and the decoded values
    combine_roundtrip(fp8_flavour="e4m3fnuz")'s, bit for bit, and within its error bound; the
    e4m3fn reference (the default) describes another wire."""
    y = _near_saturation_rows(1000 + seed)
    flavour = arch_fp8_flavour("gfx942")
    assert flavour == "e4m3fnuz"
    codes, scales = _kernel_wire_rows("gfx942", mode, y)
    want_codes, want_scales = combine_wire_rows(mode, y, fp8_flavour=flavour)
    assert torch.equal(codes, want_codes)
    if mode == "fp8_blockwise":
        assert torch.equal(bits(scales), bits(want_scales))
        amax = y.float().abs().reshape(y.shape[0], -1, 128).amax(dim=-1)
        assert torch.equal(bits(scales), bits(amax / torch.full_like(amax, 240.0)))  # amax / 240, float32
    else:
        assert want_scales is None and scales is None
    got = _kernel_wire_decode("gfx942", mode, codes, scales)
    want = combine_roundtrip(mode, y, fp8_flavour=flavour)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(_kernel_own_rows("gfx942", mode, y)), bits(want))
    assert bool(((y.float() - want).abs() <= combine_error_bound(mode, y, fp8_flavour=flavour)).all())
    assert want.abs().max() <= 240 * float(scales.max()) if scales is not None else want.abs().max() == 240
    assert not torch.equal(combine_wire_rows(mode, y)[0], codes)  # e4m3fn codes: not gfx942's wire
    assert not torch.equal(bits(combine_roundtrip(mode, y)), bits(got))


@pytest.mark.parametrize("arch", ARCHES)
def test_fp4_wire_is_the_same_in_every_fp8_flavour(arch):
    """fp4_blockwise has no fp8 in it: on every arch the kernels' rows (``_kernel_wire_rows``) are
    the reference's in either flavour, bit for bit, and so are the roundtrip and the bound."""
    y = _near_saturation_rows(7)
    codes, scales = _kernel_wire_rows(arch, "fp4_blockwise", y)
    for flavour in FP8_FLAVOURS:
        want_codes, want_scales = combine_wire_rows("fp4_blockwise", y, fp8_flavour=flavour)
        assert torch.equal(codes, want_codes) and torch.equal(bits(scales), bits(want_scales))
        assert torch.equal(bits(combine_roundtrip("fp4_blockwise", y, fp8_flavour=flavour)),
                           bits(combine_roundtrip("fp4_blockwise", y)))
        assert torch.equal(combine_error_bound("fp4_blockwise", y, fp8_flavour=flavour),
                           combine_error_bound("fp4_blockwise", y))
        assert torch.equal(combine_roundtrip("none", y, fp8_flavour=flavour), y.float())


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_the_two_flavours_wires_differ_where_they_must(seed):
    """e4m3fn (max 448, subnormal step 2^-9) and e4m3fnuz (max 240, 2^-10) on fresh random rows
    near both saturation points, each against torch's own fp8 cast as an independent oracle:

    * fp8_direct_cast: within +-240 both flavours' roundtrips are torch's casts of y (e4m3fnuz
      with no negative zero); in (240, 448] e4m3fn keeps the value to 2^-4 and e4m3fnuz saturates
      to +-240 (its bound |y| - 240 there, e4m3fn's 2^-4 |y|); past 448 e4m3fn gives +-448; the
      subnormal floor of the bound is 2^-10 against 2^-11.
    * fp8_blockwise: scales fl(amax / 448) against fl(amax / 240) bit for bit, codes torch's cast
      of fl(y / s), the roundtrips fl(decode * s); bounds 2^-4 |y| + 2^-10 s against 2^-4 |y| +
      2^-11 s.
    Each roundtrip lies inside its own bound, and e4m3fnuz's direct cast falls outside e4m3fn's."""
    y = _near_saturation_rows(seed)
    a = y.float().abs()
    fn, fnuz = FP8_FLAVOURS["e4m3fn"], FP8_FLAVOURS["e4m3fnuz"]

    rt = {f: combine_roundtrip("fp8_direct_cast", y, fp8_flavour=f) for f in FP8_FLAVOURS}
    bound = {f: combine_error_bound("fp8_direct_cast", y, fp8_flavour=f) for f in FP8_FLAVOURS}
    for f in (fn, fnuz):
        oracle = y.float().clamp(-f.numbers.max, f.numbers.max).to(getattr(torch, f.torch_name)).float()
        assert torch.equal(bits(rt[f.name]), bits(oracle)), f.name
        assert bool(((y.float() - rt[f.name]).abs() <= bound[f.name]).all()), f.name
    mid = (a > 240) & (a <= 448)
    assert int(mid.sum()) > 100 and int((a > 448).sum()) > 10
    assert bool((rt["e4m3fnuz"][mid].abs() == 240).all())
    assert torch.equal(bound["e4m3fnuz"][mid], a[mid] - 240) and torch.equal(bound["e4m3fn"][mid], a[mid] / 16)
    assert bool((rt["e4m3fn"][a > 448].abs() == 448).all())
    assert bool(((y.float() - rt["e4m3fnuz"]).abs() > bound["e4m3fn"])[a > 260].all())
    low = a < 2.0**-12
    assert int(low.sum()) > 10
    assert bool((bound["e4m3fn"][low] == 2.0**-10).all()) and bool((bound["e4m3fnuz"][low] == 2.0**-11).all())
    inside = a <= 240
    assert not torch.equal(bits(rt["e4m3fn"][inside]), bits(rt["e4m3fnuz"][inside]))  # subnormals, -0.0
    assert not bool(torch.signbit(rt["e4m3fnuz"][rt["e4m3fnuz"] == 0]).any())

    amax = a.reshape(a.shape[0], -1, 128).amax(dim=-1)
    for f in (fn, fnuz):
        codes, scales = combine_wire_rows("fp8_blockwise", y, fp8_flavour=f.name)
        s = amax / torch.full_like(amax, f.numbers.max)
        s = torch.where(amax < 2.0**COMBINE_FLUSH_LOG2, torch.ones_like(s), s)
        assert torch.equal(bits(scales), bits(s)), f.name
        per = s.repeat_interleave(128, dim=1)
        q = (y.float() / per).clamp(-f.numbers.max, f.numbers.max)
        assert torch.equal(codes, q.to(getattr(torch, f.torch_name)).view(U8)), f.name
        dq = combine_roundtrip("fp8_blockwise", y, fp8_flavour=f.name)
        assert torch.equal(bits(dq), bits(q.to(getattr(torch, f.torch_name)).float() * per)), f.name
        b = combine_error_bound("fp8_blockwise", y, fp8_flavour=f.name)
        half_sub = 2.0**-10 if f is fn else 2.0**-11
        assert torch.equal(b, a / 16 + half_sub * per), f.name
        assert bool(((y.float() - dq).abs() <= b).all()), f.name
    fn_scales = combine_wire_rows("fp8_blockwise", y)[1]
    fnuz_scales = combine_wire_rows("fp8_blockwise", y, fp8_flavour="e4m3fnuz")[1]
    assert bool((fnuz_scales > fn_scales).all())  # amax / 240 > amax / 448 on every (nonzero) block


def test_an_unknown_fp8_flavour_is_refused_by_every_wire_function():
    """Every combine wire function and fp8 quantizer refuses a flavour that is not a key of
    FP8_FLAVOURS, naming its argument, the value and the known flavours, on every mode (fp4 and
    "none" included: a misspelt flavour never passes unseen)."""
    y = torch.ones(2, 128, dtype=torch.bfloat16)
    for fn in (combine_roundtrip, combine_wire_rows, combine_error_bound):
        for mode in ("fp8_direct_cast", "fp8_blockwise", "fp4_blockwise") + (() if fn is combine_wire_rows else ("none",)):
            with pytest.raises(ValueError, match=r"^fp8_flavour='e4m3': unknown fp8 flavour; known: e4m3fn, e4m3fnuz$"):
                fn(mode, y, fp8_flavour="e4m3")
    codes = torch.zeros(2, 128, dtype=U8)
    for call in (lambda: fp8_direct_cast(y, flavour="fnuz"), lambda: dequantize_fp8_direct(codes, flavour="fnuz"),
                 lambda: quantize_fp8_blockwise(y, flavour="fnuz"),
                 lambda: dequantize_fp8_blockwise(codes, torch.ones(2, 1), flavour="fnuz")):
        with pytest.raises(ValueError, match=r"^flavour='fnuz': unknown fp8 flavour; known: e4m3fn, e4m3fnuz$"):
            call()


def test_arch_fp8_flavour_is_the_traits_row():
    assert {a: arch_fp8_flavour(a) for a in ARCHES} == {a: traits(a).fp8 for a in ARCHES}
    assert arch_fp8_flavour("gfx942") == "e4m3fnuz" and arch_fp8_flavour("sm_90") == "e4m3fn"
    with pytest.raises(ValueError, match=r"arch='gfx90a': unknown target; known: "):
        arch_fp8_flavour("gfx90a")
