"""One MoE block of a real transformers model, expert-parallel through epgen against what a user
would otherwise run, in one process per GPU.

The model: ``Qwen3MoeForCausalLM`` with one decoder layer of Qwen3-30B-A3B's shape (hidden 2048,
128 experts, top-8, expert intermediate 768, 32 heads; random bf16 weights, a 1024-token
vocabulary: no download). Timed: the layer's MoE block (``model.model.layers[0].mlp``: router and
experts) on [1, T, 2048] bf16 activations, T tokens a rank, at decode (1, 8, 128) and prefill (4096):

* ``hf grouped_mm``: transformers' single-GPU experts (``experts_implementation="grouped_mm"``),
  every expert on this GPU;
* ``hf EP``: transformers' own expert parallelism as its ``EpRouterParallel`` plan computes it
  (its math, run here by hand: the router on the replicated tokens, non-local experts masked to
  its sentinel, the rank's E / W experts through its ``grouped_mm_experts_forward``, then
  ``all_reduce`` over the process group). With one process (W = 1) the all-reduce is a real NCCL
  call on a one-rank group: the local work and the call's cost, no traffic;
* ``epgen own_tokens`` / ``epgen same_tokens``: ``epgen.integrations.transformers.expert_parallel``
  (dispatch in the expert layout, the class's experts as grouped GEMMs, weighted combine), the op
  sized for the point (max_tokens_per_rank = T; ``same_tokens`` dispatches T / W a rank and
  all-gathers, the same tokens as hf EP; at W = 1 both layouts are the same call). The decode
  points share one op of max_tokens_per_rank = 128, prefill has its own (4096): the experts'
  row-wise stages run over the op's expert-layout rows (docs/moe.md), so the buffers follow the
  batch as a server would size them.

Timing (docs/measuring.md): each point is run eagerly as a user runs it; ``queued`` is the median
GPU time per call of N calls enqueued behind a ``torch.cuda._sleep`` long enough for the host to
enqueue all of them (device events around the N calls; 5 repeats: median, mean +- stdev, best),
``host`` the median per call of the same N calls launched without the delay (what an eager
Python loop sees). Outputs are checked against hf grouped_mm (relative L2) before timing.

Run: ``python tools/bench_transformers.py`` (one GPU, W = 1) or
``torchrun --nproc-per-node 2 tools/bench_transformers.py`` (one process per GPU). About a minute
on one H200.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

TOKENS = (1, 8, 128, 4096)
DECODE_BUFFER = 128
"""max_tokens_per_rank of the op the decode points (T <= 128) share; a larger T gets an op of its own size."""
SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144)


def init_group() -> tuple[int, int]:
    """(rank, world size): torchrun's group, else a one-rank NCCL group of this process."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()


def build_model(seed: int):
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=1024, num_hidden_layers=1, norm_topk_prob=True, **SHAPE)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = tf.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.set_experts_implementation("grouped_mm")
    return model


class HfExpertParallel:
    """transformers' EpRouterParallel + experts + all-reduce, as its plan computes it (see module doc)."""

    def __init__(self, block, rank: int, world: int):
        from transformers.integrations.moe import grouped_mm_experts_forward

        self.forward_experts = grouped_mm_experts_forward
        self.gate = block.gate
        self.local = copy.deepcopy(block.experts)  # the rank's E / W experts, as the plan shards them
        E = self.local.num_experts
        L = E // world
        with torch.no_grad():
            self.local.gate_up_proj = torch.nn.Parameter(self.local.gate_up_proj[rank * L:(rank + 1) * L].clone())
            self.local.down_proj = torch.nn.Parameter(self.local.down_proj[rank * L:(rank + 1) * L].clone())
        self.local.num_experts = L
        self.local._is_expert_parallel = True
        self.rank, self.L = rank, L

    def __call__(self, hidden):
        b, s, h = hidden.shape
        x = hidden.view(-1, h)
        _, scores, ids = self.gate(x)
        non_local = (ids // self.L) != self.rank
        scores = scores.masked_fill(non_local, 0.0)
        ids = torch.where(non_local, self.L, ids % self.L)
        out = self.forward_experts(self.local, x, ids, scores)
        dist.all_reduce(out)
        return out.view(b, s, h)


def calibrate_sleep() -> float:
    """torch.cuda._sleep cycles per microsecond on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1000)


@torch.no_grad()
def time_call(fn, x, cycles_per_us: float, calls: int = 20, repeats: int = 5) -> dict:
    """Queued and host-launched time per call (microseconds); see the module doc."""
    for _ in range(3):
        fn(x)
    dist.barrier()
    torch.cuda.synchronize()
    host, queued = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        t = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        host_s = time.perf_counter() - t
        host.append(start.elapsed_time(end) * 1000 / calls)
        dist.barrier()
        torch.cuda._sleep(int(1.5 * host_s * 1e6 * cycles_per_us) + 1000)  # covers the enqueueing below
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        queued.append(start.elapsed_time(end) * 1000 / calls)
        dist.barrier()
    return dict(median=statistics.median(queued), mean=statistics.mean(queued), stdev=statistics.stdev(queued),
                best=min(queued), host=statistics.median(host))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens a rank (default %(default)s)")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1:
        parser.error(f"--tokens {min(args.tokens)}: every value must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a GPU (torch.cuda.is_available() is False)")
    rank, world = init_group()
    from epgen.integrations.transformers import expert_parallel
    from epgen.reference import relative_l2

    cycles = calibrate_sleep()
    model = build_model(0)
    block = model.model.layers[0].mlp
    hf_ep = HfExpertParallel(block, rank, world)
    if rank == 0:
        import cupy
        import transformers

        def command(*argv):
            try:
                return subprocess.run(argv, capture_output=True, text=True).stdout.strip().splitlines()[0]
            except (OSError, IndexError):
                return "unknown"

        print(f"# {torch.cuda.get_device_name()}, {world} process(es), driver "
              f"{command('nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader')}, torch "
              f"{torch.__version__}, CuPy {cupy.__version__}, transformers {transformers.__version__}, epgen "
              f"{command('git', 'rev-parse', '--short', 'HEAD')}; Qwen3-30B-A3B MoE block (H 2048, E 128, top-8, "
              "I 768); tokens: a rank's (hf grouped_mm, epgen own_tokens) or all ranks' (hf EP, epgen same_tokens)")
        print(f"{'tokens':>6} {'candidate':<18} {'queued us':>10} {'mean+-sd':>14} {'best':>8} {'host us':>8} "
              f"{'rel L2 vs hf':>12}")
    rows, converted = [], {}
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    for T in args.tokens:
        x = torch.randn(1, T, SHAPE["hidden_size"], generator=g, device="cuda", dtype=torch.bfloat16)
        shared = torch.randn(1, T, SHAPE["hidden_size"], generator=torch.Generator(device="cuda").manual_seed(7),
                             device="cuda", dtype=torch.bfloat16)  # the same tokens on every rank
        with torch.no_grad():
            ref, ref_shared = block(x), block(shared)
        candidates = [("hf grouped_mm", block, x, ref), ("hf EP", hf_ep, shared, ref_shared)]
        size = DECODE_BUFFER if T <= DECODE_BUFFER else T
        for layout in ("own_tokens", "same_tokens") if world > 1 else ("own_tokens",):
            if (layout, size) not in converted:
                ep_model = copy.deepcopy(model)
                converted[layout, size] = (ep_model, expert_parallel(ep_model, layout=layout, max_tokens_per_rank=size))
            ep_block = converted[layout, size][0].model.layers[0].mlp
            same = layout == "same_tokens"
            candidates.append((f"epgen {layout}" if world > 1 else "epgen", ep_block,
                               shared if same else x, ref_shared if same else ref))
        for name, fn, inp, expect in candidates:
            with torch.no_grad():
                error = relative_l2(fn(inp), expect)
            t = time_call(fn, inp, cycles)
            rows.append((T, name, t, error))
            if rank == 0:
                print(f"{T:>6} {name:<18} {t['median']:>10.1f} {t['mean']:>7.1f}+-{t['stdev']:<6.1f} {t['best']:>8.1f} "
                      f"{t['host']:>8.1f} {error:>12.2e}", flush=True)
    for _, handle in converted.values():
        handle.synchronize()
        dist.barrier()
        handle.close()
    bad = [(T, name, e) for T, name, _, e in rows if e > 0.02]
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank}: outputs differ from hf grouped_mm by more than 0.02 relative L2: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
