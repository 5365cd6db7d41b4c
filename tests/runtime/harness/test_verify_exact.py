"""The exact (bit-for-bit, on-device) round check of ``epgen.harness.verify`` on the CPU, against a stand-in
op that keeps the contract with a zero-copy combine input and a scrambled row order, and against
stand-ins that break it in one way each: the check must pass the first and name every break."""

import attrs
import pytest
import torch

from epgen import reference
from epgen.harness.verify import (EXACT_MAX_VALUE, check_exact_combine, check_exact_dispatch, expect, integer_inputs,
                                  run_exact_round)
from epgen.codegen.config import EpConfig
from epgen.op import DispatchOutput


class ZeroCopyOp:
    """Virtual-rank op on the CPU: the reference's rows in a random order; combine sums the rows
    of ``combine_input(d)`` that belong to each token, in fp32, like the kernel. ``fault`` breaks
    one thing (see FAULTS)."""

    virtual = True

    def family(self, tokens):
        return "normal"

    def __init__(self, cfg: EpConfig, fault: str | None = None):
        self.cfg, self.fault = cfg, fault
        self.device = torch.device("cpu")
        self.local_ranks = list(range(cfg.world_size))
        cap = cfg.world_size * cfg.max_tokens_per_rank
        self._bufs = {r: DispatchOutput(
            recv_x=torch.empty(cap, cfg.hidden, dtype=torch.bfloat16), recv_weights=torch.empty(cap, cfg.topk),
            recv_indices=torch.empty(cap, cfg.topk, dtype=torch.int32), recv_scales=None,
            recv_src=torch.empty(cap, 2, dtype=torch.int32), num_recv=torch.zeros(1, dtype=torch.int32))
            for r in self.local_ranks}
        self._combine_in = {r: torch.empty(cap, cfg.hidden, dtype=torch.bfloat16) for r in self.local_ranks}

    def recv_buffers(self, rank):
        return self._bufs[rank]

    def combine_input(self, rank):
        return self._combine_in[rank]

    def dispatch(self, xs, ws, ids, ss=None, family=None):
        ref = reference.dispatch(list(xs), list(ws), list(ids), experts_per_rank=self.cfg.experts_per_rank)
        self._src, self._tokens = [], [x.shape[0] for x in xs]
        for d, rows in enumerate(ref):
            n, b = rows.num_rows, self._bufs[d]
            p = torch.randperm(n)
            for got, want in ((b.recv_x, rows.x), (b.recv_weights, rows.weights), (b.recv_indices, rows.indices),
                              (b.recv_src, rows.src)):
                got[:n] = want[p]
            b.num_recv[0] = n
            if n >= 2 and d == self._victim():
                if self.fault == "drop_row":
                    b.num_recv[0] = n - 1
                elif self.fault == "duplicate_row":
                    for t in (b.recv_x, b.recv_weights, b.recv_indices, b.recv_src):
                        t[1] = t[0]
                elif self.fault == "foreign_row":
                    b.recv_src[0, 1] = self._tokens[int(b.recv_src[0, 0])]  # a token that does not exist
                elif self.fault == "payload_bit":
                    b.recv_x[1].view(torch.int16)[3] ^= 1
                elif self.fault == "weights":
                    b.recv_weights[0, -1] += 1.0
                elif self.fault == "indices":
                    b.recv_indices[0, 0] = -1 if b.recv_indices[0, 0] != -1 else 0
            self._src.append(b.recv_src[: int(b.num_recv[0])].clone())
        return [self._bufs[r] for r in self.local_ranks]

    def _victim(self):
        return self.cfg.world_size - 1

    def combine(self, ys, out):
        acc = [torch.zeros(T, self.cfg.hidden) for T in self._tokens]
        for d, (y, src) in enumerate(zip(ys, self._src)):  # ascending d, fp32
            for i, (r, t) in enumerate(src.tolist()):
                if self.fault == "combine_skip" and d == self._victim() and i == 0:
                    continue
                acc[r][t] += y[i].float()
        for r, (o, a) in enumerate(zip(out, acc)):
            o.copy_(a.to(torch.bfloat16))
            if self.fault == "negative_zero":
                o[a.abs().sum(dim=1) == 0] = -0.0
        return out

    def check(self):
        pass


CFG = EpConfig(world_size=4, hidden=64, topk=4, num_experts=8, max_tokens_per_rank=16)  # L = 2


@pytest.mark.parametrize("tokens,kind", [([16, 0, 5, 1], "uniform"), ([0, 0, 0, 0], "uniform"),
                                         ([7, 7, 7, 7], "invalid"), ([16, 16, 1, 0], "duplicates"),
                                         ([9, 3, 0, 16], "skewed"), ([9, 0, 16, 4], "one_rank")])
def test_exact_round_passes_an_op_that_keeps_the_contract(tokens, kind):
    stats = run_exact_round(ZeroCopyOp(CFG), CFG, integer_inputs(CFG, tokens, kind, seed=5))
    assert len(stats["recv"]) == 4 and [c.shape[0] for c in stats["combined"]] == tokens


FAULTS = {"drop_row": "num_recv=", "duplicate_row": "received more than once",
          "foreign_row": "does not exist or does not route", "payload_bit": "recv_x: 1 of",
          "weights": "recv_weights: 1 of", "indices": "recv_indices: 1 of",
          "combine_skip": "combine output of 1 of", "negative_zero": "differs from the exact sum"}


@pytest.mark.parametrize("fault", FAULTS)
def test_exact_round_names_each_kind_of_break(fault):
    inputs = integer_inputs(CFG, [16, 16, 16, 16], "uniform", seed=6)
    inputs[1] = attrs.evolve(inputs[1], indices=torch.full_like(inputs[1].indices, -1))  # rank 1: all -1
    with pytest.raises(AssertionError, match=FAULTS[fault]):
        run_exact_round(ZeroCopyOp(CFG, fault), CFG, inputs)


def test_integer_inputs_are_small_integers_and_reproducible():
    a = integer_inputs(CFG, [16, 3, 0, 9], "uniform", seed=9)
    b = integer_inputs(CFG, [16, 3, 0, 9], "uniform", seed=9)
    for i, j in zip(a, b):
        assert torch.equal(i.x, j.x) and torch.equal(i.indices, j.indices) and i.x.dtype == torch.bfloat16
        assert bool((i.x.float().abs() <= EXACT_MAX_VALUE).all()) and bool((i.x.float() == i.x.float().round()).all())
    with pytest.raises(ValueError, match="bf16"):
        integer_inputs(attrs.evolve(CFG, dtype="fp8"), [1] * 4)
    with pytest.raises(ValueError, match="W <= 8"):
        integer_inputs(EpConfig(world_size=16, hidden=64, topk=2, num_experts=16, max_tokens_per_rank=4), [1] * 16)


def test_expect_routes_like_the_reference_with_dedup():
    inputs = integer_inputs(CFG, [16, 5, 0, 9], "duplicates", seed=11)
    inputs[0].indices[0] = torch.tensor([3, 3, 5, -1], dtype=torch.int32)  # L = 2: ranks 1 (once) and 2
    exp = expect(CFG, inputs)
    assert exp.reached[0, 0].tolist() == [False, True, True, False]
    for r, i in enumerate(inputs):
        slots = reference.route(i.indices, experts_per_rank=CFG.experts_per_rank, world_size=4)
        assert torch.equal(exp.reached[r, : exp.tokens[r]], slots >= 0)
        assert not bool(exp.reached[r, exp.tokens[r]:].any())  # padding reaches nobody


def test_the_exact_sum_stays_below_256_for_eight_ranks():
    cfg = EpConfig(world_size=8, hidden=64, topk=8, num_experts=8, max_tokens_per_rank=4)  # one expert a rank
    inputs = integer_inputs(cfg, [4] * 8, "uniform", seed=1)
    for r in range(8):
        inputs[r].x.fill_(-EXACT_MAX_VALUE)
        inputs[r].indices.copy_(torch.arange(8, dtype=torch.int32).expand(4, 8))  # every token reaches every rank
    op = ZeroCopyOp(cfg)
    out = run_exact_round(op, cfg, inputs)["combined"]
    assert all(bool((o.float() == -7 * 36).all()) for o in out)  # -252: exact in bf16


def test_check_functions_take_outputs_directly():
    op = ZeroCopyOp(CFG)
    inputs = integer_inputs(CFG, [4, 4, 4, 4], "uniform", seed=2)
    exp = expect(CFG, inputs)
    outs = op.dispatch(*[[getattr(i, f) for i in inputs] for f in ("x", "weights", "indices")])
    assert sum(check_exact_dispatch(r, o, exp) for r, o in enumerate(outs)) == int(exp.reached.sum())
    with pytest.raises(AssertionError, match=r"rank 0: combine output shape \(3, 64\)"):
        check_exact_combine(0, torch.zeros(3, 64, dtype=torch.bfloat16), exp)


def test_pause_runs_before_dispatch_and_before_combine():
    calls = []
    op = ZeroCopyOp(CFG)
    real_dispatch, real_combine = op.dispatch, op.combine
    op.dispatch = lambda *a: (calls.append("dispatch"), real_dispatch(*a))[1]
    op.combine = lambda *a, **k: (calls.append("combine"), real_combine(*a, **k))[1]
    run_exact_round(op, CFG, integer_inputs(CFG, [3, 3, 3, 3], seed=4), pause=lambda: calls.append("pause"))
    assert calls == ["pause", "dispatch", "pause", "combine"]
