"""Render a KernelSpec into one self-contained translation unit.

The platform layer is pulled in with Jinja ``{% include %}`` (not ``#include``), so the text alone
is the identity of the kernel: CuPy's disk cache keys on the source string and options.
"""

from __future__ import annotations

import functools
import importlib.resources

import attrs
import jinja2

from epgen.codegen import SCHEMA_VERSION
from epgen.codegen.arch import traits
from epgen.codegen.spec import KernelSpec

RUNTIME_OPTIONS = ("-std=c++17",)
"""Options every runtime compile passes (CuPy RawModule); part of the cache key."""


@attrs.frozen
class Source:
    """A rendered kernel.

    Attributes:
        spec: the spec it was rendered from.
        text: the translation unit (starts with a header comment naming the spec and schema).
        entry: the ``extern "C"`` kernel name (``spec.name``).
        key: sha256 of text and runtime options.
    """

    spec: KernelSpec
    text: str
    entry: str
    key: str

    @property
    def filename(self) -> str:
        """``<entry><suffix>``, the name used in ``generated/<arch>/``."""
        return self.entry + self.spec.traits.suffix


class RenderError(ValueError):
    """A template met a value it has no branch for (``{{ refuse(...) }}`` in a template)."""


def refuse(message: str):
    """The templates' ``refuse(message)``: fail the render with ``message`` where a branch on a
    name (wire element, fp8 flavour) meets a name it does not know, instead of falling through.

    Raises:
        RenderError: always.
    """
    raise RenderError(message)


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The one Jinja environment: package templates, StrictUndefined, stable whitespace, and
    ``refuse`` for the templates' branches on names."""
    root = importlib.resources.files("epgen.templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["refuse"] = refuse
    return env


@functools.lru_cache(maxsize=4096)
def render(spec: KernelSpec) -> Source:
    """Render ``spec`` into a Source; the same spec always gives byte-identical text.

    Raises:
        jinja2.UndefinedError: a template names a variable ``template_vars()`` lacks.
        RenderError: a template has no branch for one of the spec's names (``refuse``).
    """
    template = environment().get_template(f"ops/{spec.op.template}.j2")
    text = template.render(**spec.template_vars())
    return Source(spec=spec, text=text, entry=spec.name, key=spec.key(text, RUNTIME_OPTIONS))


HOST_PLATFORM = "platform/host.j2"
"""The platform layer of host renderings (``render_host``): the emulation of docs/host.md."""


@functools.lru_cache(maxsize=4096)
def render_host(spec: KernelSpec) -> Source:
    """Render ``spec`` for the host emulation (``epgen.host``): the same op template and the
    same arch traits (wave size, fp8 flavour, codec choice) as ``render``, with the host platform
    layer (``platform/host.j2``: the vendor's memory orders as C++ atomics) in place of the
    vendor's, and the launch entry ``ep_host_launch`` appended. The same spec always gives
    byte-identical text.

    Raises:
        jinja2.UndefinedError, RenderError: as ``render``.
    """
    env = environment()
    values = spec.template_vars()
    # host.j2 mirrors the memory orders of the layer the device would include (device_platform)
    values["device_platform"] = values["arch"].platform_template
    values["arch"] = attrs.evolve(values["arch"], platform_template=HOST_PLATFORM)
    text = env.get_template(f"ops/{spec.op.template}.j2").render(**values)
    text += env.get_template("platform/host_launch.j2").render(**values)
    return Source(spec=spec, text=text, entry=spec.name, key=spec.key(text, ("host",)))


def render_ceiling(arch: str, blocks: int, warps_per_block: int, unroll: int) -> tuple[str, str]:
    """(text, entry) of the P2P ceiling kernel: ``entry(src, dst, num_vectors)`` copies
    ``num_vectors`` 16-byte vectors from ``src`` to ``dst`` (typically a peer's memory)."""
    t = traits(arch)
    entry = f"epgen_p2p_ceiling_{arch.replace('_', '')}_{blocks}x{warps_per_block}_u{unroll}"
    text = environment().get_template("bench/p2p_ceiling.j2").render(
        schema_version=SCHEMA_VERSION, entry=entry, arch=t, wave_size=t.wave_size,
        threads=warps_per_block * t.wave_size, blocks=blocks, unroll=unroll)
    return text, entry
