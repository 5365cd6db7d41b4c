"""transformers models train expert-parallel: a tiny Qwen3-MoE and a tiny Mixtral (random weights,
tests/hf_models.py) take SGD steps with their experts on epgen's kernels (backend "epgen": the
host emulation on the CPU), as W = 2 and 4 processes over gloo in both token layouts, and as
virtual ranks.

The bound is the model's own bf16 error (tests/hf_models.py's argument, applied to training):
the expert-parallel bf16 model and the model's own bf16 experts implementations (eager,
batched_mm, grouped_mm) are bf16 evaluations of the same function sharing every rounding outside
the experts' combine and its transpose, so at every step the relative L2 error of the
logits against float32 is at most 2 x the implementations' worst (each model at its own weights
after its own steps; the loss, a mean whose errors of both signs cancel to a near zero by
chance, is reported beside them), and every
parameter's gradient after the first step's backward is within 2 x the implementations' worst
relative L2 error against float32, for that parameter. Each model takes its own SGD steps (lr 0.05) from the same float32 weights.

Objective: ``same_tokens``, every rank the same batch and the same loss (the replicated layers'
gradients are the same on every rank); ``own_tokens``, rank r its own batch, the objective the
sum of the ranks' mean token losses, the replicated layers' gradients summed over the ranks (as
data parallelism does) before each step. A rank holds its E / W experts; their gradients come
from every rank's tokens through the backward's cached dispatch and combine.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hf_models  # noqa: E402

from epgen.reference import relative_l2  # noqa: E402

STEPS, LR, SEED = 3, 0.05, 0
FAMILIES = ("qwen3_moe", "mixtral")


def _batch(rank: int, batch: int = 4) -> torch.Tensor:
    """Rank ``rank``'s own batch (own_tokens), 4 x (28 + 2 rank) tokens; rank -1: the batch every
    rank shares (same_tokens), 8 x 32. Each objective spans at least 224 tokens: over fewer, one
    router near-tie flipped by a rounding can dominate a loss difference (tests/hf_models.py)."""
    if rank < 0:
        return hf_models.prompt(99, batch=2 * batch, length=32)
    return hf_models.prompt(100 + rank, batch=batch, length=28 + 2 * rank)


def _is_expert(name: str) -> bool:
    return ".experts." in name


@contextlib.contextmanager
def _top_k(model, forced: dict | None = None):
    """Record every router call's top-k expert indices ({router name: [indices, ...]}), or with
    ``forced`` (another run's record, the same calls) route each call to the forced indices, with
    weights the router computes for them as it computes its own (softmax of its logits in float32,
    gathered, renormalized: Qwen3-MoE with norm_topk_prob and Mixtral), so the router's gradient
    still flows. Gradients are compared under the float32 run's routing: a rounding that flips a
    near-tie in one token's top-k changes that token's router gradient by far more than a rounding
    (tests/hf_models.py); every model, the float32 one included, then routes alike."""
    record = {}

    def hook(calls, name):
        def forced_hook(_module, _args, out):
            logits, scores, indices = out
            calls.append(indices.detach().cpu())
            if forced is None:
                return None
            index = forced[name][len(calls) - 1].to(indices.device)
            w = torch.softmax(logits.float(), dim=-1).gather(1, index)
            return logits, (w / w.sum(dim=-1, keepdim=True)).to(scores.dtype), index
        return forced_hook

    with contextlib.ExitStack() as hooks:
        for name, module in model.named_modules():
            if name.endswith(".mlp.gate"):
                hooks.callback(module.register_forward_hook(hook(record.setdefault(name, []), name)).remove)
        yield record


def _loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the causal LM loss: the mean next-token cross entropy, float32; the logits, detached,
    float32 on the CPU)."""
    logits = model(batch).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    return loss, logits.detach().cpu()


def _train(model, batches, steps=STEPS, reduce=None, experts_of=None, routing=None):
    """SGD ``steps`` times on the sum of the batches' losses; returns (per step, per batch, (its
    loss, its logits); the first step's gradients as float32 on the CPU, expert weights as
    ``experts_of`` slices them). ``reduce(name, grad)`` runs on every gradient before the step
    (the data-parallel sum). ``routing``, a dict: the first step's top-k indices go into its
    "seen", and with its "forced" (such a record) the first step routes to them (``_top_k``);
    later steps route freely."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad()
        if routing is not None and not losses:
            with _top_k(model, routing.get("forced")) as seen:
                runs = [_loss(model, b) for b in batches]
            routing["seen"] = seen
        else:
            runs = [_loss(model, b) for b in batches]
        sum(loss for loss, _ in runs).backward()
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                if reduce is not None:
                    reduce(name, p.grad)
                grads[name] = p.grad.detach().float().cpu().clone()
        losses.append([(float(loss.detach()), logits) for loss, logits in runs])
        first = first or grads
        opt.step()
    if experts_of is not None:
        first = {n: experts_of(n, g) for n, g in first.items()}
    return losses, first


def _envelope(model32, batches, mine, experts_of=None, steps=STEPS):
    """The float32 run on every batch and the model's own bf16 implementations' worst errors
    against it, their first step routed as the float32 run's: (per step the float32 (loss,
    logits) of the batches ``mine`` indexes; float32 gradients; per step the worst relative L2 of
    those logits; per parameter the worst relative L2 of its gradient; the float32 first step's
    routing of the batches ``mine`` indexes, for ``_train``'s ``routing``)."""
    def pick(losses):
        return [[step[i] for i in mine] for step in losses]

    routing = {}
    l32, g32 = _train(copy.deepcopy(model32), batches, steps, experts_of=experts_of, routing=routing)
    l32, record = pick(l32), routing["seen"]
    loss_err, grad_err = [0.0] * steps, {}
    for impl in hf_models.IMPLEMENTATIONS:
        model = copy.deepcopy(model32).to(torch.bfloat16)
        model.set_experts_implementation(impl)
        losses, grads = _train(model, batches, steps, experts_of=experts_of, routing={"forced": record})
        loss_err = [max(e, _logits_error(a, b)) for e, a, b in zip(loss_err, pick(losses), l32)]
        for n in g32:
            grad_err[n] = max(grad_err.get(n, 0.0), relative_l2(grads[n], g32[n]))
    calls = len(batches)  # each router runs once a batch
    return l32, g32, loss_err, grad_err, {n: [c[i] for i in mine] for n, c in record.items() if len(c) == calls}


def _logits_error(runs, reference) -> float:
    """Relative L2 of the logits of ``runs`` ((loss, logits) per batch) against ``reference``'s."""
    return relative_l2(torch.cat([lg.flatten() for _, lg in runs]), torch.cat([lg.flatten() for _, lg in reference]))


def _check(what, losses, grads, l32, g32, loss_err, grad_err) -> list[str]:
    """Every step's logits and the first step's gradients within twice the model's own bf16
    error; returns the lines that say by how much (with the losses)."""
    lines = []
    for s, (step, b, e) in enumerate(zip(losses, l32, loss_err)):
        err = _logits_error(step, b)
        lines.append(f"{what} step {s}: loss {sum(x for x, _ in step):.6f}, float32 {sum(x for x, _ in b):.6f}; "
                     f"logits' relative L2 {err:.2e} (bound 2 x {e:.2e})")
        assert err <= 2 * e, lines[-1]
    worst = max((relative_l2(grads[n], g32[n]) / (2 * grad_err[n]), n) for n in g32)
    experts = max(relative_l2(grads[n], g32[n]) for n in g32 if _is_expert(n))
    lines.append(f"{what} gradients: worst parameter {worst[1]} at {worst[0]:.3f} of its bound; expert weights' "
                 f"worst relative L2 {experts:.3e}")
    for n in g32:
        err = relative_l2(grads[n], g32[n])
        assert err <= 2 * grad_err[n], f"{what}: grad {n}: {err:.3e} against 2 x {grad_err[n]:.3e}"
    return lines


def _body(rank, world, store, family, result_dir):
    import datetime

    import torch.distributed as dist

    from epgen.host import Schedule
    from epgen.integrations.transformers import expert_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        model32 = hf_models.tiny_model(family, SEED)
        L = hf_models.EXPERTS // world

        def experts_of(name, grad):  # this rank's experts of a full [E, ...] expert gradient
            return grad[rank * L:(rank + 1) * L] if _is_expert(name) else grad

        def data_parallel(name, grad):  # own_tokens: the replicated layers' gradients summed
            if not _is_expert(name):
                dist.all_reduce(grad)

        lines = []
        for layout in ("same_tokens", "own_tokens"):
            batches = [_batch(-1)] if layout == "same_tokens" else [_batch(r) for r in range(world)]
            mine = batches if layout == "same_tokens" else [batches[rank]]
            envelope = _envelope(model32, batches, [0] if layout == "same_tokens" else [rank], experts_of)
            model = copy.deepcopy(model32).to(torch.bfloat16)
            ep = expert_parallel(model, layout=layout, backend="epgen", dispatch_transport="pull",
                                 max_tokens_per_rank=160, timeout_s=120.0, schedule=Schedule(seed=SEED + rank))
            losses, grads = _train(model, mine, reduce=data_parallel if layout == "own_tokens" else None,
                                   routing={"forced": envelope[-1]})
            ep.close()
            lines += _check(f"{family} W={world} {layout} rank {rank}", losses, grads, *envelope[:4])
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_as_processes(tmp_path, family, world):
    torch.multiprocessing.spawn(_body, args=(world, str(tmp_path / "store"), family, str(tmp_path)), nprocs=world,
                                join=True)
    for rank in range(world):
        print((tmp_path / f"rank{rank}").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("family, steps", [("qwen3_moe", 1), ("mixtral", STEPS), ("gpt_oss", 1)])
def test_training_steps_on_virtual_ranks(family, steps):
    """W = 2 virtual ranks (every rank in this process: the model's batch split between them);
    gpt_oss's experts have biases, whose gradients on the grouped path must take no padding row
    of the expert layout (each rank's last expert's bias gradient was 0.0032 and 0.0066 off,
    against 0.0002 to 0.0007 for the others, until the padding rows got no bias)."""
    from epgen.integrations.transformers import expert_parallel

    model32 = hf_models.tiny_model(family, SEED)
    batches = [_batch(-1)]
    envelope = _envelope(model32, batches, [0], steps=steps)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    expert_parallel(model, virtual=True, world_size=2, backend="epgen", dispatch_transport="pull",
                    max_tokens_per_rank=128)
    losses, grads = _train(model, batches, steps, routing={"forced": envelope[-1]})
    print("\n".join(_check(f"{family} virtual W=2", losses, grads, *envelope[:4])))


def test_training_refusals():
    """Gradients through the reference backend, and an op without the pull kernels, are refused
    naming the fix."""
    from epgen.integrations.transformers import expert_parallel

    model = hf_models.tiny_model("qwen3_moe", SEED).to(torch.bfloat16)
    expert_parallel(model, virtual=True, world_size=2, backend="reference")
    with pytest.raises(RuntimeError, match="gradients need backend='epgen'"):
        model(_batch(-1), labels=_batch(-1)).loss.backward()
    with torch.no_grad():  # inference stays as it was
        model(_batch(-1))
    model = hf_models.tiny_model("qwen3_moe", SEED).to(torch.bfloat16)
    expert_parallel(model, virtual=True, world_size=2, backend="epgen", max_tokens_per_rank=128)
    with pytest.raises(ValueError, match=r"dispatch_transport='pull'"):
        model(_batch(-1), labels=_batch(-1))
