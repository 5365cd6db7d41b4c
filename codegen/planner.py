"""The planner: every kernel a layer launches on an arch, as data.

``plan(config, arch)`` is the one place a config becomes kernels. It reads the kernel kinds'
facts (``epgen.codegen.spec.OP_TABLE``) to pick the kinds the config builds, asks the tuning
module once for the shape's whole schedule (``epgen.codegen.tuning.schedule``: every entry's token
buckets with their sources), applies the config's explicit geometries and each kernel's limits,
and returns a ``KernelPlan``: every ``(op, transport)`` kernel with its ``(max_tokens, spec)``
buckets. The op (``epgen.plan.Plan`` adds the launch routes), the AOT build, the catalogue and
every CLI verb take their kernel lists from it. Pure data: no GPU, no torch, no runtime import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from epgen.codegen.abi import LL_FLAG_SLOTS
from epgen.codegen.arch import ARCH_TRAITS
from epgen.codegen.dtypes import combine_quant
from epgen.codegen.errors import FieldError
from epgen.codegen.spec import (LL_MAX_TOKENS, OP_TABLE, PLAN_BLOCKS, PLAN_SHARED_LIMIT, QUANTIZED_COMBINE_THREADS,
                                KernelSpec, Op)
from epgen.codegen.tuning import (Bucket, Geometry, Schedule, ShapeKey, Source, TuningKey, entry_key,
                                  schedule)

if TYPE_CHECKING:  # the config imports the planner to validate itself
    from epgen.codegen.config import EpConfig

_ORDER = {Op(r.op): i for i, r in enumerate(OP_TABLE)}

Buckets = tuple[tuple[int, KernelSpec], ...]
"""``(max_tokens, spec)`` ascending: a call with T tokens launches the first bucket with
``max_tokens >= T`` (the last one above every bucket)."""


def ops(config: EpConfig) -> tuple[Op, ...]:
    """The kernel kinds a layer of ``config`` may build, in ``OP_TABLE`` order: each row whose
    family is among the config's (``kernel_family``: "auto" both), whose token layout is "any" or
    the config's ``layout``, that is not a pull kernel where ``dispatch_transport`` is "push", and
    not the quantize kernel unless the combine wire is quantized in the rank layout with peers
    (W > 1: the expert layout's fold writes the wire rows itself, and at W = 1 no row leaves the
    rank). An arch may still build fewer (``KernelPlan.ops``).

    Raises:
        FieldError: config.nodes > 1 (a layer across nodes builds the kernels of its
            ``node_config()``, not flat ones of world_size ranks).
    """
    if config.nodes > 1:
        raise FieldError("nodes", f"EpConfig.nodes={config.nodes}: a layer across nodes compiles the kernels of its "
                         f"node_config() ({config.ranks_per_node} ranks a node), not flat ones of world_size="
                         f"{config.world_size}; plan its node_config()")
    families = {"auto": ("normal", "low_latency")}.get(config.kernel_family, (config.kernel_family,))
    wire = combine_quant(config.combine_quant).quantized and config.world_size > 1
    return tuple(Op(r.op) for r in OP_TABLE
                 if (r.family == "both" or r.family in families) and r.token_layout in ("any", config.layout)
                 and not (r.transport == "pull" and config.dispatch_transport == "push")
                 and (wire or not r.quantized_wire))


def shape_key(config: EpConfig, arch: str) -> ShapeKey:
    """The tuning schedule's key of ``config`` on ``arch``."""
    return ShapeKey(arch=arch, world_size=config.world_size, hidden=config.hidden, topk=config.topk,
                    dtype=config.dtype, combine_quant=config.combine_quant)


def tuning_key(config: EpConfig, arch: str, op: Op) -> TuningKey:
    """The table entry that sets ``op``'s geometry for ``config`` on ``arch`` (``epgen tune``
    writes it): both halves of a low-latency op share their template's entry, the pull
    dispatch's kernels the "dispatch" entry, and the normal combine with a quantized wire has its
    own (dtype the wire's name; without one it takes the bf16 combine's buckets)."""
    return entry_key(shape_key(config, arch), op.tuning_entry)


def _schedule(config: EpConfig, arch: str) -> Schedule:
    return schedule(shape_key(config, arch))


def _low_latency_tokens(config: EpConfig, sched: Schedule) -> int:
    """T_ll: 0 for "normal", max_tokens_per_rank for "low_latency", and for "auto" the smaller of
    that, the schedule's threshold, ``LL_MAX_TOKENS`` and the receive rows over W (the family
    places every row it receives: it never overflows). 0 under "auto" means never: the arch's
    schedule says the normal family won at every count."""
    if config.kernel_family == "normal":
        return 0
    if config.kernel_family == "low_latency":
        return config.max_tokens_per_rank
    return min(config.max_tokens_per_rank, sched.low_latency_tokens, LL_MAX_TOKENS,
               config.receive_rows // config.world_size)


def _fit(config: EpConfig, arch: str, op: Op, g: Geometry, explicit: bool) -> Geometry:
    """``g`` within ``op``'s register needs on ``arch``: a combine with a quantized wire runs at
    most ``QUANTIZED_COMBINE_THREADS`` threads a block; a table geometry keeps its blocks and
    loses warps, an explicit one is refused (FieldError naming ``combine_geometry``)."""
    fit = QUANTIZED_COMBINE_THREADS // ARCH_TRAITS[arch].wave_size
    if op is not Op.COMBINE or not combine_quant(config.combine_quant).quantized or g.warps_per_block <= fit:
        return g
    if explicit:
        limits = ", ".join(f"{QUANTIZED_COMBINE_THREADS // t.wave_size} on {a}" for a, t in ARCH_TRAITS.items())
        wave = ARCH_TRAITS[arch].wave_size
        raise FieldError("combine_geometry", f"EpConfig.combine_geometry={g}: {g.warps_per_block} warps of {wave} "
                         f"lanes are {g.warps_per_block * wave} threads on {arch}; a combine with a quantized wire "
                         f"({config.combine_quant}) runs at most {QUANTIZED_COMBINE_THREADS} threads a block (it "
                         f"adds the rank's own rows as they decode, in registers): warps at most {limits}")
    return attrs.evolve(g, warps_per_block=fit)


def _local(config: EpConfig, op: Op, g: Geometry) -> Geometry:
    """A local kernel's schedule geometry within its limits: expand (and its plan, which splits
    the rows as expand does) at most ``PLAN_BLOCKS`` blocks and as many warps as its per-warp
    expert counts fit in ``PLAN_SHARED_LIMIT``."""
    if op not in (Op.EXPAND_PLAN, Op.EXPAND):
        return g
    L = config.experts_per_rank
    fit = (PLAN_SHARED_LIMIT // 4 - L - 1) // L
    return attrs.evolve(g, blocks=min(g.blocks, PLAN_BLOCKS), warps_per_block=max(1, min(g.warps_per_block, fit)))


def _explicit(config: EpConfig, op: Op) -> Geometry | None:
    """The geometry the config states for ``op``: ``low_latency_geometry`` for the low-latency
    kernels, ``dispatch_geometry`` / ``combine_geometry`` for the normal family's (the pull
    dispatch's two kernels take the dispatch's); None for the local kernels."""
    row = op.row
    if row.family == "low_latency":
        return config.low_latency_geometry
    if row.reach == "remote":
        return config.dispatch_geometry if row.call == "dispatch" else config.combine_geometry
    return None


def _geometries(config: EpConfig, arch: str, op: Op, buckets: tuple[Bucket, ...]) -> tuple[tuple[int, Geometry], ...]:
    """``op``'s ``(max_tokens, geometry)`` before the pull filter: an explicit geometry alone
    (bucket max_tokens_per_rank); one geometry for every call where ``OpRow.one_geometry`` (the
    schedule's bucket at max_tokens_per_rank; a low-latency table geometry at most
    ``LL_FLAG_SLOTS`` / W blocks: one flag per (rank, block)); else each schedule bucket."""
    T = config.max_tokens_per_rank
    explicit = _explicit(config, op)
    if explicit is not None:
        return ((T, _fit(config, arch, op, explicit, True)),)
    if op.row.one_geometry:
        g = next((b.geometry for b in buckets if T <= b.max_tokens), buckets[-1].geometry)
        if op.low_latency:
            g = attrs.evolve(g, blocks=max(1, min(g.blocks, LL_FLAG_SLOTS // config.world_size)))
        return ((T, _local(config, op, g)),)
    return tuple((b.max_tokens, _fit(config, arch, op, b.geometry, False)) for b in buckets)


def _spec(config: EpConfig, arch: str, op: Op, g: Geometry, transport: str, ll_tokens: int) -> KernelSpec:
    return KernelSpec(op=op, arch=arch, dtype=config.dtype if op.payload else "bf16", hidden=config.hidden,
                      topk=config.topk, experts_per_rank=config.experts_per_rank, world_size=config.world_size,
                      max_tokens_per_rank=config.max_tokens_per_rank, scale_bytes=config.scale_bytes,
                      combine_quant=config.combine_quant, blocks=g.blocks, warps_per_block=g.warps_per_block,
                      unroll=g.unroll, recv_tokens=config.max_recv_tokens or 0,
                      expert_alignment=config.expert_alignment if config.layout == "expert" else 0,
                      ll_tokens=ll_tokens, transport=transport)


@attrs.frozen
class KernelPlan:
    """Every kernel a layer of ``config`` launches on ``arch`` (``plan``).

    Attributes:
        config, arch: what it plans.
        variants: {(op, transport): Buckets} for every kind of ``ops(config)`` ("push"), then
            DISPATCH's "pull"; empty where this arch builds none (the
            low-latency halves where T_ll is 0; the pull kernels under "auto" where no dispatch
            bucket up to max_tokens_per_rank pulls).
        low_latency_tokens: T_ll, the most tokens a call takes the low-latency family with (0: never).
        dispatch_transports: ((max_tokens, transport), ...) of the schedule's dispatch buckets.
        schedule: the tuning schedule it was planned from (every number's source).
    """

    config: EpConfig
    arch: str
    variants: dict[tuple[Op, str], Buckets]
    low_latency_tokens: int
    dispatch_transports: tuple[tuple[int, str], ...]
    schedule: Schedule

    @property
    def kernels(self) -> tuple[tuple[Op, str], ...]:
        """The ``(op, transport)`` kernels this arch builds, in ``OP_TABLE`` order (a kind's push
        kernel before its pull kernel)."""
        return tuple(sorted((k for k, v in self.variants.items() if v), key=lambda k: (_ORDER[k[0]], k[1] == "pull")))

    @property
    def ops(self) -> tuple[Op, ...]:
        """The kinds this arch builds, in order."""
        return tuple(dict.fromkeys(op for op, _ in self.kernels))

    def specs(self) -> tuple[KernelSpec, ...]:
        """Every spec the layer compiles (each bucket of each kernel), in order, without repeats:
        what ``EpDispatchCombine`` loads at construction and ``epgen build`` compiles."""
        return tuple(dict.fromkeys(s for k in self.kernels for _, s in self.variants[k]))

    def variant(self, op: Op, tokens: int, transport: str = "push") -> KernelSpec:
        """The spec ``op`` launches for ``tokens``: the smallest bucket not below it, else the largest.

        Raises:
            KeyError: the plan has no kernels of ``op`` and ``transport``."""
        variants = self.variants.get((op, transport))
        if not variants:
            raise KeyError(f"this op builds no {op.value} kernels of transport {transport!r}")
        return next((spec for max_tokens, spec in variants if tokens <= max_tokens), variants[-1][1])

    def geometry(self, op: Op, tokens: int, transport: str = "push") -> Geometry:
        """The geometry of ``variant(op, tokens, transport)``."""
        spec = self.variant(op, tokens, transport)
        return Geometry(spec.blocks, spec.warps_per_block, spec.unroll)

    def source(self, op: Op, tokens: int) -> Source:
        """Where the geometry ``op`` launches for ``tokens`` came from: "stated" where the config
        gives it, else the schedule bucket's source (a one-geometry kernel's: the bucket at
        max_tokens_per_rank)."""
        if _explicit(self.config, op) is not None:
            return Source("stated", "EpConfig's geometry field")
        t = self.config.max_tokens_per_rank if op.row.one_geometry else tokens
        return self.schedule.bucket(op.tuning_entry, t).source

    def transports(self, op: Op) -> tuple[str, ...]:
        """The transports of ``op``'s kernels this arch builds: ("push", "pull") for DISPATCH where
        the pull path is built, else ("push",) (() where ``op`` is not built)."""
        return tuple(tr for o, tr in self.kernels if o is op)

    def specs_at(self, tokens: int | None = None) -> tuple[KernelSpec, ...]:
        """The spec each kernel launches for ``tokens`` (default max_tokens_per_rank), in order:
        one per built ``(op, transport)`` (what the catalogue and ``epgen check`` show of a shape)."""
        t = self.config.max_tokens_per_rank if tokens is None else tokens
        return tuple(self.variant(op, t, tr) for op, tr in self.kernels)


def plan(config: EpConfig, arch: str) -> KernelPlan:
    """The ``KernelPlan`` of ``config`` on ``arch``: one tuning call (``tuning.schedule``) and the
    config's kernels (``ops``), each as the ``(max_tokens, spec)`` buckets an
    ``EpDispatchCombine`` compiles at construction, ascending up to the first bucket that holds
    max_tokens_per_rank. The pull dispatch's kernels (DISPATCH_PULL, and DISPATCH with transport
    "pull") take the dispatch's buckets, under "auto" only those whose transport is "pull" (a call
    in another bucket pushes), and exist only where one of them does.

    Raises:
        FieldError: config.nodes > 1 (``ops``); an explicit combine geometry a quantized wire
            cannot run; a spec that breaks an ``arch`` limit (a ValueError naming the field).
    """
    kinds = ops(config)
    sched = _schedule(config, arch)
    T = config.max_tokens_per_rank
    t_ll = _low_latency_tokens(config, sched)
    dispatch = sched.entries["dispatch"]
    # the dispatch buckets a call up to max_tokens_per_rank can land in
    used = [b for i, b in enumerate(dispatch) if i == 0 or dispatch[i - 1].max_tokens < T]
    pulls = config.dispatch_transport == "pull" or any(b.transport == "pull" for b in used)
    pulled = {b.max_tokens for b in dispatch if b.transport == "pull"}
    variants = {}
    for op, transport in [(op, "push") for op in kinds] + [(Op.DISPATCH, "pull")]:
        pull = op.row.transport == "pull" or transport == "pull"
        rows = []
        if op in kinds and (t_ll > 0 if op.low_latency else pulls and Op.DISPATCH_PULL in kinds if pull else True):
            every = not pull or config.dispatch_transport == "pull" or _explicit(config, op) is not None
            for max_tokens, g in _geometries(config, arch, op, sched.entries[op.tuning_entry]):
                if every or max_tokens in pulled:
                    rows.append((max_tokens, _spec(config, arch, op, g, transport, t_ll)))
                if max_tokens >= T:
                    break
        variants[(op, transport)] = tuple(rows)
    return KernelPlan(config=config, arch=arch, variants=variants, low_latency_tokens=t_ll,
                      dispatch_transports=tuple((b.max_tokens, b.transport) for b in dispatch), schedule=sched)


def specs(config: EpConfig, arches, tokens: int | None = None) -> list[KernelSpec]:
    """``plan(config, arch).specs_at(tokens)`` for each of ``arches`` (one name or a sequence), in
    order: the catalogue's and ``epgen check``'s view of a shape.

    Raises:
        as ``plan``.
    """
    arches = (arches,) if isinstance(arches, str) else arches
    return [s for arch in arches for s in plan(config, arch).specs_at(tokens)]


def explicit_spec(config: EpConfig, arch: str, op: Op, geometry: Geometry) -> KernelSpec:
    """The spec of ``op`` on ``arch`` with a geometry the user gave (a geometry flag): refused
    where the kernel cannot run it.

    Raises:
        FieldError: the geometry breaks a limit of ``op`` on ``arch`` (naming the field).
    """
    return _spec(config, arch, op, _fit(config, arch, op, geometry, True), "push",
                 _low_latency_tokens(config, _schedule(config, arch)))


def dispatch_transport(config: EpConfig, arch: str, tokens: int) -> str:
    """The transport the normal dispatch of a call with ``tokens`` takes on ``arch`` when x is the
    op's ``dispatch_input``: "push" or "pull" as ``dispatch_transport`` forces, and for "auto" the
    schedule's dispatch bucket's ("push" without a table entry); the low-latency family pushes.
    An x elsewhere makes "auto" push (``EpDispatchCombine.transport``)."""
    if config.kernel_family == "low_latency":
        return "push"
    if config.dispatch_transport != "auto":
        return config.dispatch_transport
    buckets = _schedule(config, arch).entries["dispatch"]
    return next((b.transport for b in buckets if tokens <= b.max_tokens), buckets[-1].transport)


__all__ = ["Buckets", "KernelPlan", "dispatch_transport", "explicit_spec", "ops", "plan", "shape_key",
           "specs", "tuning_key"]
