"""What a rank holds when a transformers MoE model is loaded expert-parallel, and its peak memory
during the load: transformers' registry (``DistributedConfig(ep_size=W, ep_implementation="epgen")``,
each rank reads only its E / W experts) against ``expert_parallel`` (every rank loads the whole
model, then drops the other ranks' experts) and the whole model on one rank.

Two parts:

* ``real``: a Qwen3-MoE model of moderate size (random bf16 weights, saved with ``save_pretrained``
  into a temporary directory), loaded on the CPU in fresh processes: one process (the whole
  model), and W gloo processes for ``expert_parallel`` and for the registry in both token layouts
  (``same_tokens``: ``tp_size=W, tp_plan={}``, the dense weights on every rank; ``own_tokens``:
  ``fsdp_size=W``, the dense weights FSDP-sharded). Held: the bytes of the parameters each rank
  holds (a DTensor's local shard). Peak: the process's peak resident set during the load and the
  conversion (``VmHWM`` of /proc/self/status, reset through /proc/self/clear_refs just before
  ``from_pretrained``) minus its resident set before it; it counts the checkpoint's pages that the
  load maps from the safetensors file as well as the tensors. Of it anonymous: the peak of
  ``RssAnon`` (sampled every 5 ms) minus its value before, the memory the load allocated.
* ``meta``: real-size configs (Qwen3-235B-A22B, DeepSeek-V3) built on the meta device (no bytes);
  the parameters that transformers' own expert plan shards (``grouped_gemm`` rules, resolved by
  ``_resolve_parallel_plans`` for the DistributedConfig) count 1/W a rank, the rest whole
  (``same_tokens``) or 1/W (``own_tokens``, FSDP). At W = 2 the same rule gives the real part's
  measured held bytes.

Run: ``python tools/ep_load_memory.py [--world 2] [--part real|meta|both]`` on the CPU (needs
transformers 5.23 or later and accelerate); a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import threading
import time

import torch

GIB = 2**30
MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _held(model) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def real_config(layers: int = 6):
    """A Qwen3-MoE of moderate size: 6 layers, H = 1024, 32 experts of I = 768, top-4 (about 0.9 GiB
    of bf16 experts)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=4096, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4,
                          moe_intermediate_size=768, intermediate_size=2048, max_position_embeddings=512)


def _load(rank, world, store, path, mode, out):
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    from epgen.integrations.transformers import expert_parallel, loaded_expert_parallel

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        before, anon_before = _status("VmRSS"), _status("RssAnon")
        peak_anon, loading = [anon_before], True

        def sample():  # the kernel keeps no peak of the anonymous part: sample it every 5 ms
            while loading:
                peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current resident set
            f.write("5")
        if mode == "whole":
            model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        elif mode == "expert_parallel":
            model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            expert_parallel(model, layout="own_tokens", backend="reference")
        else:
            dc = (DistributedConfig(tp_size=world, tp_plan={}, ep_size=world, ep_implementation="epgen")
                  if mode == "registry same_tokens" else
                  DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="epgen"))
            model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, distributed_config=dc)
            loaded_expert_parallel(model)
        import gc

        gc.collect()
        peak = _status("VmHWM") - before
        loading = False
        sampler.join()
        anon = peak_anon[0] - anon_before
        with torch.no_grad():  # it runs
            model(torch.arange(16).view(1, 16))
        with open(os.path.join(out, f"{mode}.{rank}"), "w") as f:
            f.write(f"{_held(model)} {peak} {anon}")
    finally:
        if world > 1:
            dist.destroy_process_group()


def part_real(world: int) -> None:
    from transformers import Qwen3MoeForCausalLM

    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(real_config()).to(torch.bfloat16)
        full = _held(model)
        experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
        model.save_pretrained(os.path.join(d, "model"))
        del model
        print(f"real: Qwen3-MoE {full / MIB:.1f} MiB bf16 ({experts / MIB:.1f} MiB experts), W = {world}, CPU")
        print("| load | ranks | held a rank (MiB) | held / whole | peak resident during load, a rank (MiB) | "
              "of it anonymous (MiB) |")
        print("|---|---|---|---|---|---|")
        for mode, w in (("whole", 1), ("expert_parallel", world), ("registry same_tokens", world),
                        ("registry own_tokens", world)):
            torch.multiprocessing.spawn(_load, args=(w, os.path.join(d, f"store-{mode}"), os.path.join(d, "model"),
                                                     mode, d), nprocs=w, join=True)
            got = [tuple(int(v) for v in open(os.path.join(d, f"{mode}.{r}")).read().split()) for r in range(w)]
            held, peak, anon = (max(g[i] for g in got) for i in range(3))
            print(f"| {mode} | {w} | {held / MIB:.1f} | {held / full:.3f} | {peak / MIB:.1f} | {anon / MIB:.1f} |")


META = {
    "Qwen3-235B-A22B": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=1536, intermediate_size=12288, tie_word_embeddings=False)),
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(vocab_size=129280, hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
                         intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                         num_experts_per_tok=8, n_group=8, topk_group=4, num_attention_heads=128,
                         num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=False)),
}


def per_rank(model, world: int) -> dict[str, int]:
    """Bytes a rank holds (bf16) under transformers' expert plan for ``DistributedConfig(ep_size=world)``:
    {"whole", "experts", "same_tokens", "own_tokens"}."""
    from transformers.distributed import DistributedConfig

    dc = DistributedConfig(tp_size=world, tp_plan={}, ep_size=world, ep_implementation="epgen")
    _, ep_plan, _ = model._resolve_parallel_plans(dc)
    sharded = {name for name, style in ep_plan.items() if style == "grouped_gemm"}
    whole = experts = 0
    for name, p in model.named_parameters():
        n = p.numel() * 2
        whole += n
        if name in sharded:
            assert p.shape[0] % world == 0, name
            experts += n
    rest = whole - experts
    return {"whole": whole, "experts": experts, "same_tokens": rest + experts // world,
            "own_tokens": -(-rest // world) + experts // world}


def part_meta(worlds=(8, 16)) -> None:
    import transformers

    print("| model | whole (GiB) | experts sharded by the plan (GiB) | W | a rank, same_tokens (GiB) | "
          "a rank, own_tokens (GiB) |")
    print("|---|---|---|---|---|---|")
    for label, (config_cls, model_cls, kw) in META.items():
        config = getattr(transformers, config_cls)(**kw)
        with torch.device("meta"):
            model = getattr(transformers, model_cls)(config)
        for world in worlds:
            b = per_rank(model, world)
            print(f"| {label} | {b['whole'] / GIB:.1f} | {b['experts'] / GIB:.1f} | {world} | "
                  f"{b['same_tokens'] / GIB:.1f} | {b['own_tokens'] / GIB:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--part", choices=("real", "meta", "both"), default="both")
    args = parser.parse_args()
    if args.part in ("meta", "both"):
        part_meta()
    if args.part in ("real", "both"):
        part_real(args.world)


if __name__ == "__main__":
    main()
