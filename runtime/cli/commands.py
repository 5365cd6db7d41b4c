"""The ``epgen`` command line: generate, check, report, diff, build, plan, demo, bench, tune, stress, selftest.

Each verb parses, builds its config through ``epgen.cli.flags``, calls one library function and
prints. Errors go to stderr, prefixed ``epgen VERB:``. ``epgen --help`` and the CPU verbs
(generate, check, report, diff, build without --time-import, plan) load neither torch nor CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from epgen.cli import flags
from epgen.codegen.catalogue import CATALOGUE_MAX_TOKENS, CATALOGUE_WORLD_SIZE
from epgen.cli.options import (DEFAULT_MODEL, NODES_SWEEP, NODES_SWEEP_CPU, BenchOptions, StressOptions, TuneOptions,
                               family_points, tune_counts)
from epgen.cli.progress import Progress

MOE_DEMO_TOKENS = 1024
"""``epgen demo --moe``'s tokens per rank: W = 8 virtual ranks of deepseek-v3 then need about
40 GiB (``epgen.cli.moe_demo.memory_bytes``: weights 21 GiB, expert-major rows 14 GiB, receive rows
2 GiB, one rank's GEMM temporaries at a time, eager and in the timing's graphs, 3 GiB), plus the
dense reference's chunk; 4096 would need about 95 GiB."""
MOE_DEMO_INTERMEDIATE = 2048
"""``epgen demo --moe``'s expert intermediate size (deepseek-v3's moe_intermediate_size)."""


def _error(verb: str, message: str) -> None:
    """``epgen VERB: message`` on stderr (never the verb's output), in red where stderr is a terminal."""
    Console(stderr=True, soft_wrap=True).print(f"[red]{escape(f'epgen {verb}: {message}')}[/red]")


def _compilers_missing(arches, verb: str) -> bool:
    """Print which offline compilers of ``arches`` are missing, with the install hint; True if any."""
    from epgen.codegen.offline import toolchain_status

    missing = [f"{arch}: {reason}" for arch in arches if (reason := toolchain_status(arch))]
    if missing:
        _error(verb, "offline compilers missing (pip install -e '.[dev]'):\n  " + "\n  ".join(missing))
    return bool(missing)


def cmd_generate(args, parser, console) -> int:
    from epgen.codegen.catalogue import NotACatalogue, catalogue_specs, check, read_manifest, render_files, write
    from epgen.codegen.models import MODELS
    from epgen.codegen.offline import toolchain_status

    if args.list_models:
        if args.json:
            print(json.dumps([{"name": m.name, "hidden": m.hidden, "num_experts": m.num_experts, "topk": m.topk}
                              for m in MODELS.values()]))
        else:
            print("\n".join(f"{m.name:18} hidden {m.hidden:5}  experts {m.num_experts:4}  top-{m.topk}"
                             for m in MODELS.values()))
        return 0
    if args.output:
        flags.check_path_name("-o", args.output, parser)
    specs = flags.specs_from(args, parser)
    if specs is None:  # the committed catalogue: every template path on every arch (epgen.codegen.coverage)
        if args.arch:
            parser.error("--arch selects arches of one shape (--model/--hidden); the catalogue covers every arch")
        specs, out = catalogue_specs(), flags.catalogue_dir(args, parser)
    elif not args.output:
        parser.error("-o/--output is required with --model, --hidden, --hf-config or a selector "
                     "(the catalogue lives in generated/)")
    else:
        out = Path(args.output)
    problem = flags.not_a_directory(out)
    if problem:
        parser.error(f"-o {out}: {problem}")
    if args.check and not out.is_dir():  # before rendering: a minute of compiling would find nothing to check
        parser.error(f"-o {out}: does not exist; --check compares a directory epgen generate wrote (run without "
                     "--check to write it)")
    try:
        read_manifest(out)  # another tool's manifest stops the write or check: say so before rendering
    except NotACatalogue as e:
        _error("generate", f"-o {out}: {e}")
        return 2
    quiet = args.quiet or args.json
    missing = {a: r for a in sorted({s.arch for s in specs}) if (r := toolchain_status(a))}
    if missing and not quiet:
        console.print(escape("resource report skipped: " + "; ".join(f"{a}: {r}" for a, r in missing.items())))
    with Progress(0 if missing else len(specs), "compiling the resource report", quiet or bool(missing)) as bar:
        files = render_files(specs, with_report=not missing, on_done=bar.advance)
    try:
        problems = check(out, files) if args.check else None
        touched = None if args.check else write(out, files)
    except NotACatalogue as e:
        _error("generate", f"-o {out}: {e}")
        return 2
    except OSError as e:
        _error("generate", f"{out}: {e.strerror or e} ({e.filename})")
        return 2
    if args.json:
        print(json.dumps({"directory": str(out), "in_sync": not problems, "problems": problems} if args.check
                         else {"directory": str(out), "written": touched}))
    elif args.check and problems:
        console.print(f"{out} differs from a fresh render ({len(problems)} files); run the same command without "
                      "--check to update it:")
        for p in problems[:20]:
            console.print("  " + p)
        if len(problems) > 20:
            console.print(f"  ... {len(problems) - 20} more")
    elif not args.quiet:
        console.print(f"{out}: {len(specs)} sources and their manifest/report in sync" if args.check
                      else f"{out}: {len(specs)} sources, {len(touched)} files written or removed")
        spilling = _spilling(files)
        if spilling:
            console.print(f"kernels using scratch or spilling registers (REPORT.md; `epgen check` exits 1 on them): "
                          f"{len(spilling)}: {', '.join(spilling[:5])}{' ...' if len(spilling) > 5 else ''}")
    return 1 if args.check and problems else 0


def _spilling(files: dict[str, str]) -> list[str]:
    """Entries whose report row's status is not ok (scratch or spill), from a rendered
    catalogue's report.csv (none without a report)."""
    import csv
    import io

    from epgen.codegen.catalogue import REPORT_CSV

    text = files.get(REPORT_CSV)
    return [r["entry"] for r in csv.DictReader(io.StringIO(text)) if r["status"] != "ok"] if text else []


def cmd_report(args, parser, console) -> int:
    """``epgen check`` and ``epgen report``: compile offline, print the resources; exit 1 on a
    compile error, scratch or spill, 2 when an offline compiler is missing."""
    from epgen.codegen import report
    from epgen.codegen.catalogue import catalogue_specs, report_rows

    specs = flags.specs_from(args, parser)
    specs = catalogue_specs(arches=flags.arches(args)) if specs is None else specs
    outputs = [(flag, Path(v)) for flag, v in (("--markdown", getattr(args, "markdown", None)),
                                               ("--csv", getattr(args, "csv", None))) if v]
    flags.check_output_files(outputs, parser)
    if _compilers_missing(sorted({s.arch for s in specs}), args.verb):
        return 2
    with Progress(len(specs), f"compiling {len(specs)} kernels", args.quiet or args.json) as bar:
        rows = report_rows(specs, max_workers=args.jobs, on_done=bar.advance)
    ok = all(r["status"] == "ok" for r in rows)
    for flag, file in outputs:
        try:
            file.write_text(report.to_markdown(rows, "epgen resource report") if flag == "--markdown"
                            else report.to_csv(rows))
        except OSError as e:
            _error(args.verb, f"{flag} {file}: cannot write: {e.strerror or e}")
            return 2
    if args.json:
        print(json.dumps(rows))
    elif not args.quiet or not ok:
        console.print(report.resource_table(rows, f"epgen {args.verb}: {len(rows)} kernels"))
    return 0 if ok else 1


def cmd_diff(args, parser, console) -> int:
    from epgen.codegen import diff
    from epgen.codegen.catalogue import NotACatalogue, catalogue_specs, manifest_specs, render_files
    from epgen.codegen.offline import toolchain_status

    if args.a or args.b:
        specs = flags.specs_from(args, parser)
        if specs is None:
            parser.error("--a/--b compare two specs of one shape: give --model or --hidden/--topk/--num-experts")
        changes = {}
        for side in ("a", "b"):
            try:
                changes[side] = diff.field_changes(getattr(args, side))
            except diff.FieldChangeError as e:
                parser.error(f"--{side} {e.item!r}: {e}")
        specs, one_sided = _split_by_wire(specs, changes)
        try:
            chunks = diff.spec_pair_chunks(specs, changes["a"], changes["b"]) + one_sided
        except diff.ChangedSpecError as e:
            wire = changes[e.side].get("combine_quant")
            hint = (f"; add --quant {wire}: both sides then start from that wire's geometry" if wire
                    and "warps_per_block" in str(e) and not args.quant else "")
            parser.error(f"--{e.side} {' '.join(f'{k}={v}' for k, v in changes[e.side].items())}: {e}{hint}")
    else:
        given = [f for f, v in (("--model", args.model), ("--hf-config", args.hf_config), ("--hidden", args.hidden),
                                ("--topk", args.topk),
                                ("--num-experts", args.num_experts), ("--world-size", args.world_size),
                                ("--max-tokens", args.max_tokens), ("--dtype", args.dtype), ("--quant", args.quant),
                                ("--scale-bytes", args.scale_bytes), ("--layout", args.layout),
                                ("--expert-alignment", args.expert_alignment),
                                ("--max-recv-tokens", args.max_recv_tokens),
                                ("--kernel-family", args.kernel_family),
                                ("--low-latency-geometry", args.low_latency_geometry), ("--arch", args.arch))
                 if v is not None]
        if given:
            parser.error(f"{' '.join(given)}: only with --a/--b (without them diff compares the committed catalogue, "
                         f"fixed at W={CATALOGUE_WORLD_SIZE} / Tmax={CATALOGUE_MAX_TOKENS}, with the templates)")
        if args.output:
            flags.check_path_name("-o", args.output, parser)
        out = flags.catalogue_dir(args, parser)
        if not out.is_dir():
            parser.error(f"-o {out}: not a directory (diff compares a committed catalogue folder with the templates)")
        try:  # before rendering (a minute for the catalogue): a folder epgen generate did not write has nothing to diff
            listed = manifest_specs(out)
            if listed is None:
                parser.error(f"-o {out}: has no manifest.json, so epgen generate did not write it (diff compares a "
                             "committed catalogue folder with the templates)")
        except NotACatalogue as e:  # another tool's manifest.json, or a spec that no longer builds
            _error("diff", str(e))
            return 2
        # the checkout's generated/ against the catalogue (kernels it gained show as new); any other
        # folder (epgen generate --model ... -o DIR) against the specs its manifest lists
        catalogue = not args.output or (flags.in_checkout() and out.resolve() == Path("generated").resolve())
        specs = catalogue_specs() if catalogue else listed
        chunks = diff.catalogue_chunks(out, render_files(specs, with_report=not any(
            toolchain_status(a) for a in {s.arch for s in specs})))
    if args.json:
        print(json.dumps([{"variant": c.variant, "a": c.a_name, "b": c.b_name, "diff": c.unified(args.context)}
                          for c in chunks]))
        return 1 if chunks else 0
    try:
        for c in chunks if not args.quiet else ():
            print(f"=== {c.variant}")
            sys.stdout.write(c.unified(args.context))
    except BrokenPipeError:  # `epgen diff | head`: the status still says whether they differ
        _drop_closed_stdout()
    if not chunks and not args.quiet:
        console.print("no differences")
    return 1 if chunks else 0


def _split_by_wire(specs, changes: dict) -> tuple[list, list]:
    """``specs`` that both sides' ``changes`` build, and a chunk for each of the others: a kernel
    that exists with one side's combine wire only (the quantize kernel, without a quantized
    wire: its spec refuses the other side's ``combine_quant``), shown whole on the side that
    builds it."""
    from epgen.codegen import diff
    from epgen.codegen.errors import FieldError
    from epgen.codegen.render import render

    both, one_sided = [], []
    for base in specs:
        refused = []
        for side in ("a", "b"):
            try:
                base.replace(**changes[side])
            except FieldError as e:
                if e.field == "combine_quant":
                    refused.append(side)
        if len(refused) != 1:
            both.append(base)  # built by both, or refused by both (spec_pair_chunks then names the rule)
            continue
        built = "b" if refused == ["a"] else "a"
        src = render(base.replace(**changes[built]))
        gone = f"(no {base.op.value} kernel with combine_quant={changes[refused[0]]['combine_quant']})"
        texts = {refused[0]: (gone, ""), built: (src.entry, src.text)}
        one_sided.append(diff.Chunk(f"{base.op.value} {base.arch}", texts["a"][0], texts["b"][0], texts["a"][1],
                                    texts["b"][1]))
    return both, one_sided


def cmd_build(args, parser, console) -> int:
    """``epgen build``: compile every variant an op of the config compiles into the ahead-of-time
    cache; with --time-import, time warm imports against cold compiles on this GPU. Exit 1 on
    a compile error, 2 when a compiler, the GPU or the cache directory is unusable."""
    from epgen.aot import ManifestError, build, config_specs, read_manifest
    from epgen.cache import CACHE_ENV, cache_dir, directory_problem

    if args.runs is not None and not args.time_import:
        parser.error(f"--runs {args.runs}: only with --time-import")
    _default_model(args)
    cfg = flags.config_from(args, parser)
    if cfg is None:
        parser.error("--topk needs --hidden and --num-experts (build takes one shape: --model, --hf-config or "
                     "--hidden)")
    arches = flags.arches(args)
    try:
        specs = config_specs(cfg, arches)
    except ValueError as e:
        parser.error(flags.flag_error(e, args))
    if args.output:
        flags.check_path_name("-o", args.output, parser)
    elif problem := directory_problem():  # $EPGEN_CACHE_DIR's, named so
        parser.error(problem)
    out = Path(args.output).expanduser() if args.output else cache_dir()
    label = (f"-o {args.output}" if args.output else f"{CACHE_ENV}={os.environ[CACHE_ENV]}"
             if os.environ.get(CACHE_ENV) else f"cache directory {out}")
    problem = flags.not_a_directory(out)
    if problem:
        parser.error(f"{label}: {problem}")
    try:
        read_manifest(out)  # before compiling
    except ManifestError as e:
        _error("build", str(e))
        return 2
    gpu_arch = None
    if args.time_import:
        gpu_arch = flags.import_timing_arch(args, parser, _error, arches)
        if not gpu_arch:
            return 2
    if _compilers_missing(arches, "build"):
        return 2
    quiet = args.quiet or args.json
    with Progress(len(specs), f"compiling {len(specs)} code objects", quiet) as bar:
        try:
            rows = build(specs, out, max_workers=args.jobs, on_done=bar.advance)
        except OSError as e:
            _error("build", f"{label}: {e.strerror or e} ({e.filename})")
            return 2
    ok = all(r["status"] == "ok" for r in rows)
    timing = None
    if gpu_arch and ok:
        from epgen.cli.import_timing import import_table, time_imports

        runs = args.runs or 5
        with Progress(2 * runs, f"timing imports on {gpu_arch}: {runs} runs, warm and cold", quiet) as bar:
            timing = time_imports(specs, out, runs, on_done=bar.advance)
    if args.json:
        print(json.dumps({"directory": str(out), "jobs": args.jobs or os.cpu_count(), "code_objects": rows,
                          "import_times": timing}))
        return 0 if ok else 1
    if not args.quiet or not ok:
        console.print(build_table(rows, out, args.jobs or os.cpu_count()))
    if timing and not args.quiet:
        console.print(import_table(timing, rows))
    return 0 if ok else 1


def _default_model(args) -> None:
    """A verb of one shape (build, plan, the GPU verbs) takes DEFAULT_MODEL when no flag names a shape."""
    if args.model is None and args.hf_config is None and all(
            getattr(args, f, None) is None for f in ("hidden", "topk", "num_experts")):
        args.model = DEFAULT_MODEL


def cmd_plan(args, parser, console) -> int:
    """``epgen plan``: print the kernels each call of an op of the config launches (CPU only)."""
    from epgen.plan import Plan, describe

    _default_model(args)
    cfg = flags.config_from(args, parser)
    if cfg is None:
        parser.error("--topk needs --hidden and --num-experts (plan takes one shape: --model, --hf-config or "
                     "--hidden)")
    try:
        plans = [Plan.build(cfg, arch, cfg.world_size if args.virtual else 1) for arch in flags.arches(args)]
    except ValueError as e:
        parser.error(flags.flag_error(e, args))
    if args.json:
        print(json.dumps([{"arch": p.arch, "launches": p.table()} for p in plans]))
    elif not args.quiet:
        print("\n\n".join(describe(p, args.model or args.hf_config) for p in plans))
    return 0


def build_table(rows: list[dict], directory: Path, jobs: int):
    """A rich table of ``build``'s rows in the resource report's style (``styled_table``), reading at
    80 columns: per code object its arch, entry name (folding onto a second line where narrow),
    the first 8 hex digits of its key, bytes, cold compile seconds (with ``jobs`` parallel
    compiles) and status; the units and the compilers in the caption."""
    from epgen.codegen.report import styled_table

    compilers = {r["arch"]: r["compiler"] for r in rows if r["status"] == "ok"}
    caption = [f"compile s: cold compile wall seconds, {jobs} compiles in parallel; key: the file's name under "
               "<arch>/ (first 8 hex digits)", *(f"{a}: {c}" for a, c in compilers.items())]
    t = styled_table(f"epgen build: {len(rows)} code objects in {directory}", "\n".join(caption))
    errors = any(r["status"] != "ok" for r in rows)
    for c in ("arch", "entry", "key", "bytes", "compile s", "status"):
        wraps = c == "entry" or c == "status" and errors  # the rest stay one word a cell
        t.add_column(c, overflow="fold", no_wrap=not wraps, justify="right" if c in ("bytes", "compile s") else "left")
    for r in rows:
        ok = r["status"] == "ok"
        t.add_row(r["arch"], r["entry"], r["key"][:8] if ok else "", str(r["bytes"]) if ok else "",
                  f"{r['compile_s']:.2f}" if ok else "", "ok" if ok else f"[red]{escape(r['status'])}[/red]")
    return t


def cmd_demo(args, parser, console) -> int:
    from epgen.codegen import planner
    from epgen.codegen.arch import ARCHES
    from epgen.codegen.config import EpConfig

    if args.hf_config:
        if args.moe:
            parser.error(f"--hf-config {args.hf_config}: not with --moe (the MoE layer demo takes a catalogue --model)")
        args.hidden = args.topk = args.num_experts = None
        flags.shape_from_hf_config(args, parser)
    else:
        args.model = args.model or DEFAULT_MODEL
        flags.check_model(args.model, parser)
    flags.check_wave_size(args.world_size, ARCHES, parser, arch_flag=False)  # the demo covers every arch
    if args.moe:
        return _moe_demo(args, parser, console)
    given = [f for f, v in (("--experts", args.experts), ("--intermediate", args.intermediate)) if v is not None]
    if given:
        parser.error(f"{' '.join(given)}: only with --moe")
    args.tokens = args.tokens or CATALOGUE_MAX_TOKENS
    kw = dict(world_size=args.world_size, max_tokens_per_rank=args.tokens,
              kernel_family=args.kernel_family or flags.CONFIG_DEFAULTS["kernel_family"],
              low_latency_geometry=args.low_latency_geometry)
    try:
        cfg = (EpConfig(hidden=args.hidden, topk=args.topk, num_experts=args.num_experts, **kw) if args.hf_config
               else EpConfig.for_model(args.model, **kw))
        for arch in ARCHES:  # the demo compiles every arch's kernels
            planner.plan(cfg, arch)
    except ValueError as e:
        field = getattr(e, "field", None)
        flag = ("--tokens" if field == "max_tokens_per_rank" else "--low-latency-geometry"
                if args.low_latency_geometry and field in ("blocks", "warps_per_block", "unroll") else "--world-size")
        parser.error(f"{e} ({flag} {getattr(args, flag[2:].replace('-', '_'))} with {flags.shape_source(args)})")
    from epgen.cli.demo import run_demo

    return run_demo(cfg, args.model or args.hf_config, args.iters, console, quiet=args.quiet, as_json=args.json)


def _moe_demo(args, parser, console) -> int:
    """``epgen demo --moe``: the MoE layer (``epgen.cli.moe_demo``); --tokens defaults to MOE_DEMO_TOKENS."""
    from epgen.cli.moe_demo import run_moe_demo
    from epgen.harness.moe_verify import moe_config

    given = [f for f, v in (("--kernel-family", args.kernel_family),
                            ("--low-latency-geometry", args.low_latency_geometry)) if v is not None]
    if given:
        parser.error(f"{' '.join(given)}: only without --moe (the MoE layer's op takes EpConfig's default family)")

    tokens = args.tokens or MOE_DEMO_TOKENS
    try:
        cfg = moe_config(args.model, args.world_size, tokens, args.experts)
    except ValueError as e:
        field = getattr(e, "field", None)
        flag = ("--tokens" if field == "max_tokens_per_rank" else "--experts" if field in ("num_experts", "topk",
                "experts_per_rank") and args.experts is not None else "--world-size")
        value = {"--tokens": tokens, "--experts": args.experts, "--world-size": args.world_size}[flag]
        parser.error(f"{e} ({flag} {value} with {flags.shape_source(args)}, --moe)")
    return run_moe_demo(cfg, args.model, args.intermediate or MOE_DEMO_INTERMEDIATE, args.iters, console,
                        quiet=args.quiet, as_json=args.json)


def cmd_bench(args, parser, console) -> int:
    _default_model(args)
    if args.nodes is not None:
        return _bench_nodes(args, parser, console)
    if args.cpu:
        parser.error("--cpu: applies with --nodes only")
    if args.transport == "pull" and args.family == "low_latency":
        parser.error("--transport pull: the low-latency family pushes (pull is the normal family's dispatch; "
                     "--family normal, both or auto)")
    from epgen.cli.bench import default_output

    output = args.output or default_output(args.world_size, args.virtual, flags.in_checkout())
    opts = BenchOptions(tokens=tuple(args.tokens or BenchOptions().tokens), routings=tuple(args.routing),
                        iters=args.iters, virtual=args.virtual, output=output, family=args.family)
    families = {family: max(counts) for family, counts in family_points(opts.family, opts.tokens).items()}
    cfg = flags.config_from(args, parser)
    if flags.gpu_preflight(args, parser, _error, "bench", cfg, families=families, virtual=args.virtual, output=output,
                           geometries={"--dispatch-geometry": args.dispatch_geometry,
                                       "--combine-geometry": args.combine_geometry},
                           low_latency_geometries={"--low-latency-geometry": args.low_latency_geometry}) is None:
        return 2
    from epgen.cli.bench import run

    run(cfg, opts)
    return 0


def _bench_nodes(args, parser, console) -> int:
    import attrs

    from epgen.cli.bench_nodes import NodesBenchOptions, run
    from epgen.harness.hierarchical_verify import ROUTINGS as NODE_ROUTINGS

    if args.nodes < 2:
        parser.error(f"--nodes {args.nodes}: the hierarchical bench needs at least 2 nodes")
    if args.virtual:
        parser.error("--virtual: not with --nodes (each node's ranks are virtual ranks of its process already)")
    if args.dtype == "fp4":
        parser.error("--dtype fp4: not with --nodes (the hierarchical bench's inputs are bf16 or fp8 rows)")
    bad = [r for r in args.routing if r not in NODE_ROUTINGS]
    if bad:
        parser.error(f"--routing {' '.join(bad)}: with --nodes one of {', '.join(NODE_ROUTINGS)}")
    unused = [flag for flag, given in (("--dispatch-geometry", args.dispatch_geometry),
                                       ("--combine-geometry", args.combine_geometry),
                                       ("--low-latency-geometry", args.low_latency_geometry),
                                       ("--family", args.family != "both"),
                                       ("--transport", args.transport != "auto")) if given]
    if unused:
        parser.error(f"{' '.join(unused)}: not with --nodes (the hierarchical bench runs the node-local op of its "
                     "kernel_family as the hierarchy builds it, with the tuning table's geometry, and prints a table)")
    if args.output is not None:
        flags.check_output(args.output, parser)
    if args.tokens is None:
        import torch

        args.tokens = list(NODES_SWEEP_CPU if args.cpu or not torch.cuda.is_available() else NODES_SWEEP)
    options = NodesBenchOptions(tokens=tuple(args.tokens), routings=tuple(args.routing), iters=args.iters,
                                cpu=args.cpu, output=args.output)
    try:
        cfg = attrs.evolve(flags.config_from(args, parser), nodes=args.nodes, max_tokens_per_rank=max(args.tokens))
    except ValueError as e:
        parser.error(f"{e} (--nodes {args.nodes} --world-size {args.world_size}, tokens up to {max(args.tokens)})")
    run(cfg, options, print_fn=console.print)
    return 0


def cmd_tune(args, parser, console) -> int:
    _default_model(args)
    if args.family == "normal":
        given = [f for f, v in (("--low-latency-tokens", args.low_latency_tokens),
                                ("--low-latency-geometry", args.low_latency_geometries)) if v is not None]
        if given:
            parser.error(f"{' '.join(given)}: only with --family low_latency or both (--family normal tunes the "
                         "normal family alone)")
    if args.quant != "none" and args.family != "normal":
        parser.error(f"--quant {args.quant}: only with --family normal (the normal family's combine with a quantized "
                     "wire has entries of its own; the low-latency family's entries, bf16 ones, serve every wire)")
    opts = TuneOptions(tokens=tuple(args.tokens), geometries=tuple(args.geometry) if args.geometry else None,
                       routing=args.routing, iters=args.iters, write=not args.dry_run, family=args.family,
                       low_latency_tokens=tuple(args.low_latency_tokens or TuneOptions().low_latency_tokens),
                       low_latency_geometries=tuple(args.low_latency_geometries) if args.low_latency_geometries else None,
                       virtual=args.virtual, pull=not args.no_pull)
    families = {family: max(counts) for family, counts in tune_counts(opts).items()}
    cfg = flags.config_from(args, parser)
    if flags.gpu_preflight(args, parser, _error, "tune", cfg, families=families, virtual=args.virtual,
                           geometries={"--geometry": args.geometry},
                           low_latency_geometries={"--low-latency-geometry": args.low_latency_geometries}) is None:
        return 2
    from epgen.cli.tune import run

    run(cfg, opts)
    return 0


def cmd_stress(args, parser, console) -> int:
    _default_model(args)
    cfg = flags.config_from(args, parser)
    cfg = flags.gpu_preflight(args, parser, _error, "stress", cfg, families={cfg.kernel_family: cfg.max_tokens_per_rank},
                              virtual=args.virtual, share_gpu=True,
                              low_latency_geometries={"--low-latency-geometry": args.low_latency_geometry})
    if cfg is None:
        return 2
    from epgen.cli.stress import run

    run(cfg, StressOptions(rounds=args.rounds, seed=args.seed, virtual=args.virtual, fault_every=args.fault_every or 0))
    return 0


class _Refused(argparse.Action):
    """A flag a verb does not take: a parser error naming it and ``reason``, hidden from the help."""

    def __init__(self, option_strings, dest, reason: str, **kw):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=argparse.SUPPRESS, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


def build_parser() -> argparse.ArgumentParser:
    from epgen import __version__

    arches = ", ".join(flags.ARCHES[:-1]) + f" and {flags.ARCHES[-1]}"  # every row of ARCH_TRAITS
    p = argparse.ArgumentParser(prog="epgen", description="Generate, check and run MoE expert-parallel "
                                f"dispatch/combine kernels for {arches}.")
    p.add_argument("--version", action="version", version=f"epgen {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name, help_, fn, output: str = ""):
        """A verb's parser; ``output``: what a verb that takes neither --quiet nor --json prints
        instead (its parser then refuses both, naming it), empty for a verb that honours them."""
        sp = sub.add_parser(name, help=help_, description=help_.replace("%%", "%"))
        if output:
            sp.add_argument("--quiet", "--json", action=_Refused, reason=f"epgen {name} does not take it: {output}")
        else:
            sp.add_argument("--quiet", action="store_true", help="print only failures")
            sp.add_argument("--json", action="store_true", help="print machine-readable JSON")
        sp.set_defaults(fn=fn, parser=sp, quiet=False, json=False)
        return sp

    g = verb("generate", "render the catalogue into generated/ (or one shape into -o DIR)", cmd_generate)
    flags.add_shape_args(g)
    g.add_argument("-o", "--output", type=flags.path, help="output directory (default generated/ for the catalogue); "
                   "one epgen generate wrote, or one without any file it would write: it overwrites and removes "
                   "only its own files")
    g.add_argument("--check", action="store_true", help="exit 1 when the directory differs from a fresh render")
    g.add_argument("--list-models", action="store_true", help="list the catalogue models and exit")

    table = ("registers, AGPRs, SGPRs, scratch/spill, LDS/shared bytes and occupancy per variant and arch, with the "
             "exact offline compiler releases (clang 22 for gfx*, NVRTC for sm_90)")
    c = verb("check", f"compile kernels offline and print {table}; exit 1 on a compile error, scratch or spill",
             cmd_report)
    flags.add_shape_args(c)
    flags.add_geometry_args(c)
    flags.add_jobs_arg(c)
    r = verb("report", "check, and also write its table to files (--markdown, --csv; the CSV has the full entry "
             "names); exit 1 on a compile error, scratch or spill", cmd_report)
    flags.add_shape_args(r)
    flags.add_geometry_args(r)
    flags.add_jobs_arg(r)
    r.add_argument("--markdown", type=flags.path, help="also write the table as Markdown to this file")
    r.add_argument("--csv", type=flags.path, help="also write the table as CSV to this file")

    df = verb("diff", "unified diff of generated sources, grouped by variant: the committed generated/ against "
              "the current templates, or (--a/--b) two specs of one shape; exit 1 when they differ", cmd_diff)
    flags.add_shape_args(df)
    df.add_argument("--a", nargs="+", metavar="FIELD=VALUE", help="changes of the first spec, e.g. unroll=2")
    df.add_argument("--b", nargs="+", metavar="FIELD=VALUE", help="changes of the second spec, e.g. unroll=8")
    df.add_argument("-o", "--output", type=flags.path, help="a directory epgen generate wrote (default generated/, "
                    "compared with the whole catalogue); another one is compared for the specs its manifest lists "
                    "(one shape's folder: that shape)")
    df.add_argument("-U", "--context", type=flags.non_negative, default=3, help="lines of context (default 3)")

    bd = verb("build", "compile every variant an EpDispatchCombine of this config compiles at construction (each "
              "token bucket of dispatch and combine) into the ahead-of-time cache: code objects (.hsaco by clang for "
              "gfx*, .cubin by NVRTC for sm_90) that load_kernel loads without compiling", cmd_build)
    flags.add_shape_args(bd, model_help=f"; default {DEFAULT_MODEL}")
    flags.add_geometry_args(bd)
    bd.add_argument("-o", "--output", type=flags.path, help="cache directory (default $EPGEN_CACHE_DIR, else "
                    "~/.cache/epgen)")
    flags.add_jobs_arg(bd)
    bd.add_argument("--time-import", action="store_true", help="then time load_kernel per variant on this GPU: warm "
                    "import from the cache against a cold runtime compile, in fresh processes")
    bd.add_argument("--runs", type=flags.positive, default=None, help="processes per mode for --time-import "
                    "(default 5)")

    pl = verb("plan", "print which kernels dispatch and combine launch per token bucket (kernel family, transport, "
              "async_recv split, expert layout), with each kernel's geometry and spec; no GPU needed", cmd_plan)
    flags.add_plan_args(pl)

    d = verb("demo", "render and compile-check one model for every arch (printing the compiler releases); with a "
             "GPU, run, verify and time dispatch/combine over virtual ranks; with --moe, the whole MoE layer",
             cmd_demo)
    flags.add_demo_args(d)
    d.add_argument("--moe", action="store_true", help="instead: the whole MoE layer of --model (epgen.moe.MoELayer: "
                   "dispatch, expansion, SwiGLU expert GEMMs, fold, combine) on virtual ranks of one GPU with random "
                   "weights and routing, checked against the dense reference, GPU time per stage; --tokens defaults "
                   f"to {MOE_DEMO_TOKENS} with it")
    d.add_argument("--experts", type=flags.positive, help="with --moe: routed experts E (default the model's), a "
                   "multiple of --world-size and at least the model's top-k")
    d.add_argument("--intermediate", type=flags.positive, help="with --moe: expert intermediate size I (default "
                   f"{MOE_DEMO_INTERMEDIATE})")

    b = verb("bench", "time dispatch/combine of both kernel families (--family) against the P2P ceiling and NCCL "
             "all_to_all_single in one run; write CSV, PNG and a table", cmd_bench,
             output="it prints a line per point and a table; the CSV under -o holds every figure, for programs")
    flags.add_bench_args(b)

    t = verb("tune", "sweep launch geometry on the GPU and write codegen/tuning/<arch>.json (fewest blocks "
             "within 3%% of the best per token bucket; for the low-latency family its geometry and the threshold up "
             "to which it beats the normal family); --virtual writes the same entries as real ranks of that world "
             "size, from one GPU's local memory", cmd_tune,
             output="it prints the timings and writes codegen/tuning/<arch>.json (--dry-run: prints only)")
    flags.add_tune_args(t)

    st = verb("stress", "many verified rounds with random token counts (0..max), routing kinds and both kernel "
              "families (the low-latency one also split, with GPU work between its halves); one process per rank, "
              "sharing cuda:0 when there are fewer GPUs; prints rounds, failures and the worst combine error; exit "
              "status non-zero on a failure", cmd_stress,
              output="it prints a line per failure and a summary; its exit status says whether every round passed")
    flags.add_stress_args(st)

    se = verb("selftest", "the first command on new hardware: build, run and verify every kernel family, layout, "
              "transport, dtype and combine wire at small shapes on virtual ranks (W = 2, 4) and across W = 2 "
              "processes, time the main ones, print a table and write a report to attach to a bug report; exit "
              "status non-zero on a failure; without a GPU, list the cases and exit with status 2, nothing verified "
              "(--device cpu runs them on the CPU, untimed)", cmd_selftest,
              output="it prints a line per case and a table, and writes the report file (-o)")
    se.add_argument("-o", "--output", type=flags.path, help="report file: JSON, or Markdown for a .md name (default "
                    "selftest-<arch>.json in the working directory)")
    se.add_argument("--seed", type=flags.non_negative, default=0, help="seed of the rounds' inputs (default 0)")
    se.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    se.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                    help="gpu (default): this machine's GPUs; cpu: the same cases on the host emulation, the real "
                    "kernels on the CPU with no GPU (docs/host.md; needs the ziglang package), about a minute on 2 "
                    "cores: nothing timed (timed cases only verify); a case whose kernels would run more than 4096 "
                    "threads a rank (a GPU's geometry) is skipped, naming the kernel; the report is "
                    "selftest-host-<arch>.json")
    se.add_argument("--arch", help="with --device cpu: the arch whose kernels the host runs, one of "
                    f"{', '.join(flags.ARCHES)} (default sm_90)")
    return p


def cmd_selftest(args, parser, console) -> int:
    from epgen.cli import selftest

    if args.arch is not None:
        if args.device != "cpu":
            parser.error(f"--arch {args.arch}: only with --device cpu (the host emulation runs that arch's kernels); "
                         "on a GPU the selftest runs the GPU's own arch")
        if args.arch not in flags.ARCHES:
            parser.error(f"--arch {args.arch}: unknown arch; epgen has kernels for {', '.join(flags.ARCHES)}")
    if args.list:
        selftest.print_cases(console, args.device)
        return 0
    if args.output:  # refused now, not after the cases ran
        flags.check_output_files([("-o", Path(args.output))], parser)
    return selftest.run(args.output, args.seed, console, device=args.device, arch=args.arch)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    stream = sys.stderr if args.json else sys.stdout
    # a terminal's width, else $COLUMNS (rich reads it when width is None), else 200 for pipes and files
    console = Console(stderr=args.json, width=None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit()
                      else 200)
    try:
        return args.fn(args, args.parser, console)
    except BrokenPipeError:  # output piped into head & co.
        _drop_closed_stdout()
        return 0
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        _error(args.verb, "interrupted")
        return 130


def _drop_closed_stdout() -> None:
    """After the reader of stdout went away: send the rest (and the exit-time flush) to devnull."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
