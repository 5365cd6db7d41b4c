"""What CuPy's ROCm build provides, read from its wheel (``cupy_rocm_surface.json``, written by
``tools/cupy_rocm_surface.py``: the wheel, its version and the command that regenerates it are in
the file), and the rule a name the op touches must pass.

``problem("cupy.cuda.runtime.memset")`` is None when the wheel has the name and, for a function of
``cupy.cuda.runtime`` or ``cupy.cuda.driver``, its implementation reaches a HIP call; otherwise it
says why (a stub: the CUDA call is mapped to an error return on ROCm; or missing).
"""

from __future__ import annotations

import json
from pathlib import Path

SURFACE = json.loads((Path(__file__).parent / "cupy_rocm_surface.json").read_text())


def problem(name: str) -> str | None:
    """Why ``name`` (a dotted path from ``cupy``, e.g. ``cupy.cuda.runtime.memset``) cannot be used
    on CuPy-ROCm, or None. A path below a module's attribute (``cupy.cuda.Memory.ptr``) is judged
    by the attribute (``cupy.cuda.Memory``)."""
    modules, functions = SURFACE["modules"], SURFACE["functions"]
    parts = name.split(".")
    module = "cupy"
    for part in parts[1:]:
        if f"{module}.{part}" in modules:
            module = f"{module}.{part}"
            continue
        attribute = f"{module}.{part}"
        if part not in modules[module]:
            return f"{attribute}: missing from {SURFACE['name']} {SURFACE['version']}"
        calls = functions.get(module, {}).get(part)
        if calls == []:
            return (f"{attribute}: a stub in {SURFACE['name']} {SURFACE['version']} (its implementation calls no HIP "
                    "function: CuPy maps the CUDA call to an error return on ROCm)")
        return None
    return None  # a module itself
