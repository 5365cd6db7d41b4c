"""Expert parallelism for Hugging Face transformers (v5) MoE models through epgen's dispatch and combine.

``expert_parallel(model, ...)`` turns every experts module of a loaded model expert-parallel:

* the router stays as the model computes it (the MoE block calls its experts module with the
  block's tokens, the top-k expert ids and the top-k weights, as it always does);
* the experts module's forward becomes epgen's: dispatch in the expert layout
  (``EpConfig(layout="expert")``), the class's own expert math on this rank's L local experts
  (``expert_rows``: its gate/up layout, transposition, biases, ``_apply_gate`` or activation, post
  expert norm), then epgen's weighted combine;
* shared experts, attention and everything else stay the model's.

Extension point: transformers' ``ExpertsInterface`` (``transformers.integrations.moe``). Its v5 MoE
classes are decorated with ``@use_experts_implementation``, whose forward looks up
``config._experts_implementation`` in ``ALL_EXPERTS_FUNCTIONS`` and calls that function with the
module and (tokens, top-k ids, top-k weights). This module registers ``"epgen"`` there (at import)
and ``expert_parallel`` selects it with ``model.set_experts_implementation("epgen")``. Why this
point: its signature is exactly epgen's contract (tokens in, top-k ids and weights, weighted sum
out), the decorator also records each class's weight conventions (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``) so any class built on it runs unchanged, and it exists in
5.17 and later alike. ``expert_parallel`` converts a loaded model: every rank loads it whole first.

Sharded at load (transformers 5.23 and later): the import also registers ``"epgen"`` in
transformers' expert-parallel plug-in registry (``EPImplementationInterface``, the seam of its
``ep_dispatch_experts`` plan rule), so ``from_pretrained(..., distributed_config=DistributedConfig(
ep_size=W, ep_implementation="epgen"))`` reads only a rank's E / W experts and runs them through
``ExpertParallel`` (``EpgenEPImplementation``, ``loaded_expert_parallel``). 5.17-5.22 have no
registry: ``expert_parallel`` is the path there (``HAS_EP_REGISTRY``).

Outside the conventions (``READERS``): dbrx's ``DbrxExperts`` (gate, up and down as [E I, H]
stacks of linear layers; its forward is the experts call, replaced) and llama4's
``Llama4TextExperts`` (its block scales each expert's input by the router's score: the block's
forward is replaced, the experts run f(w x) on the dispatched rows). Other experts classes of
transformers are refused naming the module, its class and why (``REFUSED``: jetmoe,
switch_transformers, nllb_moe, vitpose_backbone).

The rest is epgen's and framework-independent (``epgen.layers.expert_parallel``, the shape every
integration takes: docs/architecture.md, "A new framework integration"): the token layouts
(``"own_tokens"``: each rank brings its own tokens; ``"same_tokens"``: every rank the same ones,
each dispatching its slice; the former names ``"owned"`` and ``"replicated"`` warn as deprecated),
virtual ranks, the kernel family of each call, the backends (``"epgen"``: the GPU op for CUDA
weights, the host emulation for CPU weights when asked; ``"reference"``: ``epgen.reference``, the
CPU's default), the expert math on a shard (``expert_rows``) and the call with gradients. This
module adds only what transformers needs: where the experts are and how they compute
(``READERS``), the seams, the weight checks, the phase of each forward and ``generate``.

Every rank must run the same MoE layers in the same order: with one process a rank,
``expert_parallel`` makes ``model.generate`` default to ``synced_gpus=True`` (a rank whose
sequences have ended keeps running forwards until every rank's have). The experts read the
module's weights as they are at each forward (a load after the conversion runs); under
``torch.compile`` the experts call is one opaque operator (``epgen::transformers_experts``).

Training (``model.train()``, gradients): with backend "epgen" and the pull kernels
(``expert_parallel(..., dispatch_transport="pull")``) a call that needs gradients runs the base
class's ``train`` (``epgen.autograd``): gradients reach the hidden states, the router (through the
top-k weights) and this rank's expert weights (docs/training.md).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from epgen.codegen.config import EpConfig
from epgen.layers import expert_parallel as layers
from epgen.layers.expert_parallel import (ExpertShard, build_op, check_host_options, expert_rows, resolve_backend,
                                          token_layout)
from epgen.layers.moe import grouped_mm_refusal

__all__ = ["EP_IMPLEMENTATION", "EXPERTS_IMPLEMENTATION", "HAS_EP_REGISTRY", "READERS", "REFUSED", "ConventionsReader",
           "DbrxReader", "EpgenEPImplementation", "ExpertParallel", "ExpertsReader", "Llama4Reader",
           "epgen_experts_forward", "expert_parallel", "loaded_expert_parallel", "reader", "register_ep_implementation"]

EXPERTS_IMPLEMENTATION = "epgen"
"""The name registered in transformers' ``ALL_EXPERTS_FUNCTIONS``."""

# --- how epgen reads each kind of experts module -------------------------------------------------


def _attr(module: torch.nn.Module, name: str):
    """``module``'s attribute at the dotted path ``name`` (None where a part is missing)."""
    for part in name.split("."):
        module = getattr(module, part, None)
    return module


class ExpertsReader:
    """How epgen reads one kind of experts module: where its expert weights are (every one
    ``[E rows, ...]``, expert e's rows at [e rows, (e + 1) rows) of dim 0), its L local experts as
    grouped-GEMM operands (``ExpertShard``, views: no copy), its activation, and how the model's
    forward reaches epgen (``install``). ``READERS`` holds one per kind; ``reader(module)`` finds it.

    Attributes:
        input_weighted: the routing weight scales the expert's input, f(w x), not its output
            (``expert_rows`` takes the rows' weights).
    """

    input_weighted = False

    def matches(self, module: torch.nn.Module) -> bool:
        raise NotImplementedError

    def weights(self, module: torch.nn.Module) -> tuple[str, ...]:
        """The dotted names of its expert weights."""
        raise NotImplementedError

    def rows(self, module: torch.nn.Module) -> int:
        """Rows of dim 0 an expert holds in each weight (1: a stack [E, ...] of expert matrices)."""
        return 1

    def shape(self, module: torch.nn.Module) -> tuple[int, int, int]:
        """(experts E, hidden H, intermediate I) as its weights hold them."""
        raise NotImplementedError

    def check(self, name: str, module: torch.nn.Module) -> None:
        """ValueError naming the module and the reason where its class lacks what its math needs."""

    def shard(self, module: torch.nn.Module, start: int, stop: int) -> ExpertShard:
        raise NotImplementedError

    def activate(self, module: torch.nn.Module, h: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def post(self, module: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
        return y

    def config(self, module: torch.nn.Module, model: torch.nn.Module):
        """The config ``EpConfig.from_hf_config`` reads hidden size, experts and top-k from."""
        return model.config

    def install(self, model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
        """Route the model's calls of ``module`` through ``module._epgen_parallel``."""
        raise NotImplementedError


class ConventionsReader(ExpertsReader):
    """transformers' experts conventions (``@use_experts_implementation``): ``gate_up_proj`` (or
    ``up_proj`` without a gate) and ``down_proj`` as [E, ...] stacks, stored transposed or not
    (``is_transposed``), with biases (``has_bias``), the class's ``_apply_gate`` or ``act_fn``
    and ``post_expert_norm``; reached through ``ALL_EXPERTS_FUNCTIONS["epgen"]``
    (``model.set_experts_implementation``, which ``expert_parallel`` calls once for the model)."""

    def matches(self, module):
        return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed")) and hasattr(module, "down_proj")

    def weights(self, module):
        up = "gate_up_proj" if module.has_gate else "up_proj"
        return (up, "down_proj") + ((f"{up}_bias", "down_proj_bias") if module.has_bias else ())

    def shape(self, module):
        up, down = _attr(module, self.weights(module)[0]), module.down_proj
        hidden = up.shape[1] if module.is_transposed else up.shape[2]
        return up.shape[0], hidden, down.shape[1] if module.is_transposed else down.shape[2]

    def check(self, name, module):
        cls = type(module).__name__
        if module.has_gate and not callable(getattr(module, "_apply_gate", None)):
            raise ValueError(f"{name} ({cls}): has_gate but no _apply_gate")
        if not module.has_gate and not callable(getattr(module, "act_fn", None)):
            raise ValueError(f"{name} ({cls}): no gate and no act_fn")

    def shard(self, module, start, stop):
        up_name = "gate_up_proj" if module.has_gate else "up_proj"

        def operand(name):
            w = getattr(module, name)[start:stop]
            return w if module.is_transposed else w.transpose(1, 2)

        def bias(name):
            return getattr(module, name)[start:stop] if module.has_bias else None

        return ExpertShard(up=operand(up_name), up_bias=bias(f"{up_name}_bias"), down=operand("down_proj"),
                           down_bias=bias("down_proj_bias"))

    def activate(self, module, h, gate):
        return module._apply_gate(h) if module.has_gate else module.act_fn(h)

    def post(self, module, y):
        return module.post_expert_norm(y) if getattr(module, "has_post_expert_norm", False) else y

    def config(self, module, model):
        return module.config

    def install(self, model, name, module):
        pass  # expert_parallel selects the "epgen" experts implementation for the whole model


def _class(module_path: str, name: str):
    """transformers' class ``name`` of ``module_path``, or None where this transformers has none."""
    try:
        import importlib

        return getattr(importlib.import_module(module_path), name, None)
    except ImportError:
        return None


class DbrxReader(ExpertsReader):
    """dbrx's ``DbrxExperts``: not on the conventions, but a stack of linear layers a grouped GEMM
    takes: ``mlp.w1`` (gate), ``mlp.v1`` (up) [E I, H] output-major and ``mlp.w2`` [E I, H]
    input-major, act(x w1[e]^T) * (x v1[e]^T) @ w2[e] with ``mlp.activation_fn``. Its forward is
    the experts call (tokens, top-k ids, top-k weights: the weighted sum): the module's forward is
    replaced by epgen's."""

    def matches(self, module):
        cls = _class("transformers.models.dbrx.modeling_dbrx", "DbrxExperts")
        return cls is not None and isinstance(module, cls)

    def weights(self, module):
        return ("mlp.w1", "mlp.v1", "mlp.w2")

    def rows(self, module):
        return module.ffn_hidden_size

    def shape(self, module):
        rows = module.mlp.w1.shape[0]
        return rows // module.ffn_hidden_size, module.mlp.w1.shape[1], module.ffn_hidden_size

    def shard(self, module, start, stop):
        I, H = module.ffn_hidden_size, module.mlp.w1.shape[1]

        def experts(w):
            return w.view(-1, I, H)[start:stop]

        return ExpertShard(up=experts(module.mlp.v1).transpose(1, 2), up_bias=None, down=experts(module.mlp.w2),
                           down_bias=None, gate=experts(module.mlp.w1).transpose(1, 2))

    def activate(self, module, h, gate):
        return module.mlp.activation_fn(gate) * h

    def install(self, model, name, module):
        import types

        def forward(self, hidden_states, top_k_index, top_k_weights):
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            return self._epgen_parallel.forward(self, x, top_k_index.reshape(x.shape[0], -1),
                                                top_k_weights.reshape(x.shape[0], -1)).view(shape[0], -1, shape[-1])

        module.forward = types.MethodType(forward, module)


class Llama4Reader(ExpertsReader):
    """llama4's ``Llama4TextExperts``: ``gate_up_proj`` [E, H, 2I] (gate then up) and ``down_proj``
    [E, I, H], input-major, act(gate) * up. Its MoE block (``Llama4TextMoe``) runs every expert on
    every token with the input scaled by the router's score (sigmoid of the top-k logits, 0
    elsewhere), so the routing weight scales the expert's input: out = shared(x) +
    sum_k f_k(w_k x). The block's forward is replaced: the router as the model computes it, then
    epgen's dispatch, f on the dispatched rows scaled by their weights (``input_weighted``), and
    the combine; the shared expert stays the model's."""

    input_weighted = True

    def matches(self, module):
        cls = _class("transformers.models.llama4.modeling_llama4", "Llama4TextExperts")
        return cls is not None and isinstance(module, cls)

    def weights(self, module):
        return ("gate_up_proj", "down_proj")

    def shape(self, module):
        return module.gate_up_proj.shape[0], module.gate_up_proj.shape[1], module.down_proj.shape[1]

    def shard(self, module, start, stop):
        return ExpertShard(up=module.gate_up_proj[start:stop], up_bias=None, down=module.down_proj[start:stop],
                           down_bias=None)

    def activate(self, module, h, gate):
        g, u = h.chunk(2, dim=-1)
        return u * module.act_fn(g)

    def install(self, model, name, module):
        import types

        block = model.get_submodule(name.rpartition(".")[0])

        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, self.hidden_dim)
            scores, logits = self.router(x)
            ids = torch.topk(logits, self.top_k, dim=1).indices  # the router's own top-k of the same logits
            out = self.shared_expert(x)
            out.add_(self.experts._epgen_parallel.forward(self.experts, x, ids, scores.gather(1, ids)))
            return out, logits

        block.forward = types.MethodType(forward, block)


READERS = (ConventionsReader(), DbrxReader(), Llama4Reader())
"""The kinds of experts module epgen runs, tried in order."""

REFUSED = {
    "JetMoeMoA": "a mixture of attention heads (each expert a query and an output projection run inside the "
                 "attention), not an MLP experts module",
    "JetMoeMoE": "its experts (JetMoeParallelExperts) take the tokens its own router sorts and counts, not top-k "
                 "ids and weights",
    "SwitchTransformersExperts": "per-expert dense modules (a ModuleDict) called with a one-hot expert mask of "
                                 "capacity-limited top-1 routing (an encoder-decoder), not with top-k ids and weights",
    "NllbMoeExperts": "per-expert dense modules (a ModuleDict) called with a one-hot expert mask of capacity-limited "
                      "top-2 routing (an encoder-decoder), not with top-k ids and weights",
    "VitPoseNaiveMoe": "one linear head a dataset, chosen by the dataset index of the whole image, not a routing of "
                       "tokens",
}
"""Experts classes of transformers epgen refuses, by class name: why a grouped GEMM over dispatched
tokens cannot take them."""


def reader(module: torch.nn.Module) -> ExpertsReader:
    """The ``ExpertsReader`` of an experts module (ValueError: none of ``READERS``)."""
    for r in READERS:
        if r.matches(module):
            return r
    raise ValueError(f"{type(module).__name__}: not an experts module epgen reads")


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every experts module of ``model`` that epgen reads (``READERS``);
    ValueError naming the module, its class and why for an experts module epgen cannot run
    (``REFUSED``, or per-expert modules in a ModuleList or ModuleDict)."""
    found = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in REFUSED:
            raise ValueError(f"{type(model).__name__}: {name} ({cls}): {REFUSED[cls]}; epgen cannot run it")
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            first = next(iter(module.children()), None)
            raise ValueError(f"{type(model).__name__}: {name} ({cls}) holds per-expert modules "
                             f"({type(first).__name__ if first is not None else 'empty'}), not a stack of expert "
                             "weights a grouped GEMM takes (transformers' experts conventions, "
                             "@use_experts_implementation); epgen cannot run it")
        if any(r.matches(module) for r in READERS):
            found.append((name, module))
    if not found:
        raise ValueError(f"{type(model).__name__}: no experts module built on transformers' experts conventions "
                         "(@use_experts_implementation: 3-D gate_up_proj/up_proj and down_proj) or of a class epgen "
                         "reads otherwise (dbrx, llama4); nothing to make expert-parallel")
    return found


def _module_name(experts) -> str:
    """"name (Class)" of a converted experts module, as ``expert_parallel`` found it in the model."""
    return f"{getattr(experts, '_epgen_name', '?')} ({type(experts).__name__})"


def _remember_weights(experts, held: int) -> None:
    """Record the device and shapes of the expert weights as converted (``held`` experts each), for
    ``ExpertParallel.shards`` to check the weights against at every forward."""
    read = reader(experts)
    shapes = {w: (held * read.rows(experts), *_attr(experts, w).shape[1:]) for w in read.weights(experts)}
    experts._epgen_weights = (_attr(experts, read.weights(experts)[0]).device, shapes)


def _check_weight(experts, w: str, held: int, recorded, rows: int = 1) -> None:
    """ValueError naming the module and weight ``w`` when it cannot run as converted (cheap: no
    data is read): ``held`` experts of ``rows`` rows each on dim 0."""
    t = _attr(experts, w)
    where = f"{_module_name(experts)}: {w}"
    if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"{where} is a {type(t).__name__}, not a plain tensor; epgen runs the bf16 expert weights "
                         "it converted")
    if t.is_meta:
        raise ValueError(f"{where} is on the meta device (not loaded, no data); load the weights (to_empty then "
                         "load_state_dict, or load_state_dict(..., assign=True)) before running the model")
    device, shapes = recorded if recorded is not None else (t.device, {})
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}; expert_parallel converted it on {device}, where the op runs")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{where} is {t.dtype}; epgen runs bf16 experts")
    want = shapes.get(w)
    if t.shape[0] != held * rows or (want is not None and tuple(t.shape) != want):
        raise ValueError(f"{where} is {tuple(t.shape)}; expert_parallel converted it as "
                         f"{want if want is not None else (held * rows, '...')}, the {held} experts this process runs "
                         "(one process a rank holds its own E / W only); assign a weight of that shape")


def _check_arguments(model, virtual, grouped_mm) -> None:
    """TypeError naming the argument, its value and the rule (``MoELayer``'s wording)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model={model!r}: must be a torch.nn.Module (a loaded transformers model), not a "
                        f"{type(model).__name__}")
    if not isinstance(virtual, bool):
        raise TypeError(f"virtual={virtual!r}: must be True or False")
    if grouped_mm is not None and not isinstance(grouped_mm, bool):
        raise TypeError(f"grouped_mm={grouped_mm!r}: must be None, True or False")


def _check_experts(name: str, experts: torch.nn.Module, cfg: EpConfig) -> None:
    """ValueError naming the class and the reason when epgen cannot run ``experts``."""
    cls = type(experts).__name__
    if getattr(experts, "_epgen_parallel", None) is not None:
        raise ValueError(f"{name} ({cls}): already expert-parallel through epgen (its weights may be one rank's "
                         "shard); convert a freshly loaded model")
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(f"{name} ({cls}): already expert-parallel under transformers' own plan "
                         "(_is_expert_parallel); load the model without a tp_plan / distributed_config")
    read = reader(experts)
    for w in read.weights(experts):
        t = _attr(experts, w)
        if not isinstance(t, torch.Tensor):
            conventions = (f" (its conventions: has_gate={experts.has_gate}, has_bias={experts.has_bias})"
                           if isinstance(read, ConventionsReader) else "")
            raise ValueError(f"{name} ({cls}): has no tensor {w}{conventions}; a quantized experts class is not "
                             "supported")
        if type(t.data) is not torch.Tensor:
            raise ValueError(f"{name} ({cls}): {w} is a {type(t.data).__name__} (a sharded or quantized tensor "
                             "subclass); epgen needs plain tensors holding every expert")
        if t.is_meta:
            raise ValueError(f"{name} ({cls}): {w} is on the meta device (not loaded, no data); load the weights "
                             "before expert_parallel")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} ({cls}): {w} is {t.dtype}; epgen dispatches bf16 rows and runs bf16 experts "
                             "(load the model with dtype=torch.bfloat16; quantized experts are not supported)")
    read.check(name, experts)
    up_name = read.weights(experts)[0]
    up = _attr(experts, up_name)
    if up.dim() != (3 if read.rows(experts) == 1 else 2) or read.shape(experts)[:2] != (cfg.num_experts, cfg.hidden):
        experts_held, hidden, _ = read.shape(experts) if up.dim() >= 2 else (None, None, None)
        layout = f" (is_transposed={experts.is_transposed})" if isinstance(read, ConventionsReader) else ""
        raise ValueError(f"{name} ({cls}): {up_name} {tuple(up.shape)}{layout} holds {experts_held} experts of hidden "
                         f"{hidden}; the model config says {cfg.num_experts} experts of hidden {cfg.hidden}")


class ExpertParallel(layers.ExpertParallel):
    """What ``expert_parallel`` returns: ``epgen.layers.expert_parallel.ExpertParallel`` (the op,
    the token layout, the family of each call, ``synchronize()``, ``close()``) with the
    transformers side: the converted experts modules, their weights read at each forward, the
    model's phase hook and ``generate``'s synced_gpus default. After ``close()`` the model's experts
    refuse to run.

    Attributes (besides the base class's):
        grouped_mm: True when the experts run ``torch._grouped_mm``, False for the per-expert loop.
        modules: the names of the converted experts modules.
    """

    def __init__(self, config, op, *, backend, layout, virtual, group, grouped_mm, modules):
        super().__init__(config, op, backend=backend, layout=layout, virtual=virtual, group=group)
        self.grouped_mm = grouped_mm
        self.modules = modules
        self.phase_hook = None  # the model's forward pre-hook that sets the phase (_phase_hook)
        self.generate_restore = None  # undoes _sync_generate

    def shards(self, experts) -> list[ExpertShard]:
        """The local experts of ``experts`` as its parameters are now (views: no copy), one
        ExpertShard per rank this process drives. Read at every forward, so a weight loaded, replaced
        (``load_state_dict(..., assign=True)``, ``to_empty`` then a load, a new Parameter) or changed
        in place after ``expert_parallel`` is the one that runs; nothing holds the old tensors.

        Raises:
            ValueError: naming the module, the weight and why: not a plain tensor, on the meta device
                (not loaded), not on the device the op runs on, not bf16, or not the shape converted
                (with one process a rank, a rank holds its E / W experts: a full [E, ...] weight
                assigned after the conversion is refused, not silently sliced).
        """
        cfg, recorded = self.config, getattr(experts, "_epgen_weights", None)
        L, W = cfg.experts_per_rank, cfg.world_size
        read = reader(experts)
        held = L * W if self.virtual else L
        for w in read.weights(experts):
            _check_weight(experts, w, held, recorded, read.rows(experts))
        if self.virtual:
            return [read.shard(experts, r * L, (r + 1) * L) for r in range(W)]
        return [read.shard(experts, 0, L)]

    def experts_stage(self, experts):
        """``experts``' math on the dispatched rows of each rank this process drives (the base
        class's experts stage): ``expert_rows`` on its shards as they are now, with the class's
        activation and post-expert norm."""
        read, shards = reader(experts), self.shards(experts)
        activate, post = functools.partial(read.activate, experts), functools.partial(read.post, experts)

        def stage(dispatched):
            return [expert_rows(s, d.x, d.offsets, activate=activate, post=post, grouped=self.grouped_mm,
                                weights=d.weights if read.input_weighted else None)
                    for s, d in zip(shards, dispatched)]

        return stage

    def forward(self, experts, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """One experts call of the model: hidden_states [T, H] bf16, top_k_index [T, K] (any int
        dtype), top_k_weights [T, K] (any float dtype, converted to float32) -> [T, H] bf16, the
        top-k weighted sum of the experts' outputs for this rank's tokens (all T in every layout).

        Without gradients the call is the ``epgen::transformers_experts`` operator (opaque to
        torch.compile) running ``run_module``; with gradients (grad mode on, and hidden_states,
        top_k_weights or an expert weight requiring grad) it runs the base class's ``train``.

        Raises:
            RuntimeError: closed; as ``train`` with gradients.
            ValueError: hidden_states not 2-D bf16; as ``shards`` and the base class's ``run``.
        """
        self._check_open(_module_name(experts))
        if hidden_states.dim() != 2 or hidden_states.dtype != torch.bfloat16:
            raise ValueError(f"{_module_name(experts)}: hidden_states {tuple(hidden_states.shape)} "
                             f"{hidden_states.dtype} must be [T, H] torch.bfloat16 (epgen runs the bf16 model it "
                             "converted; a model cast to another dtype after expert_parallel cannot run)")
        x = hidden_states.contiguous()
        ids = top_k_index.to(torch.int32).contiguous()
        w = top_k_weights.to(torch.float32).contiguous()
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w, *experts.parameters())):
            return self.train(x, ids, w, self.experts_stage(experts), name=_module_name(experts))
        key = id(experts)
        if not torch.compiler.is_compiling() and _CONVERTED.get(key) is not experts:
            _CONVERTED[key] = experts  # (a copy of a converted model: its own modules)
        return torch.ops.epgen.transformers_experts(x, ids, w, key, self.phase)

    def run_module(self, experts, x, ids, w, phase: str) -> torch.Tensor:
        """The body of the ``epgen::transformers_experts`` operator: the base class's ``run`` with
        ``experts``' stage; ``phase`` the model forward's phase as the caller saw it."""
        return self.run(x, ids, w, self.experts_stage(experts), phase=phase, name=_module_name(experts))

    def close(self) -> None:
        """Release the op's buffers, the model's phase hook and the generate wrapper; the converted
        experts modules then refuse to run (RuntimeError naming the module). Closing twice is
        harmless."""
        if self.generate_restore is not None:
            self.generate_restore()
            self.generate_restore = None
        if self.phase_hook is not None:
            self.phase_hook.remove()
            self.phase_hook = None
        super().close()


def epgen_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The function registered as ``experts_implementation="epgen"``: runs the experts module
    ``self`` expert-parallel (``ExpertParallel.forward``).

    Raises:
        RuntimeError: the module was not converted by ``expert_parallel`` (e.g. a model loaded
            with ``experts_implementation="epgen"`` alone).
    """
    handle = getattr(self, "_epgen_parallel", None)
    if handle is None:
        raise RuntimeError(f"{type(self).__name__}: experts_implementation='epgen' needs "
                           "epgen.integrations.transformers.expert_parallel(model, ...) first (it builds the op and "
                           "shards the experts)")
    return handle.forward(self, hidden_states, top_k_index, top_k_weights)


# --- torch.compile: the experts call is one opaque operator ------------------------------------------
#
# Why a custom operator and not torch.compiler.disable: a compiled model keeps one graph (the
# operator is a node; fullgraph=True works, and a CUDA-graphed step keeps the MoE layers inside
# it) where a disabled call breaks the graph at every MoE layer and runs those layers outside any
# compiled region. Its contract is the experts call's: [T, H] bf16 out for [T, H] bf16 in, no
# input mutated, so the fake implementation is one empty tensor. Dynamo never traces dispatch,
# combine or the reference (data-dependent sizes, collectives, host synchronizations).
# What the operator cannot take as an argument goes through a handle: the experts module by
# id (``_CONVERTED``, weak: a freed module leaves it), and the phase is passed in, read where the
# model's forward runs, because a compiled graph applies Python attribute writes (the phase
# pre-hook's) only after it ends.

_CONVERTED: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
"""The converted experts modules by id, for the operator."""


@torch.library.custom_op("epgen::transformers_experts", mutates_args=())
def _experts_operator(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, module: int, phase: str) -> torch.Tensor:
    experts = _CONVERTED.get(module)
    if experts is None:
        raise RuntimeError(f"epgen::transformers_experts: no converted experts module with id {module} (freed, or "
                           "a compiled graph of another model)")
    return experts._epgen_parallel.run_module(experts, x, ids, w, phase)


@_experts_operator.register_fake
def _(x, ids, w, module, phase):
    return x.new_empty(x.shape)


def _sync_generate(model: torch.nn.Module, handle: ExpertParallel) -> None:
    """With one process a rank (W > 1, not virtual), make ``model.generate`` default to
    ``synced_gpus=True``: transformers' own mechanism for models whose forward is a collective
    (DeepSpeed ZeRO-3, FSDP), where a rank whose sequences have all ended keeps running the
    forward (its tokens discarded) until every rank's have, each step all-reducing a "still
    generating" flag over the default process group. Without it a rank that stops early (EOS)
    leaves its peers waiting in a dispatch. transformers turns it on by itself for ZeRO-3 and
    FSDP only; it is an argument of ``generate``, not a GenerationConfig field, so an instance
    ``generate`` passes it (an explicit ``synced_gpus`` is kept; ``close()`` removes the wrapper).
    The flag's all-reduce runs on the default (world) group: every process of the world generates."""
    if handle.virtual or handle.config.world_size == 1 or not callable(getattr(type(model), "generate", None)):
        return
    import inspect
    import types

    generate = type(model).generate
    signature = inspect.signature(generate)

    def synced(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        if bound.arguments.get("synced_gpus") is None:
            bound.arguments["synced_gpus"] = True
        return generate(*bound.args, **bound.kwargs)

    synced.__doc__ = generate.__doc__
    model.generate = types.MethodType(synced, model)  # a deepcopy rebinds it to the copy

    def restore():
        if model.__dict__.get("generate") is not None and getattr(model.__dict__["generate"], "__func__", None) is synced:
            del model.__dict__["generate"]

    handle.generate_restore = restore


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, epgen_experts_forward)


_register()


def _expert_path(experts, device, hidden: int, grouped_mm: bool | None) -> bool:
    """Whether the experts run as grouped GEMMs: ``grouped_mm`` as given (True refused with the
    reason where ``torch._grouped_mm`` cannot run), None: grouped where it can, else the per-expert
    loop with a warning that says why."""
    refused = grouped_mm_refusal(device, hidden, reader(experts).shape(experts)[2])
    if grouped_mm and refused:
        raise ValueError(f"grouped_mm=True: {refused}")
    if grouped_mm is None and refused:
        warnings.warn(f"epgen expert parallel: the experts run as a per-expert loop (one host synchronization per "
                      f"layer, not capturable in a CUDA graph): {refused}", stacklevel=3)
    return refused is None if grouped_mm is None else bool(grouped_mm)


def _phase_hook(handle: "ExpertParallel"):
    """The model's forward pre-hook that sets ``handle.phase``: every rank runs the same phase, so
    prefill and decode take their families alike."""

    def phase(_model, args, kwargs):
        # A decode step: one new position a sequence on a cache that holds the earlier ones. A prompt
        # of one token has an empty cache: a prefill, as its peers' longer prompts are.
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = ids if ids is not None else kwargs.get("inputs_embeds")
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # the cache's name before / since 5.25
        cached = cache is not None and hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) > 0
        handle.phase = "decode" if cached and ids is not None and ids.dim() >= 2 and ids.shape[1] == 1 else "prefill"

    return phase


def expert_parallel(model: torch.nn.Module, *, group=None, virtual: bool = False, world_size: int | None = None,
                    layout: str = "own_tokens", backend: str | None = None, max_tokens_per_rank: int = 4096,
                    grouped_mm: bool | None = None, arch: str | None = None, schedule=None,
                    **overrides) -> ExpertParallel:
    """Make every MoE experts module of a loaded transformers v5 model expert-parallel through epgen.

    Each rank keeps its L = E / W experts (global experts [rank L, (rank + 1) L)): with one process
    per rank the other experts' weights are dropped from the module (the module's parameters
    become [L, ...] copies; the full tensors are freed once nothing else holds them), with virtual
    ranks every rank's experts stay in this process. Every experts module then runs
    ``ExpertParallel.forward`` (``experts_implementation="epgen"``).

    Args:
        model: a transformers PreTrainedModel whose MoE blocks use experts modules built on
            ``@use_experts_implementation`` (qwen3_moe, qwen3_next, mixtral, deepseek_v3 and kimi_k2,
            gpt_oss, ...) or read otherwise (dbrx, llama4: ``READERS``), expert weights bfloat16 on
            one device (CUDA for backend "epgen").
        group: the process group of the W ranks (one process per GPU; default the world group of
            an initialized torch.distributed; without one, only virtual ranks or world_size=1).
        virtual: run all ``world_size`` ranks in this process (tests; one GPU or the CPU).
        world_size: W with virtual=True (required there); else the group's size (checked if given).
        layout: "own_tokens" (each rank brings its own tokens) or "same_tokens" (every rank brings
            the same tokens); the former names "owned" and "replicated" are deprecated aliases.
        backend: "epgen" (``epgen.op.EpDispatchCombine``: on the GPU for CUDA weights; for CPU
            weights on the host emulation, epgen's real kernels run on the CPU, ``epgen.host``,
            for correctness, not speed) or "reference" (``ReferenceOp``, ``epgen.reference`` on
            the CPU); default: "epgen" for CUDA weights, else "reference".
        max_tokens_per_rank: the most tokens one rank dispatches in one call (sizes the buffers);
            for experts called with each route as its own row (ergo's: ids [T K, 1]) the rows, T x K.
        grouped_mm: the expert path: None = ``torch._grouped_mm`` where it runs without a host
            synchronization (CPU, CUDA sm_90 / sm_100; H and I multiples of 8), else the
            per-expert loop, with a warning that says why; True = grouped (refused where it
            cannot run); False = loop.
        arch, schedule: with backend "epgen" on CPU weights only (the host emulation): the arch
            whose kernels run on the CPU (sm_90, gfx942, gfx950 or gfx1250; default sm_90) and
            the ``epgen.host.Schedule`` of the op's launches (default ``Schedule()``).
        **overrides: further EpConfig fields (e.g. expert_alignment, combine_quant,
            max_recv_tokens, kernel_family, timeout_s); hidden, topk and num_experts come from
            the model config (``EpConfig.from_hf_config``) and EpConfig's layout is "expert"
            (``layout`` here is the token layout).

    Returns:
        ExpertParallel.

    Raises:
        TypeError: model not a torch.nn.Module; virtual not a bool; grouped_mm not None or a bool.
        ValueError: layout or backend unknown; arch or schedule given without backend "epgen" on CPU
            weights; virtual without world_size, or world_size not the
            group's size; neither a process group (torch.distributed initialized), virtual ranks nor
            world_size=1; an EpConfig field refused (e.g. experts not a multiple of W: names the
            model_type); no experts module; an experts module epgen cannot run (names the module,
            its class and the reason: a class of ``REFUSED`` (jetmoe, switch_transformers,
            nllb_moe, vitpose_backbone), per-expert modules in a ModuleList or ModuleDict, a
            quantized or sharded weight, not
            bf16, on the meta device, shapes that disagree with the config, already expert-parallel through epgen or
            under transformers' own expert parallelism); grouped_mm=True where it cannot run.
        RuntimeError: backend "epgen" on CUDA weights without CuPy, on CPU weights without the
            ``ziglang`` package (the host compile), or W > 1 processes without
            torch.distributed (``EpDispatchCombine``); the model cannot select the "epgen" experts
            implementation.
    """
    _check_arguments(model, virtual, grouped_mm)
    layout = token_layout(layout)
    resolve_backend(backend, None)  # refused before any work
    check_host_options(backend, None, arch, schedule)
    for name, fits in (("dtype", "bf16"), ("scale_bytes", 0), ("nodes", 1)):  # the experts' rows as the model has them
        if name in overrides and overrides[name] != fits:
            raise ValueError(f"expert_parallel({name}={overrides[name]!r}): the experts dispatch the model's bf16 "
                             f"hidden states on one node; {name} must be {fits!r}")
    overrides["layout"] = "expert"
    modules = _experts_modules(model)
    first = modules[0][1]
    if virtual:
        if world_size is None:
            raise ValueError("virtual=True: pass world_size (the ranks this process runs)")
        W, rank = world_size, None
    else:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = group if group is not None else dist.group.WORLD
            W, rank = dist.get_world_size(group), dist.get_rank(group)
        elif world_size == 1 and group is None:
            W, rank = 1, 0
        else:  # a forgotten init_process_group would otherwise run every rank alone, holding every expert
            raise ValueError(f"world_size={world_size}, group={group!r}: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group (one process per GPU), or pass virtual=True, "
                             "world_size=W (W ranks in this process), or world_size=1 (one rank, no process group)")
        if world_size is not None and world_size != W:
            raise ValueError(f"world_size={world_size}: the process group has {W} ranks")
    cfg = EpConfig.from_hf_config(reader(first).config(first, model), world_size=W,
                                  max_tokens_per_rank=max_tokens_per_rank, **overrides)
    for name, experts in modules:
        _check_experts(name, experts, cfg)
    device = _attr(first, reader(first).weights(first)[0]).device
    backend = resolve_backend(backend, device)
    grouped_mm = _expert_path(first, device, cfg.hidden, grouped_mm)
    op = build_op(cfg, backend, device, group, virtual, arch, schedule)
    L = cfg.experts_per_rank
    for name, experts in modules:
        if not virtual and W > 1:
            rows = L * reader(experts).rows(experts)
            for w in reader(experts).weights(experts):
                owner, _, leaf = w.rpartition(".")
                owner = experts.get_submodule(owner) if owner else experts
                p = getattr(owner, leaf)
                if isinstance(p, torch.nn.Parameter):
                    setattr(owner, leaf, torch.nn.Parameter(p.data[rank * rows:(rank + 1) * rows].clone(),
                                                            requires_grad=p.requires_grad))
        experts._epgen_name = name
        _CONVERTED[id(experts)] = experts
        _remember_weights(experts, L * W if virtual else L)
    handle = ExpertParallel(cfg, op, backend=backend, layout=layout, virtual=virtual, group=group,
                            grouped_mm=bool(grouped_mm), modules=[n for n, _ in modules])

    handle.phase_hook = model.register_forward_pre_hook(_phase_hook(handle), with_kwargs=True)
    _sync_generate(model, handle)
    for name, experts in modules:
        experts._epgen_parallel = handle
        reader(experts).install(model, name, experts)
    conventions = [(n, e) for n, e in modules if isinstance(reader(e), ConventionsReader)]
    if conventions:
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    wrong = [n for n, e in conventions if e.config._experts_implementation != EXPERTS_IMPLEMENTATION]
    if wrong:
        raise RuntimeError(f"{type(model).__name__}: set_experts_implementation('epgen') left {wrong[0]} on "
                           f"{conventions[0][1].config._experts_implementation!r}; this model cannot select the epgen "
                           "experts implementation")
    return handle


# --- sharded at load: transformers' expert-parallel plug-in registry (5.23 and later) ------------

EP_IMPLEMENTATION = "epgen"
"""The name registered in transformers' ``EPImplementationInterface`` (5.23 and later):
``from_pretrained(..., distributed_config=DistributedConfig(ep_size=W, ep_implementation="epgen"))``."""

try:  # transformers 5.23 added the registry; 5.17-5.22 have none (expert_parallel converts a loaded model)
    from transformers.distributed.expert_parallel import EPImplementation as _EPImplementation
    from transformers.distributed.expert_parallel import EPImplementationInterface as _EPInterface
except ImportError:
    _EPImplementation = _EPInterface = None

HAS_EP_REGISTRY = _EPInterface is not None
"""Whether the installed transformers has the expert-parallel plug-in registry (5.23 and later)."""

_LOADED = weakref.WeakValueDictionary()
"""(model config id, expert group, options) -> the ExpertParallel its experts modules share."""


def _check_loaded_experts(experts: torch.nn.Module, cfg: EpConfig, experts_per_rank: int) -> None:
    """ValueError naming the class and the reason when epgen cannot run ``experts`` as transformers
    sharded it (each weight ``[E / W, ...]`` on this rank, a DTensor or a plain tensor)."""
    cls = type(experts).__name__
    if not all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed")):
        raise ValueError(f"{cls}: not an experts module on transformers' experts conventions "
                         "(@use_experts_implementation); epgen cannot run it")
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    for w in [up_name, "down_proj"] + ([f"{up_name}_bias", "down_proj_bias"] if experts.has_bias else []):
        t = getattr(experts, w, None)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{cls}: has no tensor {w} (has_gate={experts.has_gate}, has_bias={experts.has_bias}); "
                             "a quantized experts class is not supported")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{cls}: {w} is {t.dtype}; epgen dispatches bf16 rows and runs bf16 experts (load with "
                             "dtype=torch.bfloat16; quantized experts are not supported)")
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.shape[0] != experts_per_rank:
            raise ValueError(f"{cls}: {w} holds {local.shape[0]} experts on this rank; E / W = {cfg.num_experts} / "
                             f"{cfg.world_size} = {experts_per_rank} expected (an expert plan that shards "
                             "dim 0 of every expert weight, grouped_gemm)")


class EpgenEPImplementation(_EPImplementation or object):
    """epgen as an ``EPImplementation`` of transformers' registry (5.23 and later): the experts of
    an ``ep_dispatch_experts`` module reach their tokens through epgen's dispatch and combine.

    transformers shards every expert weight on dim 0 at load (the model's ``grouped_gemm`` plan
    rules: each rank reads only its E / W experts from the checkpoint) and builds one instance per
    experts module, with the expert mesh and the tensor-parallel mesh. Calls run
    ``ExpertParallel.forward`` on the module's local weights (read at each call: views, no copy).

    Token layout, from the meshes: the ranks of the expert group hold the same batch
    (``tp_size == ep_size``, e.g. ``DistributedConfig(tp_size=W, tp_plan={}, ep_size=W)``):
    "same_tokens"; each rank its own batch (``tp_size == 1``, e.g. ``DistributedConfig(fsdp_size=W,
    ep_size=W)``): "own_tokens". Other meshes (1 < tp_size < ep_size) are refused.

    One ``ExpertParallel`` (one op, one set of buffers) serves every experts module of a model;
    ``loaded_expert_parallel(model)`` returns it and installs the phase hook (decode takes the
    low-latency family).

    Options (``register_ep_implementation``): backend ("epgen" for CUDA meshes, "reference" on
    the CPU by default; "epgen" on a CPU mesh runs the kernels on the host emulation), arch and
    schedule (the host emulation's, as ``expert_parallel`` takes them), max_tokens_per_rank (4096),
    grouped_mm (None: where it runs), and further EpConfig fields.
    """

    options: dict = {}

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        opts = dict(self.options)
        backend = opts.pop("backend", None)
        max_tokens = opts.pop("max_tokens_per_rank", 4096)
        grouped_mm = opts.pop("grouped_mm", None)
        arch, schedule = opts.pop("arch", None), opts.pop("schedule", None)
        W, tp = ep_mesh.size(), tp_mesh.size()
        if tp != 1 and not (tp == W and self.shares_batch):
            raise ValueError(f"ep_implementation='epgen': tp_size={tp}, ep_size={W}: epgen runs an expert group whose "
                             "ranks all hold the same batch (tp_size == ep_size) or each their own (tp_size == 1)")
        layout = "same_tokens" if tp == W and W > 1 else "own_tokens"
        group = ep_mesh.get_group()
        cfg = EpConfig.from_hf_config(experts.config, world_size=W, max_tokens_per_rank=max_tokens,
                                      **{**opts, "layout": "expert"})
        _check_loaded_experts(experts, cfg, cfg.experts_per_rank)
        device = (torch.device(ep_mesh.device_type, torch.cuda.current_device()) if ep_mesh.device_type == "cuda"
                  else torch.device(ep_mesh.device_type))
        backend = resolve_backend(backend, device)
        key = (id(experts.config), id(group), layout, backend, grouped_mm, cfg, arch, schedule)
        handle = _LOADED.get(key)
        if handle is None:
            grouped_mm = _expert_path(experts, device, cfg.hidden, grouped_mm)
            op = build_op(cfg, backend, device, group if W > 1 else None, virtual=False, arch=arch,
                           schedule=schedule)
            handle = ExpertParallel(cfg, op, backend=backend, layout=layout, virtual=False, group=group,
                                    grouped_mm=bool(grouped_mm), modules=[])
            handle.loaded = True  # sharded at load by transformers (loaded_expert_parallel finds it)
            _LOADED[key] = handle
        self.handle = handle
        self.experts = weakref.ref(experts)
        experts._epgen_parallel = handle

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        # Inside transformers' forward the module's parameters are this rank's local tensors, which
        # ExpertParallel.forward reads at the call (ExpertParallel.shards).
        return self.handle.forward(self.experts(), hidden_states, top_k_index, top_k_weights)


def register_ep_implementation(name: str = EP_IMPLEMENTATION, **options) -> str:
    """Register epgen in transformers' expert-parallel registry under ``name`` with ``options``
    (``EpgenEPImplementation``: backend, arch and schedule (the host emulation's),
    max_tokens_per_rank, grouped_mm, EpConfig fields, e.g.
    ``kernel_family`` or ``combine_quant``); the import registers ``"epgen"`` with the defaults.
    Returns ``name``, for ``DistributedConfig(ep_implementation=name)``.

    Raises:
        RuntimeError: transformers without the registry (before 5.23): use ``expert_parallel``
            on a loaded model there.
    """
    if not HAS_EP_REGISTRY:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} has no expert-parallel plug-in registry (5.23 "
                           "added EPImplementationInterface); load the model and call expert_parallel(model, ...)")
    cls = type(f"EpgenEPImplementation_{name}", (EpgenEPImplementation,), {"options": dict(options)})
    _EPInterface.register(name, cls)
    return name


def loaded_expert_parallel(model: torch.nn.Module) -> ExpertParallel:
    """The ``ExpertParallel`` that transformers' registry built for ``model``
    (``from_pretrained(..., distributed_config=DistributedConfig(..., ep_implementation="epgen"))``),
    for ``synchronize()`` and ``close()``; makes ``model.generate`` default to
    ``synced_gpus=True`` with W > 1 processes (as ``expert_parallel`` does: a rank whose sequences
    have ended keeps stepping until every rank's have), and installs, once, the model's forward
    pre-hook that sets its phase (a forward of one position a sequence on a filled cache is a decode: with one
    process a rank and each rank its own tokens, decode takes the low-latency family and prefill
    the normal one; without the hook every call takes the normal family).

    Raises:
        ValueError: no experts module of ``model`` runs through the registry's epgen implementation.
    """
    names, handle = [], None
    for name, module in model.named_modules():
        h = getattr(module, "_epgen_parallel", None)
        if h is not None and getattr(h, "loaded", False):
            if handle is not None and h is not handle:
                raise ValueError(f"{type(model).__name__}: its experts modules run through more than one epgen "
                                 "expert-parallel handle")
            handle = h
            names.append(name)
    if handle is None:
        raise ValueError(f"{type(model).__name__}: no experts module loaded through ep_implementation='epgen' "
                         "(from_pretrained(..., distributed_config=DistributedConfig(ep_size=W, "
                         "ep_implementation='epgen')))")
    handle.modules = names
    if handle.phase_hook is None:
        handle.phase_hook = model.register_forward_pre_hook(_phase_hook(handle), with_kwargs=True)
    if handle.generate_restore is None:
        _sync_generate(model, handle)
    return handle


if HAS_EP_REGISTRY:
    register_ep_implementation()
