"""Tiny random-weight transformers MoE models for the expert-parallel tests (CPU and GPU), and the
error measure their bound is stated in. No download: each model is built from a config.

Families: qwen3_moe (softmax top-k, renormalized), mixtral (softmax top-k), deepseek_v3 (sigmoid
scores with a correction bias, group-limited top-k, routed scaling, a shared expert, MLA
attention), gpt_oss (top-k then softmax, transposed interleaved gate/up with biases, clamped gate,
sliding-window layers). Two layers, H = 64, 8 routed experts, top-2 (I = 32), vocabulary 256;
initializer_range 0.1 so that the logits spread (std ~0.8) instead of sitting in near-ties.

The bound (``bf16_envelope``): an expert-parallel bf16 model and the model's own bf16 paths are
bf16 evaluations of the same function that share every rounding outside the experts' combine
(attention, norms, router, the expert GEMMs and gate: ``expert_rows`` runs the class's own
math). In the combine, each path rounds the same exact sum sum_k w_k y_k differently: the model's
eager path adds bf16 products into a bf16 accumulator (index_add_), grouped_mm / batched_mm sum
the products in float32 and round once, epgen folds per rank in float32, rounds per rank to bf16
and sums the ranks in float32. Each of these is within (K + 1) u sum |w_k y_k| of the exact sum (u
= 2^-8, K = top-k: at most K + 1 roundings), so the expert-parallel result at each layer differs
from the exact one by no more than the worst of the model's own paths plus one more rounding
error of the same size; the rest of the network propagates both alike. Hence |EP - fp32| <=
2 x max over the model's own bf16 implementations (eager, batched_mm, grouped_mm) of
|impl - fp32|, in relative L2 over the logits. The bound is stated in L2 and not element-wise
because a bf16 rounding can flip a near-tie in a router's top-k, which moves a few tokens' logits
by far more than a rounding; every bf16 path, the model's own included, has such flips. The
envelope and the error are taken on the same tokens, at least 224 of them: over a dozen tokens one
flip can dominate the L2 (an owned-token check of mixtral on 10-16 tokens a rank measured 0.145
against an envelope of 0.024 taken on other tokens). A lost expert or a wrong weight exceeds it (tests/runtime/test_transformers_ep.py).
"""

from __future__ import annotations

import copy

import torch
import transformers as tf

from epgen.reference import relative_l2

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.1)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                         moe_intermediate_size=32, intermediate_size=64, first_k_dense_replace=0, q_lora_rank=32,
                         kv_lora_rank=16, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         routed_scaling_factor=2.5)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8)),
}
EXPERTS = 8
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
"""The model's own experts implementations in transformers 5.17 and later."""


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's float32 model with random weights drawn from ``seed``, in eval mode; deepseek_v3's
    score-correction bias and gpt_oss's expert biases drawn non-zero (their initializers zero them)."""
    config_cls, model_cls, kw = FAMILIES[family]
    config = getattr(tf, config_cls)(**{**COMMON, **kw})
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(0.1 * torch.randn(module.e_score_correction_bias.shape, generator=g))
            if getattr(module, "has_bias", False):
                module.gate_up_proj_bias.copy_(0.5 * torch.randn(module.gate_up_proj_bias.shape, generator=g))
                module.down_proj_bias.copy_(0.1 * torch.randn(module.down_proj_bias.shape, generator=g))
    return model


def prompt(seed: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    """[batch, length] int64 token ids drawn from ``seed``."""
    return torch.randint(0, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids.to(model.device)).logits.float().cpu()


@torch.no_grad()
def bf16_envelope(model32: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(max relative L2 error of the model's own bf16 implementations against float32, the float32
    logits on the CPU). The model is copied for the bf16 runs."""
    ref = logits(model32, ids)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    errors = []
    for impl in IMPLEMENTATIONS:
        model16.set_experts_implementation(impl)
        errors.append(relative_l2(logits(model16, ids), ref))
    return max(errors), ref


def eager_bf16(model32: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of the model running its own eager experts (the reference of the generation checks)."""
    model = copy.deepcopy(model32).to(torch.bfloat16)
    model.set_experts_implementation("eager")
    return model


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, tokens: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of exactly ``tokens`` tokens (no end-of-sequence stop): (sequences
    [B, S + tokens], the logits of every generated step [tokens, B, V] float32), on the CPU."""
    out = model.generate(ids.to(model.device), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits).float().cpu()


def check_generation(ep: tuple, eager: tuple, envelope: float) -> str:
    """Greedy generation of the expert-parallel model (``ep``: ``greedy``'s pair) against the
    model's eager path (``eager``): identical, or the first differing token is a near-tie that the
    logits bound allows to flip. At that step both ran on the same context; the bound puts the EP
    logits row within relative L2 ``2 envelope`` of the eager row z, so any two logits move apart by
    at most sqrt(2) x 2 envelope ||z||: the eager gap between its token and the EP token must be
    within that margin, and the EP row within the bound. Returns "identical" or a description of
    the flip; AssertionError otherwise."""
    (ep_seq, ep_logits), (eager_seq, eager_logits) = ep, eager
    if torch.equal(ep_seq, eager_seq):
        return "identical"
    row, pos = (ep_seq != eager_seq).nonzero()[0].tolist()
    step = pos - (eager_seq.shape[1] - eager_logits.shape[0])
    z, z_ep = eager_logits[step, row], ep_logits[step, row]
    mine, theirs = int(eager_seq[row, pos]), int(ep_seq[row, pos])
    gap = float(z[mine] - z[theirs])
    margin = 2**0.5 * 2 * envelope * float(z.norm())
    error = relative_l2(z_ep, z)
    assert error <= 2 * envelope and gap <= margin, (
        f"generation differs at row {row}, generated step {step}: eager {mine}, expert-parallel {theirs}; eager gap "
        f"{gap:.4g} must be a near-tie <= {margin:.4g} and the EP logits within relative L2 {2 * envelope:.3g} "
        f"(measured {error:.3g})")
    return (f"near-tie flip at generated step {step}: eager gap {gap:.3g} <= margin {margin:.3g}, EP logits within "
            f"{error:.3g} <= {2 * envelope:.3g}")
