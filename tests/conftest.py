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
    """Skip gpu and processes tests, with the reason, where no GPU can run them. A processes test
    runs its W processes on W GPUs when there are enough, else all on cuda:0 (``epgen.harness.ranks``):
    one GPU is enough."""
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("processes"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_test_watchdog(request):
    """Arm ``GPU_TEST_TIMEOUT_S`` around every gpu / processes test (faulthandler's watchdog thread
    fires even while the main thread is blocked in a CUDA call)."""
    guarded = request.node.get_closest_marker("gpu") or request.node.get_closest_marker("processes")
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
