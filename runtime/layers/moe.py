"""One expert-parallel MoE layer on the expert-major layout of ``EpDispatchCombine``, and its dense
reference with a derived error bound.

``MoELayer.forward(x, topk_weights, topk_ids)`` runs, on every rank d (L local experts; local expert
e is global expert d * L + e):

1. dispatch: ``EpDispatchCombine.dispatch`` with ``EpConfig(layout="expert")`` returns the rank's
   received rows expanded per distinct local expert, grouped by expert: ``x`` [R_max, H] bf16 and
   ``offsets`` [L + 1] int32 (expert e owns rows [offsets[e], offsets[e + 1]), padding rows zero);
2. experts: ``swiglu_experts`` computes y = (silu(x @ gate_e) * (x @ up_e)) @ down_e for every
   row of expert e (combine reads y in place: no copy);
3. combine: ``EpDispatchCombine.combine`` folds each received row's experts with their routing
   weights (fp32), sends the folded rows back over the combine wire and sums them per token in
   ascending rank: out [T, H] bf16.

``dense_moe`` computes the same layer with every expert in one process (no op, any device) and
returns, next to its outputs, an element-wise bound on |layer - dense| derived in its docstring.
``route_topk`` is a softmax top-k router that produces the layer's (weights, ids) inputs.
"""

from __future__ import annotations

import numbers

import attrs
import torch

from epgen.codegen.config import EpConfig
from epgen.layers import autograd
from epgen.codegen.dtypes import COMBINE_QUANTS, element_format
from epgen.codegen.dtypes import fp8_flavour as fp8_flavour_row
from epgen.quant import combine_error_bound, combine_roundtrip
from epgen.tensors import check_tensor

__all__ = ["ExpertWeights", "MoELayer", "dense_moe", "grouped_mm_available", "grouped_mm_refusal", "moe_gradients",
           "route_topk",
           "swiglu_experts", "swiglu_reference"]

U_BF16 = 2.0**-8
"""Unit roundoff of bfloat16 (8 significant bits, round to nearest even): |bf16(p) - p| <= 2^-8 |p|
for every p in the normal range."""

ETA_BF16 = 2.0**-134
"""Absolute rounding error bound of bfloat16 below the normal range (half its subnormal spacing)."""

EPS_FP32_ACC = 2.0**-23
"""Relative error of one float32 accumulation step as the bound assumes it: one unit in the last
place, which covers round-to-nearest (2^-24) and accumulators that truncate (tensor-core GEMMs)."""

SILU_REL = 2.0**-20
"""Relative error bound of silu evaluated in float32 (x / (1 + exp(-x)): a few float32 ulps)."""

SILU_ABS = 2.0**-118
"""Absolute error of float32 silu where exp(-x) overflows (x < -88: silu = -0 against |x e^x| < 2^-120)."""

SILU_SLOPE_MAX = 1.1
"""max |silu'(x)| over all x (1.0998 at x = 2.3994); |silu''(x)| <= 0.5 (at x = 0)."""

FOLD_ZERO_BLOCK = 2.0**-80
"""A quantized wire sends a block of amax below 2^-80 as zeros (``epgen.quant.combine_roundtrip``):
its error, below 2^-80, is added to the wire term of the bound."""


def _gamma(n: int) -> float:
    """n EPS / (1 - n EPS): bound on the relative error of any order of n float32 additions,
    relative to the sum of the magnitudes of the terms."""
    return n * EPS_FP32_ACC / (1.0 - n * EPS_FP32_ACC)


# --- weights -------------------------------------------------------------------------------------


@attrs.frozen
class ExpertWeights:
    """The SwiGLU weights of one rank's L local experts (local expert e is global expert d * L + e).

    Expert e maps a row x [H] to down[e]^T (silu(gate[e]^T x) * (up[e]^T x)), i.e. with row vectors
    y = (silu(x @ gate[e]) * (x @ up[e])) @ down[e].

    Attributes:
        gate: [L, H, I] bfloat16, contiguous.
        up: [L, H, I] bfloat16, contiguous.
        down: [L, I, H] bfloat16, contiguous.

    All three live on one device.

    Raises:
        TypeError: a field is not a torch.Tensor.
        ValueError: on construction, when a field is not 3-D bfloat16 and contiguous, the shapes
            disagree (naming both), L, H or I is 0, or the fields live on different devices.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __attrs_post_init__(self):
        for name in ("gate", "up", "down"):
            t = check_tensor(f"ExpertWeights.{name}", getattr(self, name), dtype=torch.bfloat16, dim=3,
                             contiguous=True)
            if t.numel() == 0:
                raise ValueError(f"ExpertWeights.{name}: shape {tuple(t.shape)} must have L, H, I >= 1")
        L, H, I = self.gate.shape
        if tuple(self.up.shape) != (L, H, I):
            raise ValueError(f"ExpertWeights.up: shape {tuple(self.up.shape)} must equal gate's [L, H, I] = "
                             f"{[L, H, I]}")
        if tuple(self.down.shape) != (L, I, H):
            raise ValueError(f"ExpertWeights.down: shape {tuple(self.down.shape)} must be [L, I, H] = {[L, I, H]} "
                             f"(gate is [L, H, I] = {[L, H, I]})")
        for name in ("up", "down"):
            if getattr(self, name).device != self.gate.device:
                raise ValueError(f"ExpertWeights.{name}: on {getattr(self, name).device}, must be on gate's device "
                                 f"{self.gate.device}")

    @property
    def num_experts(self) -> int:
        """L, the rank's local experts."""
        return self.gate.shape[0]

    @property
    def hidden(self) -> int:
        """H, elements per token row."""
        return self.gate.shape[1]

    @property
    def intermediate(self) -> int:
        """I, the experts' intermediate size."""
        return self.gate.shape[2]

    @property
    def device(self) -> torch.device:
        return self.gate.device

    @classmethod
    def random(cls, num_experts: int, hidden: int, intermediate: int, *, generator: torch.Generator,
               device=None) -> "ExpertWeights":
        """Random weights N(0, 1 / fan_in) rounded to bfloat16: gate and up with fan_in = H, down
        with fan_in = I, so rows x ~ N(0, 1) give gate and up outputs ~ N(0, 1) and outputs y
        with E[y^2] = E[silu(g)^2] ~ 0.36 (activations stay O(1) at any H and I).

        Args:
            num_experts, hidden, intermediate: L, H, I (>= 1).
            generator: a torch.Generator; the numbers are drawn on its device (gate, then up, then
                down), so one CPU generator gives the same weights on every device.
            device: where the weights go (default: the generator's device).

        Raises:
            ValueError: L, H or I not a positive int.
        """
        for name, value in (("num_experts", num_experts), ("hidden", hidden), ("intermediate", intermediate)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive int")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: must be a torch.Generator, got {type(generator).__name__}")
        where = generator.device
        device = where if device is None else torch.device(device)
        L, H, I = int(num_experts), int(hidden), int(intermediate)

        def draw(shape, fan_in):
            w = torch.randn(shape, generator=generator, device=where, dtype=torch.float32) * fan_in**-0.5
            return w.to(device=device, dtype=torch.bfloat16).contiguous()

        return cls(gate=draw((L, H, I), H), up=draw((L, H, I), H), down=draw((L, I, H), I))


# --- the expert stage ----------------------------------------------------------------------------


def grouped_mm_available(device) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` without a host synchronization.

    True on CPU (torch's CPU kernel) and on CUDA devices of compute capability 9.0 or 10.x (the
    CUTLASS kernel reads the group offsets on the device), when this torch has
    ``torch._grouped_mm``. False on other CUDA devices and on ROCm, where torch falls back to a
    loop that reads the offsets to the host; False for a CUDA device this process cannot see (a
    torch built without CUDA, no GPU, or an index past ``torch.cuda.device_count()``); False for
    every other device type.

    Args:
        device: a torch.device, a device string ("cpu", "cuda", "cuda:1") or a CUDA device index.

    Raises:
        TypeError: device not a torch.device, str or int.
        ValueError: a string torch cannot parse as a device, or a negative index.
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, numbers.Integral)):
        raise TypeError(f"device={device!r}: must be a torch.device, a device string or a CUDA device index")
    if isinstance(device, numbers.Integral):
        if device < 0:
            raise ValueError(f"device={device!r}: a CUDA device index must be >= 0")
        device = torch.device("cuda", int(device))
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r}: not a torch device ({e})") from None
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        return False
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor) == (9, 0) or major == 10


def grouped_mm_refusal(device, hidden: int, intermediate: int) -> str | None:
    """Why ``torch._grouped_mm`` cannot run experts of hidden size ``hidden`` and intermediate size
    ``intermediate`` on ``device`` (None when it can): no device-side grouped GEMM there
    (``grouped_mm_available``), or a size that is not a multiple of 8 (16-byte rows)."""
    if not grouped_mm_available(device):
        have = "has no torch._grouped_mm" if not hasattr(torch, "_grouped_mm") else \
            "runs torch._grouped_mm as a host-synchronizing fallback"
        return (f"torch {torch.__version__} on {device} {have} (it needs CPU, or CUDA compute "
                "capability 9.0 or 10.x)")
    if hidden % 8 or intermediate % 8:
        return (f"H={hidden}, I={intermediate}: torch._grouped_mm needs both to be multiples of 8 "
                "(16-byte rows)")
    return None


def _grouped_refusal(x: torch.Tensor, w: ExpertWeights, out) -> str | None:
    """Why the grouped path cannot take these operands (None when it can)."""
    refusal = grouped_mm_refusal(x.device, w.hidden, w.intermediate)
    if refusal:
        return refusal
    if x.device.type == "cuda":
        for name, t in (("x", x), ("w.gate", w.gate), ("w.up", w.up), ("w.down", w.down), ("out", out)):
            if t is not None and t.data_ptr() % 16:
                return f"{name}: data pointer {t.data_ptr():#x} must be 16-byte aligned for torch._grouped_mm"
    return None


def _check_bool(name: str, value) -> None:
    """True or False; anything else (a string, 0, 1, None) is a TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be True or False")


def _check_flag(name: str, value) -> None:
    """A tri-state flag: None (automatic), True or False; anything else (a string, 0, 1) is a
    TypeError naming it."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be None, True or False")


def _check_expert_stage(x, offsets, w, out) -> None:
    if not isinstance(w, ExpertWeights):
        raise TypeError(f"w: must be an ExpertWeights, got {type(w).__name__}")
    x = check_tensor("x", x, dtype=torch.bfloat16, shape=(None, w.hidden), device=w.device, contiguous=True)
    offsets = check_tensor("offsets", offsets, dtype=torch.int32, shape=(w.num_experts + 1,), device=w.device)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=tuple(x.shape), device=w.device, contiguous=True)


def _host_offsets(offsets: torch.Tensor, rows: int) -> list[int]:
    """The group offsets on the host (one synchronization), checked: offsets[0] = 0, never
    decreasing, offsets[L] <= R."""
    bounds = offsets.tolist()
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or bounds[-1] > rows:
        raise ValueError(f"offsets={bounds}: must start at 0, never decrease and end at most at R={rows}")
    return bounds


def swiglu_experts(x: torch.Tensor, offsets: torch.Tensor, w: ExpertWeights, *, grouped: bool | None = None,
                   out: torch.Tensor | None = None, offsets_checked: bool = False) -> torch.Tensor:
    """Every expert's SwiGLU FFN on its group of rows of the expert-major layout.

    Rows [offsets[e], offsets[e + 1]) of x belong to local expert e; for each such row
    y = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]. Rounding points (the same on both paths, and
    in ``dense_moe``):

        g = bf16(x @ gate[e])       float32 accumulation, rounded once
        v = bf16(x @ up[e])         float32 accumulation, rounded once
        s = bf16(silu(g))           silu evaluated in float32
        h = bf16(s * v)             the float32 product of two bf16 numbers is exact: one rounding
        y = bf16(h @ down[e])       float32 accumulation, rounded once

    Paths:
        grouped: three ``torch._grouped_mm`` calls (gate, up, down; group ends offsets[1:]) and an
            in-place silu and product; with ``offsets_checked`` no host synchronization, so it can
            be captured in a CUDA graph. ``torch._grouped_mm`` has no output argument, so with
            ``out`` given y is copied into it (one [R, H] copy).
        loop: reads offsets to the host once (one synchronization: NOT capturable in a CUDA
            graph), then per non-empty group two matmuls, silu, product and a matmul written
            straight into the output.
    Padding rows (zeros in x) go through the expert like any row and give zeros.

    Under autograd (grad mode on and x or a weight requiring grad) both paths are differentiable
    with the same rounding points: the grouped path runs its silu and product out of place, the
    loop concatenates its groups (zeros for the rows past offsets[L]); ``out`` is refused there
    (torch has no gradient for an out= matmul).

    Args:
        x: [R, H] bfloat16, contiguous, on the weights' device.
        offsets: [L + 1] int32 on x's device; offsets[0] = 0, non-decreasing, offsets[L] <= R
            (read to the host and checked, one synchronization, unless ``offsets_checked``).
        w: the rank's ExpertWeights.
        grouped: None picks grouped when ``grouped_mm_available(x.device)`` and the operands suit
            it (H and I multiples of 8; on CUDA 16-byte aligned pointers), else the loop; True
            forces grouped, False the loop.
        out: optional [R, H] bfloat16 contiguous tensor for y (e.g. ``op.combine_input(rank)``).
        offsets_checked: the caller vouches for ``offsets`` (the op's ``ExpertDispatchOutput.offsets``,
            which its expand kernel wrote to these rules): the grouped path then reads nothing to
            the host (capturable); the loop path reads them either way. Offsets that break the
            rules give wrong rows there, silently.
    Returns:
        y [R, H] bfloat16 (``out`` itself when given); rows >= offsets[L] are undefined (the loop
        leaves them as they were, the grouped path holds whatever its kernels left there).

    Raises:
        TypeError: grouped not None, True or False; offsets_checked not True or False; w not an
            ExpertWeights, a tensor argument not a tensor.
        ValueError: shapes, dtypes, devices or contiguity as above; grouped=True where the grouped
            path cannot run (naming why); offsets breaking the rules above (unless
            ``offsets_checked`` on the grouped path); ``out`` under autograd.
    """
    _check_flag("grouped", grouped)
    _check_bool("offsets_checked", offsets_checked)
    _check_expert_stage(x, offsets, w, out)
    refusal = _grouped_refusal(x, w, out)
    if grouped is None:
        grouped = refusal is None
    elif grouped and refusal is not None:
        raise ValueError(f"grouped=True: {refusal}")
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w.gate, w.up, w.down))
    if training and out is not None:
        raise ValueError("out: not taken under autograd (torch has no gradient for an out= matmul); pass out=None")
    if grouped:
        if not offsets_checked:
            _host_offsets(offsets, x.shape[0])  # one host synchronization
        ends = offsets[1:]
        g = torch._grouped_mm(x, w.gate, offs=ends)
        v = torch._grouped_mm(x, w.up, offs=ends)
        if training:
            g = torch.nn.functional.silu(g) * v
        else:
            torch.nn.functional.silu(g, inplace=True)
            g.mul_(v)
        y = torch._grouped_mm(g, w.down, offs=ends)
        if out is None:
            return y
        return out.copy_(y)
    bounds = _host_offsets(offsets, x.shape[0])  # the loop path's one host synchronization
    if training:
        groups = [(torch.nn.functional.silu(x[a:b] @ w.gate[e]) * (x[a:b] @ w.up[e])) @ w.down[e]
                  for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
        return torch.cat(groups + [x.new_zeros(x.shape[0] - bounds[-1], x.shape[1])])
    y = out if out is not None else torch.empty_like(x)
    for e in range(w.num_experts):
        start, end = bounds[e], bounds[e + 1]
        if start == end:
            continue
        g = x[start:end] @ w.gate[e]
        v = x[start:end] @ w.up[e]
        torch.nn.functional.silu(g, inplace=True)
        g.mul_(v)
        torch.matmul(g, w.down[e], out=y[start:end])
    return y


# --- the dense reference -------------------------------------------------------------------------


def _round_bound(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """E_v = (u |v_D| + (1 + u) e + eta) / (1 - u): bound on |v_C - v*| for a rounding step
    v = bf16(p) whose float32 input p is within e of the exact value v* (see ``dense_moe``)."""
    return (U_BF16 * v.double().abs() + (1 + U_BF16) * e + ETA_BF16) / (1 - U_BF16)


def _check_fp32_matmul_precision() -> None:
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        raise ValueError(f"torch.get_float32_matmul_precision()={precision!r}: the dense reference needs "
                         "'highest' (float32 GEMMs accumulating in float32, no TF32 / bf16 passes)")


def _swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    """One expert on rows x [n, H] bf16: (y [n, H] bf16, E_y [n, H] float64), the dense value and
    the bound on |y_C - y*| of any computation C with the documented rounding points."""
    H, I = gate.shape
    xf = x.float()
    g = (xf @ gate.float()).to(torch.bfloat16)
    v = (xf @ up.float()).to(torch.bfloat16)
    s = torch.nn.functional.silu(g.float()).to(torch.bfloat16)
    h = (s.float() * v.float()).to(torch.bfloat16)
    y = (h.float() @ down.float()).to(torch.bfloat16)

    xa = x.double().abs()
    E_g = _round_bound(g, _gamma(H) * (xa @ gate.double().abs()))
    E_v = _round_bound(v, _gamma(H) * (xa @ up.double().abs()))
    g64 = g.double()
    sig = torch.sigmoid(g64)
    slope = (sig * (1 + g64 * (1 - sig))).abs().add(E_g).clamp(max=SILU_SLOPE_MAX)
    e_s = slope * E_g + SILU_REL * ((g64 * sig).abs() + 2 * slope * E_g) + SILU_ABS
    E_s = _round_bound(s, e_s)
    m_s, m_v = s.double().abs() + E_s, v.double().abs() + E_v
    E_h = _round_bound(h, E_s * (m_v + E_v) + m_s * E_v)
    da = down.double().abs()
    E_y = _round_bound(y, E_h @ da + _gamma(I) * ((h.double().abs() + 2 * E_h) @ da))
    return y, E_y


def swiglu_reference(x: torch.Tensor, offsets: torch.Tensor, w: ExpertWeights):
    """``swiglu_experts`` computed as ``dense_moe`` computes each expert, with its bound.

    Args:
        x, offsets, w: as ``swiglu_experts`` (offsets are read to the host).

    Returns:
        (y, bound): y [offsets[L], H] bfloat16, bound [offsets[L], H] float64 with
        |swiglu_experts(x, offsets, w)[:offsets[L]] - y| <= bound on either path, and the same
        bound between the two paths (2 E_y of ``dense_moe``'s derivation).

    Raises:
        TypeError, ValueError: as ``swiglu_experts``'s loop path; float32 matmul precision not
            'highest'.
    """
    _check_expert_stage(x, offsets, w, None)
    _check_fp32_matmul_precision()
    bounds = _host_offsets(offsets, x.shape[0])
    ys, es = [], []
    for e in range(w.num_experts):
        y, E_y = _swiglu_rows(x[bounds[e]:bounds[e + 1]], w.gate[e], w.up[e], w.down[e])
        ys.append(y)
        es.append(E_y)
    return torch.cat(ys), 2 * torch.cat(es)


def _wire_bound(mode: str, envelope: torch.Tensor, fp8_flavour: str) -> torch.Tensor:
    """A bound on |G - F| for every F with |F| <= envelope element-wise (float64 [N, H]): the
    wire's ``combine_error_bound`` in ``fp8_flavour`` at the envelope (rounded up to float32),
    which grows with |F| and with the block amax; the saturating cast's bound drops past the fp8
    maximum m (448 in e4m3fn, 240 in e4m3fnuz: |F| - m against 2^-4 |F| just below), so there its
    value at the envelope clamped to m counts too."""
    env = torch.nextafter(envelope.float(), torch.tensor(float("inf"), device=envelope.device))
    bound = combine_error_bound(mode, env, fp8_flavour=fp8_flavour)
    if COMBINE_QUANTS[mode].block is None:
        fp8_max = element_format(COMBINE_QUANTS[mode].element, fp8_flavour).max
        bound = torch.maximum(bound, combine_error_bound(mode, env.clamp(max=fp8_max), fp8_flavour=fp8_flavour))
    return bound.double()


def _check_dense_inputs(xs, topk_weights, topk_ids, weights, combine_quant):
    if not isinstance(weights, (list, tuple)) or not weights:
        raise ValueError("weights: must be a non-empty list with one ExpertWeights per rank")
    for d, w in enumerate(weights):
        if not isinstance(w, ExpertWeights):
            raise TypeError(f"weights[rank {d}]: must be an ExpertWeights, got {type(w).__name__}")
    w0 = weights[0]
    for d, w in enumerate(weights):
        if (w.num_experts, w.hidden, w.intermediate, w.device) != (w0.num_experts, w0.hidden, w0.intermediate,
                                                                   w0.device):
            raise ValueError(f"weights[rank {d}]: L, H, I = {w.num_experts}, {w.hidden}, {w.intermediate} on "
                             f"{w.device} must equal rank 0's {w0.num_experts}, {w0.hidden}, {w0.intermediate} "
                             f"on {w0.device}")
    world = len(weights)
    for name, value in (("xs", xs), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{name}: must be a list of {world} tensors (one per rank, like weights), got {got}")
    if not isinstance(combine_quant, str) or combine_quant not in COMBINE_QUANTS:
        raise ValueError(f"combine_quant={combine_quant!r}: must be one of {', '.join(COMBINE_QUANTS)}")
    topk = None
    for r in range(world):
        x = check_tensor(f"xs[rank {r}]", xs[r], dtype=torch.bfloat16, dim=2)
        wt = check_tensor(f"topk_weights[rank {r}]", topk_weights[r], dtype=torch.float32, dim=2)
        ids = check_tensor(f"topk_ids[rank {r}]", topk_ids[r], dtype=torch.int32, dim=2)
        topk = wt.shape[1] if topk is None else topk
        if x.shape[1] != w0.hidden or x.device != w0.device:
            raise ValueError(f"xs[rank {r}]: shape {tuple(x.shape)} on {x.device} must be [T, H={w0.hidden}] on "
                             f"the weights' device {w0.device}")
        for name, t in ((f"topk_weights[rank {r}]", wt), (f"topk_ids[rank {r}]", ids)):
            if tuple(t.shape) != (x.shape[0], topk) or t.device != x.device:
                raise ValueError(f"{name}: shape {tuple(t.shape)} on {t.device} must be [T, K] = "
                                 f"{[x.shape[0], topk]} on {x.device} (T of xs[rank {r}], K of rank 0)")
        bad = (ids != -1) & ((ids < 0) | (ids >= world * w0.num_experts))
        if bool(bad.any()):
            t, k = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"topk_ids[rank {r}][token {t}, slot {k}]={int(ids[t, k])}: expert ids must be -1 or "
                             f"in [0, {world * w0.num_experts})")
    return world, topk


def dense_moe(xs: list[torch.Tensor], topk_weights: list[torch.Tensor], topk_ids: list[torch.Tensor],
              weights: list[ExpertWeights], *, combine_quant: str = "none", fp8_flavour: str = "e4m3fn"):
    """The MoE layer with every expert in one process, and a bound on its distance to the layer.

    Semantics (the weighted combine of the expert-major layout; W = len(weights) ranks, L local
    experts per rank, expert e on rank e // L): token t of rank r with ids k -> e_k and weights
    w_k. For each distinct valid expert e of the token, w_e = the float32 sum of the weights of
    the slots naming e in ascending slot order, and y_e = expert e's SwiGLU output with the
    rounding points of ``swiglu_experts``. On each destination rank d the token reached:
    F_d = bf16(acc), acc = 0.0 (float32), then for each distinct expert of rank d in ascending
    first-slot order acc = acc + (w_e * float32(y_e)) (product and sum each rounded to float32);
    G_d = ``epgen.quant.combine_roundtrip(combine_quant, F_d, fp8_flavour=fp8_flavour)``; out =
    bf16 of the float32 sum of G_d in ascending d. A token with no valid expert gets zeros. The
    GEMMs run as float32 GEMMs of the bf16 operands (exact products, float32 accumulation) on the
    inputs' device.

    Bound. Notation: v* is the exact (real-number) value of an intermediate from exact inputs, v_C
    what a computation C following the rounding points above produces (C = the layer, any path,
    any accumulation order, or this function), v_D this function's value, u = 2^-8 (bf16 unit
    roundoff), eta = 2^-134 (bf16 subnormal rounding), gamma_n = n eps / (1 - n eps) with
    eps = 2^-23 (n float32 accumulation steps in any order, round-to-nearest or truncating,
    relative to the sum of the terms' magnitudes). Every step is either a rounding
    v = bf16(p) or exact. For a rounding step whose float32 input satisfies |p_C - v*| <= e_v:
    |v_C - v*| <= u |p_C| + eta + e_v <= u (|v*| + e_v) + eta + e_v, and |v*| <= |v_D| + E_v since
    D is one such computation; solving gives

        E_v = (u |v_D| + (1 + u) e_v + eta) / (1 - u),     |v_C - v*| <= E_v for every C,

    and |v_C| <= |v_D| + 2 E_v. The e_v of each step (per row and element; |W| element-wise,
    @ a matrix product):

        gate   g = bf16(x @ Wg):   e_g = gamma_H (|x| @ |Wg|)
        up     v = bf16(x @ Wu):   e_v = gamma_H (|x| @ |Wu|)
        silu   s = bf16(silu_32(g)): e_s = m1 E_g + c (|silu(g_D)| + 2 m1 E_g) + c_abs, where
               m1 = min(|silu'(g_D)| + E_g, 1.1) bounds |silu'| between g*, g_C and g_D (all
               within 2 E_g of g_D; |silu''| <= 0.5, |silu'| <= 1.0998), c = 2^-20 the float32
               silu's relative error and c_abs = 2^-118 its absolute error where exp overflows
        gated  h = bf16(s v):      e_h = E_s (|v_D| + 2 E_v) + (|s_D| + E_s) E_v   (s v is exact
               in float32)
        down   y = bf16(h @ Wd):   e_y = E_h @ |Wd| + gamma_I ((|h_D| + 2 E_h) @ |Wd|)
        fold   F_d = bf16(acc):    e_F = sum_e |w_e| E_y,e + gamma_2K sum_e |w_e| (|y_D,e| + 2 E_y,e)
               (at most 2K - 1 float32 roundings: products and sums; w_e is the same float32
               number in every computation)
        wire   G_d:                E_G = E_F + wb(|F_D| + 2 E_F) + 2^-80, where wb =
               ``epgen.quant.combine_error_bound`` of combine_quant in fp8_flavour, which grows
               with |F| and with the block amax, so wb(|F_D| + 2 E_F) >= wb(F_C) (for the
               saturating cast, whose bound drops past the fp8 maximum, 448 or 240, the larger of
               wb at the envelope and at the envelope clamped to it); the 2^-80 covers blocks
               below 2^-80 sent as zeros. For "none" E_G = E_F (the wire is the identity).
               |G_C - F*| <= |G_C - F_C| + |F_C - F*|.
        out    out = bf16(sum_d G_d): e_out = sum_d E_G,d + gamma_W sum_d (|F_D,d| + E_F,d + E_G,d)

    Finally |out_layer - out_D| <= |out_layer - out*| + |out_D - out*| <= 2 E_out: the returned
    bound. Nothing is dropped as second order; the assumptions are the rounding model above
    (products of bf16 numbers exact in float32, float32 accumulation, round-to-nearest bf16
    outputs, no overflow), which holds for torch's CPU GEMMs, the CUTLASS kernel of
    ``torch._grouped_mm`` and cuBLAS bf16 GEMMs with
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False`` (allowed, a
    split-K GEMM may round partial sums to bf16, which the model does not cover).

    Size: the dominant term is E_h @ |Wd|, about 3-4 u (|h| @ |Wd|), and |h| @ |Wd| exceeds |y|
    by about sqrt(I) for random weights (the magnitude GEMM cannot cancel): at I = 128 the bound
    is near 0.2 of an expert output's magnitude, tight enough to expose a missing expert or a
    wrong weight (tests/runtime/layers/test_moe.py); it loosens as sqrt(I).

    Args:
        xs: per rank r, [T_r, H] bfloat16 tokens (T_r may be 0).
        topk_weights: per rank, [T_r, K] float32.
        topk_ids: per rank, [T_r, K] int32 in [0, W * L) or -1 (no expert); duplicates allowed.
        weights: per rank d, its ExpertWeights (L, H, I and device the same on every rank).
        combine_quant: the combine wire (``epgen.codegen.dtypes.COMBINE_QUANTS``).
        fp8_flavour: the fp8 flavour of an fp8 wire's codes, the layer's arch's
            (``epgen.quant.arch_fp8_flavour``; "e4m3fnuz" on gfx942); default "e4m3fn".

    Returns:
        (outs, bounds): per rank r, out [T_r, H] bfloat16 and bound [T_r, H] float64 with
        |layer out - out| <= bound element-wise.

    Raises:
        TypeError: a weights entry not an ExpertWeights, a tensor argument not a tensor.
        ValueError: list lengths differ from W; shapes, dtypes or devices inconsistent (naming
            the argument and rank); an expert id neither -1 nor in [0, W * L) (naming rank, token,
            slot and value); an unknown combine_quant or fp8_flavour; float32 matmul precision not
            'highest'.
    """
    world, topk = _check_dense_inputs(xs, topk_weights, topk_ids, weights, combine_quant)
    fp8_flavour_row(fp8_flavour, "fp8_flavour")
    _check_fp32_matmul_precision()
    L, H = weights[0].num_experts, weights[0].hidden
    device = weights[0].device
    sizes = [x.shape[0] for x in xs]
    x = torch.cat(list(xs))
    wt = torch.cat(list(topk_weights))
    ids = torch.cat(list(topk_ids)).long()
    n = x.shape[0]

    valid = ids >= 0
    first = valid.clone()
    merged = torch.zeros_like(wt)
    for k in range(topk):
        for j in range(k):
            first[:, k] &= ids[:, j] != ids[:, k]
        acc = torch.zeros(n, dtype=torch.float32, device=device)
        for j in range(topk):  # ascending slot order; adding 0.0 leaves a float32 sum unchanged
            acc = acc + torch.where(ids[:, j] == ids[:, k], wt[:, j], 0.0)
        merged[:, k] = torch.where(first[:, k], acc, 0.0)

    y = torch.zeros(n, topk, H, dtype=torch.bfloat16, device=device)
    E_y = torch.zeros(n, topk, H, dtype=torch.float64, device=device)
    for e in range(world * L):
        rows, slots = (first & (ids == e)).nonzero(as_tuple=True)
        if rows.numel():
            w = weights[e // L]
            y[rows, slots], E_y[rows, slots] = _swiglu_rows(x[rows], w.gate[e % L], w.up[e % L], w.down[e % L])

    dest = torch.where(valid, ids // L, -1)
    total = torch.zeros(n, H, dtype=torch.float32, device=device)
    e_out = torch.zeros(n, H, dtype=torch.float64, device=device)
    mag_out = torch.zeros(n, H, dtype=torch.float64, device=device)
    for d in range(world):
        acc = torch.zeros(n, H, dtype=torch.float32, device=device)
        e_fold = torch.zeros(n, H, dtype=torch.float64, device=device)
        mag = torch.zeros(n, H, dtype=torch.float64, device=device)
        reached = torch.zeros(n, 1, dtype=torch.bool, device=device)
        for k in range(topk):  # ascending first slot
            sel = (first[:, k] & (dest[:, k] == d))[:, None]
            acc = acc + torch.where(sel, merged[:, k, None] * y[:, k].float(), 0.0)
            wa = merged[:, k, None].double().abs()
            e_fold += torch.where(sel, wa * E_y[:, k], 0.0)
            mag += torch.where(sel, wa * (y[:, k].double().abs() + 2 * E_y[:, k]), 0.0)
            reached |= sel
        F = acc.to(torch.bfloat16)
        E_F = _round_bound(F, e_fold + _gamma(2 * topk) * mag)
        G = combine_roundtrip(combine_quant, F, fp8_flavour=fp8_flavour)
        E_G = E_F
        if combine_quant != "none":
            E_G = E_F + _wire_bound(combine_quant, F.double().abs() + 2 * E_F, fp8_flavour) + FOLD_ZERO_BLOCK
        total = total + torch.where(reached, G, 0.0)
        e_out += torch.where(reached, E_G, 0.0)
        mag_out += torch.where(reached, F.double().abs() + E_F + E_G, 0.0)
    out = total.to(torch.bfloat16)
    bound = 2 * _round_bound(out, e_out + _gamma(world) * mag_out)
    outs, bounds, start = [], [], 0
    for t in sizes:
        outs.append(out[start:start + t].clone())
        bounds.append(bound[start:start + t].clone())
        start += t
    return outs, bounds


def _swiglu64(x, gate, up, down):
    """One expert in float64 without rounding: y = (silu(x @ gate) * (x @ up)) @ down."""
    return (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down


def _round(v_exact: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """E_v = u |v*| + (1 + u) e + eta: |v_C - v*| <= E_v for a rounding v = bf16(p) whose float32
    input is within e of the exact v* (``moe_gradients``)."""
    return U_BF16 * v_exact.abs() + (1 + U_BF16) * e + ETA_BF16


def moe_gradients(xs: list[torch.Tensor], topk_weights: list[torch.Tensor], topk_ids: list[torch.Tensor],
                  weights: list[ExpertWeights], probes: list[torch.Tensor]):
    """The layer's gradients from a dense float64 autograd reference, and bounds on how far the
    layer's bf16 backward may be from them.

    The loss is L = sum over ranks r and tokens t of <out_r[t], probes_r[t]>. The reference is the
    layer (semantics of ``dense_moe``) in float64 with no rounding at all: out[t] = sum over the
    token's distinct valid experts e of w_e y_e(x_t), w_e the sum of the slot weights naming e,
    y_e = (silu(x Wg_e) (x Wu_e)) Wd_e; its gradients by ``torch.autograd`` in float64: exact up to
    float64 rounding (about 2^-50 relative, neglected against the bf16 terms).

    Bound, element-wise, by first-order-free propagation as in ``dense_moe`` (every step a
    rounding v = bf16(p) or exact; for a rounding with |p_C - v*| <= e: |v_C - v*| <= E_v =
    u |v*| + (1 + u) e + eta, u = 2^-8, eta = 2^-134; gamma_n float32 accumulation; v* exact, taken
    from the float64 reference; |v_C| <= |v*| + E_v). The layer's backward, per expanded row p of
    (token t, expert e), with g = probes[t] (bf16: the combine's backward moves it exactly):

        forward     E_g, E_v, E_s, E_h, E_y as ``dense_moe`` (with |v*| for |v_D|)
        weight      w_p = float32 sum of the slots' weights: e_w = gamma_K sum |w_k|
        grad y      gy = bf16(float32(w_p g)):       e = |g| e_w + 2^-24 |w g|
        grad h      gh = bf16(gy @ Wd^T):            e = E_gy @ |Wd^T| + gamma_H (|gy| + E_gy) @ |Wd^T|
        grad Wd     bf16(h^T @ gy) over the rows of e: e = E_h^T @ (|gy| + E_gy) + |h|^T @ E_gy
                                                        + gamma_n (|h| + E_h)^T @ (|gy| + E_gy)
        grad s, v   gs = bf16(gh v), gv = bf16(gh s): e = E_gh (|v| + E_v) + |gh| E_v (and s for v)
        grad g      gg = bf16(silu'_32(g) gs):        e = m1 E_gs + (|gs| + E_gs)(E_g / 2 + c m1), m1 =
                    min(|silu'(g*)| + E_g / 2, 1.1) (|silu''| <= 1/2; c = 2^-20 the float32 evaluation)
        grad Wg, Wu bf16(x^T @ gg), bf16(x^T @ gv): e = |x|^T @ E + gamma_n |x|^T @ (|.| + E)
        grad x row  bf16(bf16(gg @ Wg^T) + bf16(gv @ Wu^T)): each product as grad h, then the sum
        grad x      per rank bf16(sum of its rows, float32), then bf16(sum over ranks, float32):
                    e = sum E + gamma_2K (or gamma_W) sum (|.| + E)
        grad w_k    float32 <y_p, g> (y the forward's bf16 output; exact transport):
                    e = E_y @ |g| + gamma_H (|y| + E_y) @ |g|

    Nothing is dropped; the model assumes products of bf16 numbers exact in float32 and float32
    accumulation in every GEMM of the backward (torch's CPU GEMMs and ``torch._grouped_mm``; on
    CUDA with ``allow_bf16_reduced_precision_reduction = False``).

    Args:
        xs, topk_weights, topk_ids, weights: as ``dense_moe``.
        probes: per rank r, [T_r, H] bfloat16, the loss's gradient with respect to out.

    Returns:
        (grads, bounds), each a dict: "x" and "topk_weights" (per rank, [T_r, H] and [T_r, K]
        float64), "gate", "up", "down" (per rank, [L, H, I], [L, H, I], [L, I, H] float64).

    Raises:
        TypeError, ValueError: as ``dense_moe``; a probe not [T_r, H] bfloat16 (naming its rank).
    """
    world, topk = _check_dense_inputs(xs, topk_weights, topk_ids, weights, "none")
    for r, (p, x) in enumerate(zip(probes, xs)):
        check_tensor(f"probes[rank {r}]", p, dim=2, dtype=torch.bfloat16)
        if p.shape != x.shape:
            raise ValueError(f"probes[rank {r}]: shape {tuple(p.shape)} must be xs[rank {r}]'s {tuple(x.shape)}")
    L, H, I = weights[0].num_experts, weights[0].hidden, weights[0].intermediate
    f64 = torch.float64
    sizes = [x.shape[0] for x in xs]
    x = torch.cat(list(xs)).to(f64).requires_grad_()
    wt32 = torch.cat(list(topk_weights))
    wt = wt32.to(f64).requires_grad_()
    ids = torch.cat(list(topk_ids)).long()
    P = torch.cat(list(probes)).to(f64)
    n = x.shape[0]
    params = [[getattr(w, name).to(f64).requires_grad_() for name in ("gate", "up", "down")] for w in weights]
    first = ids >= 0
    for k in range(topk):
        for j in range(k):
            first[:, k] &= ids[:, j] != ids[:, k]

    # the dense float64 reference and its gradients by autograd
    out = torch.zeros(n, H, dtype=f64)
    for e in range(world * L):
        rows, slots = (first & (ids == e)).nonzero(as_tuple=True)
        if rows.numel():
            gate, up, down = (t[e % L] for t in params[e // L])
            w_e = (wt[rows] * (ids[rows] == e)).sum(dim=1)
            out = out.index_add(0, rows, w_e[:, None] * _swiglu64(x[rows], gate, up, down))
    flat = [x, wt] + [t for p in params for t in p]
    got = torch.autograd.grad((out * P).sum(), flat, allow_unused=True)
    got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, flat)]

    # the bounds
    gam = _gamma
    E_x_rank = torch.zeros(world, n, H, dtype=f64)  # per destination rank: e of the fold's input
    mag_x_rank = torch.zeros(world, n, H, dtype=f64)
    E_wt = torch.zeros(n, topk, dtype=f64)
    E_par = [[torch.zeros_like(t) for t in p] for p in params]
    with torch.no_grad():
        xd = x.detach()
        for e in range(world * L):
            rows, slots = (first & (ids == e)).nonzero(as_tuple=True)
            if not rows.numel():
                continue
            d, le = e // L, e % L
            Wg, Wu, Wd = (t.detach()[le] for t in params[d])
            X, g = xd[rows], P[rows]
            Xa = X.abs()
            # forward, exact values and bounds
            gs_ = X @ Wg
            vs_ = X @ Wu
            E_g = _round(gs_, gam(H) * (Xa @ Wg.abs()))
            E_v = _round(vs_, gam(H) * (Xa @ Wu.abs()))
            sig = torch.sigmoid(gs_)
            s_ = gs_ * sig
            d1 = sig * (1 + gs_ * (1 - sig))  # silu'
            m1 = (d1.abs() + E_g).clamp(max=SILU_SLOPE_MAX)
            E_s = _round(s_, m1 * E_g + SILU_REL * (s_.abs() + 2 * m1 * E_g) + SILU_ABS)
            h_ = s_ * vs_
            E_h = _round(h_, E_s * (vs_.abs() + E_v) + (s_.abs() + E_s) * E_v)
            y_ = h_ @ Wd
            E_y = _round(y_, E_h @ Wd.abs() + gam(I) * ((h_.abs() + E_h) @ Wd.abs()))
            # backward
            naming = (ids[rows] == e)
            w_ = (wt.detach()[rows] * naming).sum(dim=1, keepdim=True)
            e_w = gam(topk) * (wt.detach()[rows].abs() * naming).sum(dim=1, keepdim=True)
            gy_ = w_ * g
            E_gy = _round(gy_, g.abs() * e_w + 2.0**-24 * gy_.abs())
            gh_ = gy_ @ Wd.T
            E_gh = _round(gh_, E_gy @ Wd.abs().T + gam(H) * ((gy_.abs() + E_gy) @ Wd.abs().T))
            nrow = rows.numel()
            gd_ = h_.T @ gy_
            E_par[d][2][le] = _round(gd_, E_h.T @ (gy_.abs() + E_gy) + h_.abs().T @ E_gy
                                     + gam(nrow) * ((h_.abs() + E_h).T @ (gy_.abs() + E_gy)))
            gs2 = gh_ * vs_
            E_gs = _round(gs2, E_gh * (vs_.abs() + E_v) + gh_.abs() * E_v)
            gv_ = gh_ * s_
            E_gv = _round(gv_, E_gh * (s_.abs() + E_s) + gh_.abs() * E_s)
            gg_ = d1 * gs2
            m1b = (d1.abs() + E_g / 2).clamp(max=SILU_SLOPE_MAX)
            E_gg = _round(gg_, m1b * E_gs + (gs2.abs() + E_gs) * (E_g / 2 + SILU_REL * m1b))
            E_par[d][0][le] = _round(X.T @ gg_, Xa.T @ E_gg + gam(nrow) * (Xa.T @ (gg_.abs() + E_gg)))
            E_par[d][1][le] = _round(X.T @ gv_, Xa.T @ E_gv + gam(nrow) * (Xa.T @ (gv_.abs() + E_gv)))
            a_, b_ = gg_ @ Wg.T, gv_ @ Wu.T
            E_a = _round(a_, E_gg @ Wg.abs().T + gam(I) * ((gg_.abs() + E_gg) @ Wg.abs().T))
            E_b = _round(b_, E_gv @ Wu.abs().T + gam(I) * ((gv_.abs() + E_gv) @ Wu.abs().T))
            gx_ = a_ + b_
            E_gx = _round(gx_, E_a + E_b)
            E_x_rank[d].index_add_(0, rows, E_gx)
            mag_x_rank[d].index_add_(0, rows, gx_.abs() + E_gx)
            E_gw = (E_y * g.abs()).sum(1) + gam(H) * ((y_.abs() + E_y) * g.abs()).sum(1)
            E_wt[rows] += torch.where(naming, E_gw[:, None], 0.0)
        # grad x: the fold per rank, then the sum over ranks
        e_out = torch.zeros(n, H, dtype=f64)
        mag_out = torch.zeros(n, H, dtype=f64)
        for d in range(world):
            F_ = mag_x_rank[d] - E_x_rank[d]  # an upper bound of sum |gx_p|: the fold's exact input magnitude
            E_F = _round(F_, E_x_rank[d] + gam(2 * topk) * mag_x_rank[d])
            e_out += E_F
            mag_out += F_ + E_F
        E_x = _round(got[0], e_out + gam(world) * mag_out)

    def per_rank(t):
        return list(torch.split(t.detach(), sizes))

    grads = {"x": per_rank(got[0]), "topk_weights": per_rank(got[1])}
    bounds = {"x": per_rank(E_x), "topk_weights": per_rank(E_wt)}
    for i, name in enumerate(("gate", "up", "down")):
        grads[name] = [got[2 + 3 * d + i] for d in range(world)]
        bounds[name] = [E_par[d][i] for d in range(world)]
    return grads, bounds


# --- routing -------------------------------------------------------------------------------------


def route_topk(logits: torch.Tensor, k: int, *, renormalize: bool = True):
    """Softmax top-k router: the layer's (topk_weights, topk_ids) from router logits.

    A logit of -inf masks its expert (probability 0, never selected); every row needs at least k
    experts above -inf. NaN and +inf are refused (softmax would turn the whole row into NaN
    weights). Checking reads one flag to the host (a synchronization).

    Args:
        logits: [T, E] floating (any float dtype; the softmax runs in float32), each entry finite
            or -inf.
        k: experts per token, 1 <= k <= E.
        renormalize: divide the k selected probabilities by their sum (they then sum to 1);
            False keeps the softmax probabilities.

    Returns:
        (weights [T, k] float32, ids [T, k] int32): the k largest probabilities of each row in
        descending order and their expert ids (distinct within a row, none of them masked; which
        of two equal probabilities wins is torch.topk's choice).

    Raises:
        TypeError: logits not a tensor; renormalize not True or False.
        ValueError: logits not 2-D floating, or k not an int in [1, E]; a NaN or +inf logit
            (naming the first such row and expert); a row with fewer than k experts above -inf,
            an all -inf row included (naming the first such row).
    """
    check_tensor("logits", logits)
    _check_bool("renormalize", renormalize)
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits: shape {tuple(logits.shape)} {logits.dtype} must be [T, E] floating")
    experts = logits.shape[1]
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not 1 <= k <= experts:
        raise ValueError(f"k={k!r}: must be an int in [1, E={experts}]")
    k = int(k)
    refused = torch.isnan(logits) | (logits == float("inf"))  # [T, E]
    live = (logits > float("-inf")).sum(dim=-1)  # [T]: experts not masked
    short = live < k
    if bool(refused.any() | short.any()):  # the one host synchronization
        bad_row = refused.any(dim=-1)
        first = int((bad_row | short).nonzero()[0])
        if bool(bad_row[first]):
            e = int(refused[first].nonzero()[0])
            raise ValueError(f"logits[{first}, {e}]={float(logits[first, e])}: router logits must be finite or -inf "
                             "(a masked expert)")
        raise ValueError(f"logits[{first}]: {int(live[first])} of E={experts} experts above -inf, fewer than k={k}: "
                         "the row has no top-k (-inf masks an expert)")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# --- the layer -----------------------------------------------------------------------------------


class MoELayer(torch.nn.Module):
    """An expert-parallel MoE layer: dispatch (expert-major layout), SwiGLU experts, weighted combine.

    Modes follow ``EpDispatchCombine``: one process per GPU (``weights`` is this rank's
    ExpertWeights, inputs and outputs are tensors); ``virtual=True`` (all W ranks in this process,
    ``weights`` a list of W ExpertWeights, inputs and outputs lists with one entry per rank);
    W = 1 (one rank).

    Stages, callable one by one (e.g. to time them): ``dispatch(x, topk_weights, topk_ids)`` ->
    ``experts(dispatched)`` -> ``combine(y)``; ``forward`` runs the three. With the grouped
    expert path, ``forward`` synchronizes nothing and can be captured in a CUDA graph after one
    eager call (the op's rule); the loop path reads the group offsets to the host once per rank.

    Args:
        config: an EpConfig with layout="expert" and dtype="bf16" (the experts read bf16 rows).
        weights: ExpertWeights of each rank this process drives, L = config.experts_per_rank
            local experts of H = config.hidden, bfloat16, on the op's device, one intermediate
            size I for all of them (one process per GPU: each process checks only its own).
        virtual, device: as ``EpDispatchCombine``; with ``op`` given, virtual must be the op's
            mode and device None or the op's device index.
        grouped_mm: the expert path (``swiglu_experts``'s ``grouped``), fixed at construction:
            None = grouped where available, True = grouped (refused where it cannot run), False =
            loop.
        op: an already built op with EpDispatchCombine's interface (config, local_ranks, virtual,
            device, dispatch, combine_input, combine) to run instead of building one; its config
            must equal ``config``.

    Attributes:
        op: the EpDispatchCombine (or the op given).
        ranks: the ranks this process drives (``op.local_ranks``).
        weights: their ExpertWeights, in the order of ``ranks``.
        grouped_mm: True when the experts run the grouped path, False for the loop.

    Raises:
        TypeError: config not an EpConfig; a weights entry not an ExpertWeights; grouped_mm not
            None, True or False; virtual not a bool.
        ValueError: config.layout not "expert" or config.dtype not "bf16"; weights not one per
            local rank, or an entry's L, H not the config's, or its I or device not weights[0]'s
            (naming the entry); grouped_mm=True where the grouped path cannot run; an op given
            whose config differs from config, whose virtual differs from virtual, or whose device
            is not cuda:device. All of these are raised before an op is built; the weights on
            another device than the op's is raised after, and an op built here is closed first.
        RuntimeError: as ``EpDispatchCombine`` (no GPU, no process group).
    """

    def __init__(self, config: EpConfig, weights, *, virtual: bool = False, device: int | None = None,
                 grouped_mm: bool | None = None, op=None):
        super().__init__()
        if not isinstance(config, EpConfig):
            raise TypeError(f"config: expected an EpConfig, got {type(config).__name__}")
        if config.layout != "expert":
            raise ValueError(f"config.layout={config.layout!r}: MoELayer needs EpConfig(layout='expert') (its "
                             "experts read the expert-major rows of dispatch)")
        if config.dtype != "bf16":
            raise ValueError(f"config.dtype={config.dtype!r}: MoELayer's experts read bf16 rows; use dtype='bf16'")
        _check_flag("grouped_mm", grouped_mm)
        if not isinstance(virtual, bool):
            raise TypeError(f"virtual={virtual!r}: must be True or False")
        if op is not None:
            if op.config != config:
                raise ValueError(f"op.config={op.config!r}: must equal config={config!r}")
            if op.virtual != virtual:
                raise ValueError(f"virtual={virtual}: the op given was built with virtual={op.virtual}; pass its mode")
            if device is not None and op.device != torch.device("cuda", device):
                raise ValueError(f"device={device!r}: the op given runs on {op.device}")
        ws = list(weights) if isinstance(weights, (list, tuple)) else [weights]
        for i, w in enumerate(ws):
            if not isinstance(w, ExpertWeights):
                raise TypeError(f"weights[{i}]: must be an ExpertWeights, got {type(w).__name__}")
            if (w.num_experts, w.hidden) != (config.experts_per_rank, config.hidden):
                raise ValueError(f"weights[{i}]: L={w.num_experts}, H={w.hidden} must be the config's "
                                 f"experts_per_rank={config.experts_per_rank}, hidden={config.hidden}")
            if w.intermediate != ws[0].intermediate:
                raise ValueError(f"weights[{i}]: I={w.intermediate} must equal weights[0]'s I={ws[0].intermediate} "
                                 "(every rank's experts have one intermediate size)")
            if w.device != ws[0].device:
                raise ValueError(f"weights[{i}]: on {w.device}, must be on weights[0]'s device {ws[0].device}")
        # the op drives every rank in virtual mode, else one (EpDispatchCombine.local_ranks)
        count = len(op.local_ranks) if op is not None else config.world_size if virtual else 1
        if len(ws) != count:
            want = f"a list of {count} (one per virtual rank)" if virtual else "one (this process's rank)"
            raise ValueError(f"weights: {len(ws)} ExpertWeights given, this process drives {count} "
                             f"rank{'s' if count > 1 else ''}: pass {want}")
        probe = torch.empty(0, config.hidden, dtype=torch.bfloat16, device=ws[0].device)
        refusals = [(i, _grouped_refusal(probe, w, None)) for i, w in enumerate(ws)]
        refused = [(i, why) for i, why in refusals if why is not None]
        if grouped_mm and refused:
            raise ValueError(f"grouped_mm=True (weights[{refused[0][0]}]): {refused[0][1]}")
        if grouped_mm is None:
            grouped_mm = not refused
        built = op is None
        if built:  # every check above runs before the op compiles its kernels and allocates its arenas
            from epgen.op import EpDispatchCombine

            op = EpDispatchCombine(config, virtual=virtual, device=device)
        if ws[0].device != op.device:  # the device an op built here picked (device=None: the current one)
            if built:
                op.close()
            raise ValueError(f"weights: on {ws[0].device}, must be on the op's device {op.device}")
        ranks = list(op.local_ranks)
        self.op = op
        self.config = config
        self.ranks = ranks
        self.weights = ws
        self.grouped_mm = bool(grouped_mm)

    def dispatch(self, x, topk_weights, topk_ids, family=None):
        """``op.dispatch``: x [T, H] bf16, topk_weights [T, K] float32, topk_ids [T, K] int32 (lists
        in virtual mode), ``family`` as the op's (the same on every rank) -> the op's
        ExpertDispatchOutput (a list in virtual mode)."""
        return self.op.dispatch(x, topk_weights, topk_ids, family=family)

    def experts(self, dispatched):
        """Run each rank's experts on its dispatched rows.

        The expert layout's combine reads y in place (any 16-byte aligned [n, H] bf16 tensor), so
        neither path copies: the grouped path returns the tensor ``torch._grouped_mm`` allocated
        (it has no output argument), the loop writes into ``op.combine_input(rank)``.

        Args:
            dispatched: what ``dispatch`` returned (per rank: ``x`` [R, H] bf16, ``offsets`` [L + 1]
                int32).

        Returns:
            y [R, H] bf16 per rank (a list in virtual mode); rows >= offsets[L] undefined.

        Raises:
            ValueError: not one entry per rank this process drives; as ``swiglu_experts``.
        """
        outs = list(dispatched) if self.op.virtual else [dispatched]
        if len(outs) != len(self.ranks):
            raise ValueError(f"dispatched: {len(outs)} entries, this process drives ranks {self.ranks}")
        ys = []
        for rank, w, d in zip(self.ranks, self.weights, outs):
            if self.grouped_mm:  # torch._grouped_mm allocates its output: combine reads it in place
                ys.append(swiglu_experts(d.x, d.offsets, w, grouped=True, offsets_checked=True))
            else:
                buf = self.op.combine_input(rank)[: d.x.shape[0]]
                ys.append(swiglu_experts(d.x, d.offsets, w, grouped=False, out=buf))
        return ys if self.op.virtual else ys[0]

    def combine(self, y):
        """``op.combine``: the weighted fold, the wire and the cross-rank sum -> out [T, H] bf16
        (a list in virtual mode)."""
        return self.op.combine(y)

    def forward(self, x, topk_weights, topk_ids, family=None):
        """dispatch, experts, combine: out [T, H] bf16 per rank (a list in virtual mode).

        Under autograd (grad mode on, and x, topk_weights or an expert weight requiring grad) the
        three stages are differentiable (``epgen.autograd``: the backward runs the op's kernels
        along the dispatch's kept layout; the op needs ``EpConfig(dispatch_transport="pull")``):
        gradients reach x, topk_weights and every ExpertWeights tensor that requires grad.

        Args:
            x: [T, H] bf16 tokens, T <= config.max_tokens_per_rank.
            topk_weights: [T, K] float32 routing weights (e.g. ``route_topk``).
            topk_ids: [T, K] int32 expert ids in [0, E) or -1.
            family: the call's kernel family, the same on every rank (``EpDispatchCombine.dispatch``:
                needed with one process a rank of W > 1 and kernel_family "auto").
        (Lists with one entry per rank in virtual mode.)

        Raises:
            As ``EpDispatchCombine.dispatch`` / ``combine`` and ``swiglu_experts``.
        """
        xs, ws = (list(v) if self.op.virtual else [v] for v in (x, topk_weights))
        tensors = xs + ws + [t for w in self.weights for t in (w.gate, w.up, w.down)]
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            d = autograd.dispatch(self.op, x, topk_weights, topk_ids, family=family)
            rows = list(d.x) if self.op.virtual else [d.x]
            offsets = list(d.offsets) if self.op.virtual else [d.offsets]
            ys = [swiglu_experts(r, o, w, grouped=self.grouped_mm) for r, o, w in zip(rows, offsets, self.weights)]
            return autograd.combine(self.op, ys if self.op.virtual else ys[0], d)
        return self.combine(self.experts(self.dispatch(x, topk_weights, topk_ids, family)))

    def close(self):
        """Release the op (``EpDispatchCombine.close``)."""
        self.op.close()
