"""The check before a code object is cached or loaded: is it a complete ELF file for the arch?

Both vendors' code objects are 64-bit little-endian ELF files: AMD's ``.hsaco`` (``e_machine``
224, ``EM_AMDGPU``, the ``EF_AMDGPU_MACH`` target in the low byte of ``e_flags``, the code object
version in ``EI_ABIVERSION``) and NVIDIA's
CUBIN (``e_machine`` 190, ``EM_CUDA``, the SM in the low byte of ``e_flags`` for ELF ABI
version 7, in bits 8-15 for later ones). ``ElfFormat`` holds what differs; each toolchain
module names its own.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import attrs

_ELFABIVERSION_CUDA_V1 = 7  # CUBINs of this ELF ABI keep the SM in the low byte of e_flags
_SHT_NOBITS = 8
_EI_ABIVERSION = 8
_AMDGPU_HSA_ABI_VERSIONS = {4: 2, 5: 3, 6: 4}
"""AMD code object version -> ``EI_ABIVERSION`` (``ELFABIVERSION_AMDGPU_HSA_V4`` ... ``_V6``,
LLVM's AMDGPUUsage)."""


@attrs.frozen
class ElfFormat:
    """The vendor-specific part of a code object's ELF header.

    Attributes:
        machine: the ``e_machine`` value.
        machine_name: its ELF name (``EM_...``), for messages.
        target: reads the target number (``ArchTraits.elf_mach``) from the image and its
            ``e_flags``.
        abi_version: the ``EI_ABIVERSION`` every image must have, or None (not checked).
        abi_names: ``EI_ABIVERSION`` -> what it means, for messages.
    """

    machine: int
    machine_name: str
    target: Callable[[bytes, int], int]
    abi_version: int | None = None
    abi_names: dict[int, str] = attrs.field(factory=dict)


def amdgpu(code_object_version: int) -> ElfFormat:
    """The AMD code object format of ``code_object_version`` (4, 5 or 6; KeyError otherwise)."""
    return ElfFormat(224, "EM_AMDGPU", lambda image, flags: flags & 0xFF,
                     _AMDGPU_HSA_ABI_VERSIONS[code_object_version],
                     {abi: f"code object v{v}" for v, abi in _AMDGPU_HSA_ABI_VERSIONS.items()})


CUDA = ElfFormat(
    190, "EM_CUDA",
    lambda image, flags: flags & 0xFF if image[8] == _ELFABIVERSION_CUDA_V1 else (flags >> 8) & 0xFF,
)


def problem(image: bytes, arch: str, elf_mach: int, fmt: ElfFormat) -> str | None:
    """Why ``image`` is not a complete code object of ``fmt`` for target ``elf_mach``, or None.

    Checks the ELF header (64-bit little-endian, ``fmt.machine``, ``fmt.abi_version`` where it is
    set, the target number in ``e_flags``) and that the program and section header tables and
    every section lie inside ``image``, which catches a truncated file. It does not checksum the contents: the driver's
    own load is the last check. ``arch`` only names the target in the message.
    """
    if len(image) < 64 or image[:4] != b"\x7fELF":
        return f"not an ELF file ({len(image)} bytes)"
    if image[4] != 2 or image[5] != 1:
        return "not a 64-bit little-endian ELF file"
    (machine,) = struct.unpack_from("<H", image, 18)
    if machine != fmt.machine:
        return f"ELF machine {machine}, not {arch}'s {fmt.machine} ({fmt.machine_name})"
    abi = image[_EI_ABIVERSION]
    if fmt.abi_version is not None and abi != fmt.abi_version:
        return (f"ELF ABI version {abi} ({fmt.abi_names.get(abi, 'unknown')}), not {fmt.abi_version} "
                f"({fmt.abi_names[fmt.abi_version]}, the version epgen builds)")
    phoff, shoff, flags = struct.unpack_from("<QQI", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 54)
    mach = fmt.target(image, flags)
    if mach != elf_mach:
        return f"built for ELF target {mach:#x}, not {arch} ({elf_mach:#x})"
    tables_end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    if tables_end > len(image):
        return f"truncated: {len(image)} bytes, but its header tables end at byte {tables_end}"
    for i in range(shnum):
        (kind,) = struct.unpack_from("<I", image, shoff + i * shentsize + 4)
        offset, size = struct.unpack_from("<QQ", image, shoff + i * shentsize + 24)
        if kind != _SHT_NOBITS and offset + size > len(image):
            return f"truncated: {len(image)} bytes, but section {i} ends at byte {offset + size}"
    return None
