"""device_arch on a faked GPU (CPU only): ROCm's gcnArchName and CUDA's compute capability map
to the arch names of ARCH_TRAITS; any other GPU is refused naming the supported arches."""

from types import SimpleNamespace

import pytest
import torch

from epgen.codegen.arch import ARCH_TRAITS
from epgen.device import device_arch


def _fake_gpu(monkeypatch, hip, **props):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    seen = []

    def get_device_properties(index):
        seen.append(index)
        return SimpleNamespace(**props)

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    return seen


@pytest.mark.parametrize("name,arch", [
    ("gfx950:sramecc+:xnack-", "gfx950"),
    ("gfx950", "gfx950"),
    ("gfx1250", "gfx1250"),
    ("gfx1250:xnack-", "gfx1250"),
    ("amdgcn-amd-amdhsa--gfx950:sramecc+:xnack-", "gfx950"),
    ("gfx942:sramecc+:xnack-", "gfx942"),
])
def test_rocm_names_drop_their_target_features(monkeypatch, name, arch):
    seen = _fake_gpu(monkeypatch, "7.0.51831", gcnArchName=name, major=9, minor=5)
    assert device_arch(3) == arch
    assert seen == [3]


def test_cuda_takes_the_compute_capability(monkeypatch):
    _fake_gpu(monkeypatch, None, major=9, minor=0, gcnArchName="")
    assert device_arch(0) == "sm_90"


@pytest.mark.parametrize("hip,props,arch,reported", [
    ("7.0.51831", dict(gcnArchName="gfx90a:sramecc+:xnack-", major=9, minor=0), "gfx90a", "gfx90a:sramecc+:xnack-"),
    ("7.0.51831", dict(gcnArchName="gfx95", major=9, minor=5), "gfx95", "gfx95"),
    (None, dict(major=8, minor=0), "sm_80", "compute capability 8.0"),
])
def test_unknown_arches_are_refused_listing_the_supported(monkeypatch, hip, props, arch, reported):
    _fake_gpu(monkeypatch, hip, **props)
    with pytest.raises(ValueError) as e:
        device_arch(1)
    assert str(e.value) == (f"GPU arch {arch!r} (device 1, {reported!r}): epgen generates kernels for "
                            f"{', '.join(ARCH_TRAITS)}")
    assert "gfx950, gfx1250, sm_90" in str(e.value)


@pytest.mark.parametrize("cached", [0, 6])
def test_free_bytes_gives_back_torchs_unused_cache_only_when_short(monkeypatch, cached):
    """The arenas are cudaMalloc'd, which cannot reach the blocks torch's caching allocator holds
    unused: ``free_bytes(device, need)`` empties that cache only where fewer than ``need`` bytes are
    free, then reads the free bytes again (a faked GPU of 4 free GiB and ``cached`` GiB in torch's
    cache, asked for 8 GiB)."""
    from epgen.platform import Platform

    state = {"free": 4 << 30, "cached": cached << 30, "emptied": False}

    def empty_cache():
        state.update(free=state["free"] + state["cached"], cached=0, emptied=True)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    platform, device = Platform(rocm=False), torch.device("cuda", 0)
    assert platform.free_bytes(device, 2 << 30) == 4 << 30 and not state["emptied"]
    assert platform.free_bytes(device, 8 << 30) == (4 + cached) << 30
    assert state["emptied"]
