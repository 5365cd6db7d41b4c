"""gfx950 sources through a real hiprtc, where this machine has one (the emulation,
tests/codegen/test_hiprtc.py, stays the main check: it runs everywhere, at the real targets).

Debian 12 packages ROCm 5.2.3's HIP runtime (``apt-get install libamdhip64-5``: hiprtc lives in
``libamdhip64.so.5``, its headers built in through ``libhiprtc-builtins5``); ROCm 6+ ships
``libhiprtc.so``. Either is found by the loader (``ctypes.util.find_library``: ldconfig and
``LD_LIBRARY_PATH``) or named by ``$EPGEN_HIPRTC_LIB`` (its dependencies on the loader path). Such
an old hiprtc knows neither gfx950 nor gfx1250, nor two builtins of the platform layer (``__builtin_amdgcn_ballot_w64``,
``__builtin_readsteadycounter``), so the gfx950 sources (gfx9, wave64, the family of gfx90a) are
compiled for gfx90a, which every hiprtc since ROCm 4 knows:

* as rendered, the compile fails on those two builtins alone, or succeeds (a hiprtc whose clang
  has them);
* with them replaced by the older ``__ballot`` and ``__builtin_readcyclecounter`` it yields a code
  object.

What this proves beyond the emulation: the sources compile against a real hiprtc's own predefined
HIP runtime and default options (no clash with what it defines, no option it lacks), through its
front end and backend to a code object. Not proved: gfx950's or gfx1250's code generation (the
target is gfx90a), and the clock's rate (the replacement counts cycles). The test names the
library file it used (its version is HIP's: ``libamdhip64.so.5.2.21153`` is HIP 5.2.21153, ROCm
5.2.3), in its assertion messages and as the ``hiprtc`` property of the JUnit report's test suite.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re

import pytest

from epgen.aot import config_specs
from epgen.codegen.config import EpConfig
from epgen.codegen.render import render

LIB_ENV = "EPGEN_HIPRTC_LIB"
TARGET = "gfx90a"
OLDER = {"__builtin_amdgcn_ballot_w64(": "__ballot(", "__builtin_readsteadycounter()": "__builtin_readcyclecounter()"}
"""The two builtins an older hiprtc lacks -> the older call it has (same operands and result width)."""

CONFIGS = (
    EpConfig(world_size=2, hidden=1024, topk=4, num_experts=8, max_tokens_per_rank=64, combine_quant="fp8_blockwise"),
    EpConfig(world_size=4, hidden=1024, topk=4, num_experts=16, max_tokens_per_rank=64, kernel_family="normal",
             dispatch_transport="pull", dtype="fp4"),
    EpConfig(world_size=2, hidden=256, topk=4, num_experts=6, max_tokens_per_rank=96, kernel_family="normal",
             layout="expert", expert_alignment=16),
)
"""Both families (whole and halves), a quantized wire, the pull dispatch with fp4, the expert layout."""


def _library():
    """(the hiprtc library, its file's path), or None."""
    names = [os.environ[LIB_ENV]] if os.environ.get(LIB_ENV) else [ctypes.util.find_library("hiprtc"),
                                                                     ctypes.util.find_library("amdhip64")]
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "hiprtcCompileProgram"):
            stem = os.path.basename(name).split(".so")[0]
            with open("/proc/self/maps") as maps:  # the file the loader mapped for it
                paths = {line.split()[-1] for line in maps if f"/{stem}.so" in line}
            return lib, os.path.realpath(sorted(paths)[0]) if paths else name
    return None


FOUND = _library()
pytestmark = pytest.mark.skipif(FOUND is None, reason=(
    f"no hiprtc library on this machine (Debian 12: apt-get install libamdhip64-5, ROCm 5.2.3; or set {LIB_ENV} to "
    "a libhiprtc.so / libamdhip64.so); CI installs none"))


@pytest.fixture(scope="module", autouse=True)
def _name_the_release(record_testsuite_property):
    record_testsuite_property("hiprtc", FOUND[1])


def _compile(lib, text: str) -> tuple[int, str, int]:
    """hiprtc's status, its log and the code object's bytes for ``text`` at ``TARGET``."""
    prog = ctypes.c_void_p()
    assert lib.hiprtcCreateProgram(ctypes.byref(prog), text.encode(), b"k.hip", 0, None, None) == 0
    opts = (ctypes.c_char_p * 1)(f"--offload-arch={TARGET}".encode())
    status = lib.hiprtcCompileProgram(prog, 1, opts)
    size = ctypes.c_size_t()
    lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.hiprtcGetProgramLog(prog, log)
    code = ctypes.c_size_t()
    lib.hiprtcGetCodeSize(prog, ctypes.byref(code))
    lib.hiprtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace"), code.value


@pytest.mark.parametrize("spec", [s for cfg in CONFIGS for s in config_specs(cfg, "gfx950")], ids=lambda s: s.name)
def test_a_gfx950_source_compiles_with_a_real_hiprtc_but_for_its_two_newer_builtins(spec):
    lib, path = FOUND
    text = render(spec).text
    assert all(old in text for old in OLDER), spec.name  # the platform layer uses both
    status, log, _ = _compile(lib, text)
    errors = re.findall(r"error: (.*)", log)
    unknown = {m.group(1) for e in errors for m in [re.match(r"use of undeclared identifier '(\w+)'", e)] if m}
    assert status == 0 or (errors and len(unknown) == len(errors) and unknown <= {o.rstrip("()") for o in OLDER}), (
        f"{path}: {log}")
    older = text
    for new, old in OLDER.items():
        older = older.replace(new, old)
    status, log, code = _compile(lib, older)
    assert status == 0 and code > 0, f"{path}: {log}"
