"""The GPU test harness (``epgen.harness.verify.run_round``) on the CPU, against a stand-in op that follows
the contract with a scrambled row order; and a broken stand-in that the harness must catch."""

import types

import attrs

import pytest
import torch

from epgen import quant, reference
from epgen.harness.verify import run_round, wire_fp8_flavour
from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.config import EpConfig
from epgen.op import DispatchOutput


class ContractOp:
    """Virtual-rank op on the CPU: the reference's rows in a random order in capacity-sized buffers.
    ``arch``: the arch it stands for (none: a stand-in without one); its combine wire quantizes fp8
    in ``wire_flavour``, by default that arch's (``ArchTraits.fp8``), else e4m3fn."""

    virtual = True
    low_latency_tokens = 0  # one kernel family: every stress round is a normal one

    def family(self, tokens):
        return "normal"

    def __init__(self, cfg: EpConfig, break_rows: bool = False, combine_nudge: float = 0.0, arch: str | None = None,
                 wire_flavour: str | None = None):
        self.cfg, self.break_rows, self.combine_nudge = cfg, break_rows, combine_nudge
        self.config = cfg
        if arch is not None:
            self.arch = arch
        self.wire_flavour = wire_flavour or (traits(arch).fp8 if arch else "e4m3fn")
        self.device = torch.device("cpu")
        self.local_ranks = list(range(cfg.world_size))
        cap = cfg.world_size * cfg.max_tokens_per_rank
        self.arena_layout = types.SimpleNamespace(capacity_rows=cap)
        self._bufs = {r: DispatchOutput(
            recv_x=torch.empty(cap, cfg.hidden, dtype=torch.bfloat16), recv_weights=torch.empty(cap, cfg.topk),
            recv_indices=torch.empty(cap, cfg.topk, dtype=torch.int32), recv_scales=None,
            recv_src=torch.empty(cap, 2, dtype=torch.int32), num_recv=torch.zeros(1, dtype=torch.int32))
            for r in self.local_ranks}
        self._perm = {}

    def recv_buffers(self, rank):
        return self._bufs[rank]

    def dispatch(self, xs, ws, ids, ss, family=None):
        ref = reference.dispatch(xs, ws, ids, experts_per_rank=self.cfg.experts_per_rank)
        for r, rows in enumerate(ref):
            n, b = rows.num_rows, self._bufs[r]
            p = torch.randperm(n)
            self._perm[r] = p
            for got, want in ((b.recv_x, rows.x), (b.recv_weights, rows.weights), (b.recv_indices, rows.indices),
                              (b.recv_src, rows.src)):
                got[:n] = want[p]
            if self.break_rows and n:
                b.recv_x[0, 0] += 1
            b.num_recv[0] = n
        self._ref = ref
        return [self._bufs[r] for r in self.local_ranks]

    def combine(self, ys, out):
        inverse = [torch.argsort(self._perm[r]) for r in self.local_ranks]
        # what the wire carries: each rank's rows quantized and decoded as the kernels do
        ys_ref = [quant.combine_roundtrip(self.cfg.combine_quant, y[: len(inv)][inv], fp8_flavour=self.wire_flavour)
                  for y, inv in zip(ys, inverse)]
        tokens = [o.shape[0] for o in out]
        for o, r in zip(out, reference.combine(ys_ref, self._ref, tokens)):
            o.copy_(r * (1 + self.combine_nudge))
        return out

    def check(self):
        pass


CFG = EpConfig.for_model("mixtral-8x7b", world_size=4, max_tokens_per_rank=32)


@pytest.mark.parametrize("tokens,kind", [([32, 0, 5, 1], "uniform"), ([0, 0, 0, 0], "uniform"),
                                         ([7, 7, 7, 7], "invalid"), ([32, 32, 1, 0], "duplicates"),
                                         ([16, 3, 0, 9], "skewed"), ([9, 0, 32, 4], "one_rank"),
                                         ([32, 7, 0, 12], "shared")])
def test_harness_accepts_an_op_that_keeps_the_contract(tokens, kind):
    stats = run_round(ContractOp(CFG), CFG, tokens, kind, seed=3)
    assert stats["wire_mismatches"] == 0 and stats["bound_ratio"] <= 1 and len(stats["recv"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_harness_bounds_each_combine_wire(mode):
    cfg = attrs.evolve(CFG, combine_quant=mode)
    stats = run_round(ContractOp(cfg), cfg, [32, 5, 0, 17], "uniform", seed=5)
    # the stand-in decodes exactly like the reference: bit-equal, and a real (nonzero) quantization error
    assert stats["wire_mismatches"] == 0 and 0 < stats["bound_ratio"] <= 1 and stats["combine_err"] > 0.01
    # a quantized op checked as if the wire were bf16 is caught by the tighter bound
    with pytest.raises(AssertionError, match="above its bound"):
        run_round(ContractOp(cfg), CFG, [32, 5, 0, 17], "uniform", seed=5)
    # an output 30% off is outside even the fp4 bound
    with pytest.raises(AssertionError, match="above its bound"):
        run_round(ContractOp(cfg, combine_nudge=0.3), cfg, [32, 5, 0, 17], "uniform", seed=5)


def test_harness_catches_a_changed_row():
    with pytest.raises(AssertionError, match="recv_x row for source"):
        run_round(ContractOp(CFG, break_rows=True), CFG, [8, 8, 8, 8], "uniform", seed=4)


@pytest.mark.slow
def test_stress_counts_rounds_and_failures():
    from epgen.cli.stress import stress

    lines = []
    ok = stress(ContractOp(CFG), CFG, rounds=12, seed=1, report=lines.append)
    assert ok.rounds == 12 and ok.failures == () and 0 < ok.worst_bound_ratio <= 1 and len(lines) == 12
    bad = stress(ContractOp(CFG, break_rows=True), CFG, rounds=5, seed=1, report=lines.append)
    assert bad.rounds == 5 and 1 <= len(bad.failures) <= 5  # virtual: counts and goes on


def test_shared_routing_pins_the_last_slot_to_the_own_rank():
    from epgen.harness.verify import make_inputs

    cfg = EpConfig.for_model("deepseek-v3", world_size=8, max_tokens_per_rank=64)
    for rank, inp in enumerate(make_inputs(cfg, [64] * 8, "shared", seed=2)):
        assert bool((inp.indices[:, -1] // cfg.experts_per_rank == rank).all())
        assert bool((inp.indices[:, :-1] >= 0).all())  # the routed slots stay uniform


def test_the_wire_flavour_is_the_ops_arch():
    """An op on a GPU names its arch (``EpDispatchCombine.arch``): its fp8 wire is that arch's
    ``ArchTraits.fp8`` (e4m3fnuz on gfx942); a stand-in without one computes e4m3fn."""
    assert {a: wire_fp8_flavour(ContractOp(CFG, arch=a)) for a in ARCHES} == {a: traits(a).fp8 for a in ARCHES}
    assert wire_fp8_flavour(ContractOp(CFG, arch="gfx942")) == "e4m3fnuz"
    assert wire_fp8_flavour(ContractOp(CFG)) == "e4m3fn"
    with pytest.raises(ValueError, match=r"arch='gfx90a': unknown target"):
        wire_fp8_flavour(ContractOp(CFG, arch="gfx90a"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_harness_checks_a_gfx942_wire_in_e4m3fnuz(mode):
    """run_round compares a gfx942 op's combine with the e4m3fnuz wire reference: an op whose wire
    is e4m3fnuz (scale amax / 240) is bit-equal to it; one that sends e4m3fn codes on gfx942 (or
    e4m3fnuz on sm_90) is caught, by bits or by the bound (e4m3fn's subnormal error 2^-10 is
    twice e4m3fnuz's), while fp4 is the same wire in both flavours."""
    cfg = attrs.evolve(CFG, combine_quant=mode)
    tokens = [32, 5, 0, 17]
    stats = run_round(ContractOp(cfg, arch="gfx942"), cfg, tokens, "uniform", seed=5)
    assert stats["wire_mismatches"] == 0 and 0 < stats["bound_ratio"] <= 1

    def caught(op):
        try:
            return run_round(op, cfg, tokens, "uniform", seed=5)["wire_mismatches"] > 0
        except AssertionError as e:
            assert "above its bound" in str(e)
            return True

    assert caught(ContractOp(cfg, arch="gfx942", wire_flavour="e4m3fn")) == mode.startswith("fp8")
    assert caught(ContractOp(cfg, arch="sm_90", wire_flavour="e4m3fnuz")) == mode.startswith("fp8")


@pytest.mark.slow
def test_selftest_fp8_wire_cases_on_gfx942_compare_against_e4m3fnuz():
    """``epgen selftest``'s fp8 combine wire cases of the rank layout (``_run_case``, the rounds
    the CLI runs on each op), on a stand-in gfx942 op whose wire is e4m3fnuz as its kernels': every
    round passes with no wire mismatch; the same op sending e4m3fn codes fails the case or is
    reported as mismatched."""
    from epgen.cli.selftest import CASES, _run_case

    cases = [c for c in CASES if c.wire.startswith("fp8") and c.layout == "rank" and not c.split]
    assert {c.wire for c in cases} == {"fp8_direct_cast", "fp8_blockwise"}
    for case in cases:
        got = _run_case(ContractOp(case.config, arch="gfx942"), case, seed=3)
        assert got["ok"] and got["error"] is None and got["wire_mismatches"] == 0, got
        assert got["rounds"] == 2 and 0 < got["bound_ratio"] <= 1
        wrong = _run_case(ContractOp(case.config, arch="gfx942", wire_flavour="e4m3fn"), case, seed=3)
        assert not wrong["ok"] or wrong["wire_mismatches"] > 0, wrong
