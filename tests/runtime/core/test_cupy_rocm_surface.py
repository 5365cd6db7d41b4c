"""Every CuPy name epgen's runtime uses exists in CuPy's ROCm wheel and is no stub there.

``cupy_rocm_surface.json`` is derived from the ``cupy-rocm-7-0`` wheel on PyPI by
``tools/cupy_rocm_surface.py`` (``rocm_surface``'s docstring); ``test_fake_rocm.py`` checks the
names the op touches while it runs against the recording stand-in, this file every name written
in a module of ``runtime/`` (the command line and the harness included), read from the source.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from rocm_surface import SURFACE, problem  # noqa: E402

RUNTIME = Path(__file__).parents[3] / "runtime"

CUDA_ONLY = {
    ("platform.py", "cupy.cuda.driver.launchCooperativeKernel"):
        "Platform.launch's CUDA branch; ROCm launches cooperatively through libamdhip64 "
        "(hipModuleLaunchCooperativeKernel) because this call is a stub there",
}
"""Uses that only CUDA reaches, each with the reason (its file, the name)."""


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def cupy_names(source: str) -> set[str]:
    """The longest dotted names rooted at ``cupy`` in ``source``, aliases resolved
    (``rt = cupy.cuda.runtime``; ``rt.memset`` -> ``cupy.cuda.runtime.memset``)."""
    tree = ast.parse(source)
    aliases = {"cupy": ["cupy"]}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and chain[0] == "cupy":
                aliases[node.targets[0].id] = chain
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in aliases:
                names.add(".".join(aliases[chain[0]] + chain[1:]))
    return names


def _uses() -> dict[tuple[str, str], None]:
    return {(str(p.relative_to(RUNTIME)), name): None for p in sorted(RUNTIME.rglob("*.py"))
            for name in sorted(cupy_names(p.read_text()))}


def test_the_surface_file_names_its_wheel_and_how_to_regenerate_it():
    assert SURFACE["name"] == "cupy-rocm-7-0" and SURFACE["wheel"].startswith(f"cupy_rocm_7_0-{SURFACE['version']}-")
    assert SURFACE["regenerate"].startswith(f"pip download --no-deps cupy-rocm-7-0=={SURFACE['version']} ")
    runtime, driver = SURFACE["functions"]["cupy.cuda.runtime"], SURFACE["functions"]["cupy.cuda.driver"]
    # What the wheel showed, and what epgen's ROCm path is built around: the memory, IPC and module
    # calls reach HIP; the cooperative launch and the occupancy queries are stubs.
    assert runtime["hostAlloc"] == ["hipHostMalloc"] and runtime["ipcOpenMemHandle"] == ["hipIpcOpenMemHandle"]
    assert driver["moduleLoad"] == ["hipModuleLoad"] and driver["moduleGetFunction"] == ["hipModuleGetFunction"]
    assert driver["launchCooperativeKernel"] == [] and driver["occupancyMaxActiveBlocksPerMultiprocessor"] == []


def test_every_cupy_name_in_the_runtime_exists_in_cupy_rocm_and_is_no_stub():
    uses = _uses()
    assert set(CUDA_ONLY) <= set(uses), sorted(set(CUDA_ONLY) - set(uses))  # no stale entry
    bad = {f"{path}: {problem(name)}" for path, name in uses if (path, name) not in CUDA_ONLY and problem(name)}
    assert not bad, sorted(bad)


@pytest.mark.parametrize("name", ["cupy.cuda.driver.launchCooperativeKernel",
                                  "cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor",
                                  "cupy.cuda.runtime.memcpy2DAsync", "cupy.cuda.runtime.hostRegister"])
def test_a_stubbed_name_fails(name):
    source = f"import cupy\n{name}(0)\n"
    assert cupy_names(source) == {name}
    assert "a stub in cupy-rocm-7-0" in problem(name)


def test_a_missing_name_fails_and_provided_ones_pass():
    assert "missing from cupy-rocm-7-0" in problem("cupy.cuda.runtime.cudaMallocPitch")
    assert "missing from" in problem("cupy.cuda.NoSuchThing.attribute")
    for name in ("cupy.cuda.runtime.memset", "cupy.cuda.runtime.hostAllocMapped", "cupy.cuda.Memory",
                 "cupy.RawModule", "cupy.cuda.function.CPointer", "cupy.cuda.runtime.runtimeGetVersion"):
        assert problem(name) is None, problem(name)
    assert cupy_names("import cupy\nrt = cupy.cuda.runtime\nrt.hostAlloc(1, rt.hostAllocMapped)\n") == {
        "cupy.cuda.runtime", "cupy.cuda.runtime.hostAlloc", "cupy.cuda.runtime.hostAllocMapped"}
