"""epgen.codegen: specs, arch traits, rendering, the catalogue and offline compile checks.

Everything here runs without a GPU.
"""

SCHEMA_VERSION = 2
"""Version of the generated-source schema; printed in every source header. Bump it when the
meaning of a spec field or the kernel ABI changes: the tables of ``epgen.codegen.abi`` (argument
structs, signal words, error codes, wait phases) or the arena layout (``spec.ARENA_REGIONS``)."""
