"""The GPU reliability tests' bodies, dry-run on the CPU against the real ``EpDispatchCombine`` host
code with its two kernels replaced by a Python emulation of their contract (virtual ranks only).

What this covers without a GPU: the op's input checks, arena views, zero-copy combine input,
fault records turned into EpError and the refusal of later calls, and the test bodies' own logic
(expectations, regexes, exact checks). What it cannot cover: kernels, streams, graphs, processes,
timeouts; those run on the device (tests/test_gpu_reliability.py).
"""

import ctypes
import types

import numpy as np
import pytest
import torch

import test_gpu_reliability as rel
from epgen.check import integer_inputs, op_inputs, run_exact_round, run_round
from epgen.codegen.spec import Op
from epgen.config import EpConfig
from epgen.op import EpDispatchCombine, EpError, _args_dtype


def _at(ptr: int, nbytes: int) -> torch.Tensor:
    """uint8 CPU tensor over ``nbytes`` of host memory at ``ptr`` (the kernels' raw pointers)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


class _Records:
    def __init__(self, world_size):
        self.words = [[0, 0, 0, 0] for _ in range(world_size)]

    def read(self, rank):
        return tuple(self.words[rank])

    def report(self, rank, code, a, b, c):
        if self.words[rank][0] == 0:  # the kernels keep the first error
            self.words[rank] = [code, a, b, c & 0xFFFFFFFF]

    def close(self):
        pass


class EmulatedOp(EpDispatchCombine):
    """EpDispatchCombine on the CPU with virtual ranks; ``_launch`` emulates the kernels: dedup by
    destination rank, receive rows in a random order, bad expert ids recorded (code 1) and
    skipped, combine summing the reached ranks' combine_input rows in fp32 in ascending rank."""

    def __init__(self, config: EpConfig, *, virtual: bool = True, validate: bool = False):
        assert virtual, "the emulation drives virtual ranks only"
        self.config, self.validate, self.virtual = config, validate, True
        self.device = torch.device("cpu")
        self.local_ranks = list(range(config.world_size))
        self.dispatch_spec = config.spec("sm_90", Op.DISPATCH, config.dispatch_geometry or rel.GEO)
        self.layout = self.dispatch_spec.layout
        self.arenas = types.SimpleNamespace(
            local={r: torch.zeros(self.layout.total_bytes, dtype=torch.uint8) for r in self.local_ranks},
            close=lambda: None)
        self.errors = _Records(config.world_size)
        self._args = {op: np.zeros((), dtype=_args_dtype(config.world_size)) for op in (Op.DISPATCH, Op.COMBINE)}
        self._pending_tokens = None
        self._fault = None
        self.launches = 0

    def synchronize(self):
        self._raise_if_faulted()

    def _send_slot(self, rank):
        cfg = self.config
        return self._view(rank, self.layout.send_slot, (cfg.max_tokens_per_rank, cfg.world_size), torch.int32)

    def _launch(self, op, tokens, args):
        self.launches += 1
        (self._dispatch if op is Op.DISPATCH else self._combine)(args["io"])
        if self.validate:
            self.synchronize()

    def _dispatch(self, io):
        cfg, W, K, L = self.config, self.config.world_size, self.config.topk, self.config.experts_per_rank
        row_bytes, S = self.dispatch_spec.row_bytes, cfg.scale_bytes
        incoming = {d: [] for d in range(W)}
        for r in self.local_ranks:
            x_ptr, w_ptr, i_ptr, s_ptr, _, T = (int(v) for v in io[r])
            ids = _at(i_ptr, T * K * 4).view(torch.int32).view(T, K)
            slot = self._send_slot(r)
            slot[:T] = -1
            for t in range(T):
                seen = set()
                for k in range(K):
                    e = int(ids[t, k])
                    if e == -1:
                        continue
                    if not 0 <= e < cfg.num_experts:
                        self.errors.report(r, 1, k, t, e)
                        continue
                    if e // L not in seen:
                        seen.add(e // L)
                        incoming[e // L].append((r, t, x_ptr, w_ptr, i_ptr, s_ptr))
        for d, rows in incoming.items():
            buf = self.recv_buffers(d)
            for row, p in enumerate(torch.randperm(len(rows)).tolist()):  # row order is unspecified
                r, t, x_ptr, w_ptr, i_ptr, s_ptr = rows[p]
                buf.recv_x[row].view(torch.uint8).copy_(_at(x_ptr + t * row_bytes, row_bytes))
                buf.recv_weights[row].view(torch.uint8).copy_(_at(w_ptr + t * K * 4, K * 4))
                buf.recv_indices[row].view(torch.uint8).copy_(_at(i_ptr + t * K * 4, K * 4))
                if S:
                    buf.recv_scales[row].copy_(_at(s_ptr + t * S, S))
                buf.recv_src[row] = torch.tensor([r, t], dtype=torch.int32)
                self._send_slot(r)[t, d] = row
            buf.num_recv[0] = len(rows)

    def _combine(self, io):
        W, H = self.config.world_size, self.config.hidden
        for r in self.local_ranks:
            out_ptr, T = int(io[r][4]), int(io[r][5])
            slots = self._send_slot(r)[:T]
            acc = torch.zeros(T, H)
            for d in range(W):
                hit = slots[:, d] >= 0
                acc[hit] += self.combine_input(d)[slots[hit, d].long()].float()
            _at(out_ptr, T * H * 2).copy_(acc.to(torch.bfloat16).view(torch.uint8).reshape(-1))


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(rel, "_op", lambda cfg, virtual, validate=True: EmulatedOp(cfg, validate=validate))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def test_the_emulation_keeps_the_contract():
    cfg = rel.edge_config(4)
    op = EmulatedOp(cfg, validate=True)
    for seed, kind in enumerate(("uniform", "invalid", "duplicates", "skewed", "one_rank")):
        run_round(op, cfg, [64, 0, 17, 5], kind, seed)  # against the CPU reference
        run_exact_round(op, cfg, integer_inputs(cfg, [64, 0, 17, 5], kind, seed))


def test_tokens_on_one_rank_on_all_but_one_and_on_none(emulated):
    rel.test_tokens_on_one_rank_on_all_but_one_and_on_none_virtual4()


@pytest.mark.parametrize("body", [rel._minus_one_body, rel._dedup_body, rel._max_tokens_body])
def test_edge_bodies(emulated, body):
    body(0, 8, True)


def test_topk_body(emulated):
    rel.test_topk_6_and_9_virtual8(2880, 9)


def test_bad_id_body(emulated):
    rel._bad_id_body(0, 8, True)


def test_jitter_body_logic(emulated):
    rel._jitter_body(0, 2, True, 25)


def test_a_rejected_call_launches_nothing_and_a_fault_refuses_every_later_call():
    cfg = rel.edge_config(8)
    op = EmulatedOp(cfg, validate=False)
    good = integer_inputs(cfg, [8] * 8, "uniform", 1)
    with pytest.raises(RuntimeError, match="needs a dispatch first"):
        op.combine([op.combine_input(r) for r in range(8)])
    assert op.launches == 0
    bad = integer_inputs(cfg, [8] * 8, "uniform", 2)
    bad[6].indices[3, 1] = 99
    op.dispatch(*op_inputs(op, bad))  # validate=False: the fault is raised at the next call
    with pytest.raises(EpError, match=r"^rank 6: indices\[3, 1\]=99: expert ids must be -1 or in \[0, 16\)$"):
        op.check()
    launches = op.launches
    for call in (lambda: op.dispatch(*op_inputs(op, good)), lambda: op.combine([op.combine_input(r) for r in range(8)]),
                 op.check, op.synchronize):
        with pytest.raises(EpError, match=r"rank 6: indices\[3, 1\]=99.*build a new EpDispatchCombine"):
            call()
    assert op.launches == launches
