"""The committed catalogue: in sync with the templates, and every kernel compiles with no
scratch or spill for gfx950, gfx1250 and sm_90."""

import json
from pathlib import Path

import pytest

from epgen.codegen.arch import ARCHES
from epgen.codegen.catalogue import MANIFEST, catalogue_specs, check, render_files, write
from epgen.codegen.offline import toolchain_status

ROOT = Path(__file__).resolve().parents[2]


def test_generated_is_fresh(compiles):
    problems = check(ROOT / "generated", render_files(catalogue_specs(), compile_fn=compiles.compile_offline))
    assert not problems, f"generated/ is stale, run `epgen generate`: {problems[:5]}"


def test_write_is_idempotent_and_prunes_only_its_own_files(tmp_path):
    files = render_files(catalogue_specs(["mixtral-8x7b"]), with_report=False)
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
    files = render_files(catalogue_specs(["mixtral-8x7b"]), with_report=False)
    assert check(tmp_path / "nope", files) == [f"missing directory: {tmp_path / 'nope'}"]
    write(tmp_path, files)
    victim = next(tmp_path.rglob("*.cu"))
    victim.write_bytes(b"\xff\xfe not utf-8")
    assert check(tmp_path, files) == [f"stale: {victim.relative_to(tmp_path).as_posix()}"]


def test_stale_file_detected(tmp_path):
    files = render_files(catalogue_specs(["mixtral-8x7b"]), with_report=False)
    write(tmp_path, files)
    victim = next(tmp_path.rglob("*.hip"))
    victim.write_text(victim.read_text() + "// edited\n")
    assert check(tmp_path, files) == [f"stale: {victim.relative_to(tmp_path).as_posix()}"]


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
    files = render_files(catalogue_specs(["mixtral-8x7b"]), with_report=False)
    write(tmp_path, files)
    (tmp_path / "gfx950" / "epgen_foo.hip").write_text("// the user's own")
    (tmp_path / "sm_90" / "epgen_foo.cu").write_text("// the user's own")
    assert check(tmp_path, files) == []
    assert write(tmp_path, files) == []
    assert (tmp_path / "gfx950" / "epgen_foo.hip").exists() and (tmp_path / "sm_90" / "epgen_foo.cu").exists()


def test_write_replaces_symlinks_instead_of_following_them(tmp_path):
    files = {**render_files(catalogue_specs(["mixtral-8x7b"]), with_report=False), "REPORT.md": "# report\n"}
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
