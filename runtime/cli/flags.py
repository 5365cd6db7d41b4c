"""Command-line flags to configs: the shape flags, their argparse types, the ``EpConfig`` and
``KernelSpec`` lists they describe, and errors that name the flag the user gave.

Every default comes from where it is defined: the catalogue's W and Tmax
(``CATALOGUE_WORLD_SIZE``, ``CATALOGUE_MAX_TOKENS``), ``EpConfig``'s attrs defaults, the tuning
table's ``DEFAULT_UNROLL``. Errors are ``parser.error`` calls (exit 2, ``epgen VERB: error:``).
Nothing here imports torch or CuPy but ``gpu_preflight``, for the GPU verbs.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import attrs

from epgen.codegen.arch import ARCHES, traits
from epgen.codegen.atomic import path_name_problem
from epgen.codegen.catalogue import CATALOGUE_MAX_TOKENS, CATALOGUE_WORLD_SIZE, model_specs
from epgen.codegen.config import DISPATCH_TRANSPORTS, KERNEL_FAMILIES, LAYOUTS, EpConfig
from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES
from epgen.codegen.models import MODELS, model
from epgen.codegen import planner
from epgen.codegen.spec import CALLS, LL_MAX_TOKENS, LOW_LATENCY_OPS, Op
from epgen.codegen.tuning import DEFAULT_UNROLL, Geometry
from epgen.harness import ROUTINGS
from epgen.cli.options import (BENCH_FAMILIES, BOTH_LOW_LATENCY_MAX_TOKENS, DEFAULT_MODEL, DEMO_ITERS,
                               GPU_VERB_WORLD_SIZE, NODES_SWEEP, NODES_SWEEP_CPU, TUNE_FAMILIES, BenchOptions,
                               StressOptions, TuneOptions, family_config)

CONFIG_DEFAULTS = {f.name: f.default for f in attrs.fields(EpConfig) if f.default is not attrs.NOTHING}
"""EpConfig's defaults by field (dtype, scale_bytes, combine_quant, ...)."""

FLAGS = {"hidden": "--hidden", "topk": "--topk", "num_experts": "--num-experts", "world_size": "--world-size",
         "max_tokens_per_rank": "--max-tokens", "dtype": "--dtype", "scale_bytes": "--scale-bytes",
         "dispatch_geometry": "--dispatch-geometry", "combine_geometry": "--combine-geometry",
         "combine_quant": "--quant", "layout": "--layout", "expert_alignment": "--expert-alignment",
         "max_recv_tokens": "--max-recv-tokens", "recv_tokens": "--max-recv-tokens",
         "kernel_family": "--kernel-family", "low_latency_geometry": "--low-latency-geometry",
         "dispatch_transport": "--transport"}
"""The flag of each EpConfig / KernelSpec field the shape flags set directly."""

_GEOMETRY_FIELDS = ("blocks", "warps_per_block", "unroll")


class Once(argparse.Action):
    """Store a flag's value, refusing it given twice (``--model A --model B`` would silently take B)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            parser.error(f"{option_string} given twice ({given[self.dest]} and {values}): give it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


def int_at_least(low: int):
    """An argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v}: must be at least {low}")
        return v

    return parse


positive = int_at_least(1)
non_negative = int_at_least(0)


def path(text: str) -> str:
    """An argparse type: a non-empty path (an empty -o would silently mean the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: must name a path")
    return text


def model_name(text: str) -> str:
    """An argparse type: a non-empty model name (``--model "$UNSET"`` must not mean "no model")."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: must name a catalogue model ({', '.join(MODELS)})")
    return text


def geometry(text: str) -> Geometry:
    """'24x16u4' -> Geometry(blocks=24, warps_per_block=16, unroll=4); the unroll defaults to
    the tuning table's ``DEFAULT_UNROLL``."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:u(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"geometry {text!r}: write BLOCKSxWARPS[uUNROLL], e.g. 24x16u4")
    b, w, u = m.groups()
    try:
        return Geometry(blocks=int(b), warps_per_block=int(w), unroll=int(u) if u else DEFAULT_UNROLL)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"geometry {text!r}: {e}") from None


KERNEL_FAMILY_HELP = ("which kernels move the tokens (EpConfig.kernel_family; default "
                      f"{CONFIG_DEFAULTS['kernel_family']}): normal (one kernel per op, built for bandwidth), "
                      "low_latency (a sending and a receiving half per op, built for decode sizes; at most "
                      f"{LL_MAX_TOKENS} tokens a rank), auto (both; a call takes the low-latency family up to the "
                      "tuning table's threshold)")
LOW_LATENCY_GEOMETRY_HELP = ("BLOCKSxWARPS[uUNROLL] of both halves of both low-latency ops "
                             "(EpConfig.low_latency_geometry; default the tuning table's); world size x blocks at most "
                             "1024")


def add_family_args(p: argparse.ArgumentParser, *, needs: str = "") -> None:
    """--kernel-family and --low-latency-geometry (EpConfig's fields); ``needs``: what the help
    adds about when they apply."""
    p.add_argument("--kernel-family", choices=list(KERNEL_FAMILIES), help=KERNEL_FAMILY_HELP + needs)
    p.add_argument("--low-latency-geometry", type=geometry, help=LOW_LATENCY_GEOMETRY_HELP + needs)


def add_hf_config_arg(p: argparse.ArgumentParser) -> None:
    """--hf-config: the shape of a transformers model's MoE layers from its config (``shape_from_hf_config``)."""
    p.add_argument("--hf-config", type=path, action=Once, help="a transformers config.json (or the directory "
                   "holding it): the shape of its MoE layers (hidden_size, routed experts, experts per token; "
                   "EpConfig.from_hf_config) instead of --model or --hidden/--topk/--num-experts; the shape read is "
                   "printed on stderr")


def add_shape_args(p: argparse.ArgumentParser, *, model_help: str = "") -> None:
    """--model, --hf-config, --hidden/--topk/--num-experts, --world-size, --max-tokens, --dtype, --quant,
    --scale-bytes, --layout, --expert-alignment, --max-recv-tokens, --kernel-family,
    --low-latency-geometry and --arch (repeatable)."""
    catalogue = f"the catalogue is fixed at W={CATALOGUE_WORLD_SIZE}/Tmax={CATALOGUE_MAX_TOKENS}"
    p.add_argument("--model", type=model_name, action=Once, help=f"catalogue model ({', '.join(MODELS)}){model_help}")
    add_hf_config_arg(p)
    p.add_argument("--hidden", type=positive, help="hidden size H (instead of --model)")
    p.add_argument("--topk", type=positive, help="experts per token K, 1 to 16 (with --hidden; alone: every "
                   "catalogue model with at least K experts, at top-k K)")
    p.add_argument("--num-experts", type=positive, help="routed experts E (with --hidden)")
    p.add_argument("--world-size", type=positive, help=f"ranks W (default {CATALOGUE_WORLD_SIZE}; needs --model, "
                   f"--hidden or a selector: {catalogue})")
    p.add_argument("--max-tokens", type=positive, help=f"max tokens per rank (default {CATALOGUE_MAX_TOKENS}; "
                   f"needs --model, --hidden or a selector: {catalogue})")
    p.add_argument("--dtype", choices=list(DTYPES), help=f"dispatch payload dtype (default {CONFIG_DEFAULTS['dtype']}; "
                   "alone: the catalogue's dispatch variants of that dtype)")
    p.add_argument("--quant", choices=list(COMBINE_QUANTS), help="combine wire format (default "
                   f"{CONFIG_DEFAULTS['combine_quant']}; alone: the catalogue's combine kernels of that wire, both "
                   "families' and the quantize kernel)")
    p.add_argument("--scale-bytes", type=int, help="opaque per-token scale bytes dispatch forwards "
                   f"(EpConfig.scale_bytes; default {CONFIG_DEFAULTS['scale_bytes']}; needs a shape or a selector)")
    p.add_argument("--layout", choices=list(LAYOUTS), help=f"receive layout (EpConfig.layout; default "
                   f"{CONFIG_DEFAULTS['layout']}; 'expert' adds the expand plan, expand and fold kernels; needs a shape)")
    p.add_argument("--expert-alignment", type=positive, help="with --layout expert: expert groups start at multiples "
                   f"of this many rows (default {CONFIG_DEFAULTS['expert_alignment']})")
    p.add_argument("--max-recv-tokens", type=positive, help="receive rows of each rank (EpConfig.max_recv_tokens; "
                   "default world size x max tokens; needs a shape)")
    add_family_args(p, needs="; needs a shape")
    p.add_argument("--arch", action="append", choices=list(ARCHES), help="target (repeatable; default all)")


def add_geometry_args(p: argparse.ArgumentParser) -> None:
    for op in CALLS:
        p.add_argument(f"--{op.value}-geometry", type=geometry, default=None, help="BLOCKSxWARPS[uUNROLL] of the "
                       f"normal family's {op.value} kernel (default: the tuning table per token bucket)")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """``epgen plan``: the shape and geometry flags, --transport and --virtual."""
    add_shape_args(p, model_help="; default deepseek-v3 without --hidden")
    add_geometry_args(p)
    p.add_argument("--transport", choices=list(DISPATCH_TRANSPORTS), help="the normal family's dispatch "
                   f"(EpConfig.dispatch_transport; default {CONFIG_DEFAULTS['dispatch_transport']})")
    p.add_argument("--virtual", action="store_true", help="every rank in one process, one grid (default: one "
                   "process a GPU)")


def add_jobs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=positive, default=None, help="parallel compiles (default: CPU count)")


def add_gpu_verb_args(p, *, world_size: int, virtual: bool, quant: bool, quant_help: str = "") -> None:
    """--model or --hf-config, --world-size (, --virtual), --dtype (, --quant) of a GPU verb: the
    shape flags it takes, read by ``config_from``; defaults ``DEFAULT_MODEL`` (the verb sets it when
    neither names a shape), ``world_size`` and EpConfig's."""
    p.add_argument("--model", type=model_name, action=Once, help=f"catalogue model (default {DEFAULT_MODEL})")
    add_hf_config_arg(p)
    p.add_argument("--world-size", type=positive, default=world_size, help="ranks; one process per GPU"
                   f"{' unless --virtual' if virtual else ''} (default {world_size})")
    if virtual:
        p.add_argument("--virtual", action="store_true", help="all ranks in one process on one GPU")
    p.add_argument("--dtype", default=CONFIG_DEFAULTS["dtype"], choices=list(DTYPES),
                   help=f"dispatch payload dtype (default {CONFIG_DEFAULTS['dtype']})")
    if quant:
        p.add_argument("--quant", default=CONFIG_DEFAULTS["combine_quant"], choices=list(COMBINE_QUANTS),
                       help=f"combine wire format (default {CONFIG_DEFAULTS['combine_quant']}){quant_help}")


def add_demo_args(d) -> None:
    """``epgen demo``'s flags (--tokens: the config's max tokens per rank)."""
    d.add_argument("--model", type=model_name, action=Once, help=f"catalogue model (default {DEFAULT_MODEL})")
    add_hf_config_arg(d)
    d.add_argument("--world-size", type=positive, default=CATALOGUE_WORLD_SIZE,
                   help=f"virtual ranks on the GPU (default {CATALOGUE_WORLD_SIZE})")
    d.add_argument("--tokens", type=positive, help=f"tokens per rank (default {CATALOGUE_MAX_TOKENS})")
    d.add_argument("--iters", type=positive, default=DEMO_ITERS, help=f"timed iterations (default {DEMO_ITERS})")
    add_family_args(d, needs="; not with --moe")


def add_bench_args(b) -> None:
    """``epgen bench``'s flags, defaults from ``BenchOptions`` and EpConfig."""
    bench = BenchOptions()
    add_gpu_verb_args(b, world_size=GPU_VERB_WORLD_SIZE, virtual=True, quant=True)
    b.add_argument("--tokens", type=positive, nargs="+", default=None, help="tokens per rank to sweep (default "
                   f"{' '.join(map(str, bench.tokens))}; with --nodes {' '.join(map(str, NODES_SWEEP))}, on the CPU "
                   f"stand-in {' '.join(map(str, NODES_SWEEP_CPU))})")
    b.add_argument("--routing", nargs="+", default=list(bench.routings), choices=ROUTINGS,
                   help=f"routing kinds (default {' '.join(bench.routings)})")
    b.add_argument("--family", choices=list(BENCH_FAMILIES), default=bench.family, help="kernel families to time "
                   f"(default {bench.family}): both = one op of each, the normal family at every --tokens count and "
                   f"the low-latency one at those up to {BOTH_LOW_LATENCY_MAX_TOKENS}; normal or low_latency = that "
                   f"family alone at every count (low_latency: at most {LL_MAX_TOKENS} tokens); auto = one op of "
                   "kernel_family auto, each point in the family it picks. The CSV's family column says which ran")
    add_geometry_args(b)
    transport = CONFIG_DEFAULTS["dispatch_transport"]
    b.add_argument("--transport", choices=list(DISPATCH_TRANSPORTS), default=transport, help="the normal "
                   f"family's dispatch (EpConfig.dispatch_transport; default {transport}): push, pull (the "
                   "receivers read the senders' rows), or auto (the tuning table's choice per bucket, with virtual "
                   "ranks; one rank a process pushes). Unless push, each call's x sits in the op's dispatch_input "
                   "(zero copy); the CSV's transport column says what each dispatch took")
    b.add_argument("--low-latency-geometry", type=geometry, default=None, help=LOW_LATENCY_GEOMETRY_HELP)
    b.add_argument("--iters", type=positive, default=bench.iters,
                   help=f"timed graph replays per point (default {bench.iters})")
    b.add_argument("-o", "--output", type=path, help="path prefix of the .csv/.png (default "
                   "tools/results/bench-ep<W>-<gpu> in an epgen checkout's root, else ./bench-ep<W>-<gpu>)")
    b.add_argument("--nodes", type=positive, default=None, help="instead: the hierarchical op across N nodes of "
                   "world-size / N ranks (epgen.hierarchical), N processes on this machine with a gloo network leg, "
                   "each leg's time and bytes against a flat all_to_all_single of the same bytes; the node-local leg "
                   "on virtual ranks of the GPU, or the CPU stand-in without one (or with --cpu); -o is then the "
                   "prefix of its .csv and .env.txt (default: none written)")
    b.add_argument("--cpu", action="store_true", help="with --nodes: the CPU stand-in node-local op even with a GPU")


def add_tune_args(t) -> None:
    """``epgen tune``'s flags, defaults from ``TuneOptions`` and EpConfig."""
    tune = TuneOptions()
    add_gpu_verb_args(t, world_size=GPU_VERB_WORLD_SIZE, virtual=True, quant=True,
                      quant_help="; with --family normal: tunes that wire's combine entries alone")
    t.add_argument("--family", choices=list(TUNE_FAMILIES), default=tune.family, help="families to tune (default "
                   f"{tune.family}): normal writes the dispatch/combine buckets; low_latency writes the dispatch_ll/"
                   "combine_ll entries (their geometry and the threshold up to which kernel_family auto takes them, "
                   "against the normal family timed at the same counts); both does both")
    t.add_argument("--tokens", type=positive, nargs="+", default=list(tune.tokens),
                   help=f"the normal family's token buckets (default {' '.join(map(str, tune.tokens))})")
    t.add_argument("--geometry", type=geometry, nargs="+", default=None, help="normal candidates "
                   f"BLOCKSxWARPS[uUNROLL] (default 8..132 blocks of 1024 threads, unroll {DEFAULT_UNROLL}; with "
                   "--family low_latency: the tuning table's, the reference of the threshold)")
    t.add_argument("--low-latency-tokens", type=positive, nargs="+", default=None,
                   help="token counts of the low-latency sweep and its threshold (default "
                   f"{' '.join(map(str, tune.low_latency_tokens))}; at most {LL_MAX_TOKENS})")
    t.add_argument("--low-latency-geometry", dest="low_latency_geometries", type=geometry, nargs="+", default=None,
                   help="low-latency candidates "
                   "BLOCKSxWARPS[uUNROLL] (default 16, 32, 64, 128 blocks of 256 and 512 threads, unroll 4, at most "
                   "1024 / world size blocks)")
    t.add_argument("--routing", default=tune.routing, choices=ROUTINGS, help=f"routing kind (default {tune.routing})")
    t.add_argument("--no-pull", action="store_true", help="time the normal family's dispatch as push alone; by "
                   "default each candidate is timed both ways and a bucket takes the faster transport's pick, written "
                   "as its transport (kernel_family auto pulls there with virtual ranks; with one rank a process only "
                   "dispatch_transport='pull' pulls)")
    t.add_argument("--iters", type=positive, default=tune.iters,
                   help=f"graph replays per point (default {tune.iters})")
    t.add_argument("--dry-run", action="store_true", help="print the table, write nothing")


def add_stress_args(st) -> None:
    """``epgen stress``'s flags, defaults from ``StressOptions`` and EpConfig."""
    stress = StressOptions()
    add_gpu_verb_args(st, world_size=GPU_VERB_WORLD_SIZE, virtual=True, quant=True)
    st.add_argument("--max-tokens", type=positive, default=CATALOGUE_MAX_TOKENS,
                    help=f"max tokens per rank (default {CATALOGUE_MAX_TOKENS})")
    st.add_argument("--rounds", type=positive, default=stress.rounds, help=f"rounds (default {stress.rounds})")
    st.add_argument("--seed", type=int, default=stress.seed, help=f"seed of the rounds (default {stress.seed})")
    st.add_argument("--fault-every", type=positive, default=None, metavar="N",
                    help="inject a recoverable fault (a bad expert id, or a y one row short) on one rank every N "
                         "rounds; every rank must raise it and run on (default: none)")
    add_family_args(st)


def arches(args) -> tuple[str, ...]:
    """The --arch values in order without repeats, or every arch (a verb without --arch: every arch)."""
    return tuple(dict.fromkeys(getattr(args, "arch", None) or ARCHES))


def check_model(name: str, parser) -> None:
    """A parser error naming --model when ``name`` is not a catalogue model (with suggestions)."""
    try:
        model(name)
    except ValueError as e:
        parser.error(f"--model {name}: {e}")


def check_wave_size(world_size: int, targets, parser, flag: str = "--world-size", arch_flag: bool = True) -> None:
    """World size W is at most the wave size of every target arch (one lane per destination rank):
    a parser error naming ``flag``, the arches over the limit and (with ``arch_flag``) the --arch
    that would allow it."""
    if all(world_size <= traits(a).wave_size for a in targets):
        return
    limit = min(traits(a).wave_size for a in targets)
    fits = [a for a in ARCHES if world_size <= traits(a).wave_size]
    hint = f"; --arch {' --arch '.join(fits)} allows more" if fits and arch_flag else ""
    parser.error(f"{flag} {world_size}: must be at most {limit}, the smallest wave size of the target arches (one "
                 f"lane per destination rank; {', '.join(f'{a}: {traits(a).wave_size}' for a in targets)}){hint}")


def shape_source(args) -> str | None:
    """Where the shape came from, as the user wrote it: "--model NAME" or "--hf-config FILE" when
    given, "the default model NAME" when no flag named one; None when --hidden/--topk/--num-experts
    did."""
    if getattr(args, "hf_config", None):
        return f"--hf-config {args.hf_config}"
    if not getattr(args, "model", None):
        return None
    return f"--model {args.model}" if "model" in getattr(args, "_given_once", {}) else f"the default model {args.model}"


def flag_error(e: ValueError, args) -> str:
    """A config or spec error plus the flags its field came from: ``e.field`` (a FieldError) mapped
    to the flags the user gave (--model or --hf-config for the shape, the geometry flags for
    blocks/warps/unroll, --num-experts and --world-size for experts_per_rank = E / W)."""
    field = getattr(e, "field", None)
    source = shape_source(args)
    if field == "num_experts" and "multiple of world_size" in str(e):
        return (f"{e} (--world-size {args.world_size} with {source})" if source
                else f"{e} (--num-experts {args.num_experts}, --world-size {args.world_size})")
    if source and field in ("hidden", "topk", "num_experts", "experts_per_rank"):
        return f"{e} ({source})"
    if field == "experts_per_rank":
        return f"{e} (--num-experts {args.num_experts} / --world-size {args.world_size})"
    if field in _GEOMETRY_FIELDS:
        geo = [f"{FLAGS[f]} {getattr(args, f)}" for f in ("dispatch_geometry", "combine_geometry", "low_latency_geometry")
               if getattr(args, f, None)]
        return f"{e} ({' or '.join(geo) if geo else 'the tuning table geometry'})"
    return f"{e} ({FLAGS.get(field, 'from the shape flags')})"


def _resolve_sizes(args, parser) -> None:
    """--world-size/--max-tokens/--scale-bytes: defaults the catalogue's W and Tmax and EpConfig's
    scale_bytes; given without a shape (--model, --hidden) or a selector (--topk, --dtype,
    --quant), a parser error, since the catalogue is fixed."""
    if getattr(args, "_sizes_resolved", False):
        return
    given = [f"{flag} {v}" for flag, v in (("--world-size", args.world_size),
                                           ("--max-tokens", getattr(args, "max_tokens", None)),
                                           ("--scale-bytes", getattr(args, "scale_bytes", None)),
                                           ("--layout", getattr(args, "layout", None)),
                                           ("--expert-alignment", getattr(args, "expert_alignment", None)),
                                           ("--max-recv-tokens", getattr(args, "max_recv_tokens", None)),
                                           ("--kernel-family", getattr(args, "kernel_family", None)),
                                           ("--low-latency-geometry", getattr(args, "low_latency_geometry", None)),
                                           ("--dispatch-geometry", getattr(args, "dispatch_geometry", None)),
                                           ("--combine-geometry", getattr(args, "combine_geometry", None)))
             if v is not None]
    shape = args.model or any(getattr(args, f, None) is not None for f in ("hidden", "topk", "dtype", "quant"))
    if given and not shape:
        parser.error(f"{' '.join(given)}: the catalogue is fixed at W={CATALOGUE_WORLD_SIZE} / "
                     f"Tmax={CATALOGUE_MAX_TOKENS}; name --model or --hidden (or a selector --dtype/--topk/--quant) "
                     "to choose the shape")
    args.world_size = CATALOGUE_WORLD_SIZE if args.world_size is None else args.world_size
    args.max_tokens = getattr(args, "max_tokens", None) or CATALOGUE_MAX_TOKENS
    args.scale_bytes = CONFIG_DEFAULTS["scale_bytes"] if getattr(args, "scale_bytes", None) is None else args.scale_bytes
    args._sizes_resolved = True


def _layer_kw(args) -> dict:
    """The EpConfig fields beyond the shape that the flags set (defaults: EpConfig's)."""
    layout = getattr(args, "layout", None) or CONFIG_DEFAULTS["layout"]
    alignment = getattr(args, "expert_alignment", None) or CONFIG_DEFAULTS["expert_alignment"]
    return dict(world_size=args.world_size, max_tokens_per_rank=args.max_tokens,
                dtype=args.dtype or CONFIG_DEFAULTS["dtype"],
                combine_quant=getattr(args, "quant", None) or CONFIG_DEFAULTS["combine_quant"],
                scale_bytes=args.scale_bytes, layout=layout, expert_alignment=alignment,
                max_recv_tokens=getattr(args, "max_recv_tokens", None))


def shape_from_hf_config(args, parser) -> None:
    """--hf-config: hidden size, top-k and routed experts of a transformers config
    (``EpConfig.from_hf_config``), set as if given as --hidden/--topk/--num-experts, and printed
    on stderr (unless --quiet): the shape the verb then uses. A parser error when --model or a
    shape flag is given too, or the file does not give a shape (its message names the file)."""
    import sys

    if getattr(args, "_hf_config_read", False):
        return
    given = [f for f, v in (("--model", args.model), ("--hidden", args.hidden), ("--topk", args.topk),
                            ("--num-experts", args.num_experts)) if v is not None]
    if given:
        parser.error(f"--hf-config {args.hf_config} gives the shape: drop {' '.join(given)}")
    try:  # W = 1 here: --world-size is checked against the experts with the other flags
        cfg = EpConfig.from_hf_config(args.hf_config, world_size=1, max_tokens_per_rank=1)
    except (OSError, ValueError) as e:
        parser.error(f"--hf-config: {e}")  # the message names the file
    args.hidden, args.topk, args.num_experts = cfg.hidden, cfg.topk, cfg.num_experts
    args._hf_config_read = True
    if not getattr(args, "quiet", False):
        print(f"--hf-config {args.hf_config}: hidden {cfg.hidden}, top-{cfg.topk} of {cfg.num_experts} routed "
              f"experts (as --hidden {cfg.hidden} --topk {cfg.topk} --num-experts {cfg.num_experts})",
              file=sys.stderr)


def config_from(args, parser) -> EpConfig | None:
    """The EpConfig the shape flags describe (with those of them a verb has: the GPU verbs take
    --model, --world-size, --dtype, and some --quant, --max-tokens, the geometry, family and
    transport flags), or None when they name no shape. Errors name the flag; with --arch (the
    CPU verbs) a given geometry is checked against the kernels and target arches it applies to
    (``_check_given_geometries``; the GPU verbs check theirs in ``gpu_preflight``)."""
    for name in ("hidden", "topk", "num_experts", "kernel_family", "low_latency_geometry", "hf_config"):
        setattr(args, name, getattr(args, name, None))  # a flag the verb lacks: unset
    if args.hf_config:
        shape_from_hf_config(args, parser)
    _resolve_sizes(args, parser)
    shape = [f for f, v in (("--hidden", args.hidden), ("--topk", args.topk), ("--num-experts", args.num_experts))
             if v is not None]
    if args.model and shape:
        parser.error(f"--model {args.model} fixes the shape: drop {' '.join(shape)} (or drop --model)")
    if args.hidden is None and args.num_experts is not None:
        parser.error("--num-experts needs --hidden (or name a --model)")
    if args.hidden is None and not args.model:
        return None  # --topk alone is a catalogue selector
    if args.model:
        check_model(args.model, parser)
    if hasattr(args, "arch"):  # a GPU verb's world size meets its GPU's wave size (gpu_preflight)
        check_wave_size(args.world_size, arches(args), parser)
    kw = dict(_layer_kw(args), dispatch_geometry=getattr(args, "dispatch_geometry", None),
              combine_geometry=getattr(args, "combine_geometry", None),
              kernel_family=args.kernel_family or CONFIG_DEFAULTS["kernel_family"],
              low_latency_geometry=args.low_latency_geometry,
              dispatch_transport=getattr(args, "transport", None) or CONFIG_DEFAULTS["dispatch_transport"])
    missing = [f"--{n}" for n, v in (("topk", args.topk), ("num-experts", args.num_experts)) if v is None]
    if args.hidden is not None and missing:
        parser.error(f"--hidden needs {' and '.join(missing)}")
    geometries = {FLAGS[f]: kw[f] for f in ("dispatch_geometry", "combine_geometry")}
    low_latency = {FLAGS["low_latency_geometry"]: kw["low_latency_geometry"]}
    try:
        # a CPU verb's geometry, named with the --arch targets that refuse it (a GPU verb's: gpu_preflight)
        if hasattr(args, "arch") and (any(geometries.values()) or any(low_latency.values())):
            bare = dict(kw, dispatch_geometry=None, combine_geometry=None, low_latency_geometry=None)
            _check_given_geometries([_config(args, bare)], arches(args), geometries, low_latency, parser)
        return _config(args, kw)
    except ValueError as e:
        parser.error(flag_error(e, args))


def _config(args, kw: dict) -> EpConfig:
    if args.hidden is None:
        return EpConfig.for_model(args.model, **kw)
    return EpConfig(hidden=args.hidden, topk=args.topk, num_experts=args.num_experts, **kw)


def specs_from(args, parser) -> list | None:
    """Dispatch and combine specs at max tokens of the shape flags for each ``--arch`` (default
    all), the selected catalogue variants (``selected_catalogue_specs``), or None when no flag
    names any (the whole catalogue)."""
    cfg = config_from(args, parser)
    if cfg is None:
        return selected_catalogue_specs(args, parser)  # None: every selector unset (sizes checked above)
    try:
        return planner.specs(cfg, arches(args))
    except ValueError as e:  # the spec's own message, plus the flag it came from
        parser.error(flag_error(e, args))


def selected_catalogue_specs(args, parser) -> list | None:
    """With only the selectors --dtype/--topk/--quant: those variants of every catalogue model
    (--dtype: dispatch, --quant: combine, each with its low-latency halves and its local kernels,
    as the quantize kernel; --topk: both unless one of the others narrows it); None
    when no selector is given. The kernel family and geometry flags need a shape (a parser error here)."""
    if args.topk is None and args.dtype is None and args.quant is None:
        return None
    family = [f"{flag} {v}" for flag, v in (("--kernel-family", getattr(args, "kernel_family", None)),
                                            ("--low-latency-geometry", getattr(args, "low_latency_geometry", None)),
                                            ("--dispatch-geometry", getattr(args, "dispatch_geometry", None)),
                                            ("--combine-geometry", getattr(args, "combine_geometry", None)))
              if v is not None]
    if family:
        parser.error(f"{' '.join(family)}: needs a shape (--model or --hidden); the selectors --dtype/--topk/--quant "
                     "pick catalogue variants")
    ops = {op for op, flag in ((Op.DISPATCH, args.dtype), (Op.COMBINE, args.quant)) if flag} or set(CALLS)
    names = [m.name for m in MODELS.values() if m.num_experts >= (args.topk or 1)]  # top-k <= experts
    if not names:
        parser.error(f"--topk {args.topk}: no catalogue model has that many experts")
    check_wave_size(args.world_size, arches(args), parser)
    for name in names:
        if MODELS[name].num_experts % args.world_size:
            parser.error(f"--world-size {args.world_size}: catalogue model {name} has {MODELS[name].num_experts} "
                         f"experts, not a multiple of {args.world_size} (the selectors cover every model; "
                         "name one with --model)")
    try:
        return [s for name in names for s in model_specs(name, arches(args), topk=args.topk, **_layer_kw(args))
                if s.op.call in ops]
    except ValueError as e:
        parser.error(flag_error(e, args))


def catalogue_dir(args, parser) -> Path:
    """-o, or ./generated inside an epgen checkout (never a stray folder elsewhere)."""
    if args.output:
        return Path(args.output)
    if not in_checkout():
        parser.error("the catalogue lives in generated/ of an epgen checkout: run from the checkout's root or "
                     "give -o DIR")
    return Path("generated")


def in_checkout() -> bool:
    """Whether the current directory is the root of an epgen checkout (its pyproject.toml names
    the project epgen): there the catalogue is generated/ and bench writes under tools/results/."""
    pyproject = Path("pyproject.toml")
    return pyproject.is_file() and 'name = "epgen"' in pyproject.read_text(errors="replace")


def check_path_name(argument: str, path, parser, suffix: str = "") -> None:
    """A parser error now, before any work, when the file system would refuse ``path`` (+
    ``suffix``) as too long: a component over its ``NAME_MAX`` (usually 255 bytes) or the whole
    over ``PATH_MAX``. The message names ``argument`` (a flag, e.g. ``-o``, or an environment
    variable as ``NAME=``), the path (abbreviated when huge) and the rule
    (``epgen.codegen.atomic.path_name_problem``); every output path of the command line goes
    through here."""
    problem = path_name_problem(argument, path, suffix)
    if problem:
        parser.error(problem)


def not_a_directory(path: Path) -> str | None:
    """Why ``path`` cannot be (made) a directory: it, or its nearest existing ancestor, is not one."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        return "exists and is not a directory" if p == path else f"{p} exists and is not a directory"
    return None


def check_output_files(outputs, parser) -> None:
    """``outputs``: (flag, Path) of files to write later; a parser error now (before minutes of
    compiling) when two name one file, or one exists and is not writable, is a directory or has
    no parent folder, is a symbolic link loop, or its name is longer than the file system allows
    (``check_path_name``)."""
    seen = {}
    for flag, file in outputs:
        check_path_name(flag, file, parser)
        try:
            resolved = file.resolve()
        except (OSError, RuntimeError):  # RuntimeError: Python before 3.13 on a symbolic link loop
            parser.error(f"{flag} {file}: a symbolic link loop (it, or a link it goes through, points back at "
                         "itself); name a file")
        if resolved in seen:
            parser.error(f"{seen[resolved]} and {flag} name the same file {file}: give each output its own")
        seen[resolved] = flag
        if file.exists() and not os.access(file, os.W_OK):
            parser.error(f"{flag} {file}: exists and is not writable")
        if file.is_dir():
            parser.error(f"{flag} {file}: is a directory; name a file")
        if not file.parent.is_dir():
            parser.error(f"{flag} {file}: parent directory {file.parent} "
                         f"{'is not a directory' if file.parent.exists() else 'does not exist'}")


def check_output(output: str, parser) -> None:
    """A parser error unless ``output`` is a path prefix in an existing, writable folder whose
    .csv/.png/.env.txt files, where they exist, are writable files, and whose names the file
    system takes (``check_path_name``)."""
    check_path_name("-o", output, parser, suffix=".env.txt")  # the longest of the three names
    if output.endswith(os.sep) or os.path.isdir(output):
        parser.error(f"-o {output}: a path prefix for the .csv/.png/.env.txt files, not a folder")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        parser.error(f"-o {output}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"-o {output}: folder {folder} is not writable")
    for suffix in (".csv", ".png", ".env.txt"):
        if os.path.isdir(output + suffix):
            parser.error(f"-o {output}: {output + suffix} is a directory; the prefix's files cannot be written")
        if os.path.exists(output + suffix) and not os.access(output + suffix, os.W_OK):
            parser.error(f"-o {output}: {output + suffix} exists and is not writable")


def gpu_preflight(args, parser, error, verb: str, layer: EpConfig, *, families: dict[str, int], virtual: bool = False,
                  output: str | None = None, geometries: dict | None = None,
                  low_latency_geometries: dict | None = None, share_gpu: bool = False) -> EpConfig | None:
    """Everything about a GPU verb's arguments that can be checked without a GPU, first (parser
    errors naming the flag), then that there is a GPU, enough of them (one a process; with
    ``share_gpu``, a verb that checks rather than times, any: its processes then share cuda:0,
    ``epgen.harness.ranks``), and (with ``output``, a plot) matplotlib, then the specs for this
    GPU's arch. ``layer``: the verb's config (``config_from``); ``families``: the most tokens a rank
    passes to the op of each ``EpConfig.kernel_family`` the verb builds (``family_config``);
    ``geometries`` / ``low_latency_geometries``: flag -> Geometry, or a list of them, or None,
    checked against the dispatch and combine / the low-latency halves of a config that builds them
    (a parser error when none does). Returns the first family's config, or None after
    ``error(verb, line)``."""
    import importlib.util

    import torch

    from epgen.device import device_arch

    cfgs = []
    bare = attrs.evolve(layer, dispatch_geometry=None, combine_geometry=None, low_latency_geometry=None)
    for family, max_tokens in families.items():  # the given geometries are checked against these below
        try:
            cfgs.append(family_config(bare, family, max_tokens))
        except ValueError as e:
            parser.error(f"{e} (--world-size {args.world_size}, the {family} family with tokens up to {max_tokens}, "
                         f"with {shape_source(args)})")
    if output is not None:
        check_output(output, parser)
    _check_given_geometries(cfgs, ARCHES, geometries, low_latency_geometries, parser)  # fits some GPU at all
    if not torch.cuda.is_available():
        return error(verb, "needs a GPU (torch.cuda.is_available() is False)")
    gpus = torch.cuda.device_count()
    if not virtual and not share_gpu and args.world_size > gpus:
        hint = "; --virtual runs all ranks on one GPU" if hasattr(args, "virtual") else ""
        return error(verb, f"--world-size {args.world_size} needs {args.world_size} GPUs (one process per GPU), "
                           f"this machine has {gpus}{hint}")
    if output is not None and importlib.util.find_spec("matplotlib") is None:
        return error(verb, "the plot needs matplotlib: pip install -e '.[bench]'")
    arch = device_arch(torch.cuda.current_device())
    for cfg in cfgs:  # the tuning table's geometries: the world size and sizes against this arch's limits
        try:
            planner.plan(cfg, arch)
        except ValueError as e:
            parser.error(f"{e} (--world-size {args.world_size} on this GPU's arch {arch})")
    _check_given_geometries(cfgs, (arch,), geometries, low_latency_geometries, parser, gpu=True)
    return family_config(layer, *next(iter(families.items())))


def _check_given_geometries(cfgs, arches, geometries, low_latency_geometries, parser, gpu: bool = False) -> None:
    """A parser error for a given geometry (flag -> Geometry, a list of them, or None) that no arch
    of ``arches`` runs for the kernels it applies to (the dispatch and combine, or the low-latency
    halves), naming the flag and the arches that refuse it: the target arches (--arch, default
    every arch), and for a GPU verb (``gpu``) then this GPU's arch. A geometry for kernels this run
    builds on none of them (--dispatch-geometry with --kernel-family low_latency) is an error."""
    for ops, given_by_flag in ((CALLS, geometries), (LOW_LATENCY_OPS, low_latency_geometries)):
        family = "low-latency" if ops is LOW_LATENCY_OPS else "normal"
        for flag, given in (given_by_flag or {}).items():
            for g in [g for g in (given if isinstance(given, (list, tuple)) else [given]) if g is not None]:
                errors = {}  # message -> the arches that raised it
                for arch in arches:
                    try:
                        holder = next((c for c in cfgs if set(ops) <= set(planner.plan(c, arch).ops)), None)
                        if holder is None:
                            raise ValueError(f"{flag} {g}: applies to the {family} family's kernels, which this run "
                                             "does not build")
                        for op in ops:
                            planner.explicit_spec(holder, arch, op, g)
                        break
                    except ValueError as e:
                        errors.setdefault(str(e), []).append(arch)
                else:
                    def where(on):
                        if len(arches) == 1:
                            return f"this GPU's arch {on[0]}" if gpu else on[0]
                        return "every arch" if len(on) == len(arches) else ", ".join(on)
                    parser.error("; ".join(f"{m} ({flag} {g} on {where(on)})" for m, on in errors.items()))

def import_timing_arch(args, parser, error, arches) -> str:
    """This GPU's arch for ``epgen build --time-import``, or "" after ``error("build", line)`` (no
    GPU or no CuPy); a parser error when the GPU's arch is not among ``arches``."""
    import importlib.util

    import torch

    from epgen.device import device_arch

    has_cupy = importlib.util.find_spec("cupy") is not None
    if not torch.cuda.is_available() or not has_cupy:
        error("build", f"--time-import: needs a GPU and CuPy; here torch.cuda.is_available() is "
                        f"{torch.cuda.is_available()} and CuPy is {'' if has_cupy else 'not '}installed")
        return ""
    gpu_arch = device_arch(torch.cuda.current_device())
    if gpu_arch not in arches:
        parser.error(f"--time-import: this GPU is {gpu_arch}, not among --arch {' '.join(arches)}; "
                     f"add --arch {gpu_arch}")
    return gpu_arch
