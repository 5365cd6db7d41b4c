import pytest


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
            if "multigpu" in item.keywords:
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)
