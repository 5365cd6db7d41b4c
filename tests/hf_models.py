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
against an envelope of 0.024 taken on other tokens). A lost expert or a wrong weight exceeds it (tests/runtime/integrations/test_transformers_ep.py).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import transformers as tf

from epgen.integrations.transformers import reader
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
                         routed_scaling_factor=2.5,
                         # multi-head latent attention: as many key-value heads as query heads, as the real
                         # config; with fewer, transformers' SDPA path repeats the keys under an attention mask
                         # (a prompt holding the pad id) and fails on the head count
                         num_key_value_heads=4)),
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
    logits on the CPU; a model outside the experts conventions has one, its forward). The model is
    copied for the bf16 runs."""
    ref = logits(model32, ids)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    errors = []
    conventions = any(hasattr(m, "has_gate") for m in model16.modules())  # else its one experts forward
    for impl in IMPLEMENTATIONS if conventions else ("eager",):
        if conventions:
            model16.set_experts_implementation(impl)
        errors.append(relative_l2(logits(model16, ids), ref))
    return max(errors), ref


def eager_bf16(model32: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of the model running its own eager experts (the reference of the generation checks)."""
    model = copy.deepcopy(model32).to(torch.bfloat16)
    if any(hasattr(m, "has_gate") for m in model.modules()):
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
    call (a module called with its tokens alone records nothing): yields {module name: [{"index":
    [N, K] int64, "weights": [N, K] float32, "router": [N, E] float32 router logits of the call's
    hidden states (the block's ``gate`` or ``router`` linear, before any bias, sigmoid or group
    limit)}, ...]}. With ``forced`` (such a record of another run
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
            if len(args) < 3:  # an experts module called with its tokens alone (llama4's eager path): no routing
                return None
            hidden, index, weights, *rest = args
            hidden = hidden.reshape(-1, hidden.shape[-1])  # dbrx passes [B, S, H]
            weight = router
            if hasattr(weight, "full_tensor"):  # a sharded DTensor (loaded with a distributed_config): every rank calls
                weight = weight.full_tensor()
            z = torch.nn.functional.linear(hidden.float(), weight.float())
            calls.append({"index": index.cpu(), "weights": weights.float().cpu(), "router": z.cpu()})
            if forced is None:
                return None
            want = forced[name][len(calls) - 1]
            assert want["index"].shape == index.shape, f"{name} call {len(calls) - 1}: not the same calls"
            return (args[0], want["index"].to(index.device), want["weights"].to(weights.device, weights.dtype), *rest)

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
                if p.dim() == 2 and p.shape[0] >= reader(experts).shape(experts)[0]:
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
    "gemma4": dict(enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
    "diffusion_gemma": dict(enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=256,
                            hidden_size_per_layer_input=16),
    "mistral_large4": dict(num_key_value_heads=4),
    "step3p7": dict(sliding_window=8),
    "axk2": dict(num_key_value_heads=4),  # multi-head latent attention: as many key-value heads as query heads
    "deepseek_v32": dict(num_key_value_heads=4),
    "glm_moe_dsa": dict(num_key_value_heads=4),
    "glm5_next": dict(num_key_value_heads=4, qk_rope_head_dim=0, qk_nope_head_dim=16, head_dim=0),  # no rope
    "dots3_note": dict(num_key_value_heads=4, v_head_dim=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                       shared_experts_intermediate_size=32),
    "zaya": dict(num_experts_per_tok=1),  # its config class takes top-1 only
    "nemotron_h": dict(layers_block_type=["full_attention", "moe"]),  # its cache needs an attention layer
    "muse_spark": dict(moe_hidden_size=64),  # the experts' hidden size, apart from the model's
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),
    "hy_v4_vl": dict(rope_parameters=dict(rope_theta=10000.0, rope_type="default", mrope_section=[2, 1, 1])),
    "glm4v_moe": dict(rope_parameters=dict(rope_theta=10000.0, rope_type="default", partial_rotary_factor=0.5,
                                           mrope_section=[2, 1, 1])),  # sums to the rotary half of head_dim
    "qwen4_exp": dict(indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4, indexer_n_heads=2,
                      indexer_kv_heads=1),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[32, 32], moe_layer_start_index=0, moe_layer_interval=1),
    "kolibri1_1": dict(index_num_heads=2, index_layers=[1], kv_source_layers=[0, 1]),
}
"""Fields a family needs beyond TEXT (its layer schedule, its own top-k name)."""


MAX_PARAMS = 20_000_000
"""The most parameters ``family_model`` builds (the text models are under 3M; a multimodal family's
vision tower can be 100s of M at its defaults)."""


def outside_families() -> list[str]:
    """Every model type of the installed transformers whose modeling module has an experts module
    (``self.experts``) not built on its experts conventions, sorted: epgen reads some of them
    otherwise (``epgen.integrations.transformers.READERS``) and refuses the rest, naming why."""
    return [name for name, text in _modeling_sources()
            if "self.experts = " in text and "@use_experts_implementation" not in text]


def _modeling_sources():
    """(model type, the text of its modeling module) of every model of the installed transformers, sorted."""
    import os

    root = os.path.join(os.path.dirname(tf.__file__), "models")
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, f"modeling_{name}.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                yield name, f.read()


def _dbrx():
    config = tf.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256, initializer_range=0.1,
                           attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
                           ffn_config=dict(ffn_hidden_size=32, moe_num_experts=EXPERTS, moe_top_k=2))
    config.attn_config.rope_theta = 10000.0  # transformers 5.25's DbrxAttention reads it; its config class lacks it
    return tf.DbrxForCausalLM(config)


OUTSIDE = {
    "dbrx": _dbrx,
    "llama4": lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(
        **{k: v for k, v in TEXT.items() if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "max_position_embeddings",
                                                  "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id")},
        intermediate_size=32, intermediate_size_mlp=64, num_local_experts=EXPERTS, num_experts_per_tok=2,
        interleave_moe_layer_step=1)),
    "jetmoe": lambda: tf.JetMoeForCausalLM(tf.JetMoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16, intermediate_size=32,
        num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.1)),
    "switch_transformers": lambda: tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
        vocab_size=256, d_model=64, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=EXPERTS, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)),
    "nllb_moe": lambda: tf.NllbMoeForConditionalGeneration(tf.NllbMoeConfig(
        vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_experts=EXPERTS, encoder_sparse_step=1,
        decoder_sparse_step=1, max_position_embeddings=256)),
    "vitpose_backbone": lambda: tf.VitPoseBackbone(tf.VitPoseBackboneConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, num_experts=2, part_features=16,
        image_size=[64, 48], patch_size=[16, 16])),
}
"""Tiny models of the families outside the experts conventions (``outside_families``)."""


def experts_families() -> list[str]:
    """Every model type of the installed transformers whose modeling module builds its experts with
    ``@use_experts_implementation`` (3-D gate_up_proj / up_proj and down_proj), sorted."""
    return [name for name, text in _modeling_sources() if "@use_experts_implementation" in text]


def _has(config, name: str) -> bool:
    """Whether ``config`` has the field ``name`` (a per-layer field of a heterogeneous config, whose
    global read raises, has it)."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError: a per-layer field
        return True
    return True


def _layer_lists(default, layers: int) -> dict:
    """The per-layer string lists of ``default`` (one entry a layer: ``layer_types``,
    ``mlp_layer_types``, ...) for ``layers`` layers: every MLP sparse (an experts module in every
    layer), and the attention kinds the family mixes, in their order (a hybrid's linear and full
    attention both; its cache needs one attention layer)."""
    n = getattr(default, "num_hidden_layers", None)
    out = {}
    for key, value in default.to_dict().items():
        if not (isinstance(value, list) and len(value) == n and value and all(isinstance(v, str) for v in value)):
            continue
        kinds = list(dict.fromkeys(value))
        if "mlp" in key:
            kinds = [k for k in kinds if k != "dense"] or kinds
            out[key] = [kinds[0]] * layers
        else:
            out[key] = (kinds * layers)[:layers]
    return out


def _text_config_class(config_cls):
    """The config class of a multimodal family's language model: its ``text_config`` sub-config,
    or one a level further down (qwen3_omni_moe's ``thinker_config.text_config``); None for a text
    family."""
    subs = getattr(config_cls, "sub_configs", None) or {}
    if "text_config" in subs:
        return subs["text_config"]
    for sub in subs.values():
        inner = (getattr(sub, "sub_configs", None) or {}).get("text_config")
        if inner is not None:
            return inner
    return None


def _causal_lm_class(model_type: str, config_cls):
    """(model class, whether it takes the text sub-config): a multimodal family's text causal LM
    class, else ``text_causal_lm`` over its text model (its towers left out); a text family's causal
    LM class, else its image-text-to-text class."""
    import importlib

    from transformers.models.auto import modeling_auto

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    text_cls = _text_config_class(config_cls)
    for name in sorted(n for n in dir(module) if n.endswith("ForCausalLM")):
        cls = getattr(module, name)
        if text_cls is not None and getattr(cls, "config_class", None) is text_cls:
            return cls, True
    text_models = [getattr(module, n) for n in sorted(dir(module)) if n.endswith("TextModel")]
    text_models = [c for c in text_models if text_cls is not None and getattr(c, "config_class", None) is text_cls]
    if text_models:
        return text_causal_lm(text_models[0]), True
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if model_type in mapping:
            return getattr(tf, mapping[model_type]), False
    raise ValueError(f"{model_type}: no causal LM class and no text model")


def text_causal_lm(text_model_cls):
    """A causal LM over a multimodal family's text model (its decoder, where its experts are) for
    a family that ships none: ``text_model_cls`` under a linear LM head, generating through
    transformers' GenerationMixin. The vision or audio towers are left out: the experts only see
    the text model's hidden states."""
    from transformers.generation import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base = next(c for c in text_model_cls.__mro__[1:] if issubclass(c, tf.PreTrainedModel))

    class TextCausalLM(base, GenerationMixin):
        config_class = text_model_cls.config_class
        _no_split_modules = getattr(text_model_cls, "_no_split_modules", None)

        def __init__(self, config):
            super().__init__(config)
            self.model = text_model_cls(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                    use_cache=None, logits_to_keep=0, **kwargs):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
            hidden = out.last_hidden_state
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep]), past_key_values=out.past_key_values)

    TextCausalLM.__name__ = TextCausalLM.__qualname__ = text_model_cls.__name__.replace("TextModel", "TextCausalLM")
    return TextCausalLM


def family_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 model of ``model_type`` (``OUTSIDE``'s for a family outside the experts
    conventions) from its config class (TEXT and EXTRA where the class has
    the fields; its per-layer lists for two layers, ``_layer_lists``; a multimodal family's text
    config under its text causal LM, or ``text_causal_lm`` over its text model), random weights from
    ``seed`` (expert biases and score-correction biases drawn non-zero), eval mode. Raises whatever
    the family's classes raise for a config they refuse; ValueError for a model without an experts
    module at that config."""
    from transformers.models.auto import configuration_auto

    if model_type in OUTSIDE:
        torch.manual_seed(seed)
        return OUTSIDE[model_type]().eval()
    if model_type not in configuration_auto.CONFIG_MAPPING:
        raise ValueError(f"{model_type}: transformers registers no config class for it (a modeling module only)")
    config_cls = configuration_auto.CONFIG_MAPPING[model_type]
    model_cls, takes_text = _causal_lm_class(model_type, config_cls)
    wanted = {**TEXT, **EXTRA.get(model_type, {})}
    sub = _text_config_class(config_cls)
    text_cls = sub if sub is not None else config_cls
    default = text_cls()
    kw = {k: v for k, v in wanted.items() if _has(default, k)}
    if _has(default, "qk_rope_head_dim") and getattr(default, "head_dim", None) == default.qk_rope_head_dim:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # multi-head latent attention whose head_dim is the rope part
    kw.update({k: v for k, v in _layer_lists(default, kw.get("num_hidden_layers", 2)).items() if k not in EXTRA.get(
        model_type, {})})
    if takes_text or sub is None:
        config = text_cls(**kw)
    else:
        config = config_cls(text_config=kw)
    with torch.device("meta"):  # its size first: a tower the text fields leave (a vision encoder) is refused
        params = sum(p.numel() for p in model_cls(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"{params / 1e6:.0f}M parameters at the tiny text config (a tower it does not shrink)")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if not any(hasattr(m, "has_gate") and hasattr(m, "down_proj") for m in model.modules()):
        raise ValueError(f"{model_type}: no experts module in the tiny model (its layer schedule keeps every MLP dense)")
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
