"""Kernel plans: which kernels an ``EpDispatchCombine`` launches for each call, as data.

A ``Plan`` is the planner's ``KernelPlan`` of an ``EpConfig`` on the target arch (the specs the
op compiles, each kernel's token buckets: ``epgen.codegen.planner``) plus the ``Route`` each call
takes, a row of
``ROUTES`` per (call, kernel family, transport, split) listing the kernel ``Step``s in launch
order. The op picks a route per call (family by token count, transport, the async_recv split)
and runs its steps with one launch loop; a new kernel family, transport or wire is new rows
here, not new branches in the op. ``epgen plan`` prints a plan (``Plan.table``). Nothing here
needs a GPU.
"""

from __future__ import annotations

import attrs

from epgen.codegen.arch import ARCH_TRAITS
from epgen.codegen.config import EpConfig
from epgen.codegen.dtypes import combine_quant
from epgen.codegen.planner import Buckets, KernelPlan, plan
from epgen.codegen.spec import KernelSpec, Op

IO_KINDS = ("none", "call", "fold")
"""What a step's launch argument carries per rank: "none" (the arena alone), "call" (the call's
inputs, outputs and token counts: ``epgen.codegen.abi.RANK_IO``), "fold" (the expert outputs the
fold reads)."""

WHOLE_LOW_LATENCY = {"nvidia": True, "amd": False}
"""Per vendor (``ArchTraits.vendor``): whether a low-latency call without ``async_recv`` runs the
whole op as one cooperative launch (where its grid fits the GPU at once, and until the runtime
refuses it as too large) or, when False, always as its two halves, which need no co-residency.

NVIDIA: a cooperative launch starts no block until all fit beside whatever else runs (measured on
an H200: docs/measurements/deployment.md). AMD: not shown on hardware, and the ROCm runtime funnels
every cooperative launch of the process, from any stream, onto one device-internal queue, ordered
against the launching stream by barriers both ways (ROCm/clr rocclr/device/rocm/rocvirtual.cpp
``VirtualGPU::submitKernel``, f9f995c; its GWS-init dispatch runs only where ``gwsInitSupported_``,
which ROCm/rocm-systems projects/clr rocsettings.cpp clears from gfx9.4 on: not on epgen's AMD
arches); nothing on that path holds compute units against kernels of other queues, and the grid is
admitted by the runtime's own occupancy estimate (hipamd/src/hip_module.cpp
``ihipLaunchKernel_validate``). ROCm/rocm-systems pull requests 8959 and 10124 describe the
serialization (every cooperative dispatch with the AQL barrier bit and a barrier packet after it).
So ROCm takes the halves until a run on MI300-class hardware shows the cooperative path's residency
and cost; flip this entry to measure it (the op reads it when it is built)."""

Y_SOURCES = ("copy", "in_place", "folded")
"""Where a combine's kernels read the expert outputs: "copy" (y copied into combine_in, where
peers read it, unless y is ``combine_input()`` itself), "in_place" (y itself), "folded" (the
fold's rows in combine_in)."""


@attrs.frozen
class Step:
    """One kernel launch of a route.

    Attributes:
        op: the kernel.
        transport: which of its variants ("pull": the pull dispatch's first kernel).
        io: what its launch argument carries (``IO_KINDS``).
        sync: ``validate=True`` synchronizes after it; False for a kernel always followed by its
            second one (a sending half, the pull dispatch's first kernel), so that a fault raised
            there never skips the second.
        optional: launched only where the config builds the kernel (the expert layout's expand and
            fold, the quantize kernel); a route whose other kernels are not built does not exist.
        quantize: the fold also writes the quantized wire rows (the normal family's combine; set
            only where the wire is quantized).
        encodes: the step encodes y into the wire rows; skipped when the caller passes rows
            already in the wire's format (``EpDispatchCombine.combine_wire_input``).
        raises_first: a fatal fault recorded so far is raised before it launches (the expansion
            after a dispatch, as ``EpDispatchCombine.expand``).
    """

    op: Op
    transport: str = "push"
    io: str = attrs.field(default="none", validator=attrs.validators.in_(IO_KINDS))
    sync: bool = True
    optional: bool = False
    quantize: bool = False
    encodes: bool = False
    raises_first: bool = False


@attrs.frozen
class Route:
    """The kernels one call launches: ``send`` when called, ``recv`` when it finishes (at once, or
    in ``RecvHandle.wait`` with ``async_recv``).

    Attributes:
        call: Op.DISPATCH or Op.COMBINE.
        family: one of ``epgen.codegen.spec.FAMILIES``.
        transport: "push" or "pull" (how the dispatch moves the payload rows; "push" for combine).
        split: the low-latency op as its two halves (async_recv, or a grid the GPU cannot hold at
            once) instead of one kernel.
        send, recv: the steps, in launch order.
        y: where the combine's kernels read the expert outputs (``Y_SOURCES``; "copy" in a dispatch
            route); the plan resolves it for the config's layout and wire.
        x_in_dispatch_input: the dispatch's rows must be in ``dispatch_input`` (the pull dispatch's
            peers read them there; an x elsewhere is copied first).
    """

    call: Op
    family: str
    transport: str
    split: bool
    send: tuple[Step, ...]
    recv: tuple[Step, ...] = ()
    y: str = "copy"
    x_in_dispatch_input: bool = False

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.send + self.recv


_EXPAND = (Step(Op.EXPAND_PLAN, optional=True, raises_first=True), Step(Op.EXPAND, optional=True))
_FOLD = Step(Op.FOLD, io="fold", optional=True)

ROUTES = (
    Route(Op.DISPATCH, "normal", "push", False, send=(Step(Op.DISPATCH, io="call"),), recv=_EXPAND),
    Route(Op.DISPATCH, "normal", "pull", False, x_in_dispatch_input=True, recv=_EXPAND,
          send=(Step(Op.DISPATCH, "pull", io="call", sync=False), Step(Op.DISPATCH_PULL))),
    Route(Op.DISPATCH, "low_latency", "push", False, send=(Step(Op.DISPATCH_LL, io="call"),), recv=_EXPAND),
    Route(Op.DISPATCH, "low_latency", "push", True, send=(Step(Op.DISPATCH_LL_SEND, io="call", sync=False),),
          recv=(Step(Op.DISPATCH_LL_RECV),) + _EXPAND),
    Route(Op.COMBINE, "normal", "push", False, send=(
        attrs.evolve(_FOLD, quantize=True), Step(Op.COMBINE_QUANTIZE, io="call", optional=True, encodes=True),
        Step(Op.COMBINE, io="call"))),
    Route(Op.COMBINE, "low_latency", "push", False, y="in_place", send=(_FOLD, Step(Op.COMBINE_LL, io="call"))),
    Route(Op.COMBINE, "low_latency", "push", True, y="in_place",
          send=(_FOLD, Step(Op.COMBINE_LL_SEND, io="call", sync=False)), recv=(Step(Op.COMBINE_LL_RECV, io="call"),)),
)
"""Every route of every op, before a config drops the kernels it does not build."""


@attrs.frozen
class Plan:
    """What an op of ``config`` launches on ``arch``, built by ``Plan.build``: the planner's
    ``KernelPlan`` and the launch routes.

    Attributes:
        kernels: the planner's plan (``epgen.codegen.planner.plan``): every kernel and its buckets.
        grid_ranks: ranks one launch's grid runs (W with virtual ranks, else 1).
        routes: {(call, family, transport, split): Route} of the routes the config builds.
        whole_low_latency: a low-latency call without async_recv may run the whole op in one
            cooperative launch (``WHOLE_LOW_LATENCY`` of the arch's vendor); False: always the halves.
        transport_rules: ((max_tokens, rule), ...) of the normal dispatch's buckets: "push",
            "pull", or "zero_copy" (pull when x is ``dispatch_input`` on every rank this process
            drives, else push).
    """

    kernels: KernelPlan
    grid_ranks: int
    routes: dict[tuple[Op, str, str, bool], Route]
    transport_rules: tuple[tuple[int, str], ...]
    whole_low_latency: bool

    @property
    def config(self) -> EpConfig:
        return self.kernels.config

    @property
    def arch(self) -> str:
        return self.kernels.arch

    @property
    def variants(self) -> dict[tuple[Op, str], Buckets]:
        """{(op, transport): ((max_tokens, spec), ...)} ascending, every kernel the op compiles
        (``KernelPlan.variants``; empty where the config builds none of that kernel)."""
        return self.kernels.variants

    @property
    def low_latency_tokens(self) -> int:
        """T_ll, the most tokens a call takes the low-latency family with (0: never)."""
        return self.kernels.low_latency_tokens

    def with_variants(self, variants: dict[tuple[Op, str], Buckets]) -> "Plan":
        """This plan with the kernels' buckets replaced (the op clamps a table geometry's blocks
        where virtual ranks need it)."""
        return attrs.evolve(self, kernels=attrs.evolve(self.kernels, variants=variants))

    @classmethod
    def build(cls, config: EpConfig, arch: str, grid_ranks: int = 1) -> "Plan":
        """The plan of ``config`` on ``arch`` with ``grid_ranks`` ranks a grid.

        Raises:
            ValueError: a spec breaks an ``arch`` limit (naming the field); config.nodes > 1
                (``epgen.codegen.planner.ops``: a layer across nodes plans its ``node_config()``).
        """
        kernels = plan(config, arch)
        variants = kernels.variants
        quantized = combine_quant(config.combine_quant).quantized
        expert = config.layout == "expert"
        routes = {}
        for row in ROUTES:
            built = [s for s in row.steps if variants.get((s.op, s.transport))]
            if any(not s.optional and s not in built for s in row.steps):
                continue
            keep = lambda steps: tuple(attrs.evolve(s, quantize=s.quantize and quantized) for s in steps if s in built)
            y = row.y if row.call is Op.DISPATCH else "folded" if expert else "in_place" if quantized else row.y
            routes[(row.call, row.family, row.transport, row.split)] = attrs.evolve(
                row, send=keep(row.send), recv=keep(row.recv), y=y)
        if config.dispatch_transport != "auto":
            rules = ((1 << 30, config.dispatch_transport),)
        elif grid_ranks < config.world_size:
            # one rank a process: no process sees its peers' x or token counts, and a rank that
            # pulls while a peer pushes corrupts rows, so "auto" pushes (set "pull" on every rank)
            rules = ((1 << 30, "push"),)
        else:
            rules = tuple((t, "zero_copy" if tr == "pull" else tr) for t, tr in kernels.dispatch_transports)
        return cls(kernels=kernels, grid_ranks=grid_ranks, routes=routes, transport_rules=rules,
                   whole_low_latency=WHOLE_LOW_LATENCY[ARCH_TRAITS[arch].vendor])

    @property
    def dispatch_spec(self) -> KernelSpec:
        """The largest bucket's spec of the first payload kernel (its arena layout is every
        kernel's; its ``ll_tokens`` is T_ll)."""
        return next(v for (op, _), v in self.variants.items() if op.payload and v)[-1][1]

    def whole_grid_specs(self, call: Op) -> tuple[KernelSpec, ...]:
        """The specs of ``call``'s unsplit low-latency route whose blocks wait for each other in
        one grid (each must be resident at once, or the op takes the split route); empty
        without that route."""
        route = self.routes.get((call, "low_latency", "push", False))
        return tuple(spec for s in (route.send if route else ()) if s.op.waits_within_grid(1)
                     for _, spec in self.variants[(s.op, s.transport)])

    def family(self, tokens: int) -> str:
        """The family a call with ``tokens`` (the largest count of the ranks a process drives)
        takes: ``EpConfig.kernel_family``, "auto" the low-latency one up to T_ll."""
        kind = self.config.kernel_family
        if kind == "auto":
            return "low_latency" if self.low_latency_tokens and tokens <= self.low_latency_tokens else "normal"
        return kind

    def transport(self, tokens: int, zero_copy: bool, family: str | None = None) -> str:
        """The dispatch's transport for ``tokens``, given whether x is ``dispatch_input`` on every
        rank this process drives: the bucket's rule (``transport_rules``), "push" where the call's
        family (``family``, default ``family(tokens)``) has no route of that transport (the
        low-latency family never pulls). A stated family decides it alone: ranks that state the
        same family take the same transport whatever their token counts."""
        rule = next((tr for t, tr in self.transport_rules if tokens <= t), self.transport_rules[-1][1])
        want = ("pull" if zero_copy else "push") if rule == "zero_copy" else rule
        family = family or self.family(tokens)
        return want if (Op.DISPATCH, family, want, False) in self.routes else "push"

    def route(self, call: Op, family: str, transport: str = "push", split: bool = False) -> Route:
        """The route of ``call``; a family without halves takes its one route whatever ``split``.

        Raises:
            KeyError: the config builds no such route.
        """
        key = (call, family, transport, split)
        return self.routes.get(key) or self.routes[key[:3] + (False,)]

    def variant(self, op: Op, tokens: int, transport: str = "push") -> KernelSpec:
        """The spec ``op`` launches for ``tokens``: the smallest bucket not below it, else the largest.

        Raises:
            KeyError: the plan has no kernels of ``op`` and ``transport``."""
        variants = self.variants.get((op, transport))
        if not variants:
            raise KeyError(f"this op builds no {op.value} kernels of transport {transport!r}")
        return next((spec for max_tokens, spec in variants if tokens <= max_tokens), variants[-1][1])

    def buckets(self) -> list[tuple[int, int]]:
        """Token ranges ``(first, last)`` up to max_tokens_per_rank within which every call launches the
        same kernels: split at every variant's bucket, T_ll and each transport bucket."""
        tmax = self.config.max_tokens_per_rank
        edges = {t for v in self.variants.values() for t, _ in v} | {t for t, _ in self.transport_rules}
        edges = sorted({min(t, tmax) for t in edges | {self.low_latency_tokens} if t > 0} | {tmax})
        return [(lo + 1, hi) for lo, hi in zip([0] + edges, edges)]

    def table(self) -> list[dict]:
        """One row per kernel each call launches, per token bucket (``buckets``): tokens (first,
        last), family, call, transport, split, stage ("call" or "finish"), op, spec name, geometry
        (BLOCKSxWARPSuUNROLL), source (``KernelPlan.source``'s kind), threads, grid (blocks x
        grid_ranks), cooperative, and ``when`` (the route's condition: "", "x in dispatch_input",
        "async_recv or grid too large"; where the vendor takes the halves, "not on <vendor>" for the
        whole low-latency op and "" for its halves)."""
        rows = []
        for lo, hi in self.buckets():
            family = self.family(hi)
            for route in self.routes.values():
                if route.family != family or (route.call is Op.DISPATCH and route.family == "normal"
                                              and route.transport not in {self.transport(hi, z) for z in (False, True)}):
                    continue
                halves_only = route.family == "low_latency" and not self.whole_low_latency
                when = (("" if halves_only else "async_recv or grid too large") if route.split else
                        f"not on {ARCH_TRAITS[self.arch].vendor}" if halves_only else
                        "x in dispatch_input" if route.transport == "pull" and self.transport(hi, False) == "push" else "")
                for stage, steps in (("call", route.send), ("finish", route.recv)):
                    for s in steps:
                        spec = self.variant(s.op, hi, s.transport)
                        rows.append(dict(tokens=(lo, hi), family=family, call=route.call.value,
                                         transport=route.transport, split=route.split, stage=stage, op=s.op.value,
                                         spec=spec.name, geometry=f"{spec.blocks}x{spec.warps_per_block}u{spec.unroll}",
                                         source=self.kernels.source(s.op, hi).kind,
                                         threads=spec.threads, grid=spec.blocks * self.grid_ranks,
                                         cooperative=s.op.waits_within_grid(self.grid_ranks), when=when))
        return rows


def describe(plan: Plan, model: str | None = None) -> str:
    """``plan`` as text: a heading (shape, world size, family and transport settings), then per
    token bucket the kernels each call launches, in order: call, route (transport, or the
    low-latency op whole or split, with when it applies), stage ("finish": at the end of the call,
    or in ``RecvHandle.wait`` with async_recv), kernel, geometry, its source (measured, published,
    derived or stated: ``KernelPlan.source``), grid blocks x threads and the spec's entry name."""
    cfg = plan.config
    ranks = "virtual ranks, one grid" if plan.grid_ranks > 1 else "one process a GPU" if cfg.world_size > 1 else "one rank"
    family = cfg.kernel_family + (f" (low-latency up to {plan.low_latency_tokens} tokens)"
                                  if cfg.kernel_family == "auto" else "")
    lines = [f"{model or f'H={cfg.hidden} K={cfg.topk} E={cfg.num_experts}'} on {plan.arch}: W={cfg.world_size} "
             f"({ranks}), Tmax={cfg.max_tokens_per_rank}, {cfg.dtype}, combine wire {cfg.combine_quant}, layout "
             f"{cfg.layout}, family {family}, dispatch transport {cfg.dispatch_transport}"]
    header = ("tokens", "call", "route", "stage", "kernel", "geometry", "source", "grid", "spec")
    table, last = [header], None
    for r in plan.table():
        route = r["transport"] if r["family"] == "normal" else "split" if r["split"] else "whole"
        route = f"{r['family']}/{route}" + (f" ({r['when']})" if r["when"] else "")
        bucket = f"{r['tokens'][0]}-{r['tokens'][1]}"
        table.append((bucket if bucket != last else "", r["call"], route, r["stage"], r["op"], r["geometry"],
                      r["source"], f"{r['grid']}x{r['threads']}" + (" coop" if r["cooperative"] else ""), r["spec"]))
        last = bucket
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table]
    return "\n".join(line.rstrip() for line in lines)
