"""The committed catalogue: every model x arch x op, rendered into ``generated/``.

``write`` updates the directory (writing only files whose bytes changed and removing files the
catalogue no longer lists); ``check`` lists what differs, which CI turns into a failure.
"""

from __future__ import annotations

import json
from pathlib import Path

from epgen.codegen.arch import ARCHES, traits
from epgen.codegen import report
from epgen.codegen.models import MODELS, model
from epgen.codegen.offline import ToolchainMissing, compile_many, toolchain_status
from epgen.codegen.render import Source, render
from epgen.codegen.dtypes import COMBINE_QUANTS
from epgen.codegen.spec import KernelSpec, Op
from epgen.codegen.tuning import Geometry

CATALOGUE_WORLD_SIZE = 8
CATALOGUE_MAX_TOKENS = 4096
MANIFEST = "manifest.json"


def shape_specs(*, hidden: int, topk: int, num_experts: int, world_size: int = CATALOGUE_WORLD_SIZE,
                max_tokens_per_rank: int = CATALOGUE_MAX_TOKENS, dtype: str = "bf16", combine_quant: str = "none",
                arches=ARCHES, geometry: Geometry | None = None) -> list[KernelSpec]:
    """Dispatch and combine specs of one shape for each arch: ``geometry`` for both ops, or the
    tuning table's geometry at ``max_tokens_per_rank``; ``combine_quant`` is the combine wire.

    Raises:
        ValueError: naming the bad field (e.g. num_experts not a multiple of world_size).
    """
    from epgen.codegen.config import EpConfig

    cfg = EpConfig(world_size=world_size, hidden=hidden, topk=topk, num_experts=num_experts,
                   max_tokens_per_rank=max_tokens_per_rank, dtype=dtype, combine_quant=combine_quant,
                   dispatch_geometry=geometry,
                   combine_geometry=geometry)
    return [s for arch in arches for s in cfg.kernel_specs(arch)]


def model_specs(name: str, arches=ARCHES, topk: int | None = None, **kw) -> list[KernelSpec]:
    """Specs of catalogue model ``name``, at its own top-k or ``topk`` (ValueError with suggestions
    when the name is unknown)."""
    m = model(name)
    return shape_specs(hidden=m.hidden, topk=topk or m.topk, num_experts=m.num_experts, arches=arches, **kw)


CATALOGUE_DTYPES = ("bf16", "fp8", "fp4")


def catalogue_specs(models=None, arches=ARCHES, dtypes=CATALOGUE_DTYPES) -> list[KernelSpec]:
    """The committed catalogue (W = 8, Tmax = 4096, table geometry): for every model and arch,
    dispatch of every payload dtype, the bf16-wire combine and the combine of every quantized wire
    (``COMBINE_QUANTS``), in a fixed order without repeats."""
    specs = []
    for name in models or MODELS:
        specs += [s for d in dtypes for s in model_specs(name, arches, dtype=d)]
        specs += [s for q in COMBINE_QUANTS if q != "none"
                  for s in model_specs(name, arches, combine_quant=q) if s.op is Op.COMBINE]
    return list(dict.fromkeys(specs))


REPORT_MD = "REPORT.md"
REPORT_CSV = "report.csv"


def render_files(specs: list[KernelSpec], with_report: bool = True, title: str = "epgen catalogue",
                 on_done=None) -> dict[str, str]:
    """{relative path: text} for the sources of ``specs``, their manifest and, with
    ``with_report``, the resource report (REPORT.md, report.csv) from the offline compilers, so a
    template change shows its register/LDS/occupancy change in review; ``on_done`` is called
    after each compile.

    Raises:
        epgen.codegen.offline.ToolchainMissing: ``with_report`` and an offline compiler is absent.
    """
    sources = [render(s) for s in specs]
    files = {f"{s.spec.arch}/{s.filename}": s.text for s in sources}
    files[MANIFEST] = manifest(sources)
    if with_report:
        rows = report_rows(specs, on_done=on_done)
        files[REPORT_MD] = report.to_markdown(rows, f"{title}: resources per variant (clang 22 for gfx*, NVRTC for sm_90)")
        files[REPORT_CSV] = report.to_csv(rows)
    return files


def report_rows(specs: list[KernelSpec], max_workers: int | None = None, on_done=None) -> list[dict]:
    """Compile ``specs`` offline and return the report rows (``codegen.report``); ``on_done``
    is called after each compile."""
    for arch in sorted({s.arch for s in specs}):
        reason = toolchain_status(arch)
        if reason:
            raise ToolchainMissing(f"{arch}: {reason}")
    sources = [render(s) for s in specs]
    results = compile_many([(src.text, s.arch, src.entry) for s, src in zip(specs, sources)], max_workers=max_workers,
                           on_done=on_done)
    return report.rows(specs, results)


def manifest(sources: list[Source]) -> str:
    """JSON listing, per source: file, entry, key (sha256 of text + runtime options) and spec."""
    rows = [{"file": f"{s.spec.arch}/{s.filename}", "entry": s.entry, "key": s.key, "spec": s.spec.as_dict()}
            for s in sources]
    return json.dumps({"schema": 1, "sources": rows}, indent=1, sort_keys=True) + "\n"


def owned_sources(directory: Path) -> list[str]:
    """Generated sources under ``directory``: ``<arch>/epgen_*`` files with the arch's suffix.
    Nothing else there is ever removed or reported."""
    found = []
    for arch in ARCHES:
        folder = directory / arch
        if folder.is_dir():
            found += [f"{arch}/{p.name}" for p in sorted(folder.glob(f"epgen_*{traits(arch).suffix}")) if p.is_file()]
    return found


def _differs(path: Path, text: str) -> bool:
    return not path.is_file() or path.read_bytes() != text.encode()


def write(directory: Path, files: dict[str, str]) -> list[str]:
    """Write ``files`` under ``directory`` where bytes differ and remove generated sources
    (``_owned``) that ``files`` no longer lists. Returns the paths written or removed.

    Raises:
        OSError: the directory or a file cannot be written.
    """
    directory = Path(directory)
    touched = []
    for rel, text in files.items():
        p = directory / rel
        if _differs(p, text):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(text.encode())
            touched.append(rel)
    for rel in owned_sources(directory):
        if rel not in files:
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
    problems += [f"extra: {rel}" for rel in owned_sources(directory) if rel not in files]
    return problems
