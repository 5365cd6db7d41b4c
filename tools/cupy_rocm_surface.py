"""Derive what CuPy's ROCm build really provides from its wheel: tests/runtime/core/cupy_rocm_surface.json.

    pip download --no-deps cupy-rocm-7-0==14.2.0 -d /tmp/wheel
    python tools/cupy_rocm_surface.py /tmp/wheel/cupy_rocm_7_0-14.2.0-*.whl > tests/runtime/core/cupy_rocm_surface.json

No GPU and no ROCm are needed: the wheel is read as a zip and its Cython extensions with binutils
(``objdump``, ``strings``, ``readelf``). CuPy builds its ROCm wheel from the CUDA sources through
``cupy_backends/hip/cupy_hip_runtime.h`` and friends, which map each ``cudaX`` either to its HIP
call or to an inline stub returning ``hipErrorUnknown`` (e.g. the occupancy calls); the headers
are compiled in, not shipped, so a stub shows as a function that calls no HIP symbol. For each
Python-level function of ``cupy.cuda.runtime`` and ``cupy.cuda.driver`` (Cython ``cpdef``/``def``:
symbols ``__pyx_f_/__pyx_pw_<module>_<name>``) the tool follows the static call graph of the
extension (``objdump -d``: direct calls and tail jumps between its own functions) down to the HIP
symbols it imports through the PLT, leaving out the error path every wrapper shares
(``ERROR_PATH``): a function that reaches none is a stub on ROCm. ``cupy.cuda.driver`` calls
through function pointers that ``cupy_backends.cuda._softlink`` resolves by the CUDA names, which
the ROCm extension exports itself (the header's inline ``cuModuleLoad`` calling ``hipModuleLoad``),
so its functions start there.

``runtime_links``: the libraries ``cupy.cuda.runtime``'s extension links (``readelf -d``), whose
``libamdhip64`` soname names the ROCm major release the wheel runs on.

Module names: a pure-Python module's top-level names (``ast``: assignments, defs, classes, imports,
``from m import *`` followed inside the wheel); a Cython module's names are its qualified-name
strings (``cupy.cuda.memory.Memory``: every function and class), plus, for the runtime and driver,
the identifiers of their constant tables (``hostAllocMapped``, ``cudaIpcMemLazyEnablePeerAccess``).
A name in a Cython module's list may be a C identifier that Python cannot reach (the lists are
read from strings): absence proves absence, presence is the over-approximation.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from pathlib import Path, PurePosixPath

MODULES = {
    "cupy": "cupy/__init__.py",
    "cupy.cuda": "cupy/cuda/__init__.py",
    "cupy.cuda.runtime": "cupy_backends/cuda/api/runtime",
    "cupy.cuda.driver": "cupy_backends/cuda/api/driver",
    "cupy.cuda.function": "cupy/cuda/function",
    "cupy.cuda.memory": "cupy/cuda/memory",
    "cupy.cuda.device": "cupy/cuda/device",
    "cupy.cuda.stream": "cupy/cuda/stream",
    "cupy.cuda.compiler": "cupy/cuda/compiler.py",
}
"""The modules epgen's runtime reaches, by import path -> path in the wheel (a Cython extension
without its ``.cpython-*.so`` suffix)."""

CONSTANT_TABLES = {
    "cupy.cuda.runtime": ("cupy_backends/cuda/api/_runtime_enum", r"(cuda[A-Z]|hostAlloc|stream[A-Z]|event[A-Z]|"
                                                                  r"memory[A-Z]|device[A-Z]|is_hip$)\w*"),
    "cupy.cuda.driver": ("cupy_backends/cuda/api/_driver_enum", r"(CU_|CUDA_|cu[A-Z]|is_hip$)\w*"),
}
"""Modules whose constants come from a ``cpdef enum`` module (``from ._runtime_enum import *``) and
their own assignments: the enum module and the identifier pattern of a constant."""

ERROR_PATH = ("hipGetErrorName", "hipGetErrorString", "hipGetLastError")
"""HIP calls every wrapper reaches through its shared error check (``check_status`` builds the
exception from the error's name and text): reaching them alone does not make a call real."""

DRIVER_NAME = re.compile(r"cu([A-Z]\w*)")
CYTHON_NAME = re.compile(r"__pyx_(?:f|pw)_\d+cupy_backends_4cuda_3api_7runtime_(?:\d+)?([A-Za-z]\w*)$")


def _extension(names: list[str], stem: str) -> str:
    (found,) = [n for n in names if n.startswith(stem + ".cpython-") and n.endswith(".so")]
    return found


def _python_names(wheel: zipfile.ZipFile, path: str) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(wheel.read(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name == "*":
                    stem = str(PurePosixPath(*node.module.split(".")))
                    inner = [n for n in wheel.namelist() if n in (stem + ".py", stem + "/__init__.py")]
                    names |= _python_names(wheel, inner[0]) if inner else set()
                else:
                    names.add(a.asname or a.name)
    return {n for n in names if not n.startswith("__") or n == "__version__"}


def _strings(path: Path) -> list[str]:
    return subprocess.run(["strings", "-n", "3", str(path)], check=True, capture_output=True, text=True).stdout.split()


def _cython_names(path: Path, module: str) -> set[str]:
    prefix = module + "."
    names = {s[len(prefix):].split(".")[0] for s in _strings(path) if s.startswith(prefix)}
    return {n for n in names if n.isidentifier() and not n.startswith("__pyx")}


def _demangle(symbol: str) -> str:
    """``_ZL50__pyx_f_..._memsetlimi`` -> ``__pyx_f_..._memset`` (the length prefix bounds the name)."""
    m = re.match(r"_ZL(\d+)", symbol)
    return symbol[m.end():m.end() + int(m.group(1))] if m else symbol


def _needed(path: Path) -> list[str]:
    """The shared libraries ``path`` links (``readelf -d``: its ``NEEDED`` entries)."""
    out = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _hip_calls(path: Path, driver: bool) -> dict[str, list[str]]:
    """Python-level function name -> the HIP symbols its implementation reaches (sorted).

    The runtime's functions start at their Cython symbols; the driver's at the header's inline
    ``cu<Name>`` that the extension exports (its softlink resolves the driver entry points by
    those names), for the Python-level function ``<name>`` (``moduleLoad`` -> ``cuModuleLoad``).
    """
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], check=True, capture_output=True,
                          text=True).stdout
    calls: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            current = _demangle(head.group(1))
            calls.setdefault(current, set())
            continue
        target = re.search(r"\s(?:call|jmp)\s.*<([^>+]+)>$", line)
        if current and target:
            calls[current].add(_demangle(target.group(1)))
    # A PLT entry "X@plt" jumps to X: an imported HIP symbol ("hipMalloc@hip_4.2"), or one of the
    # extension's own exported functions (the header's inline "cudaMemset", called through the PLT).
    for name in [n for n in calls if n.endswith("@plt")]:
        target = name[:-len("@plt")]
        calls[name] = {target} if target in calls else {target + "@import"}
    result: dict[str, set[str]] = {}
    for name in calls:
        m = DRIVER_NAME.fullmatch(name) if driver else CYTHON_NAME.search(name)
        if not m or "__" in m.group(1):  # a method of an exception or a struct class
            continue
        seen, todo, hip = {name}, deque([name]), set()
        while todo:
            for t in calls.get(todo.popleft(), ()):
                if "@" in t and not t.endswith("@plt"):  # an imported symbol: "hipMalloc@hip_4.2", "...@import"
                    hip |= {t.split("@")[0]} if t.startswith("hip") else set()
                elif t not in seen and t in calls:
                    seen.add(t)
                    todo.append(t)
        python = m.group(1)[0].lower() + m.group(1)[1:] if driver else m.group(1)
        result.setdefault(python, set()).update(hip - set(ERROR_PATH))
    return {k: sorted(v) for k, v in sorted(result.items())}


def derive(wheel_path: Path) -> dict:
    """The surface record of one ``cupy-rocm`` wheel (the JSON ``main`` prints)."""
    with zipfile.ZipFile(wheel_path) as wheel, tempfile.TemporaryDirectory() as tmp:
        listing = wheel.namelist()
        (metadata,) = [n for n in listing if n.endswith(".dist-info/METADATA")]
        fields = dict(line.split(": ", 1) for line in wheel.read(metadata).decode().splitlines()[:10] if ": " in line)
        modules, functions = {}, {}
        for module, stem in MODULES.items():
            if stem.endswith(".py"):
                modules[module] = sorted(_python_names(wheel, stem))
                continue
            so = Path(wheel.extract(_extension(listing, stem), tmp))
            names = _cython_names(so, module) | _cython_names(so, stem.replace("/", "."))
            if module in CONSTANT_TABLES:
                enum_stem, pattern = CONSTANT_TABLES[module]
                enum = Path(wheel.extract(_extension(listing, enum_stem), tmp))
                names |= {s for f in (so, enum) for s in _strings(f) if re.fullmatch(pattern, s)}
                functions[module] = _hip_calls(so, driver=module == "cupy.cuda.driver")
                if module == "cupy.cuda.runtime":
                    links = _needed(so)
                names |= set(functions[module])
            modules[module] = sorted(names)
    return {
        "wheel": wheel_path.name, "name": fields["Name"], "version": fields["Version"],
        "regenerate": f"pip download --no-deps {fields['Name']}=={fields['Version']} -d /tmp/wheel && python "
                      f"tools/cupy_rocm_surface.py /tmp/wheel/{wheel_path.name} > tests/runtime/core/cupy_rocm_surface.json",
        "error_path": list(ERROR_PATH),
        "runtime_links": links,
        "functions": functions,
        "modules": modules,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(derive(Path(argv[0])), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
