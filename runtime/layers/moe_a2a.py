"""The MoE layer built the torch-native way: ``torch.distributed.all_to_all_single`` around a
local permute, the baseline ``epgen.layers.moe.MoELayer`` is measured against (``tools/bench_moe.py``).

One process per rank. A forward, on rank d of W (L = E / W local experts; local expert e of d is
global expert d * L + e):

1. count exchange: every token goes once to each distinct rank its valid experts live on; the
   per-destination row counts are exchanged with an ``all_to_all_single`` of [W] int64;
2. send: the tokens sorted by destination rank (ascending token within a rank) and their full
   top-k ids and weights rows are exchanged with ``all_to_all_single`` (one call for the rows,
   one for ids + weights packed as int32);
3. local permute: each received row is expanded into one row per distinct local expert it names,
   the weights of slots naming one expert summed in fp32 in ascending slot order; rows are
   grouped by expert, ascending receive row (that is, by source rank and source token) within a
   group;
4. the same ``epgen.layers.moe.swiglu_experts`` on the groups;
5. weight and fold per received row: ``acc = 0``, then per distinct local expert in ascending
   first-slot order ``acc = acc + w * float32(y)`` (the product rounded to fp32, then the sum),
   ``bf16(acc)``;
6. unpermute: the folded rows go back to their source ranks through the reverse
   ``all_to_all_single``, and each rank sums, per token, the rows of the ranks it reached in
   ascending rank order in fp32, rounded once to bf16; a token with no valid expert gets zeros.

That is the expert-major layout's weighted combine (docs/moe.md;
``epgen.reference.combine_weighted``) with the bf16 wire, so the output meets
``epgen.layers.moe.dense_moe`` within its bound.

Host synchronization: the split sizes of the ``all_to_all_single`` calls are host integers, read
from the exchanged counts (``.tolist()``), and the row selections of steps 2 and 3 have
data-dependent sizes (``nonzero``), so every forward waits for the device three times, plus once
more to check the expert ids. That is how torch-native expert parallelism works; the epgen layer
needs none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epgen.layers.moe import ExpertWeights, swiglu_experts
from epgen.tensors import check_tensor

__all__ = ["AllToAllMoE"]


def _a2a(output: torch.Tensor, input_: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """``all_to_all_single`` of the rows of 2-D ``input_`` into ``output`` (split sizes in rows),
    both viewed as bytes: they move unchanged, and gloo takes no bf16 or int16."""
    output, input_ = output.view(torch.uint8), input_.view(torch.uint8)
    dist.all_to_all_single(output, input_, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


class AllToAllMoE:
    """One rank's MoE layer with ``all_to_all_single`` dispatch and combine (module docstring).

    Args:
        weights: this rank's L local experts (gate [L, H, I], up [L, H, I], down [L, I, H] bf16);
            local expert e is global expert rank * L + e.
        num_experts: E = W x L routed experts of the whole layer.
        topk: K, expert slots per token (1 to E).
        group: process group of the W ranks (default: the world group); any backend with
            ``all_to_all_single`` (NCCL for CUDA tensors, gloo for CPU ones).

    Raises:
        TypeError: ``weights`` is not an ExpertWeights.
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``num_experts`` is not W x L, or ``topk`` not an int in [1, num_experts].
    """

    def __init__(self, weights: ExpertWeights, *, num_experts: int, topk: int, group=None):
        if not isinstance(weights, ExpertWeights):
            raise TypeError(f"weights: expected an epgen.layers.moe.ExpertWeights, got {type(weights).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("AllToAllMoE needs torch.distributed initialized (one process per rank; a one-rank "
                               "group for W = 1)")
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.weights = weights
        self.experts_per_rank, self.hidden, _ = weights.gate.shape
        L, W = self.experts_per_rank, self.world_size
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts != W * L:
            raise ValueError(f"num_experts={num_experts!r}: must be world_size x local experts = {W} x {L} = {W * L}")
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
            raise ValueError(f"topk={topk!r}: must be an int in [1, num_experts={num_experts}]")
        self.num_experts, self.topk = num_experts, topk
        self.device = weights.gate.device

    def _check(self, x, topk_weights, topk_ids) -> None:
        H, K, E = self.hidden, self.topk, self.num_experts
        x = check_tensor("x", x, dtype=torch.bfloat16, shape=(None, H), device=self.device)
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(x.shape[0], K), device=self.device)
        check_tensor("topk_ids", topk_ids, dtype=torch.int32, shape=(x.shape[0], K), device=self.device)
        bad = (topk_ids != -1) & ((topk_ids < 0) | (topk_ids >= E))
        if bool(bad.any()):  # a host sync
            t, k = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"topk_ids[{t}, {k}]={int(topk_ids[t, k])}: expert ids must be -1 or in [0, {E})")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The layer on this rank's tokens; every rank of the group calls it (collective).

        Args:
            x: [T, H] bf16 tokens (T may be 0 and may differ across ranks).
            topk_weights: [T, K] float32 routing weights.
            topk_ids: [T, K] int32 global expert ids, -1 = no expert.

        Returns:
            [T, H] bf16 (module docstring); all on the weights' device.

        Raises:
            TypeError, ValueError: an input of the wrong type, dtype, shape or device, or an
                expert id neither -1 nor in [0, E) (before any exchange: the other ranks then
                wait in theirs).
        """
        self._check(x, topk_weights, topk_ids)
        T, H, K, L, W = x.shape[0], self.hidden, self.topk, self.experts_per_rank, self.world_size
        ranks = torch.arange(W, device=self.device)
        dest = torch.where(topk_ids >= 0, topk_ids.long() // L, -1)  # [T, K]
        reached = (dest[:, :, None] == ranks).any(dim=1)  # [T, W]
        send_rank, send_tok = reached.t().nonzero(as_tuple=True)  # by destination rank, ascending token
        send_counts = reached.sum(dim=0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sends, recvs = torch.stack([send_counts, recv_counts]).tolist()  # the split sizes, on the host
        n_recv = sum(recvs)
        meta = torch.cat([topk_ids[send_tok], topk_weights[send_tok].view(torch.int32)], dim=1)  # [S, 2K] int32
        recv_x = x.new_empty((n_recv, H))
        recv_meta = meta.new_empty((n_recv, 2 * K))
        _a2a(recv_x, x[send_tok], recvs, sends, self.group)
        _a2a(recv_meta, meta, recvs, sends, self.group)
        folded = self._experts(recv_x, recv_meta[:, :K], recv_meta[:, K:].view(torch.float32))
        back = x.new_empty((send_tok.shape[0], H))
        _a2a(back, folded, sends, recvs, self.group)
        acc = torch.zeros((T, H), dtype=torch.float32, device=self.device)
        start = 0
        for n in sends:  # the rows rank d folded, ascending d: one per token that reached d
            if n:
                acc.index_add_(0, send_tok[start:start + n], back[start:start + n].float())
            start += n
        return acc.to(torch.bfloat16)

    __call__ = forward

    def _experts(self, recv_x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Steps 3-5 on the R received rows: [R, H] bf16 x, [R, K] int32 ids and float32 weights
        (the senders' full rows) -> [R, H] bf16 folded rows."""
        R, K, L, H = recv_x.shape[0], self.topk, self.experts_per_rank, self.hidden
        local = ids.long() - self.rank * L
        mine = (ids >= 0) & (local >= 0) & (local < L)  # [R, K]
        same = ids[:, :, None] == ids[:, None, :]  # [R, k, j]: slots k and j name one expert
        later = torch.ones((K, K), dtype=torch.bool, device=self.device).triu(diagonal=1)  # j > k
        first = mine & ~(same & later.t()).any(dim=2)  # no earlier slot names the expert
        wsum = weights.clone()  # slot k's weight plus those of later slots naming its expert, ascending
        for j in range(1, K):
            wsum = wsum + torch.where(same[:, :, j] & later[:, j], weights[:, j:j + 1], 0.0)
        row, slot = first.nonzero(as_tuple=True)  # a host sync: the expanded row count
        expert = local[row, slot]
        order = torch.argsort(expert * max(R, 1) + row)  # grouped by expert, ascending receive row
        row, slot, expert = row[order], slot[order], expert[order]
        offsets = torch.zeros(L + 1, dtype=torch.int32, device=self.device)
        offsets[1:] = torch.bincount(expert, minlength=L).cumsum(0)
        acc = torch.zeros((R, H), dtype=torch.float32, device=self.device)
        if row.numel():
            y = swiglu_experts(recv_x[row], offsets, self.weights, offsets_checked=True)  # built above
            wy = wsum[row, slot][:, None] * y.float()  # [n, H], each product rounded to fp32
            pos = torch.full((R, K), -1, dtype=torch.int64, device=self.device)
            pos[row, slot] = torch.arange(row.numel(), device=self.device)
            for k in range(K):  # ascending first slot; + 0.0 where slot k is no row's first
                p = pos[:, k]
                acc = acc + torch.where((p >= 0)[:, None], wy[p.clamp(min=0)], 0.0)
        return acc.to(torch.bfloat16)
