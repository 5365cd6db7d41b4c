"""The package map's one-way rules, read from the sources (``ast``, no import executed).

``runtime/`` is ``epgen``, ``codegen/`` is ``epgen.codegen``: every import of a project module
names it absolutely, each wing imports only the wings below it (``WINGS``, ``MAY_IMPORT``), the
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
    """(line, relative level, module, names) of every import statement, function-local ones too,
    but not those under ``if TYPE_CHECKING:`` (annotations only: never executed, so no edge)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in block.body}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, 0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module, [a.name for a in node.names]))
    return found


def _edges() -> list[tuple[str, str, str]]:
    """(importer, imported module, ``path:line``) of every import of a project module."""
    mods, edges = _modules(), []
    for mod, path in mods.items():
        for line, _, name, names in _imports(path):
            if name is None or not (name == "epgen" or name.startswith("epgen.")):
                continue
            targets = {f"{name}.{n}" for n in names if f"{name}.{n}" in mods} or {name}
            edges += [(mod, t, f"{path.relative_to(ROOT)}:{line}") for t in sorted(targets) if t in mods and t != mod]
    return edges


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in _modules()}
    for mod, target, _ in _edges():
        graph[mod].add(target)
    return graph


WINGS = {
    "codegen": ("epgen.codegen",),
    "tensors": ("epgen.tensors",),
    "core": ("epgen.op", "epgen.arena", "epgen.platform", "epgen.loader", "epgen.cache",
             "epgen.device", "epgen.aot", "epgen.config", "epgen.plan", "epgen.host"),
    "references": ("epgen.reference", "epgen.quant"),
    "layers": ("epgen.layers",),
    "integrations": ("epgen.integrations",),
    "harness": ("epgen.harness",),
    "cli": ("epgen.cli", "epgen.__main__"),
    "front": ("epgen", "epgen.autograd", "epgen.moe", "epgen.hierarchical"),
}
"""The wing of each module: a name or the package it lies in (``runtime/__init__.py``'s map).
"front" is the public face: the package's own ``__init__`` and the re-exports of public paths."""

MAY_IMPORT = {
    "codegen": {"codegen"},
    "tensors": set(),
    "core": {"codegen", "tensors", "core"},
    "references": {"codegen", "tensors", "references"},
    "layers": {"codegen", "tensors", "core", "references", "layers"},
    "integrations": {"codegen", "tensors", "core", "references", "layers", "integrations"},
    "harness": {"codegen", "tensors", "core", "references", "layers", "harness"},
    "cli": {"codegen", "tensors", "core", "references", "layers", "harness", "cli", "front"},
    "front": {"codegen", "core", "references", "layers"},
}
"""Which wings a module of each wing may import: nothing imports the command line from outside it
(``epgen.__main__`` is its entry), and only the command line reads the front
(``epgen.__version__``): the package imports each module from where it lives."""


def _wing(module: str) -> str:
    """The wing of ``module``: the longest ``WINGS`` entry that is it or a package above it."""
    found = [(len(p), wing) for wing, prefixes in WINGS.items() for p in prefixes
             if module == p or module.startswith(p + ".")]
    assert found, f"{module}: in no wing; add it to WINGS in {Path(__file__).name} (and the map in runtime/__init__.py)"
    return max(found)[1]


def _wing_violations(edges) -> list[str]:
    bad = []
    for mod, target, where in edges:
        wing, target_wing = _wing(mod), _wing(target)
        if target_wing not in MAY_IMPORT[wing]:
            allowed = f"{', '.join(sorted(MAY_IMPORT[wing]))} only" if MAY_IMPORT[wing] else "nothing of epgen"
            bad.append(f"{where}: {mod} ({wing}) imports {target} ({target_wing}); the {wing} wing may import "
                       f"{allowed}")
    return bad


def test_the_map_covers_every_module():
    mods = _modules()
    assert "epgen.op" in mods and "epgen.codegen.spec" in mods and "epgen.codegen.config" in mods
    assert "epgen.codegen.offline" in mods and "epgen.codegen.offline.nvrtc" in mods  # subpackages too
    assert {"epgen", "epgen.quant", "epgen.quant.codecs", "epgen.quant.wire"} <= set(mods)


def test_imports_are_absolute():
    relative = [f"{p.relative_to(ROOT)}:{line}" for p in _modules().values()
                for line, level, _, _ in _imports(p) if level]
    assert not relative, f"relative imports (write 'from epgen... import'): {relative}"


def test_every_module_has_a_wing():
    assert not [m for m in _modules() if not any(m == p or m.startswith(p + ".") for ps in WINGS.values() for p in ps)]


def test_each_wing_imports_only_the_wings_below_it():
    bad = _wing_violations(_edges())
    assert not bad, "imports against the layer rules (runtime/__init__.py):\n  " + "\n  ".join(bad)


def test_the_wing_rule_names_the_offending_import():
    """A harness module importing the command line, and a layer importing the harness, are caught
    with the file, line and rule; the command line importing a layer is not."""
    bad = _wing_violations([("epgen.harness.verify", "epgen.cli.options", "runtime/harness/verify.py:16"),
                            ("epgen.layers.moe", "epgen.harness.timing", "runtime/layers/moe.py:3"),
                            ("epgen.op", "epgen.layers.hierarchical", "runtime/op.py:9"),
                            ("epgen.cli.bench", "epgen.layers.moe", "runtime/cli/bench.py:2"),
                            ("epgen.tensors", "epgen.codegen.arch", "runtime/tensors.py:5")])
    assert bad == [
        "runtime/harness/verify.py:16: epgen.harness.verify (harness) imports epgen.cli.options (cli); the harness "
        "wing may import codegen, core, harness, layers, references, tensors only",
        "runtime/layers/moe.py:3: epgen.layers.moe (layers) imports epgen.harness.timing (harness); the layers wing "
        "may import codegen, core, layers, references, tensors only",
        "runtime/op.py:9: epgen.op (core) imports epgen.layers.hierarchical (layers); the core wing may import "
        "codegen, core, tensors only",
        "runtime/tensors.py:5: epgen.tensors (tensors) imports epgen.codegen.arch (codegen); the tensors wing may "
        "import nothing of epgen"]
    assert _wing("epgen.codegen.offline.nvrtc") == "codegen" and _wing("epgen.quant.wire") == "references"


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


def _package_private_names() -> set[str]:
    """Names with one leading underscore that the package defines: functions, classes, methods and
    attributes assigned on ``self``."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reaches(path: Path, private: set[str]) -> list[str]:
    """Where the script ``path`` reaches the package other than through its public names: an
    import of the command line's modules (it is run, not imported) or of a private module or
    name, a private name of the package read off any object, and an assignment to an attribute of
    an imported epgen module (a monkeypatch)."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT)
    bad, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name == "epgen" or name.startswith("epgen."):
                    if name == "epgen.cli" or name.startswith("epgen.cli.") or any(
                            p.startswith("_") for p in name.split(".")):
                        bad.append(f"{where}:{node.lineno}: imports {name}")
                    if isinstance(node, ast.ImportFrom):
                        bad += [f"{where}:{node.lineno}: imports {name}.{a.name}" for a in node.names
                                if a.name.startswith("_")]
                        modules |= {a.asname or a.name for a in node.names}
                    else:
                        modules |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.Attribute) and node.attr in private:
            bad.append(f"{where}:{node.lineno}: reads .{node.attr}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules and node.attr not in private:
                bad.append(f"{where}:{node.lineno}: assigns {ast.unparse(node)} (a monkeypatch of the package)")
    return sorted(bad, key=lambda b: int(b.split(":")[1]))


def test_tools_reach_the_package_through_public_names_only():
    """The scripts under tools/ import no module of the command line and no private name, read no
    private name of the package's objects, and patch none of its modules: what they measure goes
    through the names a user has (``epgen.harness.measure``, ``EpDispatchCombine.kernel``...)."""
    private = _package_private_names()
    bad = [b for path in sorted((ROOT / "tools").glob("*.py")) for b in _private_reaches(path, private)]
    assert not bad, "tools/ reaching past the public names:\n  " + "\n  ".join(bad)


def test_the_public_name_rule_catches_what_it_forbids(tmp_path, monkeypatch):
    """A private helper of the command line, a private method of the op, and a patched module
    function are each caught with the line; a public name and torch's own private names are not."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "tools").mkdir()
    script = tmp_path / "tools" / "probe.py"
    script.write_text("import torch\n"
                      "import epgen.codegen.tuning as tuning\n"
                      "from epgen.cli.bench import measure\n"
                      "from epgen.harness.measure import capture_graph\n"
                      "op._pick(1, 2)\n"
                      "tuning.local_geometry = lambda arch, op: None\n"
                      "torch.cuda._sleep(10)\n"
                      "from epgen.harness.measure import _private\n")
    assert _private_reaches(script, {"_pick", "_private"}) == [
        "tools/probe.py:3: imports epgen.cli.bench",
        "tools/probe.py:5: reads ._pick",
        "tools/probe.py:6: assigns tuning.local_geometry (a monkeypatch of the package)",
        "tools/probe.py:8: imports epgen.harness.measure._private"]
