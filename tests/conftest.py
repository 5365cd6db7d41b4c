import faulthandler
import os

import pytest

GPU_TEST_TIMEOUT_S = float(os.environ.get("EPGEN_GPU_TEST_TIMEOUT", "300"))
"""Bound of one GPU test; past it every thread's stack is printed and pytest exits (a kernel or
collective that never returns cannot be interrupted any other way)."""


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no GPU: torch.cuda.is_available() is False"
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"CuPy is not installed ({e}); pip install -e .[cuda]"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        import torch

        if torch.cuda.device_count() >= 2:
            return
        skip = pytest.mark.skip(reason=f"needs 2 GPUs, found {torch.cuda.device_count()}")
        for item in items:
            if item.get_closest_marker("multigpu"):
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("multigpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_test_watchdog(request):
    """Arm ``GPU_TEST_TIMEOUT_S`` around every gpu / multigpu test (faulthandler's watchdog thread
    fires even while the main thread is blocked in a CUDA call)."""
    guarded = request.node.get_closest_marker("gpu") or request.node.get_closest_marker("multigpu")
    if guarded:
        faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True)
    yield
    if guarded:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """The tuning tables live in ``tmp_path`` for the test (``tuning.write_entry`` writes there)."""
    from epgen.codegen import tuning

    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning._table.cache_clear()
    yield tmp_path
    tuning._table.cache_clear()
