"""EpConfig: what a user states about one expert-parallel layer, a value validated on construction.

Which kernels a config launches is the planner's answer (``epgen.codegen.planner.plan``), not the
config's."""

from __future__ import annotations

import numbers

import attrs

from epgen.codegen.arch import ARCH_TRAITS
from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES
from epgen.codegen.errors import FieldError
from epgen.codegen.models import model as _model
from epgen.codegen.planner import plan
from epgen.codegen.spec import EXPERT_ALIGNMENTS, LL_MAX_TOKENS
from epgen.codegen.tuning import Geometry

LAYOUTS = ("rank", "expert")
"""``EpConfig.layout`` values."""

KERNEL_FAMILIES = ("auto", "normal", "low_latency")
"""``EpConfig.kernel_family`` values."""

DISPATCH_TRANSPORTS = ("auto", "push", "pull")
"""``EpConfig.dispatch_transport`` values."""


def _check(cond: bool, field: str, value, rule: str):
    if not cond:
        raise FieldError(field, f"EpConfig.{field}={value!r}: {rule}")


def _int(value):
    """An integer of another type (numpy's, e.g. from ``np.int64``) as a Python int; anything
    else, bools included, unchanged for the validation to reject."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


DEFAULT_TIMEOUT_S = 300.0
"""``EpConfig.timeout_s``'s default, seconds: longer than any wait of a healthy but loaded system
(DeepEP bounds its waits at 2 x 10^11 clock cycles, about 100 s; a serving step can stall longer on
a busy host) and shorter than torch.distributed's default collective timeout (10 minutes), so that
epgen's timeout, which names the rank that stopped answering and the phase, comes before a
framework watchdog aborts the process."""


@attrs.frozen
class EpConfig:
    """One expert-parallel MoE layer as its user describes it.

    Attributes:
        world_size: ranks W (processes, or virtual ranks in one process).
        hidden: elements per token row H.
        topk: experts per token K, 1 to 16 (``KernelSpec.topk``) and at most num_experts.
        num_experts: routed experts E, a multiple of W (expert e lives on rank e // (E / W)).
        max_tokens_per_rank: the most tokens any rank passes to one dispatch.
        dtype: dispatch payload dtype.
        scale_bytes: opaque per-token scale bytes forwarded by dispatch (0 = none).
        combine_quant: wire format of the combine leg: "none" (bf16), "fp8_direct_cast",
            "fp8_blockwise" or "fp4_blockwise" (``epgen.codegen.dtypes.COMBINE_QUANTS``; error
            bounds in ``epgen.quant.combine_error_bound``). Input and output stay bf16.
        dispatch_geometry, combine_geometry: launch geometry of the two kernels; None (default)
            takes it from the tuning table per token bucket (``epgen.codegen.tuning``).
        timeout_s: bound of every in-kernel spin-wait, seconds (``DEFAULT_TIMEOUT_S``: 300). Past it
            the waiting rank records a timeout naming the peer and the phase, and the op refuses
            every later call (the ranks are out of step). A healthy rank can wait long for a peer
            that is busy (a slow expert stage, a peer waiting on its own collectives, a host
            descheduled, or processes that share a GPU), so the default is far above any such wait;
            set a few seconds where a dead peer should be found fast (tests, a health check).
        layout: "rank" (default): dispatch returns rank-major receive rows and combine sums one
            row per (token, rank); "expert": the received rows are also expanded into per-expert
            groups and combine applies the routing weights (docs/moe.md).
        expert_alignment: the expert layout's groups start at multiples of this many rows (a power
            of two, 1 to 256; 1 with the rank layout). The expert layout holds at most 6143 local
            experts per rank (its expand kernel counts rows per (warp, expert) in 48 KiB of shared
            memory; ``KernelSpec.plan_shared_bytes``).
        max_recv_tokens: receive rows of each rank, N (None: W x max_tokens_per_rank, the worst
            case); a dispatch that would need more raises ``EpError`` naming the rank and the rows.
        kernel_family: which kernels move the tokens. "normal": one kernel per op (counting,
            receive rows reserved with remote atomics; built for bandwidth). "low_latency": two
            kernels per op, a sending half that pushes rows into fixed slots and raises one flag per
            (receiver, block), and a receiving half that waits for the flags and finishes the op
            (built for decode sizes; the only family with ``async_recv``); its stages hold W x
            max_tokens_per_rank rows, at most 65535 tokens a rank (fewer at W >= 16:
            ``KernelSpec.ll_shared_bytes``). "auto" (default): both, and each
            call takes the low-latency family when its token count is at most T_ll
            (``epgen.codegen.planner.KernelPlan.low_latency_tokens``: the tuning table's threshold,
            which ``epgen tune`` measures; its stages are sized for that many). Both return the same outputs. With one
            process per GPU every rank must take the same family in a call (their token counts on
            the same side of the threshold); a rank waiting for a family its peer did not run times
            out (``EpError`` naming the phase).
        low_latency_geometry: launch geometry of both halves of both low-latency ops; None
            (default) takes the tuning table's.
        dispatch_transport: how the normal family's dispatch moves the payload rows. "push": the
            dispatch kernel stores every row into its destinations (the pull kernels are not
            built). "pull": the dispatch kernel sends only the metadata and a second kernel
            (DISPATCH_PULL) on every destination loads the rows from the source rank's
            ``dispatch_input`` (an x elsewhere is first copied there by torch: H x row bytes per
            token, one more local copy). "auto" (default): a call pulls when its tuning bucket says
            "pull" and x is the op's ``dispatch_input`` (in virtual mode on every rank), else it
            pushes; with one rank a process (W > 1) "auto" always pushes, since no process sees its
            peers' inputs; only the pull buckets' kernels are built. The shipped tables hold push
            buckets only: ``epgen tune`` measures the push dispatch (a pull bucket is written by
            hand, with its measurement in the provenance). Every rank must take the same transport
            in a call (``op.transport(T, x)`` says which): a pulling rank whose peer pushed times
            out (``EpError`` naming the pull phase). The low-latency family never pulls.
        nodes: nodes N the W ranks span (default 1: one node, every peer reached by IPC). With
            N > 1 the layer runs hierarchically (``epgen.hierarchical``, docs/multinode.md): W = N x G
            ranks, global rank = node x G + local rank, and the node-local kernels are those of
            ``node_config()`` (G ranks); the flat W-rank kernels are never built.
        gpus_per_node: ranks G on each node; None (default) = world_size / nodes. world_size must
            be nodes x gpus_per_node.

    The integer fields take any integer type (numpy's too) and hold a Python int; bools and
    floats are rejected.

    Raises:
        epgen.codegen.errors.FieldError: a ValueError naming the field (``.field``), its value
            and the rule, on construction; the derived KernelSpecs are validated too (e.g. a row
            that is not a multiple of 16 bytes: the KernelSpec's field, e.g. ``hidden``).
    """

    world_size: int = attrs.field(converter=_int)
    hidden: int = attrs.field(converter=_int)
    topk: int = attrs.field(converter=_int)
    num_experts: int = attrs.field(converter=_int)
    max_tokens_per_rank: int = attrs.field(converter=_int)
    dtype: str = "bf16"
    scale_bytes: int = attrs.field(default=0, converter=_int)
    combine_quant: str = "none"
    dispatch_geometry: Geometry | None = None
    combine_geometry: Geometry | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    layout: str = "rank"
    expert_alignment: int = attrs.field(default=1, converter=_int)
    max_recv_tokens: int | None = attrs.field(default=None, converter=_int)
    kernel_family: str = "auto"
    low_latency_geometry: Geometry | None = None
    dispatch_transport: str = "auto"
    nodes: int = attrs.field(default=1, converter=_int)
    gpus_per_node: int | None = attrs.field(default=None, converter=_int)

    def __attrs_post_init__(self):
        for f in ("world_size", "hidden", "topk", "num_experts", "max_tokens_per_rank"):
            v = getattr(self, f)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f, v, "must be a positive int")
        _check(self.num_experts % self.world_size == 0, "num_experts", self.num_experts,
               f"must be a multiple of world_size={self.world_size}")
        _check(isinstance(self.dtype, str) and self.dtype in DTYPES, "dtype", self.dtype,
               f"must be one of {', '.join(DTYPES)}")
        _check(isinstance(self.combine_quant, str) and self.combine_quant in COMBINE_QUANTS, "combine_quant", self.combine_quant,
               f"must be one of {', '.join(COMBINE_QUANTS)}")
        _check(self.topk <= self.num_experts, "topk", self.topk, f"must be at most num_experts={self.num_experts}")
        _check(isinstance(self.kernel_family, str) and self.kernel_family in KERNEL_FAMILIES, "kernel_family",
               self.kernel_family, f"must be one of {', '.join(KERNEL_FAMILIES)}")
        _check(self.low_latency_geometry is None or self.kernel_family != "normal", "low_latency_geometry",
               self.low_latency_geometry, "applies to kernel_family 'auto' or 'low_latency' (kernel_family='normal' "
               "builds no low-latency kernels)")
        _check(self.kernel_family != "low_latency" or not isinstance(self.max_tokens_per_rank, int)
               or self.max_tokens_per_rank <= LL_MAX_TOKENS, "max_tokens_per_rank", self.max_tokens_per_rank,
               f"kernel_family='low_latency' holds at most {LL_MAX_TOKENS} tokens a rank (use 'auto' or 'normal')")
        _check(isinstance(self.dispatch_transport, str) and self.dispatch_transport in DISPATCH_TRANSPORTS,
               "dispatch_transport", self.dispatch_transport, f"must be one of {', '.join(DISPATCH_TRANSPORTS)}")
        _check(self.dispatch_transport != "pull" or self.kernel_family != "low_latency", "dispatch_transport",
               self.dispatch_transport, "applies to the normal family's dispatch (kernel_family 'auto' or 'normal'; "
               "the low-latency family never pulls)")
        for f in ("dispatch_geometry", "combine_geometry", "low_latency_geometry"):
            g = getattr(self, f)
            _check(g is None or isinstance(g, Geometry), f, g, "must be None (tuning table) or an "
                   "epgen.codegen.tuning.Geometry(blocks, warps_per_block, unroll)")
        _check(isinstance(self.scale_bytes, int) and not isinstance(self.scale_bytes, bool)
               and self.scale_bytes >= 0, "scale_bytes", self.scale_bytes, "must be an int >= 0")
        _check(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool), "timeout_s",
               self.timeout_s, "must be a Python int or float (seconds)")
        _check(1e-3 <= self.timeout_s <= 3600, "timeout_s", self.timeout_s,
               "must be in [0.001, 3600] seconds (the kernels count whole nanoseconds; a bound under a "
               "millisecond fails healthy waits)")
        _check(isinstance(self.layout, str) and self.layout in LAYOUTS, "layout", self.layout,
               f"must be one of {', '.join(LAYOUTS)}")
        _check(isinstance(self.expert_alignment, int) and not isinstance(self.expert_alignment, bool)
               and self.expert_alignment in EXPERT_ALIGNMENTS[1:],
               "expert_alignment", self.expert_alignment, "must be a power of two from 1 to 256 rows")
        _check(self.expert_alignment == 1 or self.layout == "expert", "expert_alignment", self.expert_alignment,
               "applies to layout='expert' only (the rank layout has no expert groups)")
        worst = self.world_size * self.max_tokens_per_rank if isinstance(self.max_tokens_per_rank, int) else None
        _check(self.max_recv_tokens is None or (isinstance(self.max_recv_tokens, int)
                                                and not isinstance(self.max_recv_tokens, bool)
                                                and worst is not None and 1 <= self.max_recv_tokens <= worst),
               "max_recv_tokens", self.max_recv_tokens,
               f"must be None or an int in [1, world_size x max_tokens_per_rank = {worst}]")
        _check(self.max_recv_tokens is None or self.kernel_family != "low_latency" or self.max_recv_tokens == worst,
               "max_recv_tokens", self.max_recv_tokens,
               f"kernel_family='low_latency' receives up to world_size x max_tokens_per_rank = {worst} rows a call and "
               "places every one of them (it never overflows): leave max_recv_tokens None, or use kernel_family "
               "'auto' (which takes the low-latency family up to max_recv_tokens / world_size tokens) or 'normal'")
        if self._check_nodes() > 1:
            self._check_node_config()
            return
        # Shape rules fail here, not at first use: the specs must build for at least one arch (the
        # op builds them again for its GPU's arch, whose limits may be narrower, e.g. wave 32).
        errors = []
        for arch in ARCH_TRAITS:
            try:
                plan(self, arch)
            except ValueError as e:
                errors.append(e)
        if len(errors) == len(ARCH_TRAITS):
            raise errors[0]

    def _check_nodes(self) -> int:
        """Validate ``nodes`` and ``gpus_per_node``; returns N."""
        N, G = self.nodes, self.gpus_per_node
        _check(isinstance(N, int) and not isinstance(N, bool) and N >= 1, "nodes", N, "must be a positive int")
        _check(G is None or (isinstance(G, int) and not isinstance(G, bool) and G >= 1), "gpus_per_node", G,
               "must be None (world_size / nodes) or a positive int")
        if G is None:
            _check(self.world_size % N == 0, "nodes", N, f"must divide world_size={self.world_size}")
        else:
            _check(self.world_size == N * G, "gpus_per_node", G,
                   f"nodes x gpus_per_node must be world_size={self.world_size} (nodes={N})")
        return N

    def _check_node_config(self) -> None:
        """With nodes > 1: the node-local layer must be valid (its field errors re-raised naming this
        layer's nodes, since its fields derive from this one's)."""
        _check(self.node_scale_bytes <= 4096, "scale_bytes", self.scale_bytes,
               f"with nodes={self.nodes} the node-local layer carries the K global ids, the global source and "
               f"these scale bytes in its own scale bytes ({self.node_scale_bytes} in all), at most 4096")
        try:
            self.node_config()
        except FieldError as e:
            raise FieldError(e.field, f"EpConfig(nodes={self.nodes}, gpus_per_node={self.ranks_per_node}): the "
                             f"node-local layer (node_config()) is invalid: {e}") from e

    @property
    def ranks_per_node(self) -> int:
        """G: ``gpus_per_node``, or world_size / nodes when it is None."""
        return self.gpus_per_node if self.gpus_per_node is not None else self.world_size // self.nodes

    @property
    def node_scale_bytes(self) -> int:
        """Scale bytes of the node-local layer: per forwarded row the K global expert ids (int32),
        the global (source rank, source token) (2 x int32), then this layer's S scale bytes, padded
        to a multiple of 4 bytes (so the ids and the source read as int32 views)."""
        return 4 * self.topk + 8 + self.scale_bytes + (-self.scale_bytes) % 4

    def node_config(self) -> "EpConfig":
        """The node-local layer of a hierarchical config (``epgen.hierarchical``): G ranks, their
        G x L experts, at most N x max_tokens_per_rank rows a rank (the rows forwarded to it from
        every node), ``node_scale_bytes`` scale bytes; every other field as here (max_recv_tokens
        keeps its meaning: the rows one rank receives). ``self`` when nodes is 1.

        Raises:
            epgen.codegen.errors.FieldError: a field of the node-local layer breaks a rule.
        """
        if self.nodes == 1:
            return self
        G = self.ranks_per_node
        return attrs.evolve(self, world_size=G, num_experts=G * self.experts_per_rank,
                            max_tokens_per_rank=self.nodes * self.max_tokens_per_rank,
                            scale_bytes=self.node_scale_bytes, nodes=1, gpus_per_node=None)

    @classmethod
    def for_model(cls, name: str, *, world_size: int, max_tokens_per_rank: int, **kw) -> "EpConfig":
        """Config for a catalogue model (``epgen.codegen.models.MODELS``).

        Raises:
            ValueError: unknown model (with suggestions) or an invalid field.
        """
        m = _model(name)
        shape = {"hidden", "topk", "num_experts"} & set(kw)
        if shape:
            raise ValueError(f"EpConfig.for_model({name!r}): {', '.join(sorted(shape))} come from the model; "
                             "build EpConfig(...) directly for another shape")
        return cls(world_size=world_size, hidden=m.hidden, topk=m.topk, num_experts=m.num_experts,
                   max_tokens_per_rank=max_tokens_per_rank, **kw)

    @classmethod
    def from_hf_config(cls, source, *, world_size: int, max_tokens_per_rank: int, **kw) -> "EpConfig":
        """Config for the MoE layers of a Hugging Face transformers model, read from its config
        (no download: a local file, a dict, or a loaded ``transformers.PretrainedConfig``).

        Fields read (``epgen.codegen.hfconfig``; the first name present wins; a multimodal
        config's ``text_config``, ``thinker_config``, ``language_config`` or ``llm_config`` is read
        when the top level has no hidden size):

            hidden:       the config class's alias of hidden_size (``attribute_map``), then
                          hidden_size, d_model (dbrx)
            num_experts:  the class's alias of num_local_experts / num_experts / n_routed_experts,
                          the family's name (``hfconfig.FAMILY_FIELDS``), then n_routed_experts
                          (deepseek_v3, kimi_k2, longcat_flash), num_local_experts (mixtral,
                          gpt_oss), num_experts (qwen3_moe, qwen3_next, hunyuan_v1_moe,
                          kimi_linear, bailing_hybrid, gemma4), moe_num_experts (ernie4_5_moe,
                          aria; dbrx's ffn_config)
            topk:         the class's alias of num_experts_per_tok, the family's name, then
                          num_experts_per_tok, experts_per_token (gpt_oss config.json),
                          num_experts_per_token (kimi_linear, bailing_hybrid), moe_k
                          (ernie4_5_moe), moe_topk (hunyuan_v1_moe: one per layer, all equal;
                          longcat_flash, aria), top_k_experts (gemma4), moe_top_k (dbrx)

        The config class's aliases come from a loaded config's class, or, for a file or dict whose
        names miss, from transformers' class of its model_type where transformers is installed.
        Shared experts (``n_shared_experts``, ``shared_expert_intermediate_size``) and longcat_flash's
        zero (identity) experts are not routed through dispatch: they do not enter the config.

        Args:
            source: a path (str or os.PathLike) to a config.json or to a directory holding one; a
                dict of its contents; or an object with ``to_dict()`` (a PretrainedConfig).
            world_size, max_tokens_per_rank, **kw: as ``EpConfig`` (hidden, topk and num_experts
                come from the model and are refused here).

        Raises:
            TypeError: a keyword that is not an EpConfig field (naming it and the fields).
            FileNotFoundError: a path that is neither a file nor a directory holding config.json.
            OSError: the file cannot be read (naming it).
            ValueError: (each naming the file, or the dict or config object, and the rule) the file
                is not UTF-8, not valid JSON, nested deeper than ``hfconfig.MAX_DEPTH`` levels, or
                not a JSON object; source of another type; hidden, topk or num_experts passed in
                kw; a field missing (the message names the field, every name looked for and the
                model_type, and says "dense" only where nothing in the config speaks of experts)
                or not a positive int; FieldError (a ValueError) for a field EpConfig refuses, e.g.
                num_experts not a multiple of world_size, prefixed with the source and model_type.
        """
        from epgen.codegen.hfconfig import moe_shape

        unknown = sorted(set(kw) - {f.name for f in attrs.fields(cls)})
        if unknown:
            raise TypeError(f"{unknown[0]}={kw[unknown[0]]!r}: not an EpConfig field (its fields: "
                            f"{', '.join(f.name for f in attrs.fields(cls))})")
        fields, model_type, where = moe_shape(source)
        shape = set(fields) & set(kw)
        if shape:
            raise ValueError(f"{where} ({model_type}): {', '.join(sorted(shape))} come from the model config; build "
                             "EpConfig(...) directly for another shape")
        try:
            return cls(world_size=world_size, max_tokens_per_rank=max_tokens_per_rank, **fields, **kw)
        except FieldError as e:
            raise FieldError(e.field, f"{where} ({model_type}): {e}") from e

    @property
    def experts_per_rank(self) -> int:
        """L = E / W."""
        return self.num_experts // self.world_size

    @property
    def receive_rows(self) -> int:
        """N, the receive rows of each rank: ``max_recv_tokens``, or W x max_tokens_per_rank."""
        return self.max_recv_tokens or self.world_size * self.max_tokens_per_rank

    @property
    def expert_layout_rows(self) -> int:
        """R, the expert layout's rows of each rank (``KernelSpec.expert_rows``): N x min(K, L) +
        L x (A - 1), every receive row expanded to at most min(K, L) rows and each of the L groups
        padded by fewer than A rows; 0 in the rank layout."""
        if self.layout != "expert":
            return 0
        L = self.experts_per_rank
        return self.receive_rows * min(self.topk, L) + L * (self.expert_alignment - 1)
