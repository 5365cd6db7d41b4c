"""Template paths: which feature values each kernel kind is rendered with on each arch.

A kernel's template path is its arch, its kind (``Op``: the template, and which half of a
low-latency op) and the value of each of ``FEATURES`` that applies to the kind, read from its
spec: the payload dtype (the kinds that move the payload, ``Op.payload``) or the combine wire (the
others, which include the wire codec; their dtype is always bf16), the layout (rank or expert),
the transport (push or pull) and the family (normal or low-latency). The templates branch on these
(``{% if %}`` on the wire, the layout, the transport, the half of the op) and size every row by
the dtype; the other spec fields (the shape, the geometry) are numbers in the source.

``space`` is every kernel an op can build at one shape: ``EpConfig`` over the product of its
tables (``DTYPES``, ``COMBINE_QUANTS``, ``LAYOUTS``, ``KERNEL_FAMILIES``, ``DISPATCH_TRANSPORTS``) on
every arch of ``ARCH_TRAITS``, the configurations it refuses left out. A new wire, dtype, arch or
kernel kind thus enters the space as a row of its table. ``items`` names what a set of specs
covers, one ``(arch, kind, feature, value)`` per feature value a kind takes on an arch; ``cover``
picks the fewest specs of the space that add every item a given set lacks.
"""

from __future__ import annotations

import itertools

from epgen.codegen.arch import ARCHES
from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES
from epgen.codegen.spec import KernelSpec

FEATURES = {
    "dtype": lambda s: s.dtype if s.op.payload else None,
    "wire": lambda s: None if s.op.payload else s.combine_quant,
    "layout": lambda s: "expert" if s.expert_alignment else "rank",
    "transport": lambda s: s.transport,
    "family": lambda s: "low_latency" if s.op.low_latency else "normal",
}
"""Feature name -> its value in a spec, None where it does not apply to the spec's kind."""


def path(spec: KernelSpec) -> tuple:
    """The template path of ``spec``: arch, kind, then the value of each of ``FEATURES`` (or None)."""
    return (spec.arch, spec.op.value, *(f(spec) for f in FEATURES.values()))


def items(specs) -> set[tuple[str, str, str, str]]:
    """``(arch, kind, feature, value)`` of every feature value the kernels of ``specs`` take."""
    return {(s.arch, s.op.value, name, f(s)) for s in specs for name, f in FEATURES.items() if f(s) is not None}


def space(model: str, *, world_size: int, max_tokens_per_rank: int, expert_alignment: int,
          arches=ARCHES) -> list[KernelSpec]:
    """Every kernel of catalogue model ``model``'s configurations (the product of ``EpConfig``'s
    tables; the expert layout at ``expert_alignment``; table geometry at ``max_tokens_per_rank``)
    on each of ``arches``, one per template path (the first in that order), without repeats.
    A configuration ``EpConfig`` refuses (the low-latency family with the pull transport) adds
    nothing."""
    from epgen.codegen.config import DISPATCH_TRANSPORTS, KERNEL_FAMILIES, LAYOUTS, EpConfig
    from epgen.codegen.errors import FieldError
    from epgen.codegen.planner import plan

    specs = {}
    for dtype, wire, layout, family, transport in itertools.product(DTYPES, COMBINE_QUANTS, LAYOUTS, KERNEL_FAMILIES,
                                                                     DISPATCH_TRANSPORTS):
        try:
            cfg = EpConfig.for_model(model, world_size=world_size, max_tokens_per_rank=max_tokens_per_rank,
                                     dtype=dtype, combine_quant=wire, layout=layout, kernel_family=family,
                                     dispatch_transport=transport,
                                     expert_alignment=expert_alignment if layout == "expert" else 1)
        except FieldError:
            continue
        for arch in arches:
            for s in plan(cfg, arch).specs_at():
                specs.setdefault(path(s), s)
    return list(specs.values())


def cover(candidates: list[KernelSpec], have: set) -> list[KernelSpec]:
    """The specs of ``candidates`` that add every item (``items``) of the candidates that ``have``
    lacks: greedily, each time the candidate adding the most (the first of equals, so the result
    follows the candidates' order), until none is missing."""
    own = [(s, items([s])) for s in candidates]
    missing = set().union(*(i for _, i in own)) - have
    chosen = []
    while missing:
        spec, adds = max(own, key=lambda pair: len(pair[1] & missing))
        chosen.append(spec)
        missing -= adds
    return chosen
