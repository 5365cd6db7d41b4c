"""The package map's one-way rule, read from the sources (``ast``, no import executed).

``runtime/`` is ``epgen``, ``codegen/`` is ``epgen.codegen``: every import of a project module
names it absolutely, ``epgen.codegen`` never imports ``epgen`` outside ``epgen.codegen``, the
module graph has no cycle, and no test imports another test module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"runtime": "epgen", "codegen": "epgen.codegen"}  # folder -> import package (pyproject.toml)


def _modules() -> dict[str, Path]:
    """Module name -> source of every module of the packages, subpackages (``epgen.quant``) too."""
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((package, *parts))] = path
    return mods


def _imports(path: Path) -> list[tuple[int, int, str | None, list[str]]]:
    """(line, relative level, module, names) of every import statement, function-local ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, 0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module, [a.name for a in node.names]))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        for _, _, name, names in _imports(path):
            if name is None or not (name == "epgen" or name.startswith("epgen.")):
                continue
            targets = {f"{name}.{n}" for n in names if f"{name}.{n}" in mods} or {name}
            graph[mod] |= {t for t in targets if t in mods and t != mod}
    return graph


def test_the_map_covers_every_module():
    mods = _modules()
    assert "epgen.op" in mods and "epgen.codegen.spec" in mods and "epgen.codegen.config" in mods
    assert "epgen.codegen.offline" in mods and "epgen.codegen.offline.nvrtc" in mods  # subpackages too
    assert {"epgen", "epgen.quant", "epgen.quant.codecs", "epgen.quant.wire"} <= set(mods)


def test_imports_are_absolute():
    relative = [f"{p.relative_to(ROOT)}:{line}" for p in _modules().values()
                for line, level, _, _ in _imports(p) if level]
    assert not relative, f"relative imports (write 'from epgen... import'): {relative}"


def test_codegen_never_imports_the_runtime():
    bad = [f"{m} -> {t}" for m, ts in _graph().items() if m.startswith("epgen.codegen")
           for t in ts if not t.startswith("epgen.codegen")]
    assert not bad, f"epgen.codegen must not import the runtime package: {bad}"


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_rule_catches_what_it_forbids(tmp_path, monkeypatch):
    """The walk sees function-local imports and names imported from a package."""
    (tmp_path / "codegen").mkdir()
    (tmp_path / "runtime").mkdir()
    (tmp_path / "codegen" / "a.py").write_text("def f():\n    from epgen import op\n")
    (tmp_path / "runtime" / "op.py").write_text("from epgen.codegen.a import f\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    graph = _graph()
    assert graph["epgen.codegen.a"] == {"epgen.op"} and graph["epgen.op"] == {"epgen.codegen.a"}


def test_no_test_imports_another_test_module():
    tests = ROOT / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")} | {"conftest"}
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in tests.rglob("*.py")
           for line, _, name, _ in _imports(p) if name and name.split(".")[0] in names]
    assert not bad, bad
