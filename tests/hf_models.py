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

import contextlib
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


def stopping_at_different_steps(model, rank: int, steps: tuple[int, ...] = (1, 20), tokens: int = 21,
                                **generate_kwargs) -> dict:
    """Generation that ends at a different step on each rank (one process a rank, the model made
    expert-parallel; every rank calls this together): rank r's prompts end (EOS) at generated step
    ``steps[r % len(steps)]``. Each rank first generates ``tokens`` greedy tokens with no EOS (the
    same number of steps everywhere: what the rank alone generates), among 8 seeded candidate
    prompts picks one whose token at that step appears nowhere before it (2 prompts for step 1,
    1 otherwise; their first tokens for step 1), regenerates the pick alone as the reference, then
    generates with those tokens as EOS and ``generate_kwargs`` (no ``synced_gpus`` by default). Returns {"ids": the
    prompts, "reference": the no-EOS sequences, "out": the EOS-stopped sequences, "forwards": the
    model forwards of the stopped generation, "step": the rank's stopping step}."""
    step = steps[rank % len(steps)]
    candidates = prompt(40 + rank, batch=8, length=8 + 2 * rank)
    S = candidates.shape[1]
    seqs, _ = greedy(model, candidates, tokens)
    if step == 1:
        rows = [0, 1]
    else:
        rows = [r for r in range(len(seqs)) if int(seqs[r, S + step - 1]) not in seqs[r, S:S + step - 1].tolist()][:1]
        assert rows, f"rank {rank}: no candidate prompt whose step-{step} token is new"
    ids = candidates[rows]
    reference, _ = greedy(model, ids, tokens)
    eos = sorted({int(t) for t in reference[:, S + step - 1]})
    assert all(t not in reference[:, S:S + step - 1] for t in eos), f"rank {rank}: an EOS token comes before step {step}"
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            out = model.generate(ids.to(model.device), max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=0, **generate_kwargs).cpu()
    finally:
        hook.remove()
    return {"ids": ids, "reference": reference, "out": out, "forwards": len(forwards), "step": step}


@contextlib.contextmanager
def routing(model: torch.nn.Module, forced: dict | None = None):
    """Record the routing of every routed experts module of ``model`` (named ``*.experts``), call by
    call: yields {module name: [{"index": [N, K] int64, "weights": [N, K] float32, "router": [N, E]
    float32 router logits of the call's hidden states (the block's ``gate`` or ``router`` linear,
    before any bias, sigmoid or group limit)}, ...]}. With ``forced`` (such a record of another run
    making the same calls), each call runs on the forced call's top-k indices and weights instead
    of its own; what is recorded stays the routing the model computed."""
    record, handles = {}, []
    for name, module in model.named_modules():
        if not name.endswith(".experts"):
            continue
        block = model.get_submodule(name.rpartition(".")[0])
        router = router_weight(block, module)
        calls = record.setdefault(name, [])

        def pre(_module, args, calls=calls, name=name, router=router):
            hidden, index, weights, *rest = args
            weight = router
            if hasattr(weight, "full_tensor"):  # a sharded DTensor (loaded with a distributed_config): every rank calls
                weight = weight.full_tensor()
            z = torch.nn.functional.linear(hidden.float(), weight.float())
            calls.append({"index": index.cpu(), "weights": weights.float().cpu(), "router": z.cpu()})
            if forced is None:
                return None
            want = forced[name][len(calls) - 1]
            assert want["index"].shape == index.shape, f"{name} call {len(calls) - 1}: not the same calls"
            return (hidden, want["index"].to(index.device), want["weights"].to(weights.device, weights.dtype), *rest)

        handles.append(module.register_forward_pre_hook(pre))
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def router_weight(block: torch.nn.Module, experts: torch.nn.Module) -> torch.Tensor:
    """The router's [E (+ zero experts), H] weight of an MoE block: its ``gate`` or ``router`` linear
    (or the first 2-D parameter of that module with H columns: hunyuan_v1_moe's ``gate.wg``, gemma4's
    ``router.proj``)."""
    for attr in ("gate", "router"):
        r = getattr(block, attr, None)
        if isinstance(r, torch.nn.Module):
            for _, p in r.named_parameters():
                if p.dim() == 2 and p.shape[0] >= experts.down_proj.shape[0]:
                    return p
    raise AttributeError(f"{type(block).__name__}: no gate or router weight found")


def routing_ties(ep: dict, eager: dict, calls: int, envelope: float) -> list[str]:
    """The tokens of the first ``calls`` calls of each experts module (the calls both runs made on the
    same tokens) whose top-k expert sets differ between two routing records: one line each, with
    the eager router's logit gap between the experts only it chose and those only the EP run chose,
    and how far the two runs' router logits of that token are apart (max abs), the drift that
    flipped it. A near-tie only: AssertionError where a token's drift exceeds 2 ``envelope`` times
    its router logits' L2 norm (the bound the model's logits obey), i.e. where the runs' routers saw
    inputs further apart than bf16 rounding explains."""
    lines = []
    for name, ep_calls in ep.items():
        for call, (a, b) in enumerate(zip(ep_calls[:calls], eager[name][:calls])):
            for row in (a["index"].sort(-1).values != b["index"].sort(-1).values).any(-1).nonzero().flatten().tolist():
                only_eager = sorted(set(b["index"][row].tolist()) - set(a["index"][row].tolist()))
                only_ep = sorted(set(a["index"][row].tolist()) - set(b["index"][row].tolist()))
                z = b["router"][row]
                gap = float(z[only_eager].min() - z[only_ep].max()) if only_eager and only_ep else float("nan")
                drift = float((a["router"][row] - z).abs().max())
                assert drift <= 2 * envelope * float(z.norm()), (
                    f"{name} call {call} token {row}: routed to {only_ep} instead of {only_eager} with router logits "
                    f"{drift:.3g} apart (max abs), beyond a rounding drift of 2 x {envelope:.3g} x {float(z.norm()):.3g}")
                lines.append(f"{name} call {call} token {row}: eager {only_eager} / EP {only_ep}, router logit "
                             f"gap {gap:.3g}, drift {drift:.3g}")
    return lines


def check_generation(ep_model: torch.nn.Module, eager_model: torch.nn.Module, ids: torch.Tensor,
                     envelope: float, tokens: int = 32) -> str:
    """Greedy generation of ``tokens`` tokens from ``ids`` by the expert-parallel model against the
    model's bf16 eager path: identical, or explained by ``_check_flip`` (a near-tie the logits
    bound allows), or explained by routing near-ties. A routing near-tie: the two runs' router
    inputs differ by bf16 rounding, and where two experts' router scores tie within that drift the
    runs pick different experts for a token, which moves its logits far beyond a rounding (every
    bf16 path of the model has such flips). Then the eager model is run again on the EP run's
    routing (``routing(forced=...)``): it must reproduce the EP generation the same way. Returns
    a verdict naming the routing ties (how many tokens of the calls before the flip, and the worst
    gap); AssertionError otherwise."""
    with routing(ep_model) as ep_routes:
        ep = greedy(ep_model, ids, tokens)
    with routing(eager_model) as eager_routes:
        eager = greedy(eager_model, ids, tokens)
    try:
        return _check_flip(ep, eager, envelope)
    except AssertionError as plain:
        if torch.equal(ep[0], eager[0]):
            raise
        pos = int((ep[0] != eager[0]).any(0).nonzero()[0])
        ties = routing_ties(ep_routes, eager_routes, pos - (ids.shape[1] - 1), envelope)
        assert ties, f"{plain}; and no token was routed differently before the flip"
        with routing(eager_model, forced=ep_routes):
            forced = greedy(eager_model, ids, tokens)
        verdict = _check_flip(ep, forced, envelope)
        return (f"{len(ties)} routing near-tie token(s) before generated step {pos - ids.shape[1]} "
                f"({ties[0]}{'; ...' if len(ties) > 1 else ''}); eager on the EP routing: {verdict}")


def _check_flip(ep: tuple, eager: tuple, envelope: float) -> str:
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


# --- every family on transformers' experts conventions ---------------------------------------------

TEXT = dict(COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=EXPERTS, num_local_experts=EXPERTS,
            n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=0,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1,
            shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
"""The fields of a tiny text config, given where the family's config class has them (through its aliases:
``attribute_map``)."""

EXTRA = {
    "ernie4_5_moe": dict(moe_layer_start_index=0, moe_layer_interval=1),
    "hunyuan_v1_moe": dict(moe_topk=2),
    "longcat_flash": dict(moe_topk=2, zero_expert_num=0, num_layers=1),
    "gemma4": dict(enable_moe_block=True, top_k_experts=2),
}
"""Fields a family needs beyond TEXT (its layer schedule, its own top-k name)."""


MAX_PARAMS = 20_000_000
"""The most parameters ``family_model`` builds (the text models are under 3M; a multimodal family's
vision tower can be 100s of M at its defaults)."""


def experts_families() -> list[str]:
    """Every model type of the installed transformers whose modeling module builds its experts with
    ``@use_experts_implementation`` (3-D gate_up_proj / up_proj and down_proj), sorted."""
    import os

    root = os.path.join(os.path.dirname(tf.__file__), "models")
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, f"modeling_{name}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                if "@use_experts_implementation" in f.read():
                    out.append(name)
    return out


def family_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 model of ``model_type`` from its config class (TEXT and EXTRA where the class has
    the fields; a multimodal config's text_config), its causal LM or image-text-to-text class, random
    weights from ``seed`` (expert biases and score-correction biases drawn non-zero), eval mode.
    Raises whatever the family's classes raise for a config they refuse."""
    from transformers.models.auto import configuration_auto, modeling_auto

    config_cls = configuration_auto.CONFIG_MAPPING[model_type]
    names = [n for n in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")
             if model_type in getattr(modeling_auto, n)]
    if not names:
        raise ValueError(f"{model_type}: no causal LM class")
    model_cls = getattr(tf, getattr(modeling_auto, names[0])[model_type])
    wanted = {**TEXT, **EXTRA.get(model_type, {})}
    sub = (getattr(config_cls, "sub_configs", None) or {}).get("text_config")
    text_cls = sub if sub is not None else config_cls
    default = text_cls()
    kw = {k: v for k, v in wanted.items() if hasattr(default, k)}
    if hasattr(default, "qk_rope_head_dim") and getattr(default, "head_dim", None) == default.qk_rope_head_dim:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # multi-head latent attention whose head_dim is the rope part
    config = config_cls(text_config=kw) if sub is not None else config_cls(**kw)
    with torch.device("meta"):  # its size first: a tower the text fields leave (a vision encoder) is refused
        params = sum(p.numel() for p in model_cls(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"{params / 1e6:.0f}M parameters at the tiny text config (a tower it does not shrink)")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
                module.e_score_correction_bias.copy_(0.1 * torch.randn(module.e_score_correction_bias.shape, generator=g))
            if getattr(module, "has_bias", False) and hasattr(module, "down_proj_bias"):
                up = module.gate_up_proj_bias if module.has_gate else module.up_proj_bias
                up.copy_(0.5 * torch.randn(up.shape, generator=g))
                module.down_proj_bias.copy_(0.1 * torch.randn(module.down_proj_bias.shape, generator=g))
    return model
