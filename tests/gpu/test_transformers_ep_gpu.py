"""transformers models expert-parallel through the real epgen op (``EpDispatchCombine``, expert
layout, ``torch._grouped_mm`` experts) on the GPU.

The tiny random-weight models of tests/hf_models.py (qwen3_moe, mixtral, deepseek_v3, gpt_oss; the
bound is derived there): full-model logits of the bf16 expert-parallel model against the float32
model within 2 x the model's own bf16 error (its eager, batched_mm and grouped_mm experts on this
GPU), and greedy generation of 32 tokens against the model's own bf16 eager path (identical, or a
near-tie the logits bound allows, or a routing near-tie reproduced by the eager model on the
expert-parallel run's routing, ``hf_models.check_generation``):

* virtual ranks, W = 2, 4, 8, on one GPU (every rank in this process, one grid);
* W = 2 and 4 processes (``epgen.harness.ranks.run_ranks``: all on cuda:0 when there are fewer GPUs), in
  both token layouts: "same_tokens" (every rank the same prompt; each dispatches its slice and the
  outputs are gathered: every rank's logits identical) and "own_tokens" (every rank its own prompt);
* generate across W = 2 and 4 processes whose prompts end at different steps (1 and 20): no hang,
  each rank's own generation;
* torch.compile (inductor) of the model, virtual ranks and two processes, within the bound;
* dbrx and llama4 (experts outside transformers' conventions, read by epgen's READERS), virtual
  ranks, W = 2 and 4.
"""

import copy

import pytest

pytest.importorskip("transformers", reason="the optional transformers dependency (pip install -e '.[dev]') is missing")

import torch  # noqa: E402

import hf_models  # noqa: E402
from epgen.moe import grouped_mm_available  # noqa: E402
from epgen.reference import relative_l2  # noqa: E402

SEED = 0
PROMPT = hf_models.prompt(1, batch=4, length=64)
TIMEOUT_S = 60.0
"""EpConfig.timeout_s of these ops: a lost peer fails the test in a minute."""
RUN_TIMEOUT_S = 500.0


def _ep(model, world=None, **kw):
    from epgen.integrations.transformers import expert_parallel

    if world is not None:
        kw.update(virtual=True, world_size=world)
    return expert_parallel(model, max_tokens_per_rank=256, timeout_s=TIMEOUT_S, **kw)


@pytest.fixture(scope="module")
def envelopes():
    """Per family: (float32 model on cuda, the model's own bf16 error envelope on this GPU, the
    float32 logits of PROMPT)."""
    out = {}
    for family in hf_models.FAMILIES:
        model = hf_models.tiny_model(family, SEED).to("cuda")
        out[family] = (model, *hf_models.bf16_envelope(model, PROMPT))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_virtual_ranks_logits_within_twice_the_models_own_bf16_error(envelopes, family, world):
    model32, envelope, ref = envelopes[family]
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ep = _ep(model, world)
    try:
        assert ep.backend == "epgen" and ep.grouped_mm is grouped_mm_available(model.device)
        error = relative_l2(hf_models.logits(model, PROMPT), ref)
        ep.synchronize()
    finally:
        ep.close()
    print(f"{family} W={world} virtual: relative L2 {error:.3e}, model's own bf16 {envelope:.3e}, "
          f"ratio {error / envelope:.2f}")
    assert error <= 2 * envelope, f"{family} W={world}: {error:.3e} > 2 x {envelope:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_virtual_ranks_greedy_generation(envelopes, family):
    model32, envelope, _ = envelopes[family]
    eager = hf_models.eager_bf16(model32)
    ids = PROMPT[:1, :8]
    model = copy.deepcopy(eager)
    ep = _ep(model, 4)
    try:
        verdict = hf_models.check_generation(model, eager, ids, envelope)
        ep.synchronize()
    finally:
        ep.close()
    print(f"{family} W=4 virtual generation: {verdict}")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["dbrx", "llama4"])
def test_families_outside_the_conventions_on_the_gpu_op(family, world):
    """dbrx (gate apart from up: two grouped GEMMs) and llama4 (input-weighted experts) through the
    GPU op, virtual ranks: logits within the bound, greedy generation checked."""
    model32 = hf_models.family_model(family, SEED).to("cuda")
    envelope, ref = hf_models.bf16_envelope(model32, PROMPT)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ep = _ep(model, world)
    try:
        assert ep.backend == "epgen"
        error = relative_l2(hf_models.logits(model, PROMPT), ref)
        verdict = hf_models.check_generation(model, hf_models.eager_bf16(model32), PROMPT[:1, :8], envelope)
        ep.synchronize()
    finally:
        ep.close()
    print(f"{family} W={world} virtual: relative L2 {error:.3e}, model's own bf16 {envelope:.3e}; generation {verdict}")
    assert error <= 2 * envelope, f"{family} W={world}: {error:.3e} > 2 x {envelope:.3e}"


@pytest.mark.gpu
def test_loop_path_on_the_gpu(envelopes):
    model32, envelope, ref = envelopes["gpt_oss"]
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ep = _ep(model, 4, grouped_mm=False)
    try:
        assert ep.grouped_mm is False
        error = relative_l2(hf_models.logits(model, PROMPT), ref)
    finally:
        ep.close()
    assert error <= 2 * envelope, f"loop path: {error:.3e} > 2 x {envelope:.3e}"


def _processes_body(rank, world_size):
    """Every family, both token layouts, as rank ``rank`` of ``world_size`` processes."""
    import torch.distributed as dist

    for family in sorted(hf_models.FAMILIES):
        model32 = hf_models.tiny_model(family, SEED).to("cuda")
        envelope, ref = hf_models.bf16_envelope(model32, PROMPT)
        # Each rank its own batch, of its own size; the bound is the model's own bf16 error on that
        # batch, over at least 224 tokens (tests/hf_models.py: fewer let one router near-tie dominate).
        own = hf_models.prompt(10 + rank, batch=4, length=56 + 2 * rank)
        envelope_own, ref_own = hf_models.bf16_envelope(model32, own)
        eager = hf_models.eager_bf16(model32)
        ids = {"same_tokens": PROMPT[:1, :8], "own_tokens": own[:, :8]}
        for layout in ("same_tokens", "own_tokens"):
            model = copy.deepcopy(model32).to(torch.bfloat16)
            ep = _ep(model, layout=layout)  # a failure raises at once: run_ranks then ends the peers
            assert (ep.virtual, ep.ranks, ep.config.world_size) == (False, [rank], world_size)
            for name in ep.modules:  # this rank keeps its experts only
                assert model.get_submodule(name).down_proj.shape[0] == hf_models.EXPERTS // world_size
            if layout == "same_tokens":
                out = hf_models.logits(model, PROMPT)
                every = [None] * world_size
                dist.all_gather_object(every, out)
                assert all(torch.equal(o, out) for o in every), "the same tokens on every rank: the ranks' logits differ"
                error = relative_l2(out, ref)
            else:
                error = relative_l2(hf_models.logits(model, own), ref_own)
            bound = envelope if layout == "same_tokens" else envelope_own
            verdict = hf_models.check_generation(model, eager, ids[layout], bound)
            ep.synchronize()
            dist.barrier()  # every peer is done with this rank's arena
            ep.close()
            print(f"{family} W={world_size} processes, {layout} tokens, rank {rank}: relative L2 {error:.3e} "
                  f"(bound {2 * bound:.3e}); generation {verdict}", flush=True)
            assert error <= 2 * bound, f"{family} {layout} rank {rank}: {error:.3e} > 2 x {bound:.3e}"


@pytest.mark.processes
@pytest.mark.parametrize("world_size", [2, 4])
def test_processes_both_token_layouts(world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _processes_body, timeout_s=RUN_TIMEOUT_S)


def _straddle_body(rank, world_size):
    """Owned tokens whose prefill counts straddle the low-latency threshold (T_ll - 1 on rank 0,
    T_ll + 1 on rank 1, ...), then a decode: each phase one family on every rank, no hang, the
    generation as the eager model's (``check_generation``)."""
    model32 = hf_models.tiny_model("qwen3_moe", SEED).to("cuda")
    eager = hf_models.eager_bf16(model32)
    model = copy.deepcopy(eager)
    ep = _ep(model, layout="own_tokens")
    t_ll = ep.op.low_latency_tokens
    assert 1 < t_ll < 255, t_ll
    ids = hf_models.prompt(20 + rank, batch=1, length=t_ll - 1 + 2 * rank)
    envelope, _ = hf_models.bf16_envelope(model32, hf_models.prompt(30, batch=4, length=64))
    verdict = hf_models.check_generation(model, eager, ids, envelope, tokens=4)
    ep.synchronize()
    torch.distributed.barrier()
    ep.close()
    print(f"rank {rank}: prefill of {ids.shape[1]} tokens (T_ll {t_ll}), 4 decode steps: {verdict}", flush=True)


@pytest.mark.processes
def test_owned_prefill_on_both_sides_of_the_threshold_then_decode():
    from epgen.harness.ranks import run_ranks

    run_ranks(2, _straddle_body, timeout_s=RUN_TIMEOUT_S)


def _stop_at_different_steps_body(rank, world_size):
    """Owned tokens, one process a rank: rank r's prompts end (EOS) at generated step 1 (even
    ranks) or 20 (odd ranks); ``expert_parallel`` makes ``generate`` run with synced_gpus=True, so
    the ranks that end first keep running decode forwards (each step one family on every rank: the
    phase's) until the last one ends: no hang, every rank 20 forwards, and each rank's output is
    its own no-EOS generation cut at its EOS (``hf_models.stopping_at_different_steps``)."""
    model = hf_models.tiny_model("qwen3_moe", SEED).to("cuda").to(torch.bfloat16)
    ep = _ep(model, layout="own_tokens")
    r = hf_models.stopping_at_different_steps(model, rank)
    ep.synchronize()
    torch.distributed.barrier()
    ep.close()
    S, step = r["ids"].shape[1], r["step"]
    print(f"rank {rank}: {len(r['ids'])} prompt(s) of {S} tokens stop at step {step}: {r['out'].shape[1] - S} tokens; "
          f"{r['forwards']} forwards", flush=True)
    assert torch.equal(r["out"], r["reference"][:, :S + step]), f"rank {rank}: the stopped generation is not its own"
    assert r["forwards"] == 20, f"rank {rank}: {r['forwards']} forwards, the slowest rank's 20 expected"


@pytest.mark.processes
@pytest.mark.parametrize("world_size", [2, 4])
def test_generate_when_ranks_stop_at_different_steps(world_size):
    from epgen.harness.ranks import run_ranks

    run_ranks(world_size, _stop_at_different_steps_body, timeout_s=RUN_TIMEOUT_S)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_inductor_compiled_model_within_the_bound(envelopes, family):
    """torch.compile(fullgraph=True, inductor) of the expert-parallel model (virtual W = 4): one
    graph around the epgen::transformers_experts operator (the GPU op inside, opaque); the logits
    within 2 x the model's own bf16 error, like eager's."""
    model32, envelope, ref = envelopes[family]
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ep = _ep(model, 4)
    try:
        eager = hf_models.logits(model, PROMPT)
        torch._dynamo.reset()
        out = hf_models.logits(torch.compile(model, fullgraph=True), PROMPT)
        ep.synchronize()
    finally:
        ep.close()
    error = relative_l2(out, ref)
    print(f"{family} W=4 virtual, inductor: relative L2 {error:.3e} (eager {relative_l2(eager, ref):.3e}, model's own "
          f"bf16 {envelope:.3e}); compiled vs eager {relative_l2(out, eager):.3e}")
    assert error <= 2 * envelope, f"{family} compiled: {error:.3e} > 2 x {envelope:.3e}"


def _compiled_processes_body(rank, world_size):
    """Owned tokens, one process a rank, the model compiled in place (inductor): the logits of the
    rank's own batch within the bound, and a compiled greedy generation as the eager model's
    (``check_generation``): prefill and decode each take their family inside the compiled graph."""
    model32 = hf_models.tiny_model("qwen3_moe", SEED).to("cuda")
    own = hf_models.prompt(10 + rank, batch=4, length=56 + 2 * rank)
    envelope, ref = hf_models.bf16_envelope(model32, own)
    eager = hf_models.eager_bf16(model32)
    model = copy.deepcopy(eager)
    ep = _ep(model, layout="own_tokens")
    model.compile()
    error = relative_l2(hf_models.logits(model, own), ref)
    verdict = hf_models.check_generation(model, eager, own[:, :8], envelope, tokens=8)
    ep.synchronize()
    torch.distributed.barrier()
    ep.close()
    print(f"rank {rank} compiled: relative L2 {error:.3e} (bound {2 * envelope:.3e}); generation {verdict}", flush=True)
    assert error <= 2 * envelope, f"rank {rank} compiled: {error:.3e} > 2 x {envelope:.3e}"


@pytest.mark.processes
def test_compiled_model_as_two_processes():
    from epgen.harness.ranks import run_ranks

    run_ranks(2, _compiled_processes_body, timeout_s=RUN_TIMEOUT_S)
