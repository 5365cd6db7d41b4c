"""Edits of the protocol that must fail on the host emulation (docs/host.md, "Mutations").

Each mutation is a text edit of the rendered host source of a small config (``MUTATIONS``: the
text it removes or replaces must be there, so a template change cannot turn a mutation into a
no-op unseen). Each runs the scenario that exposes it, seed after seed, and must fail within
``SEEDS`` seeds; the failing seed is named. The same scenarios pass unmutated in
tests/host/ (the contract tests) and here (``test_scenarios_pass_unmutated``).
"""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from epgen.codegen.config import EpConfig

SEEDS = 6
"""Seeds a mutation may take to fail (each seed a fresh op, a few rounds)."""
TIMEOUT_S = 5.0
"""The kernels' wait bound: the processes' clock is the OS's, and a hung peer costs this much."""

MUTATIONS = {
    # the low-latency dispatch's flags in one slot, any later generation accepted (the parity
    # buffers and the exact-generation check reverted)
    "single_slot_ll_flag": (("ep_poll_flag<true>(a, rank, flags + j, gen, kPhaseLlDispatch", "ep_poll_flag<false>(a, rank, flags + j, gen, kPhaseLlDispatch"),
                            ("s_rows[p] = ep_flag_is(seen, gen)", "s_rows[p] = ep_flag_reached(seen, gen)"),
                            ("kSigLlDispatchFrom + (int)(gen & 1u) * kSigLlDispatchFromParity", "kSigLlDispatchFrom + 0"),
                            ("kSigLlDispatchFrom + (int)(s_gen & 1u) * kSigLlDispatchFromParity", "kSigLlDispatchFrom + 0")),
    # a rank's recoverable fault reaches its own records only
    "no_fault_hand_off": (("for (int d = lane; d < kWorld; d += kWave) {\n    ep_u32* rec = ep_fault_record(a, d, records, gen, rank);",
                           "for (int d = lane; d < kWorld; d += kWave) if (d == rank) {\n    ep_u32* rec = ep_fault_record(a, d, records, gen, rank);"),),
    # the flag fan-out without its release fence
    "no_release_before_fan_out": (("  ep_sync_warp();\n  ep_fence_release_system();\n  for (int d = lane; d < kWorld; d += kWave) ep_store_relaxed_system",
                                   "  ep_sync_warp();\n  for (int d = lane; d < kWorld; d += kWave) ep_store_relaxed_system"),),
    # the low-latency receiving phase reads rows with no acquire after its polls
    "no_acquire_after_ll_polls": (("if (tid < kFlags) ep_fence_after_poll();", "if (false) ep_fence_after_poll();"),),
    # the low-latency flags raised with no block barrier after the block's rows
    "no_barrier_before_ll_flags": (("  ep_sync_block_for_release();\n  if (tid < kWorld) {\n    const ep_u64 info",
                                    "  if (tid < kWorld) {\n    const ep_u64 info"),
                                   ("ep_sync_block_for_release();  // every thread's rows before the flags' releases", "")),
    # the overflow word kept after it was reported: it outlives its call
    "overflow_word_kept": (("      ep_store_relaxed_system(need, 0ull);\n", ""),),
}
"""name -> ((text, replacement), ...) applied to every host source that holds the text; at least
one source of the scenario's op must hold each edit's text."""

ARCHES = ("sm_90", "gfx942", "gfx950", "gfx1250")
RUN_ON = {
    # runs of W processes cost seconds each (a pool restarts after every failing run): one arch each
    "single_slot_ll_flag": ("gfx1250",),
    "no_fault_hand_off": ("sm_90",),
    "no_release_before_fan_out": ("sm_90", "gfx942"),
    # sm_90 polls with acquire loads (platform/nvidia.j2): the fence after the polls is empty there
    "no_acquire_after_ll_polls": ("gfx942", "gfx1250"),
    "no_barrier_before_ll_flags": ("sm_90", "gfx950"),
    "overflow_word_kept": ("gfx942", "sm_90"),
}
"""The arches each mutation's scenario runs on."""


def _mutate(name: str | None) -> None:
    """Make epgen.host render every source with mutation ``name`` applied (None: as it is; the
    processes of ``run_ranks`` stay up between runs, so each run sets its own)."""
    import epgen.host as host

    _unmutate()
    if name is None:
        return
    original = host.render_host.__wrapped__ if hasattr(host.render_host, "__wrapped__") else host.render_host

    def render(spec):
        src = original(spec)
        text = src.text
        for old, new in MUTATIONS[name]:
            text = text.replace(old, new)
        return attrs.evolve(src, text=text, key=src.key + f"+{name}")

    render.__wrapped__ = original
    host.render_host = render


def _config(W: int, family: str, **kw) -> EpConfig:
    return EpConfig(world_size=W, hidden=128, topk=2, num_experts=2 * W, max_tokens_per_rank=16,
                    kernel_family=family, timeout_s=TIMEOUT_S, **kw)


# ---- scenarios: each raises AssertionError (or the op's errors) when the protocol breaks -------

def _rounds_body(rank, W, arch, family, mutation, seed, whole=False):
    """Exact rounds on virtual ranks (one process drives all W). ``whole``: the low-latency calls
    run as one kernel on every vendor (epgen.plan.WHOLE_LOW_LATENCY; AMD's plan takes the halves,
    where a receiving half starts after every rank's sending half ended)."""
    import epgen.plan
    from epgen.harness.verify import integer_inputs, run_exact_round
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine

    _mutate(mutation)
    cfg = _config(W, family)
    saved = dict(epgen.plan.WHOLE_LOW_LATENCY)
    if whole:
        epgen.plan.WHOLE_LOW_LATENCY.update(amd=True)
    try:
        op = EpDispatchCombine(cfg, virtual=True, device="cpu", arch=arch, schedule=Schedule(seed=seed),
                               validate=True)
    finally:
        epgen.plan.WHOLE_LOW_LATENCY.update(saved)
    try:
        for k in range(3):
            tokens = [(5 + 7 * (k + r + seed)) % (cfg.max_tokens_per_rank + 1) for r in range(W)]
            run_exact_round(op, cfg, integer_inputs(cfg, tokens, "uniform", 1000 * seed + k, device=op.device))
    finally:
        op.close()


def _short_y_rounds_body(arch, mutation, seed):
    """Virtual ranks: rank W - 1 passes a short y to combine; the call raises, and every rank's
    receiving kernel consumed the fault's records (none left), then exact rounds follow."""
    from epgen.harness.verify import (check_no_record_left, integer_expert_stage, integer_inputs, op_inputs,
                                      run_exact_round)
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine, EpError

    _mutate(mutation)
    W = 3
    cfg = _config(W, "normal")
    op = EpDispatchCombine(cfg, virtual=True, device="cpu", arch=arch, schedule=Schedule(seed=seed), validate=True)
    try:
        for call in range(2):
            outs = op.dispatch(*op_inputs(op, integer_inputs(cfg, [16] * W, "uniform", seed + call, device=op.device)))
            ys = [integer_expert_stage(op, r) for r in range(W)]
            ys[-1] = ys[-1][: max(int(outs[-1].num_recv) - 1, 0)]
            with pytest.raises(EpError, match="combine: y has"):
                op.combine(ys)
            check_no_record_left(op, f"seed {seed}, short y in call {call}")
            run_exact_round(op, cfg, integer_inputs(cfg, [5] * W, "uniform", seed + 10 + call, device=op.device))
            check_no_record_left(op, f"seed {seed}, the round after call {call}")
    finally:
        op.close()


def _overflow_rounds_body(arch, mutation, seed):
    """Virtual ranks: a dispatch that overflows rank 0's receive rows raises (recoverable), then
    exact rounds follow with no fault left over."""
    from epgen.harness.verify import check_no_record_left, integer_inputs, op_inputs, run_exact_round
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine, EpError

    _mutate(mutation)
    W = 3
    cfg = _config(W, "normal", max_recv_tokens=12)
    op = EpDispatchCombine(cfg, virtual=True, device="cpu", arch=arch, schedule=Schedule(seed=seed), validate=True)
    try:
        over = integer_inputs(cfg, [cfg.max_tokens_per_rank] * W, "one_rank", seed, device=op.device)
        with pytest.raises(EpError, match="needed .* rows"):
            op.dispatch(*op_inputs(op, over))
        for k in range(4):  # calls g + 1 .. g + 4: both parities of every signal word
            run_exact_round(op, cfg, integer_inputs(cfg, [4] * W, "uniform", seed + 1 + k, device=op.device))
            check_no_record_left(op, f"seed {seed}, round {k} after the overflow")
    finally:
        op.close()


def _dispatch_again_body(rank, W, arch, family, mutation, seed):
    """Processes: the last rank receives each call late (a sleep between its halves); the others
    dispatch again meanwhile. Every row exact (tests/gpu/test_processes.py's scenario)."""
    from epgen.harness.verify import (check_exact_combine, check_exact_dispatch, expect, integer_expert_stage,
                                      integer_inputs, op_inputs, poison)
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine

    _mutate(mutation)
    cfg = _config(W, family)
    op = EpDispatchCombine(cfg, device="cpu", arch=arch, schedule=Schedule(seed=seed))
    slow = W - 1
    try:
        for round_ in range(2):
            calls = []
            for k in range(2):
                tokens = [(7 + 13 * (k + r + round_ + seed)) % (cfg.max_tokens_per_rank + 1) for r in range(W)]
                inputs = integer_inputs(cfg, tokens, "uniform", 100 * round_ + k + seed, device=op.device)
                exp = expect(cfg, inputs)
                poison(op, rank)
                if rank == slow and family == "low_latency":
                    handle = op.dispatch(*op_inputs(op, inputs), async_recv=True)
                    time.sleep(0.2)  # the receiving half runs late
                    out = handle.wait()
                else:
                    if rank == slow:
                        time.sleep(0.2)
                    out = op.dispatch(*op_inputs(op, inputs))
                check_exact_dispatch(rank, out, exp)
                calls.append(exp)
            ys = integer_expert_stage(op, rank)
            combined = op.combine(ys, out=torch.full((calls[-1].tokens[rank], cfg.hidden), float("nan"),
                                                     dtype=torch.bfloat16))
            check_exact_combine(rank, combined, calls[-1])
        op.synchronize()
    finally:
        torch.distributed.barrier()
        op.close()


def _fault_body(rank, W, arch, family, fault, mutation, seed):
    """Processes: rank W - 1 faults (a bad id, or a short y in combine); every rank raises, then
    exact rounds follow (tests/gpu/test_processes.py's scenario)."""
    from epgen.harness.verify import integer_expert_stage, integer_inputs, op_inputs, run_exact_round
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine, EpError

    _mutate(mutation)
    cfg = _config(W, family)
    op = EpDispatchCombine(cfg, device="cpu", arch=arch, schedule=Schedule(seed=seed), validate=True)
    culprit = W - 1
    good = lambda s: integer_inputs(cfg, [4] * W, "uniform", s, device=op.device)  # noqa: E731
    try:
        run_exact_round(op, cfg, good(seed))
        inputs = integer_inputs(cfg, [cfg.max_tokens_per_rank] * W, "uniform", seed + 1, device=op.device)
        if fault == "bad_id":
            inputs[culprit].indices[5, 1] = cfg.num_experts
        raised = ""
        try:
            out = op.dispatch(*op_inputs(op, inputs))  # validate=True: the faulted call raises itself
            y = integer_expert_stage(op, rank)
            n = int(out.num_recv.item())
            op.combine(y[: max(n - 1, 0)] if rank == culprit and fault == "short_y" else y)
        except EpError as e:
            raised = str(e)
        every = [None] * W
        torch.distributed.all_gather_object(every, raised)
        assert all(every), f"the fault was raised on ranks {[r for r in range(W) if every[r]]} only: {every}"
        for k in range(3):
            run_exact_round(op, cfg, good(seed + 10 + k))
    finally:
        torch.distributed.barrier()
        op.close()


SCENARIOS = {
    "single_slot_ll_flag": ("dispatch_again", "low_latency", None),
    "no_fault_hand_off": ("fault", "normal", "bad_id"),
    "no_release_before_fan_out": ("short_y_rounds", "normal", None),
    "no_acquire_after_ll_polls": ("whole_rounds", "low_latency", None),
    "no_barrier_before_ll_flags": ("rounds", "low_latency", None),
    "overflow_word_kept": ("overflow_rounds", "normal", None),
}
"""mutation -> (scenario, kernel family, fault)."""


def _run(scenario: str, arch: str, family: str, fault, mutation, seed: int, W: int):
    from epgen.harness.ranks import run_ranks

    if scenario == "short_y_rounds":
        _short_y_rounds_body(arch, mutation, seed)
    elif scenario == "overflow_rounds":
        _overflow_rounds_body(arch, mutation, seed)
    elif scenario in ("rounds", "whole_rounds"):
        _rounds_body(0, W, arch, family, mutation, seed, whole=scenario == "whole_rounds")
    elif scenario == "dispatch_again":
        run_ranks(W, _dispatch_again_body, arch, family, mutation, seed, timeout_s=240)
    else:
        run_ranks(W, _fault_body, arch, family, fault, mutation, seed, timeout_s=240)


def _sources(arch: str, cfg: EpConfig) -> list[str]:
    """The host sources of every kernel an op of ``cfg`` on ``arch`` builds (``HostPlatform.plan``)."""
    from epgen.codegen.render import render_host
    from epgen.host import HostPlatform

    plan = HostPlatform(arch).plan(cfg, arch, cfg.world_size)
    return [render_host(spec).text for variants in plan.variants.values() for _, spec in variants]


def _unmutate():
    import epgen.host as host

    if hasattr(host.render_host, "__wrapped__"):
        host.render_host = host.render_host.__wrapped__


@pytest.fixture(autouse=True)
def _restore_render():
    yield
    _unmutate()


def _fails(scenario, arch, family, fault, mutation, W) -> tuple[int, str] | None:
    """The first seed in range(SEEDS) whose run fails, with the failure's last line, or None. A
    source that does not compile is an error of the mutation, not a failure of the protocol."""
    for seed in range(SEEDS):
        try:
            _run(scenario, arch, family, fault, mutation, seed, W)
        except (AssertionError, RuntimeError, torch.multiprocessing.ProcessRaisedException,
                torch.multiprocessing.ProcessExitedException, TimeoutError) as e:
            text = str(e)
            if "host compile failed" in text:
                raise
            lines = [line for line in text.strip().splitlines() if line.strip()]
            # a process's exception ends its traceback; an assertion here starts with its message
            return seed, (lines[0] if isinstance(e, AssertionError) else lines[-1])[:300]
        finally:
            _unmutate()
    return None


@pytest.mark.slow
@pytest.mark.parametrize(("mutation", "arch"), [(m, a) for m in MUTATIONS for a in RUN_ON[m]])
def test_mutation_fails(mutation, arch):
    scenario, family, fault = SCENARIOS[mutation]
    W = 3 if scenario.endswith("rounds") else 2
    texts = _sources(arch, _config(W, family, **({"max_recv_tokens": 12} if mutation == "overflow_word_kept" else {})))
    missing = [old for old, _ in MUTATIONS[mutation] if not any(old in t for t in texts)]
    assert not missing, f"{mutation}: no source of the op on {arch} holds {missing}"
    failed = _fails(scenario, arch, family, fault, mutation, W)
    assert failed is not None, f"{mutation} ({scenario}, {family}, {arch}, W={W}) passed {SEEDS} seeds"
    print(f"\n{mutation} on {arch}: failed at seed {failed[0]}: {failed[1]}")


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_scenarios_pass_unmutated(mutation):
    scenario, family, fault = SCENARIOS[mutation]
    _run(scenario, "gfx942", family, fault, None, 0, 3 if scenario.endswith("rounds") else 2)
