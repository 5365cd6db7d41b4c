"""The ROCm release each AMD arch needs, the HIP runtime check, and the launch argument's size
against HIP's kernel-argument limit (``epgen.platform``), on the CPU: the op's refusals run in
``test_fake_rocm.py``'s ranks."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from epgen.codegen.arch import ARCH_TRAITS
from epgen.op import _args_dtype, max_hip_world_size
from epgen.platform import HIP_KERNEL_ARGS_BYTES, MIN_ROCM, ROCM_FLOOR, Platform, hip_version

sys.path.insert(0, str(Path(__file__).parent))
from rocm_surface import SURFACE, problem  # noqa: E402

AMD_ARCHES = [name for name, t in ARCH_TRAITS.items() if t.vendor == "amd"]


def test_every_amd_arch_names_its_rocm_release_at_or_above_the_wheels_floor():
    assert AMD_ARCHES and sorted(MIN_ROCM) == sorted(AMD_ARCHES)
    for arch in AMD_ARCHES:
        need, why = MIN_ROCM[arch]
        assert need >= ROCM_FLOOR and why, arch
    hip = [lib for lib in SURFACE["runtime_links"] if lib.startswith("libamdhip64.so.")]
    assert hip == [f"libamdhip64.so.{ROCM_FLOOR[0]}"]  # the wheel's runtime extension links ROCm 7's HIP


def test_hip_versions_decode_as_hip_version_h_encodes_them():
    assert hip_version(70051831) == (7, 0, 51831)
    assert hip_version(60443483) == (6, 4, 43483)
    assert hip_version(71400000) == (7, 14, 0)


@pytest.mark.parametrize("arch", AMD_ARCHES)
def test_an_older_runtime_is_refused_naming_version_arch_release_and_reason(monkeypatch, arch):
    need, why = MIN_ROCM[arch]
    encoded = {"version": 0}
    runtime = types.SimpleNamespace(runtimeGetVersion=lambda: encoded["version"])
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    assert problem("cupy.cuda.runtime.runtimeGetVersion") is None  # hipRuntimeGetVersion in the wheel
    rocm = Platform(rocm=True)
    encoded["version"] = need[0] * 10_000_000 + need[1] * 100_000 + 12345
    rocm.check_runtime(arch)  # the release itself passes
    older = (need[0], need[1] - 1) if need[1] else (need[0] - 1, 9)
    encoded["version"] = older[0] * 10_000_000 + older[1] * 100_000 + 12345
    with pytest.raises(RuntimeError) as info:
        rocm.check_runtime(arch)
    assert str(info.value) == (f"HIP runtime {older[0]}.{older[1]}.12345: epgen on {arch} needs ROCm "
                               f"{need[0]}.{need[1]} or later ({why}); install a newer ROCm (docs/rocm.md)")
    Platform(rocm=False).check_runtime(arch)  # CUDA: no HIP runtime to read


def test_the_launch_argument_is_88w_plus_24_bytes_and_w_above_46_is_refused_on_rocm():
    for W in range(1, 65):
        assert _args_dtype(W).itemsize == 88 * W + 24
    assert max_hip_world_size() == 46 and 88 * 46 + 24 <= HIP_KERNEL_ARGS_BYTES < 88 * 47 + 24
    Platform(rocm=True).check_kernel_args(88 * 46 + 24, 46, 46)
    with pytest.raises(ValueError, match=r"^EpConfig\.world_size=64: the launch argument \(struct EpArgs, 88 x W \+ 24 "
                                         r"= 5656 bytes\) exceeds the 4096 bytes of kernel arguments epgen passes to a "
                                         r"HIP launch; world_size <= 46 on ROCm$"):
        Platform(rocm=True).check_kernel_args(88 * 64 + 24, 64, 46)
    Platform(rocm=False).check_kernel_args(88 * 64 + 24, 64, 46)  # CUDA 12.1+: 32,764 bytes
