"""Shared pieces of the host-emulation contract tests (tests/host): small configs, ops on the host
emulation with a named schedule seed, the local kernels' geometry, and a parallel warm-up of the
host compile cache.

The GPU tests' checks run unchanged through ``epgen.harness`` (``run_round``, ``run_exact_round``,
``run_expert_round``, ``check_round``); what differs is the op: ``EpDispatchCombine(cfg,
device="cpu", arch=..., schedule=Schedule(seed=...))`` runs the arch's kernels on the fiber
emulation (``epgen.host``). Every op of these tests has its own ``Schedule`` seed, named in the
failure (``seeded``): a failing test replays alone with the same seed.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from epgen.codegen.config import EpConfig
from epgen.host import GEOMETRY, Schedule

ARCHES = ("sm_90", "gfx942", "gfx950", "gfx1250")
LANES = {"sm_90": 32, "gfx942": 64, "gfx950": 64, "gfx1250": 32}
"""The wave size each arch's rendering runs with (``epgen.codegen.arch.traits``)."""

HIDDEN = 128
TMAX = 32
TIMEOUT_S = 5.0
"""Kernel wait bound where it is not under test. Virtual ranks run on the scheduler's clock (50 ns a
step), so it never fires in a correct run; processes run on the OS clock."""
PROCS_TIMEOUT_S = 20.0
"""Kernel wait bound of the multi-process tests: W processes on two busy cores, each launch a few
hundred fibers on one thread, so a peer may be descheduled for seconds."""

def cfg(world_size: int, family: str = "normal", *, hidden: int = HIDDEN, topk: int = 4, experts_per_rank: int = 3,
        tmax: int = TMAX, timeout_s: float = TIMEOUT_S, **kw) -> EpConfig:
    """The small layer of the host tests: H 128, top-4 of 3 experts a rank, 32 tokens a rank,
    the host's geometry written out (so ``op.config`` equals the config the test built, and
    ``Plan.build`` of it is what the op compiles)."""
    geo = dict(dispatch_geometry=GEOMETRY, combine_geometry=GEOMETRY)
    if family != "normal":
        geo["low_latency_geometry"] = GEOMETRY
    geo.update(kw)
    return EpConfig(world_size=world_size, hidden=hidden, topk=topk, num_experts=world_size * experts_per_rank,
                    max_tokens_per_rank=tmax, kernel_family=family, timeout_s=timeout_s, **geo)


SEED_OFFSET = int(os.environ.get("EPGEN_HOST_SEED_OFFSET", "0"))
"""Added to every test's seed: ``EPGEN_HOST_SEED_OFFSET=1 pytest tests/host`` runs every schedule anew
(a failure names its seed either way)."""


def seed_of(name: str) -> int:
    """A stable Schedule seed for a test (or case) name: distinct names, distinct seeds, spaced
    10^4 apart (launch i of an op runs with seed + i), plus ``SEED_OFFSET``."""
    return (zlib.crc32(name.encode()) % 100_000) * 10_000 + SEED_OFFSET


def host_op(config: EpConfig, arch: str, seed: int, *, virtual: bool = True, validate: bool = True, **schedule):
    """``EpDispatchCombine`` of ``config`` on the host emulation of ``arch`` with
    ``Schedule(seed=seed, **schedule)`` (virtual ranks, or this process's rank of a process group)."""
    from epgen.op import EpDispatchCombine

    op = EpDispatchCombine(config, virtual=virtual and config.world_size > 1, device="cpu", arch=arch,
                           validate=validate, schedule=Schedule(seed=seed, **schedule))
    assert op.config == config, "the host took another geometry than the test's"
    return op


@contextlib.contextmanager
def seeded(op_or_seed, what: str = ""):
    """Name the op's schedule (seed, arch, launches so far) in any exception raised inside."""
    try:
        yield
    except BaseException as e:
        if isinstance(op_or_seed, int):
            note = f"[host emulation: Schedule(seed={op_or_seed}){' ' + what if what else ''}]"
        else:
            p = op_or_seed.platform
            note = (f"[host emulation {op_or_seed.arch}, W={op_or_seed.config.world_size}: Schedule(seed="
                    f"{p.schedule.seed}), {p.launches} launches so far (launch i runs seed + i)"
                    f"{'; ' + what if what else ''}]")
        if hasattr(e, "add_note"):
            e.add_note(note)
        elif e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]} {note}",) + e.args[1:]
        raise


@contextlib.contextmanager
def host_module():
    """What a host test module runs under: one torch intra-op thread (the reference's CPU
    ``index_add_`` took 0.1-0.5 s a call with two threads on two busy cores, 1 ms with one),
    restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def in_host_process(rank: int, world_size: int, body, *args) -> None:
    """``run_ranks`` entry: ``body(rank, world_size, *args)`` under ``host_module``'s settings,
    restored after (the pool's processes serve later tests too)."""
    with host_module():
        body(rank, world_size, *args)


def warm(jobs, workers: int | None = None) -> int:
    """Compile the host sources of ``jobs`` ((config, arch, grid ranks) each) into the host cache,
    ``workers`` clang processes at a time (default: every core), each distinct source once.
    Returns how many sources it compiled or found. Errors are left to the op that builds the
    config (it renders and compiles the same source again, and raises there, in its test)."""
    from epgen.codegen.render import render_host
    from epgen.host import HostPlatform, compile_source

    texts = {}
    for config, arch, ranks in jobs:
        try:
            plan = HostPlatform(arch).plan(config, arch, ranks)
            for variants in plan.variants.values():
                for _, spec in variants:
                    text = render_host(spec).text
                    texts.setdefault(text, None)
        except Exception:  # noqa: BLE001 (the test that builds it reports it)
            continue

    def one(text):
        try:
            compile_source(text)
        except Exception:  # noqa: BLE001
            pass

    with ThreadPoolExecutor(max_workers=workers or max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(one, texts))
    return len(texts)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
