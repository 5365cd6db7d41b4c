"""The host emulation's scheduler: seeds replay exactly, seeds differ, delays keep rounds exact,
and a grid that cannot finish raises HostError instead of hanging (docs/host.md)."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from epgen.codegen.config import EpConfig

CFG = EpConfig(world_size=2, hidden=128, topk=2, num_experts=4, max_tokens_per_rank=16, timeout_s=2.0)


def _op(arch="gfx942", cfg=CFG, **schedule):
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine

    return EpDispatchCombine(cfg, virtual=True, device="cpu", arch=arch, validate=True,
                             schedule=Schedule(**schedule))


def _round(op, seed=3, tokens=(11, 7)):
    from epgen.harness.verify import integer_inputs, run_exact_round

    cfg = op.config
    return run_exact_round(op, cfg, integer_inputs(cfg, list(tokens), "uniform", seed, device=op.device))


def _outputs(op):
    return [t.clone() for t in (op.recv_buffers(r).recv_x for r in range(op.config.world_size))]


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_a_seed_replays_exactly(arch):
    runs = []
    for _ in range(2):
        op = _op(arch, seed=41)
        _round(op)
        runs.append(([(k, s, st) for k, s, st in op.platform.stats], _outputs(op)))
        op.close()
    assert runs[0][0] == runs[1][0]  # every launch: kernel, seed and every counter of the scheduler
    assert all(a.view(torch.int16).equal(b.view(torch.int16)) for a, b in zip(runs[0][1], runs[1][1]))


def test_seeds_interleave_differently():
    steps = set()
    for seed in range(3):
        op = _op(seed=seed)
        _round(op)
        steps.add(tuple(st["switches"] for _, _, st in op.platform.stats))
        op.close()
    assert len(steps) == 3, steps


@pytest.mark.parametrize("delays", [{1: 3000}, {(0, 1): 2000}, {0: 500, (1, 0): 1500}])
def test_delayed_ranks_and_blocks_keep_rounds_exact(delays):
    op = _op(seed=7, delays=delays)
    for seed in range(3):
        _round(op, seed=seed, tokens=(16, seed * 5))
    op.close()


def _inject(text: str, code: str) -> str:
    """``code`` at the start of the kernel's body."""
    out, n = re.subn(r"(EP_KERNEL\(kThreads\) epgen_\w+\(const EP_GRID_CONSTANT EpArgs a\) \{\n)", r"\1  " + code + "\n",
                     text)
    assert n == 1
    return out


@pytest.fixture
def inject(monkeypatch):
    import epgen.host

    def apply(code):
        original = epgen.host.render_host

        def render(spec):
            src = original(spec)
            return attrs.evolve(src, text=_inject(src.text, code), key=src.key + "+inject")

        monkeypatch.setattr(epgen.host, "render_host", render)

    return apply


@pytest.mark.slow
def test_a_deadlock_raises_host_error_naming_the_waits(inject):
    from epgen.host import HostError

    # lane 0 waits at a wave collective for lanes that wait at the block barrier for lane 0
    inject("if (ep_thread_idx() == 0) (void)ep_ballot(true); else ep_sync_block();")
    op = _op(seed=2)
    with pytest.raises(HostError, match=r"seed 2\): deadlock.*127 of 128 threads at the barrier.*1 of 64 lanes"):
        _round(op)


@pytest.mark.slow
def test_a_grid_past_max_steps_raises_host_error(inject):
    from epgen.host import HostError

    inject("if (ep_thread_idx() == 0) for (;;) ep_backoff();")  # thread 0 spins forever, the others wait for it
    op = _op(seed=0, max_steps=20_000)
    with pytest.raises(HostError, match="ran past 20000 scheduler steps"):
        _round(op)
    from epgen.op import EpError

    with pytest.raises(EpError, match="unusable after that fault"):  # its buffers are mid-call
        _round(op)


@pytest.mark.parametrize("bad", [dict(seed=-1), dict(seed=2**64), dict(seed=True), dict(preempt=1.5), dict(hold=-0.1),
                                 dict(max_steps=0), dict(max_steps=2**64), dict(delays={-1: 3}), dict(delays={0: -5}),
                                 dict(delays={1: 2**64}), dict(delays={(0, 1, 2): 3})])
def test_schedule_refuses_bad_values(bad):
    from epgen.host import Schedule

    with pytest.raises(ValueError, match=r"Schedule\.\w+"):
        Schedule(**bad)


def test_host_options_need_device_cpu():
    from epgen.host import Schedule
    from epgen.op import EpDispatchCombine

    with pytest.raises(ValueError, match="only the host emulation"):
        EpDispatchCombine(CFG, virtual=True, arch="gfx942")
    with pytest.raises(ValueError, match="only the host emulation"):
        EpDispatchCombine(CFG, virtual=True, schedule=Schedule())
    with pytest.raises(ValueError, match="gfx9000"):
        EpDispatchCombine(CFG, virtual=True, device="cpu", arch="gfx9000")


@pytest.mark.slow
def test_a_memory_fault_raises_host_error_naming_the_thread(inject):
    from epgen.host import HostError

    inject("if (ep_thread_idx() == 5 && ep_block_idx() == 1) *(volatile int*)8 = 1;")
    op = _op(seed=1)
    with pytest.raises(HostError, match=r"memory fault \(signal 11\) at address 0x8 in thread 5 of block \(x 1"):
        _round(op)


def test_a_delay_of_a_rank_the_op_lacks_is_refused():
    with pytest.raises(ValueError, match=r"Schedule.delays\[5\]: rank 5 of world_size=2"):
        _op(delays={5: 100})


def test_shared_segments_go_with_the_op():
    import gc
    import os

    op = _op()
    paths = [a.path for a in op.platform._allocations.values()]
    assert paths and all(os.path.exists(p) for p in paths)
    del op
    gc.collect()
    assert not any(os.path.exists(p) for p in paths)  # not only at close(): /dev/shm is memory


def test_a_schedule_that_is_not_one_is_refused():
    from epgen.host import HostPlatform

    with pytest.raises(TypeError, match=r"schedule='fast': must be None or an epgen.host.Schedule"):
        HostPlatform("sm_90", "fast")
