"""The GPU as torch and CuPy see it: its arch name and CuPy's view of torch's current stream."""

from __future__ import annotations

def device_arch(device_index: int) -> str:
    """Target name of a torch device: ``sm_<major><minor>`` on CUDA, the gfx name on ROCm."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


_STREAMS: dict[int, object] = {}


def cupy_stream(device):
    """CuPy's view of torch's current stream on ``device`` (cached per stream)."""
    import cupy
    import torch

    ts = torch.cuda.current_stream(device)
    s = _STREAMS.get(ts.cuda_stream)
    if s is None:
        s = cupy.cuda.Stream.from_external(ts) if hasattr(ts, "__cuda_stream__") else \
            cupy.cuda.ExternalStream(ts.cuda_stream, ts.device.index)
        _STREAMS[ts.cuda_stream] = s
    return s
