"""``epgen.config``: where users import ``EpConfig`` and ``Geometry`` from. Both are defined in
``epgen.codegen.config`` (they need only the codegen package); this module re-exports them."""

from epgen.codegen.config import EpConfig, Geometry

__all__ = ["EpConfig", "Geometry"]
