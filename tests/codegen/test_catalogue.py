"""The committed catalogue: in sync with the templates, every template path on every arch with
the fewest kernels, and every kernel compiles with no scratch or spill for gfx950, gfx1250 and
sm_90."""

import json
from pathlib import Path

import pytest

from epgen.codegen import coverage
from epgen.codegen.arch import ARCHES
from epgen.codegen.catalogue import (CATALOGUE_EXPERT_LAYOUT, CATALOGUE_MAX_TOKENS, CATALOGUE_WORLD_SIZE,
                                     HEADLINE_MODELS, MANIFEST, catalogue_specs, check, model_specs, render_files,
                                     write)
from epgen.codegen.config import LAYOUTS
from epgen.codegen.dtypes import COMBINE_QUANTS, DTYPES
from epgen.codegen.models import MODELS
from epgen.codegen.offline import toolchain_status
from epgen.codegen.spec import TRANSPORTS, KernelSpec, Op

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_generated_is_fresh(compiles):
    specs = catalogue_specs()
    compiles.resources(specs)  # the report's compiles, said on the terminal, for the later tests too
    problems = check(ROOT / "generated", render_files(specs, compile_fn=compiles.compile_offline))
    assert not problems, f"generated/ is stale, run `epgen generate`: {problems[:5]}"


def _space() -> list[KernelSpec]:
    name, alignment = CATALOGUE_EXPERT_LAYOUT
    return coverage.space(name, world_size=CATALOGUE_WORLD_SIZE, max_tokens_per_rank=CATALOGUE_MAX_TOKENS,
                          expert_alignment=alignment)


def test_generated_covers_every_template_path():
    """Every (arch, kernel kind, feature, value) the spec space holds is in generated/: each kind
    with each of its payload dtypes or combine wires, layouts, transports and its family, on every
    arch (``epgen.codegen.coverage``); and the space is the tables' (every arch, kind, dtype, wire,
    layout and transport), so a new row of a table is a path the catalogue must cover."""
    required = coverage.items(_space())
    for arch in ARCHES:
        have = {(feature, value) for a, _, feature, value in required if a == arch}
        assert {k for a, k, _, _ in required if a == arch} == {op.value for op in Op}
        for feature, table in (("dtype", DTYPES), ("wire", COMBINE_QUANTS), ("layout", LAYOUTS),
                               ("transport", TRANSPORTS), ("family", ("normal", "low_latency"))):
            assert {v for f, v in have if f == feature} == set(table), (arch, feature)
    manifest = json.loads((ROOT / "generated" / MANIFEST).read_text())
    committed = coverage.items(KernelSpec(**row["spec"]) for row in manifest["sources"])
    missing = sorted(required - committed)
    assert not missing, f"{len(missing)} template paths missing from generated/, e.g. {missing[:5]}"


def test_generated_holds_only_what_its_manifest_lists():
    """``epgen generate`` removes only the sources its old manifest listed (``catalogue.write``), so a
    source left by another branch's manifest (a merge) would stay unseen by ``--check``: every file
    of the committed arch folders must be one the manifest lists."""
    listed = {row["file"] for row in json.loads((ROOT / "generated" / MANIFEST).read_text())["sources"]}
    present = {f"{d.name}/{f.name}" for d in (ROOT / "generated").iterdir() if d.is_dir() for f in d.iterdir()}
    assert not present - listed, f"{len(present - listed)} files in generated/ the manifest does not list, e.g. " \
                                 f"{sorted(present - listed)[:3]}: remove them"


def test_the_catalogue_adds_the_fewest_kernels_to_the_headline_variants():
    """Beyond the headline variants, each (arch, kind) takes one kernel per missing value of the
    feature with the most missing values: no cover can take fewer (a kernel adds one value of
    each feature)."""
    headline = [s for name in HEADLINE_MODELS for s in model_specs(name)]
    added = [s for s in catalogue_specs() if s not in headline]
    missing = coverage.items(_space()) - coverage.items(headline)
    for arch in ARCHES:
        for op in Op:
            values = {}
            for a, kind, feature, value in missing:
                if (a, kind) == (arch, op.value):
                    values.setdefault(feature, set()).add(value)
            fewest = max(map(len, values.values()), default=0)
            assert sum(s.arch == arch and s.op is op for s in added) == fewest, (arch, op.value)


def _model_variants(arch: str) -> list[KernelSpec]:
    """Every catalogue model's dispatch of each payload dtype, combine of each wire (with its
    quantize kernel) and pull dispatch of each dtype, both families, W = 8, Tmax = 4096: the
    sources the catalogue held before it was sized for review."""
    specs = []
    for name in MODELS:
        specs += [s for d in DTYPES for s in model_specs(name, (arch,), dtype=d)]
        specs += [s for q in COMBINE_QUANTS if q != "none"
                  for s in model_specs(name, (arch,), combine_quant=q) if s.op.call is Op.COMBINE]
        specs += [s for d in DTYPES for s in model_specs(name, (arch,), dtype=d, dispatch_transport="pull")
                  if s.op is Op.DISPATCH_PULL or s.transport == "pull"]
    return list(dict.fromkeys(specs))


@pytest.mark.models
@pytest.mark.parametrize("arch", ARCHES)
def test_every_model_variant_compiles_without_scratch(arch, compiles):
    """The shapes of every catalogue model, in every payload dtype, combine wire and transport,
    compile clean (259 sources an arch, about 0.2 s of CPU each: marked ``models``, which the
    default run leaves to .ci/run)."""
    reason = toolchain_status(arch)
    if reason:
        pytest.skip(reason)
    specs = _model_variants(arch)
    bad = [(s.name, str(r) if isinstance(r, Exception) else f"scratch {r.scratch_bytes} spill {r.spill_bytes}")
           for s, r in zip(specs, compiles.resources(specs)) if isinstance(r, Exception) or not r.ok]
    assert not bad, bad


def test_write_is_idempotent_and_prunes_only_its_own_files(tmp_path):
    files = render_files(model_specs("mixtral-8x7b"), with_report=False)
    assert write(tmp_path, files)
    assert write(tmp_path, files) == []
    doc = json.loads(files[MANIFEST])  # an earlier run's manifest, listing a variant the catalogue dropped
    doc["sources"].append({**doc["sources"][0], "file": "sm_90/epgen_old.cu"})
    (tmp_path / MANIFEST).write_text(json.dumps(doc))
    (tmp_path / "sm_90" / "epgen_old.cu").write_text("// a variant the catalogue dropped")
    (tmp_path / "sm_90" / "mine.cu").write_text("// the user's own file")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "epgen_x.cu").write_text("// not in an arch folder")
    assert check(tmp_path, files) == [f"stale: {MANIFEST}", "extra: sm_90/epgen_old.cu"]
    assert write(tmp_path, files) == [MANIFEST, "sm_90/epgen_old.cu"]
    assert check(tmp_path, files) == []
    assert (tmp_path / "sm_90" / "mine.cu").exists() and (tmp_path / "notes" / "epgen_x.cu").exists()


def test_check_survives_binary_files_and_missing_dir(tmp_path):
    files = render_files(model_specs("mixtral-8x7b"), with_report=False)
    assert check(tmp_path / "nope", files) == [f"missing directory: {tmp_path / 'nope'}"]
    write(tmp_path, files)
    victim = next(tmp_path.rglob("*.cu"))
    victim.write_bytes(b"\xff\xfe not utf-8")
    assert check(tmp_path, files) == [f"stale: {victim.relative_to(tmp_path).as_posix()}"]


def test_stale_file_detected(tmp_path):
    files = render_files(model_specs("mixtral-8x7b"), with_report=False)
    write(tmp_path, files)
    victim = next(tmp_path.rglob("*.hip"))
    victim.write_text(victim.read_text() + "// edited\n")
    assert check(tmp_path, files) == [f"stale: {victim.relative_to(tmp_path).as_posix()}"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_catalogue_compiles_without_scratch(arch, compiles):
    reason = toolchain_status(arch)
    if reason:
        pytest.skip(reason)
    specs = catalogue_specs(arches=(arch,))
    bad = [(s.name, str(r) if isinstance(r, Exception) else f"scratch {r.scratch_bytes} spill {r.spill_bytes}")
           for s, r in zip(specs, compiles.resources(specs)) if isinstance(r, Exception) or not r.ok]
    assert not bad, bad


def test_write_never_removes_foreign_epgen_files(tmp_path):
    """Only files the directory's own manifest lists are pruned: the user's ``epgen_*`` files in
    the arch folders survive a second run, and ``check`` does not report them."""
    files = render_files(model_specs("mixtral-8x7b"), with_report=False)
    write(tmp_path, files)
    (tmp_path / "gfx950" / "epgen_foo.hip").write_text("// the user's own")
    (tmp_path / "sm_90" / "epgen_foo.cu").write_text("// the user's own")
    assert check(tmp_path, files) == []
    assert write(tmp_path, files) == []
    assert (tmp_path / "gfx950" / "epgen_foo.hip").exists() and (tmp_path / "sm_90" / "epgen_foo.cu").exists()


def test_write_replaces_symlinks_instead_of_following_them(tmp_path):
    files = {**render_files(model_specs("mixtral-8x7b"), with_report=False), "REPORT.md": "# report\n"}
    out = tmp_path / "out"
    write(out, files)
    source = next(rel for rel in files if rel.startswith("sm_90/"))
    outside = {rel: tmp_path / f"outside{i}" for i, rel in enumerate([source, "REPORT.md"])}
    for rel, target in outside.items():
        target.write_text("precious")
        (out / rel).unlink()
        (out / rel).symlink_to(target)
    assert check(out, files) == [f"stale: {rel}" for rel in files if rel in outside]
    assert sorted(write(out, files)) == sorted(outside)
    for rel, target in outside.items():
        assert target.read_text() == "precious"
        assert not (out / rel).is_symlink() and (out / rel).read_text() == files[rel]
    assert check(out, files) == []
