"""The ``epgen`` command line: generate, check, report, diff, build, demo, bench, tune, stress."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from epgen.codegen.arch import ARCHES
from epgen.codegen.catalogue import catalogue_specs, check as check_dir, model_specs, owned_sources, render_files, write
from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES
from epgen.codegen.spec import Op
from epgen.codegen.models import MODELS


def _int_at_least(low: int):
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


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _path(text: str) -> str:
    """An argparse type: a non-empty path (an empty -o would silently mean the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: must name a path")
    return text


def _shape_args(p: argparse.ArgumentParser, *, model_help: str = ""):
    p.add_argument("--model", help=f"catalogue model ({', '.join(MODELS)}){model_help}")
    p.add_argument("--hidden", type=_positive, help="hidden size H (instead of --model)")
    p.add_argument("--topk", type=_positive, help="experts per token K (with --hidden; alone: every catalogue "
                   "model with at least K experts, at top-k K)")
    p.add_argument("--num-experts", type=_positive, help="routed experts E (with --hidden)")
    p.add_argument("--world-size", type=_positive, default=None, help="ranks W (default 8; needs --model, --hidden "
                   "or a selector: the catalogue is fixed at W=8)")
    p.add_argument("--max-tokens", type=_positive, default=None, help="max tokens per rank (default 4096; needs "
                   "--model, --hidden or a selector: the catalogue is fixed at Tmax=4096)")
    p.add_argument("--dtype", choices=list(DTYPES), help="dispatch payload dtype (default bf16; alone: the "
                   "catalogue's dispatch variants of that dtype)")
    p.add_argument("--quant", choices=list(COMBINE_QUANTS), help="combine wire format (default none; alone: the "
                   "catalogue's combine variants of that wire)")
    p.add_argument("--arch", action="append", choices=list(ARCHES), help="target (repeatable; default all)")


def _layer_args(p: argparse.ArgumentParser):
    """The EpConfig fields beyond the shape flags (``epgen build``): scales and explicit geometry."""
    p.add_argument("--scale-bytes", type=int, default=0, help="opaque per-token scale bytes dispatch forwards "
                   "(EpConfig.scale_bytes; default 0)")
    _geometry_args(p)


def _geometry_args(p: argparse.ArgumentParser):
    for op in ("dispatch", "combine"):
        p.add_argument(f"--{op}-geometry", type=_geometry, default=None,
                       help="BLOCKSxWARPS[uUNROLL] (default: the tuning table per token bucket)")


def _jobs_arg(p: argparse.ArgumentParser):
    p.add_argument("--jobs", type=_positive, default=None, help="parallel compiles (default: CPU count)")


def _check_wave_size(world_size: int, arches, parser, flag: str = "--world-size", arch_flag: bool = True) -> None:
    """World size W is at most the wave size of every target arch (one lane per destination rank):
    a parser error naming ``flag``, the arches over the limit and (with ``arch_flag``) the --arch
    that would allow it."""
    from epgen.codegen.arch import traits

    over = [a for a in arches if world_size > traits(a).wave_size]
    if not over:
        return
    limit = min(traits(a).wave_size for a in arches)
    fits = [a for a in ARCHES if world_size <= traits(a).wave_size]
    hint = f"; --arch {' --arch '.join(fits)} allows more" if fits and arch_flag else ""
    parser.error(f"{flag} {world_size}: must be at most {limit}, the smallest wave size of the target arches (one "
                 f"lane per destination rank; {', '.join(f'{a}: {traits(a).wave_size}' for a in arches)}){hint}")


def _config_from(args, parser):
    """The EpConfig the shape flags (and, where the verb has them, ``_layer_args``) describe, or
    None when they name no shape. Errors name the flag."""
    from epgen.codegen.config import EpConfig

    _resolve_sizes(args, parser)
    shape = [f for f, v in (("--hidden", args.hidden), ("--topk", args.topk), ("--num-experts", args.num_experts))
             if v is not None]
    if args.model and shape:
        parser.error(f"--model {args.model} fixes the shape: drop {' '.join(shape)} (or drop --model)")
    if args.hidden is None and args.num_experts is not None:
        parser.error("--num-experts needs --hidden (or name a --model)")
    if args.hidden is None and not args.model:
        return None  # --topk alone is a catalogue selector
    _check_wave_size(args.world_size, tuple(args.arch or ARCHES), parser)
    kw = dict(world_size=args.world_size, max_tokens_per_rank=args.max_tokens, dtype=args.dtype or "bf16",
              combine_quant=args.quant or "none",
              scale_bytes=getattr(args, "scale_bytes", 0), dispatch_geometry=getattr(args, "dispatch_geometry", None),
              combine_geometry=getattr(args, "combine_geometry", None))
    try:
        if args.hidden is None:
            return EpConfig.for_model(args.model, **kw)
        missing = [f"--{n}" for n, v in (("topk", args.topk), ("num-experts", args.num_experts)) if v is None]
        if missing:
            parser.error(f"--hidden needs {' and '.join(missing)}")
        return EpConfig(hidden=args.hidden, topk=args.topk, num_experts=args.num_experts, **kw)
    except ValueError as e:
        parser.error(_with_flag(e, args))


def _resolve_sizes(args, parser) -> None:
    """--world-size/--max-tokens: defaults 8 and 4096; given without a shape (--model, --hidden) or
    a selector (--topk, --dtype, --quant), a parser error, since the catalogue is fixed."""
    if getattr(args, "_sizes_resolved", False):
        return
    given = [f"{flag} {v}" for flag, v in (("--world-size", args.world_size), ("--max-tokens", args.max_tokens))
             if v is not None]
    shape = args.model or any(v is not None for v in (args.hidden, args.topk, args.dtype, args.quant))
    if given and not shape:
        parser.error(f"{' '.join(given)}: the catalogue is fixed at W=8 / Tmax=4096; name --model or --hidden "
                     "(or a selector --dtype/--topk/--quant) to choose the shape")
    args.world_size = 8 if args.world_size is None else args.world_size
    args.max_tokens = 4096 if args.max_tokens is None else args.max_tokens
    args._sizes_resolved = True


def _with_flag(e: ValueError, args=None) -> str:
    """A config or spec error, plus the flag its field came from (with ``args``: the flags the
    user gave, e.g. --model for the shape, the geometry flags for blocks/warps/unroll)."""
    field = str(e).split("=")[0].split(".")[-1]
    if args is not None:
        model = getattr(args, "model", None)
        if field == "num_experts" and "multiple of world_size" in str(e):
            return (f"{e} (--world-size {args.world_size} with --model {model})" if model
                    else f"{e} (--num-experts, --world-size)")
        if model and field in ("hidden", "topk", "num_experts", "experts_per_rank"):
            return f"{e} (--model {model})"
        if field in ("blocks", "warps_per_block", "unroll"):
            geo = [f"--{op}-geometry" for op in ("dispatch", "combine") if getattr(args, f"{op}_geometry", None)]
            return f"{e} ({' or '.join(geo) if geo else 'the tuning table geometry'})"
    return f"{e} ({_FLAGS.get(field, 'from the shape flags')})"


def _specs_from(args, parser) -> list | None:
    """Dispatch and combine specs at max tokens of the shape flags for each ``--arch`` (default
    all), the selected catalogue variants (``_selected_catalogue_specs``), or None when no flag
    names any (the whole catalogue)."""
    cfg = _config_from(args, parser)
    if cfg is None:
        return _selected_catalogue_specs(args, parser)  # None: every selector unset (sizes checked above)
    try:
        return [s for arch in (args.arch or ARCHES) for s in cfg.kernel_specs(arch)]
    except ValueError as e:  # the spec's own message, plus the flag it came from
        parser.error(_with_flag(e, args))


_FLAGS = {"hidden": "--hidden", "topk": "--topk", "num_experts": "--num-experts", "world_size": "--world-size",
          "max_tokens_per_rank": "--max-tokens", "dtype": "--dtype", "model": "--model", "scale_bytes": "--scale-bytes",
          "dispatch_geometry": "--dispatch-geometry", "combine_geometry": "--combine-geometry", "combine_quant": "--quant"}


def _selected_catalogue_specs(args, parser) -> list | None:
    """With only the selectors --dtype/--topk/--quant: those variants of every catalogue model
    (--dtype: dispatch, --quant: combine, --topk: both unless one of the others narrows it); None
    when no selector is given."""
    if args.topk is None and args.dtype is None and args.quant is None:
        return None
    ops = {op for op, flag in ((Op.DISPATCH, args.dtype), (Op.COMBINE, args.quant)) if flag} or set(Op)
    names = [m.name for m in MODELS.values() if m.num_experts >= (args.topk or 1)]  # top-k <= experts
    if not names:
        parser.error(f"--topk {args.topk}: no catalogue model has that many experts")
    _check_wave_size(args.world_size, tuple(args.arch or ARCHES), parser)
    for name in names:
        if MODELS[name].num_experts % args.world_size:
            parser.error(f"--world-size {args.world_size}: catalogue model {name} has {MODELS[name].num_experts} "
                         f"experts, not a multiple of {args.world_size} (the selectors cover every model; "
                         "name one with --model)")
    try:
        return [s for name in names
                for s in model_specs(name, tuple(args.arch or ARCHES), topk=args.topk, world_size=args.world_size,
                                     max_tokens_per_rank=args.max_tokens, dtype=args.dtype or "bf16",
                                     combine_quant=args.quant or "none") if s.op in ops]
    except ValueError as e:
        parser.error(_with_flag(e, args))


def _catalogue_dir(args, parser) -> Path:
    """-o, or ./generated inside an epgen checkout (never a stray folder elsewhere)."""
    if args.output:
        return Path(args.output)
    pyproject = Path("pyproject.toml")
    if not (pyproject.is_file() and 'name = "epgen"' in pyproject.read_text(errors="replace")):
        parser.error("the catalogue lives in generated/ of an epgen checkout: run from the checkout's root or "
                     "give -o DIR")
    return Path("generated")


class _Progress:
    """A rich progress bar over ``total`` compiles on stderr (nothing when quiet or when stderr is
    not a terminal: logs get no bar residue)."""

    def __init__(self, total: int, label: str, quiet: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = None if quiet or not sys.stderr.isatty() else Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(label, total=total) if self._bar else None

    def __enter__(self):
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.stop()

    def advance(self):
        if self._bar:
            self._bar.advance(self._task)


def _report_possible(specs, console, quiet) -> bool:
    from epgen.codegen.offline import toolchain_status

    reasons = {a: toolchain_status(a) for a in sorted({s.arch for s in specs})}
    missing = {a: r for a, r in reasons.items() if r}
    if missing and not quiet:
        console.print(escape("resource report skipped: " + "; ".join(f"{a}: {r}" for a, r in missing.items())))
    return not missing


def cmd_generate(args, parser, console) -> int:
    if args.list_models:
        if args.json:
            print(json.dumps([{"name": m.name, "hidden": m.hidden, "num_experts": m.num_experts, "topk": m.topk}
                              for m in MODELS.values()]))
            return 0
        for m in MODELS.values():
            print(f"{m.name:18} hidden {m.hidden:5}  experts {m.num_experts:4}  top-{m.topk}")
        return 0
    specs = _specs_from(args, parser)
    if specs is None:  # the committed catalogue: every model, every arch
        if args.arch:
            parser.error("--arch selects arches of one shape (--model/--hidden); the catalogue covers every arch")
        specs = catalogue_specs()
        out = _catalogue_dir(args, parser)
    elif not args.output:
        parser.error("-o/--output is required with --model, --hidden or a selector (the catalogue lives in generated/)")
    else:
        out = Path(args.output)
    problem = _not_a_directory(out)
    if problem:
        parser.error(f"-o {out}: {problem}")
    quiet = args.quiet or args.json
    report = _report_possible(specs, console, quiet)
    with _Progress(len(specs) if report else 0, "compiling the resource report", quiet or not report) as bar:
        files = render_files(specs, with_report=report, on_done=bar.advance)
    try:
        if args.check:
            problems = check_dir(out, files)
        else:
            touched = write(out, files)
    except OSError as e:
        _error(f"{out}: {e.strerror or e} ({e.filename})")
        return 2
    if args.check:
        if args.json:
            print(json.dumps({"directory": str(out), "in_sync": not problems, "problems": problems}))
        elif problems:
            console.print(f"{out} differs from a fresh render ({len(problems)} files); run the same command without "
                          "--check to update it:")
            for p in problems[:20]:
                console.print("  " + p)
            if len(problems) > 20:
                console.print(f"  ... {len(problems) - 20} more")
        elif not args.quiet:
            console.print(f"{out}: {len(specs)} sources and their manifest/report in sync")
        return 1 if problems else 0
    if args.json:
        print(json.dumps({"directory": str(out), "written": touched}))
    elif not args.quiet:
        console.print(f"{out}: {len(specs)} sources, {len(touched)} files written or removed")
    return 0


def _compilers_missing(arches) -> bool:
    """Print which offline compilers of ``arches`` are missing, with the install hint; True if any."""
    from epgen.codegen.offline import toolchain_status

    missing = [f"{arch}: {reason}" for arch in arches if (reason := toolchain_status(arch))]
    if missing:
        _error("offline compilers missing (pip install -e '.[dev]'):\n  " + "\n  ".join(missing))
    return bool(missing)


def cmd_report(args, parser, console) -> int:
    """``epgen check`` and ``epgen report``: compile offline, print the resources; exit 1 on a
    compile error, scratch or spill, 2 when an offline compiler is missing."""
    from epgen.codegen import report
    from epgen.codegen.catalogue import report_rows
    from epgen.demo import resource_table

    specs = _specs_from(args, parser)
    specs = catalogue_specs(arches=tuple(args.arch or ARCHES)) if specs is None else specs
    outputs = [(flag, Path(v)) for flag, v in (("--markdown", getattr(args, "markdown", None)),
                                               ("--csv", getattr(args, "csv", None))) if v]
    for flag, path in outputs:  # before compiling: a bad path fails in a second, not after minutes
        parent = path.parent
        if path.is_dir():
            parser.error(f"{flag} {path}: is a directory; name a file")
        if not parent.is_dir():
            parser.error(f"{flag} {path}: parent directory {parent} "
                         f"{'is not a directory' if parent.exists() else 'does not exist'}")
    if _compilers_missing(sorted({s.arch for s in specs})):
        return 2
    with _Progress(len(specs), f"compiling {len(specs)} kernels", args.quiet or args.json) as bar:
        rows = report_rows(specs, max_workers=args.jobs, on_done=bar.advance)
    ok = all(r["status"] == "ok" for r in rows)
    for flag, path in outputs:
        try:
            path.write_text(report.to_markdown(rows, "epgen resource report") if flag == "--markdown"
                            else report.to_csv(rows))
        except OSError as e:
            _error(f"{flag} {path}: cannot write: {e.strerror or e}")
            return 2
    if args.json:
        print(json.dumps(rows))
    elif not args.quiet or not ok:
        console.print(resource_table(rows, f"epgen {args.verb}: {len(rows)} kernels"))
    return 0 if ok else 1


def _field_changes(items, parser, flag) -> dict:
    import attrs as _attrs

    from epgen.codegen.spec import KernelSpec

    names = {f.name for f in _attrs.fields(KernelSpec)} - {"op"}
    changes = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in names:
            parser.error(f"{flag} {item!r}: write FIELD=VALUE with FIELD one of {', '.join(sorted(names))}")
        if key in changes:
            parser.error(f"{flag} {item!r}: {key} is already set to {changes[key]!r}; give each field once")
        changes[key] = int(value) if value.lstrip("-").isdigit() else value
    return changes


def cmd_diff(args, parser, console) -> int:
    import difflib

    from epgen.codegen.render import render

    chunks = []
    if args.a or args.b:
        specs = _specs_from(args, parser)
        if specs is None:
            parser.error("--a/--b compare two specs of one shape: give --model or --hidden/--topk/--num-experts")
        a_changes, b_changes = _field_changes(args.a, parser, "--a"), _field_changes(args.b, parser, "--b")
        for base in specs:
            pair = []
            for flag, changes in (("--a", a_changes), ("--b", b_changes)):
                try:
                    pair.append(base.replace(**changes))
                except ValueError as e:
                    given = " ".join(f"{k}={v}" for k, v in changes.items())
                    parser.error(f"{flag} {given}: {e}")
            sa, sb = pair
            ta, tb = render(sa), render(sb)
            if ta.text != tb.text:
                chunks.append((f"{base.op.value} {base.arch}", ta.entry, tb.entry, ta.text, tb.text))
    else:
        given = [f for f, v in (("--model", args.model), ("--hidden", args.hidden), ("--topk", args.topk),
                                ("--num-experts", args.num_experts), ("--world-size", args.world_size),
                                ("--max-tokens", args.max_tokens), ("--dtype", args.dtype), ("--quant", args.quant),
                                ("--arch", args.arch)) if v is not None]
        if given:
            parser.error(f"{' '.join(given)}: only with --a/--b (without them diff compares the committed catalogue, "
                         "fixed at W=8 / Tmax=4096, with the templates)")
        out = _catalogue_dir(args, parser)
        if args.output and not out.is_dir():
            parser.error(f"-o {args.output}: not a directory (diff compares a committed catalogue folder with the "
                         "templates)")
        files = render_files(catalogue_specs(), with_report=_report_possible(catalogue_specs(), console, True))
        for rel, text in files.items():
            p = out / rel
            old = p.read_text(errors="replace") if p.is_file() else ""
            if old != text:
                chunks.append((rel, f"{out}/{rel} (committed)", f"{rel} (templates now)", old, text))
        for rel in owned_sources(out):
            if rel not in files:
                chunks.append((rel, f"{out}/{rel} (committed)", "(not rendered any more)",
                               (out / rel).read_text(errors="replace"), ""))
    if args.json:
        print(json.dumps([{"variant": v, "a": a_name, "b": b_name,
                           "diff": "".join(difflib.unified_diff(a_text.splitlines(True), b_text.splitlines(True),
                                                                a_name, b_name, n=args.context))}
                          for v, a_name, b_name, a_text, b_text in chunks]))
        return 1 if chunks else 0
    try:
        for variant, a_name, b_name, a_text, b_text in chunks:
            if args.quiet:
                continue
            print(f"=== {variant}")
            sys.stdout.writelines(difflib.unified_diff(a_text.splitlines(True), b_text.splitlines(True), a_name,
                                                       b_name, n=args.context))
    except BrokenPipeError:  # `epgen diff | head`: the status still says whether they differ
        _drop_closed_stdout()
    if not chunks and not args.quiet:
        console.print("no differences")
    return 1 if chunks else 0


def cmd_build(args, parser, console) -> int:
    """``epgen build``: compile every variant an op of the config compiles into the ahead-of-time
    cache; with --time-import, time warm imports against cold compiles on this GPU. Exit 1 on
    a compile error, 2 when a compiler, the GPU or the cache directory is unusable."""
    from epgen.aot import ManifestError, build, config_specs, read_manifest
    from epgen.cache import cache_dir
    from epgen.import_timing import time_imports

    if args.runs is not None and not args.time_import:
        parser.error(f"--runs {args.runs}: only with --time-import")
    if args.model is None and all(v is None for v in (args.hidden, args.topk, args.num_experts)):
        args.model = "deepseek-v3"
    cfg = _config_from(args, parser)
    if cfg is None:
        parser.error("--topk needs --hidden and --num-experts (build takes one shape: --model or --hidden)")
    arches = tuple(dict.fromkeys(args.arch or ARCHES))
    try:
        specs = config_specs(cfg, arches)
    except ValueError as e:
        parser.error(_with_flag(e, args))
    from epgen.cache import CACHE_ENV

    out = Path(args.output).expanduser() if args.output else cache_dir()
    label = (f"-o {args.output}" if args.output else f"{CACHE_ENV}={os.environ[CACHE_ENV]}"
             if os.environ.get(CACHE_ENV) else f"cache directory {out}")
    problem = _not_a_directory(out)
    if problem:
        parser.error(f"{label}: {problem}")
    try:
        read_manifest(out)  # before compiling
    except ManifestError as e:
        _error(str(e))
        return 2
    gpu_arch = None
    if args.time_import:
        import importlib.util

        import torch

        from epgen.device import device_arch

        has_cupy = importlib.util.find_spec("cupy") is not None
        if not torch.cuda.is_available() or not has_cupy:
            console.print(f"--time-import: needs a GPU and CuPy; here torch.cuda.is_available() is "
                          f"{torch.cuda.is_available()} and CuPy is {'' if has_cupy else 'not '}installed")
            return 2
        gpu_arch = device_arch(torch.cuda.current_device())
        if gpu_arch not in arches:
            parser.error(f"--time-import: this GPU is {gpu_arch}, not among --arch {' '.join(arches)}; "
                         f"add --arch {gpu_arch}")
    if _compilers_missing(arches):
        return 2
    quiet = args.quiet or args.json
    with _Progress(len(specs), f"compiling {len(specs)} code objects", quiet) as bar:
        try:
            rows = build(specs, out, max_workers=args.jobs, on_done=bar.advance)
        except OSError as e:
            _error(f"{label}: {e.strerror or e} ({e.filename})")
            return 2
    ok = all(r["status"] == "ok" for r in rows)
    timing = None
    if gpu_arch and ok:
        runs = args.runs or 5
        with _Progress(2 * runs, f"timing imports on {gpu_arch}: {runs} runs, warm and cold", quiet) as bar:
            timing = time_imports(specs, out, runs, on_done=bar.advance)
    if args.json:
        print(json.dumps({"directory": str(out), "jobs": args.jobs or os.cpu_count(), "code_objects": rows,
                          "import_times": timing}))
        return 0 if ok else 1
    if not args.quiet or not ok:
        console.print(_build_table(rows, out, args.jobs or os.cpu_count()))
    if timing and not args.quiet:
        console.print(_import_table(timing, rows))
    return 0 if ok else 1


def _not_a_directory(path: Path) -> str | None:
    """Why ``path`` cannot be (made) a directory: it, or its nearest existing ancestor, is not one."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        return "exists and is not a directory" if p == path else f"{p} exists and is not a directory"
    return None


def _build_table(rows: list[dict], out: Path, jobs: int):
    from rich.table import Table

    compilers = {r["arch"]: r["compiler"] for r in rows if r["status"] == "ok"}
    t = Table(title=f"epgen build: {len(rows)} code objects in {out} (cold compile seconds with {jobs} parallel "
                    "compiles)", caption="\n".join(f"{a}: {c}" for a, c in compilers.items()))
    for c in ("arch", "op", "entry", "key", "bytes", "compile s", "status"):
        t.add_column(c, overflow="fold")
    for r in rows:
        ok = r["status"] == "ok"
        t.add_row(r["arch"], r["op"], r["entry"], r["key"][:16] if ok else "", str(r["bytes"]) if ok else "",
                  f"{r['compile_s']:.2f}" if ok else "", r["status"] if ok else f"[red]{r['status']}[/red]")
    return t


def _import_table(timing: dict, rows: list[dict]):
    from rich.table import Table

    from epgen.import_timing import WARM_IMPORT_TARGET_S

    compile_s = {r["entry"]: r["compile_s"] for r in rows}
    t = Table(title=f"load_kernel on {timing['arch']}: median of {timing['runs']} fresh processes each, CuPy's "
                    "kernel cache empty (CUPY_CACHE_DIR fresh)",
              caption=f"once per process, not in the rows: {timing['warm_once_s'] * 1e3:.0f} ms for the compiler "
                      f"identity of the cache key (warm), {timing['cold_once_s'] * 1e3:.0f} ms runtime compiler "
                      "warm-up (cold)")
    for c in ("op", "entry", "build s (CPU)", "render ms", "cold compile ms", "warm import ms", "speed-up",
              "warm from", f"warm < {WARM_IMPORT_TARGET_S * 1e3:.0f} ms"):
        t.add_column(c, overflow="fold")
    for r in timing["rows"]:
        met = r["warm_s"] < WARM_IMPORT_TARGET_S and r["warm_from"] == ["cache"]
        t.add_row(r["op"], r["entry"], f"{compile_s[r['entry']]:.2f}", f"{r['render_s'] * 1e3:.1f}",
                  f"{r['cold_s'] * 1e3:.1f}", f"{r['warm_s'] * 1e3:.1f}", f"{r['cold_s'] / r['warm_s']:.0f}x",
                  ", ".join(r["warm_from"]), "yes" if met else "[red]no[/red]")
    return t


def cmd_demo(args, parser, console) -> int:
    from epgen.demo import run_demo

    from epgen.codegen.config import EpConfig

    from epgen.codegen.models import model

    try:
        model(args.model)
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")
    _check_wave_size(args.world_size, ARCHES, parser, arch_flag=False)  # the demo covers every arch
    try:
        EpConfig.for_model(args.model, world_size=args.world_size, max_tokens_per_rank=args.tokens)
    except ValueError as e:
        flag = {"max_tokens_per_rank": "--tokens"}.get(str(e).split("=")[0].split(".")[-1], "--world-size")
        parser.error(f"{e} ({flag} {getattr(args, flag[2:].replace('-', '_'))} with --model {args.model})")
    return run_demo(args.model, args.world_size, args.tokens, args.iters, console, quiet=args.quiet, as_json=args.json)


def _geometry(text: str):
    """'24x16u4' -> Geometry(blocks=24, warps_per_block=16, unroll=4)."""
    import re

    from epgen.codegen.config import Geometry

    m = re.fullmatch(r"(\d+)x(\d+)(?:u(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"geometry {text!r}: write BLOCKSxWARPS[uUNROLL], e.g. 24x16u4")
    b, w, u = m.groups()
    try:
        return Geometry(blocks=int(b), warps_per_block=int(w), unroll=int(u or 4))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"geometry {text!r}: {e}") from None


def _check_gpu_verb(args, parser, verb: str, *, max_tokens: int, virtual: bool = False, output: str | None = None,
                    geometries: dict | None = None) -> int:
    """Everything about a GPU verb's arguments that can be checked without a GPU, first (parser
    errors naming the flag), then the GPUs it needs, then the specs for this GPU's arch
    (``geometries``: flag -> Geometry, or a list of them, or None). Returns 0, or 2 after an
    error line."""
    import importlib.util

    import torch

    from epgen.codegen.models import model
    from epgen.codegen.config import EpConfig

    try:
        model(args.model)
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")
    try:
        cfg = EpConfig.for_model(args.model, world_size=args.world_size, max_tokens_per_rank=max_tokens,
                                 dtype=args.dtype, combine_quant=getattr(args, "quant", "none"))
    except ValueError as e:
        parser.error(f"{e} (--world-size {args.world_size}, tokens up to {max_tokens}, with --model {args.model})")
    if output is not None:
        if output.endswith(os.sep) or os.path.isdir(output):
            parser.error(f"-o {output}: a path prefix for the .csv/.png/.env.txt files, not a folder")
        folder = os.path.dirname(os.path.abspath(output))
        if not os.path.isdir(folder):
            parser.error(f"-o {output}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            parser.error(f"-o {output}: folder {folder} is not writable")
        if importlib.util.find_spec("matplotlib") is None:
            _error(f"epgen {verb}: the plot needs matplotlib: pip install -e '.[bench]'")
            return 2
    if not torch.cuda.is_available():
        _error(f"epgen {verb}: needs a GPU (torch.cuda.is_available() is False)")
        return 2
    gpus = torch.cuda.device_count()
    if not virtual and args.world_size > gpus:
        hint = "; --virtual runs all ranks on one GPU" if hasattr(args, "virtual") else ""
        _error(f"epgen {verb}: --world-size {args.world_size} needs {args.world_size} GPUs (one process per GPU), "
               f"this machine has {gpus}{hint}")
        return 2
    from epgen.codegen.spec import Op
    from epgen.device import device_arch

    arch = device_arch(torch.cuda.current_device())
    try:  # the tuning table's geometries: the world size and sizes against this arch's limits
        for op in Op:
            cfg.variants(arch, op)
    except ValueError as e:
        parser.error(f"{e} (--world-size {args.world_size} on this GPU's arch {arch})")
    for flag, given in (geometries or {}).items():
        for geometry in given if isinstance(given, (list, tuple)) else [given]:
            try:
                if geometry is not None:
                    for op in Op:
                        cfg.spec(arch, op, geometry)
            except ValueError as e:
                parser.error(f"{e} ({flag} {geometry} on this GPU's arch {arch})")
    return 0


def cmd_bench(args, parser, console) -> int:
    from epgen.bench import BenchOptions, default_output, run

    output = args.output or default_output(args.world_size, args.virtual)
    status = _check_gpu_verb(args, parser, "bench", max_tokens=max(args.tokens), virtual=args.virtual, output=output,
                             geometries={"--dispatch-geometry": args.dispatch_geometry,
                                         "--combine-geometry": args.combine_geometry})
    if status:
        return status
    opts = BenchOptions(model=args.model, world_size=args.world_size, tokens=tuple(args.tokens), dtype=args.dtype,
                        combine_quant=args.quant,
                        routings=tuple(args.routing), dispatch_geometry=args.dispatch_geometry,
                        combine_geometry=args.combine_geometry, iters=args.iters, virtual=args.virtual,
                        output=output)
    run(opts)
    return 0


def cmd_tune(args, parser, console) -> int:
    from epgen.tune import TuneOptions, run

    status = _check_gpu_verb(args, parser, "tune", max_tokens=max(args.tokens), geometries={"--geometry": args.geometry})
    if status:
        return status
    run(TuneOptions(model=args.model, world_size=args.world_size, tokens=tuple(args.tokens), dtype=args.dtype,
                    geometries=tuple(args.geometry) if args.geometry else None, routing=args.routing,
                    iters=args.iters, write=not args.dry_run))
    return 0


def cmd_stress(args, parser, console) -> int:
    from epgen.stress import StressOptions, run

    status = _check_gpu_verb(args, parser, "stress", max_tokens=args.max_tokens, virtual=args.virtual)
    if status:
        return status
    run(StressOptions(model=args.model, world_size=args.world_size, max_tokens=args.max_tokens, rounds=args.rounds,
                      seed=args.seed, virtual=args.virtual, dtype=args.dtype, combine_quant=args.quant))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epgen", description="Generate, check and run MoE expert-parallel "
                                "dispatch/combine kernels for gfx950, gfx1250 and sm_90.")
    from epgen import __version__

    p.add_argument("--version", action="version", version=f"epgen {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name, help_, fn):
        sp = sub.add_parser(name, help=help_, description=help_.replace("%%", "%"))
        sp.add_argument("--quiet", action="store_true", help="print only failures")
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON")
        sp.set_defaults(fn=fn, parser=sp)
        return sp

    g = verb("generate", "render the catalogue into generated/ (or one shape into -o DIR)", cmd_generate)
    _shape_args(g)
    g.add_argument("-o", "--output", type=_path, help="output directory (default generated/ for the catalogue)")
    g.add_argument("--check", action="store_true", help="exit 1 when the directory differs from a fresh render")
    g.add_argument("--list-models", action="store_true", help="list the catalogue models and exit")

    c = verb("check", "compile kernels offline (clang 22 for gfx*, NVRTC for sm_90) and print resources; "
             "exit 1 on a compile error, scratch or spill", cmd_report)
    _shape_args(c)
    _jobs_arg(c)

    r = verb("report", "registers, SGPRs, scratch/spill, LDS/shared memory and occupancy per variant and arch "
             "(offline compilers); exit 1 on scratch or spill", cmd_report)
    _shape_args(r)
    _jobs_arg(r)
    r.add_argument("--markdown", help="also write the table as Markdown to this file")
    r.add_argument("--csv", help="also write the table as CSV to this file")

    df = verb("diff", "unified diff of generated sources, grouped by variant: the committed generated/ against "
              "the current templates, or (--a/--b) two specs of one shape; exit 1 when they differ", cmd_diff)
    _shape_args(df)
    df.add_argument("--a", nargs="+", metavar="FIELD=VALUE", help="changes of the first spec, e.g. unroll=2")
    df.add_argument("--b", nargs="+", metavar="FIELD=VALUE", help="changes of the second spec, e.g. unroll=8")
    df.add_argument("-o", "--output", type=_path, help="committed catalogue directory (default generated/)")
    df.add_argument("-U", "--context", type=_non_negative, default=3, help="lines of context (default 3)")

    bd = verb("build", "compile every variant an EpDispatchCombine of this config compiles at construction (each "
              "token bucket of dispatch and combine) into the ahead-of-time cache: code objects (.hsaco by clang for "
              "gfx*, .cubin by NVRTC for sm_90) that load_kernel loads without compiling", cmd_build)
    _shape_args(bd, model_help="; default deepseek-v3")
    _layer_args(bd)
    bd.add_argument("-o", "--output", type=_path, help="cache directory (default $EPGEN_CACHE_DIR, else ~/.cache/epgen)")
    _jobs_arg(bd)
    bd.add_argument("--time-import", action="store_true", help="then time load_kernel per variant on this GPU: warm "
                    "import from the cache against a cold runtime compile, in fresh processes")
    bd.add_argument("--runs", type=_positive, default=None, help="processes per mode for --time-import (default 5)")

    d = verb("demo", "render and compile-check one model for every arch; with a GPU, run, verify and time "
             "dispatch/combine over virtual ranks", cmd_demo)
    d.add_argument("--model", default="deepseek-v3", help="catalogue model (default deepseek-v3)")
    d.add_argument("--world-size", type=_positive, default=8, help="virtual ranks on the GPU (default 8)")
    d.add_argument("--tokens", type=_positive, default=4096, help="tokens per rank (default 4096)")
    d.add_argument("--iters", type=_positive, default=20, help="timed iterations (default 20)")

    import attrs

    from epgen.bench import SWEEP
    from epgen.verify import ROUTINGS

    b = verb("bench", "time dispatch/combine against the P2P ceiling and NCCL all_to_all_single in one run; "
             "write CSV, PNG and a table", cmd_bench)
    b.add_argument("--model", default="deepseek-v3", help="catalogue model (default deepseek-v3)")
    b.add_argument("--world-size", type=_positive, default=2, help="ranks; one process per GPU unless --virtual "
                   "(default 2)")
    b.add_argument("--virtual", action="store_true", help="all ranks in one process on one GPU")
    b.add_argument("--tokens", type=_positive, nargs="+", default=list(SWEEP), help="tokens per rank to sweep "
                   f"(default {' '.join(map(str, SWEEP))})")
    b.add_argument("--routing", nargs="+", default=["uniform", "skewed"], choices=ROUTINGS,
                   help="routing kinds (default uniform skewed)")
    _geometry_args(b)
    b.add_argument("--iters", type=_positive, default=30, help="timed graph replays per point (default 30)")
    b.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dispatch payload dtype (default bf16)")
    b.add_argument("--quant", default="none", choices=list(COMBINE_QUANTS), help="combine wire format (default none)")
    b.add_argument("-o", "--output", type=_path, help="path prefix of the .csv/.png (default tools/results/bench-ep<W>-<gpu>)")

    from epgen.tune import TuneOptions

    tdef = attrs.fields(TuneOptions)
    t = verb("tune", "sweep launch geometry on the GPU and write codegen/tuning/<arch>.json (fewest blocks "
             "within 3%% of the best per token bucket)", cmd_tune)
    t.add_argument("--model", default="deepseek-v3", help="catalogue model (default deepseek-v3)")
    t.add_argument("--world-size", type=_positive, default=2, help="ranks, one process per GPU (default 2)")
    t.add_argument("--tokens", type=_positive, nargs="+", default=list(tdef.tokens.default),
                   help=f"token buckets (default {' '.join(map(str, tdef.tokens.default))})")
    t.add_argument("--geometry", type=_geometry, nargs="+", default=None,
                   help="candidates BLOCKSxWARPS[uUNROLL] (default 8..132 blocks of 1024 threads, unroll 4)")
    t.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dispatch payload dtype (default bf16)")
    t.add_argument("--routing", default="uniform", choices=ROUTINGS, help="routing kind (default uniform)")
    t.add_argument("--iters", type=_positive, default=20, help="graph replays per point (default 20)")
    t.add_argument("--dry-run", action="store_true", help="print the table, write nothing")

    st = verb("stress", "many verified rounds with random token counts (0..max) and routing kinds; prints "
              "rounds, failures and the worst combine error; exit status non-zero on a failure", cmd_stress)
    st.add_argument("--model", default="deepseek-v3", help="catalogue model (default deepseek-v3)")
    st.add_argument("--world-size", type=_positive, default=2, help="ranks; one process per GPU unless --virtual")
    st.add_argument("--virtual", action="store_true", help="all ranks in one process on one GPU")
    st.add_argument("--max-tokens", type=_positive, default=4096, help="max tokens per rank (default 4096)")
    st.add_argument("--rounds", type=_positive, default=200, help="rounds (default 200)")
    st.add_argument("--seed", type=int, default=0, help="seed of the rounds (default 0)")
    st.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dispatch payload dtype (default bf16)")
    st.add_argument("--quant", default="none", choices=list(COMBINE_QUANTS), help="combine wire format (default none)")
    return p


def _error(message: str) -> None:
    """An error line on stderr (never the verb's output), in red where stderr is a terminal."""
    Console(stderr=True, soft_wrap=True).print(f"[red]{escape(message)}[/red]")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    stream = sys.stderr if args.json else sys.stdout
    console = Console(stderr=args.json, width=None if stream.isatty() else 200)
    try:
        return args.fn(args, args.parser, console)
    except BrokenPipeError:  # output piped into head & co.
        _drop_closed_stdout()
        return 0


def _drop_closed_stdout() -> None:
    """After the reader of stdout went away: send the rest (and the exit-time flush) to devnull."""
    import os

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
