"""The committed catalogue (``catalogue_specs``: every template path on every arch and the headline
models' main variants), rendered into ``generated/``.

``write`` updates the directory (writing only files whose bytes changed and removing files the
catalogue no longer lists); it touches only a directory that is new, empty of the files it would
write, or holds the manifest it wrote itself (``read_manifest``). ``check`` lists what differs,
which CI turns into a failure.
"""

from __future__ import annotations

import json
from pathlib import Path

from epgen.codegen.arch import ARCHES
from epgen.codegen.atomic import write_atomically
from epgen.codegen import coverage, report
from epgen.codegen.models import model
from epgen.codegen.offline import (ToolchainMissing, compile_many, compile_offline, compiler_identity,
                                   toolchain_status)
from epgen.codegen.render import Source, render
from epgen.codegen.spec import KernelSpec, Op
from epgen.codegen.tuning import Geometry

CATALOGUE_WORLD_SIZE = 8
CATALOGUE_MAX_TOKENS = 4096
MANIFEST = "manifest.json"


def shape_specs(*, hidden: int, topk: int, num_experts: int, world_size: int = CATALOGUE_WORLD_SIZE,
                max_tokens_per_rank: int = CATALOGUE_MAX_TOKENS, dtype: str = "bf16", combine_quant: str = "none",
                scale_bytes: int = 0, arches=ARCHES, geometry: Geometry | None = None, layout: str = "rank",
                expert_alignment: int = 1, max_recv_tokens: int | None = None,
                dispatch_transport: str = "auto") -> list[KernelSpec]:
    """Dispatch and combine specs of one shape for each arch (and the expert layout's kernels with
    ``layout="expert"``, and the pull dispatch's two kernels with ``dispatch_transport="pull"``):
    ``geometry`` for both calls (dispatch and combine), or the tuning table's geometry at
    ``max_tokens_per_rank``; ``combine_quant`` is the combine wire, ``scale_bytes`` the per-token
    scale bytes dispatch forwards; ``layout``, ``expert_alignment``, ``max_recv_tokens`` and
    ``dispatch_transport`` as ``EpConfig``'s.

    Raises:
        ValueError: naming the bad field (e.g. num_experts not a multiple of world_size).
    """
    from epgen.codegen.config import EpConfig
    from epgen.codegen.planner import specs

    cfg = EpConfig(world_size=world_size, hidden=hidden, topk=topk, num_experts=num_experts,
                   max_tokens_per_rank=max_tokens_per_rank, dtype=dtype, combine_quant=combine_quant,
                   scale_bytes=scale_bytes, dispatch_geometry=geometry, combine_geometry=geometry, layout=layout,
                   expert_alignment=expert_alignment, max_recv_tokens=max_recv_tokens,
                   dispatch_transport=dispatch_transport)
    return specs(cfg, arches)


def model_specs(name: str, arches=ARCHES, topk: int | None = None, **kw) -> list[KernelSpec]:
    """Specs of catalogue model ``name``, at its own top-k or ``topk`` (ValueError with suggestions
    when the name is unknown)."""
    m = model(name)
    return shape_specs(hidden=m.hidden, topk=topk or m.topk, num_experts=m.num_experts, arches=arches, **kw)


HEADLINE_MODELS = ("deepseek-v3", "qwen3-235b-a22b", "gpt-oss-120b")
"""The models whose main variant the catalogue holds (``EpConfig``'s defaults: bf16 payload and
wire, the rank layout, both kernel families, the tuning table's transport): deepseek-v3, the shape
of every measurement and GPU test, and the hidden sizes (4096; 2880, not a power of two) and top-k
(8; 4) of the other large models users run."""
COVERAGE_MODEL = "deepseek-v3"
"""The model whose kernels cover the template paths the headline variants leave out."""
CATALOGUE_EXPERT_LAYOUT = (COVERAGE_MODEL, 16)
"""The model and expert alignment whose expert-layout kernels the catalogue holds (16: what
torch's grouped GEMM reads best, docs/moe.md, "Which alignment")."""


def catalogue_specs(arches=ARCHES) -> list[KernelSpec]:
    """The committed catalogue's kernels of ``arches`` (W = 8, Tmax = 4096, table geometry): the
    main variant of each of ``HEADLINE_MODELS``, then the fewest kernels of ``COVERAGE_MODEL``'s
    configurations (``coverage.space``, the expert layout at ``CATALOGUE_EXPERT_LAYOUT``'s
    alignment) that add every template path the headline variants lack (``coverage.cover``), so
    that on every arch each kernel kind takes each of its payload dtypes or combine wires, layouts
    and transports at least once. Ordered by arch (``ARCHES``) and kind (``Op``), the headline
    variants first; computed for every arch, then filtered, so a subset lists the same kernels as
    the whole. Any other shape or variant is ``epgen generate --model/--hidden ... -o DIR``."""
    headline = [s for name in HEADLINE_MODELS for s in model_specs(name)]
    name, alignment = CATALOGUE_EXPERT_LAYOUT
    space = coverage.space(name, world_size=CATALOGUE_WORLD_SIZE, max_tokens_per_rank=CATALOGUE_MAX_TOKENS,
                           expert_alignment=alignment)
    specs = list(dict.fromkeys(headline + coverage.cover(space, coverage.items(headline))))
    kinds = list(Op)
    specs.sort(key=lambda s: (ARCHES.index(s.arch), kinds.index(s.op)))
    return [s for s in specs if s.arch in arches]


REPORT_MD = "REPORT.md"
REPORT_CSV = "report.csv"


def render_files(specs: list[KernelSpec], with_report: bool = True, title: str = "epgen catalogue",
                 on_done=None, compile_fn=compile_offline) -> dict[str, str]:
    """{relative path: text} for the sources of ``specs``, their manifest and, with
    ``with_report``, the resource report (REPORT.md, report.csv) from the offline compilers, so a
    template change shows its register/LDS/occupancy change in review (REPORT.md opens with a
    summary per kernel kind); ``on_done`` and ``compile_fn`` as ``report_rows``'s.

    Raises:
        epgen.codegen.offline.ToolchainMissing: ``with_report`` and an offline compiler is absent.
    """
    sources = [render(s) for s in specs]
    files = {f"{s.spec.arch}/{s.filename}": s.text for s in sources}
    files[MANIFEST] = manifest(sources)
    if with_report:
        rows = report_rows(specs, on_done=on_done, compile_fn=compile_fn)
        files[REPORT_MD] = report.to_markdown(rows, f"{title}: resources per variant (clang 22 for gfx*, NVRTC for sm_90)")
        files[REPORT_CSV] = report.to_csv(rows)
    return files


def report_rows(specs: list[KernelSpec], max_workers: int | None = None, on_done=None,
                compile_fn=compile_offline) -> list[dict]:
    """Compile ``specs`` offline and return the report rows (``codegen.report.rows``, each with
    the exact release of the compiler that made it: ``compiler_identity``); ``on_done`` is called
    after each compile; ``compile_fn`` compiles one source as ``compile_offline`` does (the tests
    pass one that reuses the run's earlier compiles).

    Raises:
        epgen.codegen.offline.ToolchainMissing: an offline compiler of one of the arches is absent.
    """
    for arch in sorted({s.arch for s in specs}):
        reason = toolchain_status(arch)
        if reason:
            raise ToolchainMissing(f"{arch}: {reason}")
    sources = [render(s) for s in specs]
    results = compile_many([(src.text, s.arch, src.entry) for s, src in zip(specs, sources)], max_workers=max_workers,
                           on_done=on_done, compile_fn=compile_fn)
    return report.rows(specs, results, {arch: compiler_identity(arch) for arch in sorted({s.arch for s in specs})})


MANIFEST_SCHEMA = 1
_MANIFEST_ROW = {"file", "entry", "key", "spec"}


def manifest(sources: list[Source]) -> str:
    """JSON listing, per source: file, entry, key (sha256 of text + runtime options) and spec."""
    rows = [{"file": f"{s.spec.arch}/{s.filename}", "entry": s.entry, "key": s.key, "spec": s.spec.as_dict()}
            for s in sources]
    return json.dumps({"schema": MANIFEST_SCHEMA, "sources": rows}, indent=1, sort_keys=True) + "\n"


class NotACatalogue(ValueError):
    """``write`` refuses a directory it did not write: its ``manifest.json`` is not the one
    ``manifest`` makes, or (with no manifest) a file it would write is already there. The message
    names the file; nothing was written."""


def read_manifest(directory: Path) -> list[str] | None:
    """The files listed by ``<directory>/manifest.json`` when ``write`` wrote it (the object
    ``manifest`` makes: ``schema`` and ``sources``, each row ``file``/``entry``/``key``/``spec``);
    None when there is no manifest.

    Raises:
        NotACatalogue: the manifest exists but is another tool's (e.g. a build cache's) or unreadable.
    """
    rows = _manifest_rows(directory)
    return None if rows is None else [r["file"] for r in rows]


def manifest_specs(directory: Path) -> list[KernelSpec] | None:
    """The specs ``<directory>/manifest.json`` lists (what ``epgen generate`` rendered into it, in
    its order), or None without a manifest: ``epgen diff -o DIR`` renders these again.

    Raises:
        NotACatalogue: the manifest is another tool's or unreadable, or a row's spec no longer
            builds (naming its file and the rule).
    """
    rows = _manifest_rows(directory)
    if rows is None:
        return None
    specs = []
    for r in rows:
        try:
            specs.append(KernelSpec(**r["spec"]))
        except (TypeError, ValueError) as e:
            raise NotACatalogue(f"{Path(directory) / MANIFEST}: the spec of {r['file']} does not build now ({e}); "
                                "generate the directory again") from None
    return specs


def _manifest_rows(directory: Path) -> list[dict] | None:
    path = Path(directory) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NotACatalogue(f"{path}: not a manifest epgen generate wrote ({e}); choose another directory") from None
    rows = doc.get("sources") if isinstance(doc, dict) and doc.get("schema") == MANIFEST_SCHEMA else None
    if set(doc if isinstance(doc, dict) else ()) != {"schema", "sources"} or not isinstance(rows, list) or not all(
            isinstance(r, dict) and set(r) == _MANIFEST_ROW and isinstance(r["file"], str) for r in rows):
        raise NotACatalogue(f'{path}: not a manifest epgen generate wrote (needs {{"schema": {MANIFEST_SCHEMA}, '
                            '"sources": [{file, entry, key, spec}]}); choose another directory')
    return rows


def _listed(directory: Path) -> list[str]:
    """The generated sources ``directory``'s own manifest lists, inside an arch folder (none when
    it has no manifest or another tool's): the only files ``write`` removes and ``check`` reports
    as extra. Nothing else there is ever removed or reported."""
    try:
        listed = read_manifest(directory) or []
    except NotACatalogue:
        return []
    return [rel for rel in dict.fromkeys(listed) if _in_arch_folder(rel)]


def _in_arch_folder(rel: str) -> bool:
    arch, _, name = rel.partition("/")
    return arch in ARCHES and bool(name) and "/" not in name


def _differs(path: Path, text: str) -> bool:
    return path.is_symlink() or not path.is_file() or path.read_bytes() != text.encode()


def write(directory: Path, files: dict[str, str]) -> list[str]:
    """Write ``files`` under ``directory`` where bytes differ and remove the generated sources
    that ``files`` no longer lists: only those the old manifest listed, only in a directory
    holding a manifest ``write`` wrote. In a directory without one, nothing is removed and no
    existing file is overwritten. Each file is written atomically (``write_atomically``: a
    symlink in its place is replaced, never followed). The manifest is written first, so an
    interrupted write leaves a directory ``write`` takes again. Returns the paths written or
    removed.

    Raises:
        NotACatalogue: the directory is another tool's (nothing written).
        OSError: the directory or a file cannot be written.
    """
    directory = Path(directory)
    listed = read_manifest(directory)
    if listed is None:
        taken = [rel for rel in files if (directory / rel).exists() or (directory / rel).is_symlink()]
        if taken:
            raise NotACatalogue(f"{directory / taken[0]}: exists, and {directory} has no manifest.json of epgen "
                                "generate, so it is not a catalogue directory: choose another directory or remove it")
    touched = []
    for rel in sorted(files, key=lambda rel: rel != MANIFEST):
        p = directory / rel
        if _differs(p, files[rel]):
            write_atomically(p, files[rel].encode())
            touched.append(rel)
    for rel in [rel for rel in dict.fromkeys(listed or ()) if _in_arch_folder(rel)]:
        if rel not in files and (directory / rel).is_file():
            (directory / rel).unlink()
            touched.append(rel)
    return touched


def check(directory: Path, files: dict[str, str]) -> list[str]:
    """Lines describing how ``directory`` differs from ``files`` (empty when in sync)."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"missing directory: {directory}"]
    problems = [f"{'missing' if not (directory / rel).exists() else 'stale'}: {rel}"
                for rel, text in files.items() if _differs(directory / rel, text)]
    problems += [f"extra: {rel}" for rel in _listed(directory) if rel not in files and (directory / rel).is_file()]
    return problems
