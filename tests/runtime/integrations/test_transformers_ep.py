"""Hugging Face transformers models made expert-parallel by ``epgen.integrations.transformers``, on
the CPU: the backend is ``epgen.reference`` (dispatch, expansion per local expert, weighted fold and
combine of all W ranks, run for real in torch), under the models' own code (router, attention,
shared experts, the experts classes' own gate and biases).

Tiny random-weight models of qwen3_moe, mixtral, deepseek_v3 and gpt_oss (tests/hf_models.py, where
the bound is derived): full-model logits of the bf16 expert-parallel model against the float32
model within 2 x the model's own bf16 error; greedy generation of 32 tokens against the model's own
bf16 eager path; a lost expert exceeds the bound; the two token layouts as two processes (gloo),
converted after loading and sharded at load through transformers' expert-parallel registry;
generate across two processes whose prompts end at different steps; weights loaded or changed
after the conversion; torch.compile against eager; the refusals. One test runs backend "epgen" on
the CPU instead: epgen's real kernels on the host emulation (epgen.host), within the same bound.
"""

import copy
import os
import types

import pytest

pytest.importorskip("transformers", reason="the optional transformers dependency (pip install -e '.[dev]') is missing")

import torch  # noqa: E402

import hf_models  # noqa: E402
from epgen.integrations.transformers import expert_parallel  # noqa: E402
from epgen.reference import relative_l2  # noqa: E402

SEED = 0
PROMPT = hf_models.prompt(1, batch=4, length=64)
"""256 tokens: a bf16 near-tie that flips a router's top-k moves a few tokens' logits far; over 256 tokens
every bf16 path has a few such flips, so their relative L2 errors are comparable."""


@pytest.fixture(scope="module")
def envelopes():
    """Per family: (float32 model, the model's own bf16 error envelope, the float32 logits of PROMPT)."""
    out = {}
    for family in hf_models.FAMILIES:
        model = hf_models.tiny_model(family, SEED)
        out[family] = (model, *hf_models.bf16_envelope(model, PROMPT))
    return out


def ep_model(model32, world, max_tokens_per_rank=256, **kw):
    model = copy.deepcopy(model32).to(torch.bfloat16)
    return model, expert_parallel(model, virtual=True, world_size=world, max_tokens_per_rank=max_tokens_per_rank, **kw)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_logits_within_twice_the_models_own_bf16_error(envelopes, family, world):
    model32, envelope, ref = envelopes[family]
    model, ep = ep_model(model32, world)
    assert (ep.backend, ep.grouped_mm, ep.config.experts_per_rank) == ("reference", True, hf_models.EXPERTS // world)
    assert len(ep.modules) == 2  # every layer's experts
    error = relative_l2(hf_models.logits(model, PROMPT), ref)
    print(f"{family} W={world}: relative L2 {error:.3e}, model's own bf16 {envelope:.3e}, ratio {error / envelope:.2f}")
    assert error <= 2 * envelope, f"{family} W={world}: {error:.3e} > 2 x {envelope:.3e}"


def test_the_real_kernels_on_the_host_emulation_stay_within_the_bound(envelopes):
    """backend="epgen" on CPU weights: epgen's own kernels (sm_90's dispatch, expansion, fold and
    combine) run on the host emulation (epgen.host), W = 2 virtual ranks, against the same bound as
    the reference backend; arch and schedule refused where the host emulation does not run."""
    from epgen.host import Schedule

    model32, envelope, ref = envelopes["qwen3_moe"]
    model, ep = ep_model(model32, 2, max_tokens_per_rank=128, backend="epgen", schedule=Schedule(seed=5))
    assert (ep.backend, ep.op.device.type, ep.op.arch, ep.op.platform.schedule.seed) == ("epgen", "cpu", "sm_90", 5)
    error = relative_l2(hf_models.logits(model, PROMPT), ref)
    print(f"qwen3_moe W=2 on the host emulation: relative L2 {error:.3e}, model's own bf16 {envelope:.3e}")
    assert error <= 2 * envelope, f"{error:.3e} > 2 x {envelope:.3e}"
    ran = {kernel.split("_sm90_")[0] for kernel, _, _ in ep.op.platform.stats}
    assert {"epgen_expand", "epgen_fold"} <= ran and ran & {"epgen_dispatch", "epgen_dispatch_ll"}, ran
    assert len(ep.op.platform.stats) == ep.op.platform.launches >= 2 * 5  # two layers, five launches each
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    for kw in ({"backend": "reference", "arch": "gfx942"}, {"schedule": Schedule()}):  # the CPU's default: reference
        with pytest.raises(ValueError, match=r"only the host emulation takes them \(backend='epgen' with the model's "
                                             r"weights on the CPU"):
            expert_parallel(model16, virtual=True, world_size=2, **kw)
    with pytest.raises(ValueError, match="gfx90a"):
        expert_parallel(model16, virtual=True, world_size=2, backend="epgen", arch="gfx90a")


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_greedy_generation_matches_the_eager_path(envelopes, family):
    model32, envelope, _ = envelopes[family]
    eager = hf_models.eager_bf16(model32)
    ids = PROMPT[:1, :8]
    model, _ = ep_model(model32, 4)
    verdict = hf_models.check_generation(model, eager, ids, envelope)
    print(f"{family}: {verdict}")


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_a_prompt_holding_the_pad_id_generates(envelopes, family):
    """``greedy`` passes pad id 0, so a prompt holding token 0 is prefilled under an attention mask
    (the SDPA path that repeats the keys by the key-value groups): the tiny model of each family
    takes it, eager and expert-parallel alike, with the same tokens (the W = 4 process test's rank
    2 prompt failed so on deepseek_v3 while its config had fewer key-value heads than query heads)."""
    model32, envelope, _ = envelopes[family]
    ids = hf_models.prompt(12, batch=4, length=8)
    ids[1, 3] = 0
    model, _ = ep_model(model32, 2)
    print(f"{family}: {hf_models.check_generation(model, hf_models.eager_bf16(model32), ids, envelope, tokens=4)}")


def test_loop_path_matches_grouped_path(envelopes):
    model32, envelope, ref = envelopes["gpt_oss"]
    loop, ep = ep_model(model32, 4, grouped_mm=False)
    assert ep.grouped_mm is False
    grouped, _ = ep_model(model32, 4, grouped_mm=True)
    a, b = hf_models.logits(loop, PROMPT), hf_models.logits(grouped, PROMPT)
    assert relative_l2(a, ref) <= 2 * envelope and relative_l2(b, ref) <= 2 * envelope
    assert relative_l2(a, b) <= envelope


def test_a_lost_expert_exceeds_the_bound(envelopes):
    model32, envelope, ref = envelopes["qwen3_moe"]
    model, ep = ep_model(model32, 4)
    for name in ep.modules:  # rank 1's first expert (global expert L) answers zeros in every layer
        with torch.no_grad():
            model.get_submodule(name).down_proj[ep.config.experts_per_rank].zero_()
    error = relative_l2(hf_models.logits(model, PROMPT), ref)
    assert error > 2 * envelope, f"a lost expert gives {error:.3e}, within the bound 2 x {envelope:.3e}"


@pytest.mark.parametrize("family", ["dbrx", "llama4"])
def test_a_lost_expert_exceeds_the_bound_outside_the_conventions(family):
    """dbrx's [E I, H] weights and llama4's input-weighted experts, read otherwise (READERS): within
    the bound as converted (tests/runtime/integrations/test_transformers_families.py), and a zeroed expert of
    rank 1 exceeds it, so the bound sees a lost expert of these readers too."""
    model32 = hf_models.family_model(family)
    envelope, ref = hf_models.bf16_envelope(model32, PROMPT)
    model, ep = ep_model(model32, 4)
    L = ep.config.experts_per_rank
    assert relative_l2(hf_models.logits(model, PROMPT), ref) <= 2 * envelope
    for name in ep.modules:
        experts = model.get_submodule(name)
        with torch.no_grad():
            if family == "dbrx":
                experts.mlp.w2.view(-1, experts.ffn_hidden_size, experts.mlp.w2.shape[1])[L].zero_()
            else:
                experts.down_proj[L].zero_()
    error = relative_l2(hf_models.logits(model, PROMPT), ref)
    assert error > 2 * envelope, f"a lost expert gives {error:.3e}, within the bound 2 x {envelope:.3e}"


def _dbrx_body(rank, world, store, result_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model32 = hf_models.family_model("dbrx")
        virtual, _ = ep_model(model32, world)
        expected = hf_models.logits(virtual, PROMPT)
        model = copy.deepcopy(model32).to(torch.bfloat16)
        ep = expert_parallel(model, layout="same_tokens", max_tokens_per_rank=256)
        L, I = ep.config.experts_per_rank, model32.config.ffn_config.ffn_hidden_size
        for name in ep.modules:  # this rank keeps the rows of its experts only: [rank L I, (rank + 1) L I)
            mlp, whole = model.get_submodule(name).mlp, model32.get_submodule(name).mlp
            for w in ("w1", "v1", "w2"):
                assert torch.equal(getattr(mlp, w), getattr(whole, w)[rank * L * I:(rank + 1) * L * I].bfloat16())
        out = hf_models.logits(model, PROMPT)
        assert torch.equal(out, expected), "the same tokens a rank must equal the virtual ranks' run"
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(f"dbrx rank {rank}: {L} experts of {I} rows a weight, logits equal to the virtual ranks'")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dbrx_as_two_processes(tmp_path):
    world = 2
    torch.multiprocessing.spawn(_dbrx_body, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                                join=True)
    for rank in range(world):
        print((tmp_path / f"rank{rank}").read_text())


# --- the two token layouts, one process per rank -----------------------------------------------


def _layouts_body(rank, world, store, family, result_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model32 = hf_models.tiny_model(family, SEED)
        envelope, ref_shared = hf_models.bf16_envelope(model32, PROMPT)
        # Each rank its own batch, of its own size; the bound is the model's own bf16 error on that
        # batch, over at least 224 tokens (tests/hf_models.py: fewer let one router near-tie dominate).
        own_prompt = hf_models.prompt(10 + rank, batch=4, length=56 + 2 * rank)
        envelope_own, ref_own = hf_models.bf16_envelope(model32, own_prompt)
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        virtual, _ = ep_model(model32, world)
        expected_shared = hf_models.logits(virtual, PROMPT)
        lines = []
        for layout in ("same_tokens", "own_tokens"):
            model = copy.deepcopy(model16)
            ep = expert_parallel(model, layout=layout, max_tokens_per_rank=256)
            assert (ep.virtual, ep.ranks, ep.config.world_size) == (False, [rank], world)
            for name in ep.modules:  # this rank keeps its experts only
                assert model.get_submodule(name).down_proj.shape[0] == hf_models.EXPERTS // world
            if layout == "same_tokens":  # every rank the same tokens: its slice dispatched, all rows gathered
                out = hf_models.logits(model, PROMPT)
                assert torch.equal(out, expected_shared), "the same tokens a rank must equal the virtual ranks' run"
                error = relative_l2(out, ref_shared)
                bound = envelope
            else:  # every rank its own tokens
                error = relative_l2(hf_models.logits(model, own_prompt), ref_own)
                bound = envelope_own
            lines.append(f"{layout} rank {rank}: {error:.3e} (bound {2 * bound:.3e})")
            assert error <= 2 * bound, lines[-1]
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_both_token_layouts_as_two_processes(tmp_path):
    world = 2
    torch.multiprocessing.spawn(_layouts_body, args=(world, str(tmp_path / "store"), "deepseek_v3", str(tmp_path)),
                                nprocs=world, join=True)
    for rank in range(world):
        print((tmp_path / f"rank{rank}").read_text())


def _generate_body(rank, world, store, result_dir):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails in a minute
    try:
        model = hf_models.tiny_model("qwen3_moe", SEED).to(torch.bfloat16)
        ep = expert_parallel(model, layout="own_tokens", max_tokens_per_rank=256)
        r = hf_models.stopping_at_different_steps(model, rank)
        S, step = r["ids"].shape[1], r["step"]
        assert torch.equal(r["out"], r["reference"][:, :S + step]), "the stopped generation is not the rank's own"
        slowest = 20
        assert r["forwards"] == slowest, f"rank {rank}: {r['forwards']} forwards, the slowest rank's {slowest} expected"
        line = (f"rank {rank}: {len(r['ids'])} prompt(s) of {S} tokens stop at step {step}: {r['out'].shape[1] - S} "
                f"tokens, equal to its own no-EOS generation's first {step}; {r['forwards']} forwards")
        experts = model.get_submodule(ep.modules[0])  # a full [E, ...] weight on a rank that holds E / W: refused
        experts.down_proj = torch.nn.Parameter(torch.zeros(hf_models.EXPERTS, *experts.down_proj.shape[1:],
                                                           dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(Qwen3MoeExperts\): down_proj is "
                                             r"\(8, 64, 32\); expert_parallel converted it as \(4, 64, 32\)"):
            hf_models.logits(model, r["ids"])
        ep.close()
        assert "generate" not in model.__dict__
        with open(os.path.join(result_dir, f"generate{rank}"), "w") as f:
            f.write(line)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_generate_across_processes_when_ranks_stop_at_different_steps(tmp_path):
    """Two processes (gloo, owned tokens): rank 0's prompts end (EOS) at generated step 1, rank
    1's at step 20. expert_parallel makes generate run with synced_gpus=True, so rank 0 keeps
    running forwards (20 on each rank) until rank 1 ends; no hang, and each rank's output is what
    it generates alone (its own no-EOS generation, cut at its EOS)."""
    world = 2
    torch.multiprocessing.spawn(_generate_body, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                                join=True)
    for rank in range(world):
        print((tmp_path / f"generate{rank}").read_text())


# --- refusals -------------------------------------------------------------------------------------


def test_refusals_name_the_class_and_the_reason(envelopes):
    model32 = envelopes["mixtral"][0]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(MixtralExperts\): gate_up_proj is "
                                         r"torch.float32; epgen dispatches bf16 rows"):
        expert_parallel(copy.deepcopy(model32), virtual=True, world_size=2)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"from_hf_config\(<MixtralConfig>\) \(mixtral\): EpConfig.num_experts=8: must be a multiple of "
                                         r"world_size=3"):
        expert_parallel(model16, virtual=True, world_size=3)
    with pytest.raises(ValueError, match="layout='expert': must be one of own_tokens, same_tokens"):
        expert_parallel(model16, virtual=True, world_size=2, layout="expert")
    with pytest.raises(ValueError, match="virtual=True: pass world_size"):
        expert_parallel(model16, virtual=True)
    for kw in ({}, {"world_size": 2}):  # no process group: a forgotten init_process_group is not W = 1
        with pytest.raises(ValueError, match=r"torch.distributed is not initialized; call "
                                             r"torch.distributed.init_process_group"):
            expert_parallel(copy.deepcopy(model16), backend="reference", **kw)
    one = copy.deepcopy(model16)
    assert expert_parallel(one, backend="reference", world_size=1).config.world_size == 1
    experts = model16.model.layers[1].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts \(MixtralExperts\): down_proj is torch.float8_e4m3fn"):
        expert_parallel(model16, virtual=True, world_size=2)
    converted, _ = ep_model(model32, 2)
    with pytest.raises(ValueError, match=r"layers.0.mlp.experts \(MixtralExperts\): already expert-parallel through "
                                         r"epgen"):
        expert_parallel(converted, virtual=True, world_size=2)
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="Sequential: no experts module built on transformers' experts conventions"):
        expert_parallel(dense, virtual=True, world_size=2)
    listed = torch.nn.Module()
    listed.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(ValueError, match=r"experts \(ModuleList\) holds per-expert modules \(Linear\), not a stack of "
                                         r"expert weights a grouped GEMM takes"):
        expert_parallel(listed, virtual=True, world_size=2)
    # Families outside the experts conventions that epgen does not read: the module, its class and why.
    for family, where in (("switch_transformers", r"encoder.block.1.layer.1.mlp.experts \(SwitchTransformersExperts\): "
                                                  r"per-expert dense modules"),
                          ("jetmoe", r"model.layers.0.mlp \(JetMoeMoE\): its experts \(JetMoeParallelExperts\)")):
        with pytest.raises(ValueError, match=where + ".*; epgen cannot run it"):
            expert_parallel(hf_models.family_model(family).to(torch.bfloat16), virtual=True, world_size=2)


def test_arguments_refused_like_moe_layer(envelopes):
    """The argument, its value and the rule, as MoELayer words them; nothing is converted."""
    model16 = copy.deepcopy(envelopes["qwen3_moe"][0]).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"model=None: must be a torch.nn.Module \(a loaded transformers model\), not "
                                        r"a NoneType"):
        expert_parallel(None, virtual=True, world_size=2)
    with pytest.raises(TypeError, match=r"virtual='yes': must be True or False"):
        expert_parallel(model16, virtual="yes", world_size=2)
    for flag in (0, 1, "yes"):
        with pytest.raises(TypeError, match=rf"grouped_mm={flag!r}: must be None, True or False"):
            expert_parallel(model16, virtual=True, world_size=2, grouped_mm=flag)
    assert not hasattr(model16.model.layers[0].mlp.experts, "_epgen_parallel")


def test_closed_experts_refuse_to_run(envelopes):
    model, ep = ep_model(envelopes["qwen3_moe"][0], 2)
    hf_models.logits(model, PROMPT[:1, :8])
    ep.close()
    with pytest.raises(RuntimeError, match=r"model.layers.0.mlp.experts \(Qwen3MoeExperts\): its epgen expert "
                                           r"parallelism was closed"):
        hf_models.logits(model, PROMPT[:1, :8])
    ep.close()  # twice: harmless


# --- the weights that run: the module's own, as they are now -------------------------------------


def _replace_parameters(model, source):
    """Every parameter of ``model`` replaced by a new Parameter holding ``source``'s value."""
    for name, value in source.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value.detach().clone()))


@pytest.mark.parametrize("how", ["load_state_dict(assign=True)", "to_empty then load_state_dict",
                                 "load_state_dict in place", "new Parameters"])
def test_weights_loaded_or_changed_after_conversion_are_the_ones_that_run(envelopes, how):
    """A model converted with one set of weights (seed 0), then given another (seed 1) in each way
    a user loads or changes weights, computes exactly what the model converted with the second set
    computes (the same kernels: bit-equal logits); the stale first set would be far off."""
    model32 = envelopes["qwen3_moe"][0]
    other16 = hf_models.tiny_model("qwen3_moe", SEED + 1).to(torch.bfloat16)
    expected = hf_models.logits(ep_model(other16, 2)[0], PROMPT)
    model, _ = ep_model(model32, 2)
    stale = relative_l2(hf_models.logits(model, PROMPT), expected)
    if how == "load_state_dict(assign=True)":
        model.load_state_dict(other16.state_dict(), assign=True)
    elif how == "to_empty then load_state_dict":
        model.to_empty(device="cpu")
        model.load_state_dict(other16.state_dict())
        with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are not in a state dict
            for (_, b), (_, ob) in zip(model.named_buffers(), other16.named_buffers()):
                b.copy_(ob)
    elif how == "load_state_dict in place":
        model.load_state_dict(other16.state_dict())
    else:
        _replace_parameters(model, other16)
    out = hf_models.logits(model, PROMPT)
    print(f"{how}: relative L2 to the model converted with the new weights {relative_l2(out, expected):.3e}; before "
          f"the change the model was {stale:.3f} away")
    assert torch.equal(out, expected)
    assert stale > 0.1


def test_meta_and_mismatched_weights_refused_naming_the_module(envelopes):
    model32 = envelopes["qwen3_moe"][0]
    with torch.device("meta"):
        meta = type(model32)(model32.config).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(Qwen3MoeExperts\): gate_up_proj is on the "
                                         r"meta device \(not loaded, no data\); load the weights before expert_parallel"):
        expert_parallel(meta, virtual=True, world_size=2)
    model, ep = ep_model(model32, 2)
    experts = model.model.layers[1].mlp.experts
    good = experts.down_proj
    experts.down_proj = torch.nn.Parameter(torch.empty_like(good, device="meta"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts \(Qwen3MoeExperts\): down_proj is on the meta "
                                         r"device \(not loaded, no data\); load the weights \(to_empty then "
                                         r"load_state_dict, or load_state_dict\(..., assign=True\)\) before running"):
        hf_models.logits(model, PROMPT[:1, :8])
    experts.down_proj = torch.nn.Parameter(good.detach()[:4].clone())  # one virtual rank's experts, not all 8
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts \(Qwen3MoeExperts\): down_proj is \(4, 64, 32\); "
                                         r"expert_parallel converted it as \(8, 64, 32\), the 8 experts this process "
                                         r"runs"):
        hf_models.logits(model, PROMPT[:1, :8])
    experts.down_proj = torch.nn.Parameter(good.detach().float())
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts \(Qwen3MoeExperts\): down_proj is torch.float32; "
                                         r"epgen runs bf16 experts"):
        hf_models.logits(model, PROMPT[:1, :8])
    experts.down_proj = good
    hf_models.logits(model, PROMPT[:1, :8])
    model.float()  # the whole model cast after the conversion: the first experts module names itself
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(Qwen3MoeExperts\): hidden_states \(8, 64\) "
                                         r"torch.float32 must be \[T, H\] torch.bfloat16 \(epgen runs the bf16 model"):
        hf_models.logits(model, PROMPT[:1, :8])


# --- torch.compile -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_compiled_model_is_one_graph_equal_to_eager(envelopes, family):
    """torch.compile(fullgraph=True) of the expert-parallel model: one graph, the experts call an
    opaque operator (epgen::transformers_experts) inside it; backend aot_eager runs the same
    kernels, so the logits equal eager's bit for bit. (Inductor fuses the rest of the model
    differently: about 33 s of CPU compile, 0.0097 relative L2 to eager for qwen3_moe, measured
    once; the GPU test runs it.)"""
    model32, envelope, ref = envelopes[family]
    model, _ = ep_model(model32, 2)
    eager = hf_models.logits(model, PROMPT)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = hf_models.logits(compiled, PROMPT)
    print(f"{family}: compiled vs eager relative L2 {relative_l2(out, eager):.3e}; vs float32 "
          f"{relative_l2(out, ref):.3e} (model's own bf16 {envelope:.3e})")
    assert torch.equal(out, eager)


def test_compiled_llama4_block_is_one_graph_equal_to_eager():
    """llama4's MoE block forward replaced by epgen's (router, then the epgen::transformers_experts
    operator on input-weighted experts) compiles into one graph (fullgraph=True) with the same
    logits as eager."""
    model32 = hf_models.family_model("llama4")
    model, _ = ep_model(model32, 2)
    eager = hf_models.logits(model, PROMPT)
    torch._dynamo.reset()
    assert torch.equal(hf_models.logits(torch.compile(model, backend="aot_eager", fullgraph=True), PROMPT), eager)


@pytest.mark.slow
def test_compiled_calls_see_their_own_phase_and_generate_as_eager(envelopes):
    """A compiled function applies the Python attribute writes it traced (the phase pre-hook's)
    only after its graph ends: during a decode the handle still says "prefill" (measured: the
    handle's phase lags one call). The operator takes the phase as an argument, read where the
    forward runs, so each experts call sees its own forward's phase. A model compiled in place
    (``model.compile``) generates as eager does."""
    model32, _, _ = envelopes["qwen3_moe"]
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ep = expert_parallel(model, backend="reference", world_size=1)
    ids = PROMPT[:2, :8]
    eager, _ = hf_models.greedy(model, ids, tokens=3)
    seen, run = [], ep.run_module
    ep.run_module = lambda experts, x, i, w, phase: seen.append((phase, ep.phase)) or run(experts, x, i, w, phase)
    torch._dynamo.reset()
    model.compile(backend="aot_eager")
    compiled, _ = hf_models.greedy(model, ids, tokens=3)
    assert [p for p, _ in seen] == ["prefill"] * 2 + ["decode"] * 4, seen  # 2 layers: a prefill, 2 decodes
    print(f"(phase passed, handle's phase during the graph): {seen}")
    assert torch.equal(compiled, eager)


def test_tokens_above_the_buffers_and_gradients_refused(envelopes):
    model, ep = ep_model(envelopes["qwen3_moe"][0], 2, max_tokens_per_rank=4)
    assert ep.config.max_tokens_per_rank == 4
    with pytest.raises(ValueError, match=r"rank 0 passes 128 tokens to one dispatch, more than max_tokens_per_rank=4"):
        hf_models.logits(model, PROMPT)
    model, _ = ep_model(envelopes["qwen3_moe"][0], 2)  # the reference backend: no backward (training: backend epgen)
    with pytest.raises(RuntimeError, match=r"gradients need backend='epgen'.*run it under torch.no_grad\(\)"):
        model(PROMPT)
    model, _ = ep_model(envelopes["qwen3_moe"][0], 2, max_tokens_per_rank=128, backend="epgen")  # push kernels
    with pytest.raises(ValueError, match=r"convert with expert_parallel\(..., dispatch_transport='pull'\) to train, "
                                         r"or run inference under torch.no_grad\(\)"):
        model(PROMPT)


def test_a_model_loaded_with_the_epgen_implementation_alone_is_refused(envelopes):
    model = copy.deepcopy(envelopes["qwen3_moe"][0]).to(torch.bfloat16)
    model.set_experts_implementation("epgen")
    with pytest.raises(RuntimeError, match=r"Qwen3MoeExperts: experts_implementation='epgen' needs "
                                           r"epgen.integrations.transformers.expert_parallel\(model, ...\) first"):
        hf_models.logits(model, PROMPT)


@pytest.mark.slow
def test_forced_routing_reproduces_the_other_run_and_a_wrong_router_is_no_tie(envelopes):
    """``hf_models.routing(forced=...)`` runs a model on another run's routing: a model whose first
    router is negated (every token routed elsewhere) generates differently, and the original model
    forced onto its routing generates exactly what it did. ``check_generation`` refuses that
    difference as a routing near-tie: the routers' logits are far apart, not a rounding."""
    model32, envelope, _ = envelopes["qwen3_moe"]
    eager = hf_models.eager_bf16(model32)
    wrong = copy.deepcopy(eager)
    with torch.no_grad():
        wrong.model.layers[0].mlp.gate.weight.neg_()
    ids = PROMPT[:1, :8]
    with hf_models.routing(wrong) as routes:
        seq_wrong, _ = hf_models.greedy(wrong, ids)
    assert not torch.equal(seq_wrong, hf_models.greedy(eager, ids)[0])
    with hf_models.routing(eager, forced=routes) as seen:
        seq_forced, _ = hf_models.greedy(eager, ids)
    assert torch.equal(seq_forced, seq_wrong)
    assert not torch.equal(seen["model.layers.0.mlp.experts"][0]["index"], routes["model.layers.0.mlp.experts"][0]["index"])
    with pytest.raises(AssertionError, match="beyond a rounding drift"):
        hf_models.check_generation(wrong, eager, ids, envelope)


def test_prefill_and_decode_take_their_families_by_phase(envelopes):
    """One process a rank, own tokens, kernel_family "auto": no rank sees its peers' counts, so
    the family comes from the phase every rank runs alike: the model's forward with one position a
    sequence is a decode (the low-latency family), any other a prefill (the normal family); the
    same_tokens layout takes the family of the largest slice, the same on every rank. The phase
    is read by a pre-hook on the model, removed at close."""
    from epgen.integrations.transformers import ExpertParallel

    model32, _, _ = envelopes["qwen3_moe"]
    model = copy.deepcopy(model32).to(torch.bfloat16)
    hooks = len(model._forward_pre_hooks)
    ep = expert_parallel(model, backend="reference", world_size=1)
    seen = []
    model.register_forward_hook(lambda *_: seen.append(ep.phase))
    hf_models.greedy(model, PROMPT[:2, :8], tokens=3)
    assert seen == ["prefill", "decode", "decode"]
    seen.clear()  # a one-token prompt is a prefill (an empty cache), as a peer's longer prompt is
    hf_models.greedy(model, PROMPT[:1, :1], tokens=2)
    assert seen == ["prefill", "decode"]
    assert len(model._forward_pre_hooks) == hooks + 1
    ep.close()
    assert len(model._forward_pre_hooks) == hooks

    cfg = types.SimpleNamespace(world_size=2, kernel_family="auto", layout="expert")
    op = types.SimpleNamespace(local_ranks=[1], low_latency_tokens=128, config=cfg, virtual=False,
                               family=lambda t: "low_latency" if t <= 128 else "normal")
    own = ExpertParallel(cfg, op, backend="epgen", layout="own_tokens", virtual=False, group=None, grouped_mm=True,
                         modules=[])
    for phase, want in (("prefill", "normal"), ("decode", "low_latency")):
        own.phase = phase
        assert [own.family(t) for t in (0, 127, 128, 129)] == [want] * 4
    op.low_latency_tokens = 0  # an op without the low-latency family decodes with the normal one
    assert own.family(1) == "normal"
    same = ExpertParallel(cfg, op, backend="epgen", layout="same_tokens", virtual=False, group=None,
                          grouped_mm=True, modules=[])
    assert [same.family(t) for t in (255, 256, 257)] == ["low_latency", "low_latency", "normal"]
    cfg.kernel_family = "normal"  # a fixed family: the op's own
    assert own.family(5) is None and same.family(5) is None


def test_the_former_layout_names_are_deprecated_aliases(envelopes):
    """``"owned"`` and ``"replicated"`` still run, as ``"own_tokens"`` and ``"same_tokens"``, with a
    DeprecationWarning naming the new name."""
    model32 = envelopes["qwen3_moe"][0]
    for old, new in (("owned", "own_tokens"), ("replicated", "same_tokens")):
        model = copy.deepcopy(model32).to(torch.bfloat16)
        with pytest.warns(DeprecationWarning, match=f"layout='{old}' is deprecated: use layout='{new}'"):
            ep = expert_parallel(model, virtual=True, world_size=2, layout=old)
        assert ep.layout == new


# --- sharded at load through transformers' expert-parallel registry (5.23 and later) ----------


def _expert_bytes(model) -> tuple[int, int]:
    """(bytes this process holds of the experts modules' weights, bytes of the rest), local shards
    of DTensors counted as held."""
    experts = rest = 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        n = local.numel() * local.element_size()
        if ".experts." in name:
            experts += n
        else:
            rest += n
    return experts, rest


def _registry_body(rank, world, store, path, family, result_dir):
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    from epgen.integrations.transformers import loaded_expert_parallel, register_ep_implementation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model32 = hf_models.tiny_model(family, SEED)
        model_cls = getattr(transformers, hf_models.FAMILIES[family][1])
        full_experts, full_rest = _expert_bytes(model_cls.from_pretrained(path, dtype=torch.bfloat16))  # whole
        envelope, ref_same = hf_models.bf16_envelope(model32, PROMPT)
        own_prompt = hf_models.prompt(10 + rank, batch=4, length=56 + 2 * rank)
        envelope_own, ref_own = hf_models.bf16_envelope(model32, own_prompt)
        eager = hf_models.eager_bf16(model32)
        configs = {  # every rank the same batch: the expert group is the tensor-parallel group, no TP rule applied
            "same_tokens": DistributedConfig(tp_size=world, tp_plan={}, ep_size=world, ep_implementation="epgen"),
            # each rank its own batch: the dense weights are FSDP-sharded across the same ranks
            "own_tokens": DistributedConfig(fsdp_size=world, ep_size=world,
                                            ep_implementation=register_ep_implementation("epgen-256",
                                                                                         max_tokens_per_rank=256))}
        lines = []
        for layout, dc in configs.items():
            model = model_cls.from_pretrained(path, dtype=torch.bfloat16, distributed_config=dc)
            ep = loaded_expert_parallel(model)
            assert (ep.layout, ep.backend, ep.virtual, ep.ranks, ep.config.world_size) == (
                layout, "reference", False, [rank], world)
            assert ep.modules == [f"model.layers.{i}.mlp.experts" for i in range(2)]
            assert ep.config.max_tokens_per_rank == (256 if layout == "own_tokens" else 4096)
            assert "generate" in model.__dict__  # generate defaults to synced_gpus=True (ranks end at different steps)
            L = hf_models.EXPERTS // world
            for name in ep.modules:  # this rank holds experts [rank L, (rank + 1) L) only
                experts = model.get_submodule(name)
                assert experts._epgen_parallel is ep
                full = model32.get_submodule(name)
                for w, p in experts.named_parameters(recurse=False):
                    local = p.to_local()
                    assert local.shape == (L, *full.get_parameter(w).shape[1:]), (name, w, local.shape)
                    assert torch.equal(local, full.get_parameter(w)[rank * L:(rank + 1) * L].to(torch.bfloat16))
            held_experts, held_rest = _expert_bytes(model)
            assert held_experts * world == full_experts, (held_experts, full_experts)
            if layout == "same_tokens":
                assert held_rest == full_rest
                out = hf_models.logits(model, PROMPT)
                error, bound, ids = relative_l2(out, ref_same), envelope, PROMPT[:1, :8]
            else:
                error, bound = relative_l2(hf_models.logits(model, own_prompt), ref_own), envelope_own
                ids = own_prompt[:1, :8]
            assert error <= 2 * bound, f"{layout} rank {rank}: {error:.3e} > 2 x {bound:.3e}"
            verdict = hf_models.check_generation(model, eager, ids, bound)
            assert ep.phase == "decode"  # the phase hook saw the generation's last step
            lines.append(f"{layout} rank {rank}: experts {held_experts} of {full_experts} bytes, the rest "
                         f"{held_rest} of {full_rest}; logits {error:.3e} (bound {2 * bound:.3e}); generation "
                         f"{verdict}")
            ep.close()
            assert "generate" not in model.__dict__
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_at_load_through_transformers_registry(tmp_path):
    """``from_pretrained(..., distributed_config=DistributedConfig(ep_size=2, ep_implementation="epgen"))``
    as two processes (gloo, the reference backend): each rank reads and holds only its E / W experts
    of every layer (DTensor shards, local shapes and values checked, bytes counted), the experts run
    through epgen (``loaded_expert_parallel``), both token layouts from the meshes, logits within 2 x
    the model's own bf16 error and greedy generation as the eager model's (``check_generation``)."""
    from epgen.integrations.transformers import HAS_EP_REGISTRY

    if not HAS_EP_REGISTRY:
        pytest.skip("transformers before 5.23 has no expert-parallel registry: expert_parallel is the path there")
    pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate")
    family, world = "deepseek_v3", 2
    hf_models.tiny_model(family, SEED).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    torch.multiprocessing.spawn(_registry_body, args=(world, str(tmp_path / "store"), str(tmp_path / "model"), family,
                                                      str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        print((tmp_path / f"rank{rank}").read_text())


def test_the_registry_path_refusals(envelopes, monkeypatch):
    """A model not loaded through the registry has no epgen handle to return; transformers without
    the registry (5.17-5.22) refuses a registration and names the path that works there."""
    import epgen.integrations.transformers as integration

    model = copy.deepcopy(envelopes["qwen3_moe"][0]).to(torch.bfloat16)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM: no experts module loaded through "
                                         "ep_implementation='epgen'"):
        integration.loaded_expert_parallel(model)
    expert_parallel(model, virtual=True, world_size=2)  # converted after loading: not the registry's
    with pytest.raises(ValueError, match="no experts module loaded through"):
        integration.loaded_expert_parallel(model)
    monkeypatch.setattr(integration, "HAS_EP_REGISTRY", False)
    with pytest.raises(RuntimeError, match=r"no expert-parallel plug-in registry \(5.23 added "
                                           r"EPImplementationInterface\); load the model and call expert_parallel"):
        integration.register_ep_implementation("epgen-x")


@pytest.mark.parametrize("override", [dict(dtype="fp8"), dict(scale_bytes=16), dict(nodes=2)])
def test_overrides_the_experts_cannot_take_are_refused(envelopes, override):
    model = copy.deepcopy(envelopes["qwen3_moe"][0]).to(torch.bfloat16)
    (name, value), = override.items()
    with pytest.raises(ValueError, match=rf"expert_parallel\({name}={value!r}\): the experts dispatch"):
        expert_parallel(model, virtual=True, world_size=2, **override)
