"""FieldError: the ValueError a validated record raises, carrying the name of the bad field."""

from __future__ import annotations


class FieldError(ValueError):
    """A field of ``EpConfig`` or ``KernelSpec`` broke a rule; ``str(e)`` names the field, its
    value and the rule (e.g. ``KernelSpec.unroll=0: must be in [1, 16]``).

    Attributes:
        field: the attribute's name, e.g. ``"unroll"``, so a caller (the command line) maps it to
            the argument it came from without reading the message.
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
