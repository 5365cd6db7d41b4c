"""Load kernels at runtime: from the ahead-of-time cache when ``epgen build`` put them there,
else compiled with CuPy (NVRTC on CUDA, hiprtc on ROCm).

``load_kernel`` looks a source up in this order:

1. this process's memo, by (device, source text): a second op with the same kernels loads nothing;
2. the ahead-of-time cache (``epgen.aot``): ``$EPGEN_CACHE_DIR`` (default ``~/.cache/epgen``)
   ``/<arch>/<key>.<hsaco|cubin>``, where ``<arch>`` is the current device's and ``<key>`` the
   sha256 of the text, the offline compile options and the offline compiler's identity. The
   file is checked (ELF target of this arch, not truncated) and loaded with
   ``cupy.RawModule(path=...)``: no compile;
3. a runtime compile with CuPy (``RUNTIME_OPTIONS``); CuPy's own disk cache
   (``$CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) makes a second process skip it.

A cached file that fails the check or that the driver rejects is reported once
(``warnings.warn``, naming the file) and the kernel is compiled as in step 3 instead. So is a
cache directory the file system cannot name (``epgen.cache.directory_problem``: e.g.
``$EPGEN_CACHE_DIR`` with a component over ``NAME_MAX``, usually 255 bytes), reported once a
process, naming the variable, its value and the rule: the cache only saves compile time, so no
problem of it stops an op's construction.
"""

from __future__ import annotations

import hashlib
import warnings

from epgen.cache import find_code_object
from epgen.codegen.render import RUNTIME_OPTIONS
from epgen.device import device_arch

_FUNCTIONS: dict[tuple[int, str], object] = {}


def load_kernel(text: str, entry: str):
    """The kernel ``entry`` of source ``text``, loaded for the current CuPy device, its module
    loaded now (not at the first launch). Lookup order: the module docstring.

    Returns:
        cupy.RawKernel-like function object, launchable with ``(grid, block, args, stream=...)``.

    Raises:
        cupy.cuda.compiler.CompileException: no usable cached code object, and the runtime
            compiler rejected the source.
    """
    return load_kernel_from(text, entry)[0]


def load_kernel_from(text: str, entry: str) -> tuple[object, str]:
    """``load_kernel``, and where the function came from: ``"memory"`` (this process loaded it
    before), ``"cache"`` (the ahead-of-time cache) or ``"compiled"`` (a runtime compile)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    memo = (device, hashlib.sha256(text.encode()).hexdigest())
    fn = _FUNCTIONS.get(memo)
    if fn is not None:
        return fn, "memory"
    fn, origin = _load_cached(text, entry, device_arch(device)), "cache"
    if fn is None:
        fn, origin = cupy.RawModule(code=text, options=RUNTIME_OPTIONS).get_function(entry), "compiled"
        fn.kernel  # noqa: B018  (compiles now: construction compiles, launches never do)
    _FUNCTIONS[memo] = fn
    return fn, origin


def _load_cached(text: str, entry: str, arch: str):
    """The function from the ahead-of-time cache, or None (a miss, or a file the driver rejects)."""
    import cupy

    path = find_code_object(text, arch)
    if path is None:
        return None
    # Loading a file compiles nothing and needs no hipcc, which a ROCm image may lack (CuPy's
    # source, 6b6d956): cupy/_core/raw.pyx RawModule.__init__ with path= keeps no options, and
    # _get_raw_module's path branch is `mod = Module(); mod.load_file(path)` (cupy/cuda/function.pyx
    # Module.load_file: driver.moduleLoad). Only the code= branch compiles: compile_with_cache ->
    # cupy/cuda/compiler.py _compile_with_cache_hip, which runs `hipcc -x hip -E -v /dev/null` for
    # include folders (cupy/_environment.py _get_hipcc_include_dirs, RuntimeError without hipcc).
    try:
        fn = cupy.RawModule(path=str(path)).get_function(entry)
        fn.kernel  # noqa: B018  (loads the module now, so a bad file shows here, not at a launch)
    except cupy.cuda.driver.CUDADriverError as e:
        warnings.warn(f"{path}: the driver cannot load {entry} from it ({e}) (run epgen build again, or delete "
                      "the file); compiling at runtime instead", RuntimeWarning, stacklevel=2)
        return None
    return fn
