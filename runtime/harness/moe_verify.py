"""The MoE layer's measured inputs and its check against the dense reference, shared by
``epgen demo --moe`` and ``tools/bench_moe.py``: the expert-major config of a catalogue model, one
rank's fresh routed inputs, and the worst error of a layer's outputs relative to
``epgen.layers.moe.dense_moe``'s per-element bound.
"""

from __future__ import annotations

import torch

from epgen.codegen.catalogue import CATALOGUE_EXPERT_LAYOUT
from epgen.codegen.config import EpConfig
from epgen.codegen.models import MODELS

EXPERT_ALIGNMENT = CATALOGUE_EXPERT_LAYOUT[1]
"""Expert group alignment of the measured layer: the catalogue's (what torch's grouped GEMM reads best)."""

DENSE_CHUNK_TOKENS = 4096
"""Tokens (all ranks together) per call of the dense reference: bounds its temporaries."""


def moe_config(model: str, world_size: int, tokens: int, experts: int | None = None) -> EpConfig:
    """The expert-major EpConfig of ``model`` (a catalogue name) with W = ``world_size``, Tmax =
    ``tokens``, E = ``experts`` (default the model's) and groups aligned to EXPERT_ALIGNMENT rows.

    Raises:
        epgen.codegen.errors.FieldError: a field breaks its rule (``.field`` names it), e.g.
            num_experts not a multiple of world_size, or topk above num_experts.
    """
    m = MODELS[model]
    return EpConfig(world_size=world_size, hidden=m.hidden, topk=m.topk,
                    num_experts=m.num_experts if experts is None else experts, max_tokens_per_rank=tokens,
                    layout="expert", expert_alignment=EXPERT_ALIGNMENT)


def error_ratio(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[float, float]:
    """(worst |out - ref| / bound, worst |out - ref|) over the elements, in float64 (``dense_moe``'s
    bounds are float64); an element with bound 0 counts 0 when exact, inf otherwise."""
    err = (out.double() - ref.double()).abs()
    ratio = torch.where(bound > 0, err / bound.clamp(min=torch.finfo(torch.float64).tiny),
                        torch.where(err > 0, float("inf"), 0.0))
    return (float(ratio.max()), float(err.max())) if err.numel() else (0.0, 0.0)


def rank_inputs(cfg: EpConfig, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's fresh layer inputs on ``gen``'s device: x [tokens, H] bf16 normal samples, and
    (weights float32, ids int32) [tokens, K] from ``route_topk`` on normal logits [tokens, E]."""
    from epgen.layers.moe import route_topk

    x = torch.randn(tokens, cfg.hidden, generator=gen, device=gen.device).to(torch.bfloat16)
    w, ids = route_topk(torch.randn(tokens, cfg.num_experts, generator=gen, device=gen.device), cfg.topk)
    return x, w, ids


def dense_error(outs: list, xs: list, ws: list, ids: list, weights: list, combine_quant: str, *,
                fp8_flavour: str = "e4m3fn") -> tuple[float, float]:
    """(worst error / bound ratio, worst error) of the per-rank outputs ``outs`` against
    ``epgen.layers.moe.dense_moe`` of the per-rank inputs (one entry per rank; a rank's entry may hold 0
    tokens, then it costs nothing), computed DENSE_CHUNK_TOKENS tokens at a time (every rank's
    tokens of a chunk together); ``weights`` is every rank's ExpertWeights; an fp8 wire in
    ``fp8_flavour``, the layer's arch's (``epgen.quant.arch_fp8_flavour``)."""
    from epgen.layers.moe import dense_moe

    T = max(x.shape[0] for x in xs)
    step = max(1, DENSE_CHUNK_TOKENS // len(xs))
    worst_ratio = worst_err = 0.0
    for a in range(0, T, step):
        b = a + step
        refs, bounds = dense_moe([x[a:b] for x in xs], [w[a:b] for w in ws], [i[a:b] for i in ids], weights,
                                 combine_quant=combine_quant, fp8_flavour=fp8_flavour)
        for out, ref, bound in zip(outs, refs, bounds):
            ratio, err = error_ratio(out[a:b], ref, bound)
            worst_ratio, worst_err = max(worst_ratio, ratio), max(worst_err, err)
    return worst_ratio, worst_err
