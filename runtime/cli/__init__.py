"""``epgen.cli``: the command line, the outermost wing of ``epgen``.

The ``epgen`` console script (``epgen.cli:main``) and ``python -m epgen`` enter here.
``commands`` holds the parser and the verbs; ``flags`` turns flags into the ``EpConfig`` and
``KernelSpec`` lists they describe; ``options`` the verb-specific options and their defaults
(torch-free, so ``epgen --help`` loads no torch); ``progress`` the progress bar. The GPU verbs
are modules of their own, each a function of an ``EpConfig`` and its options: ``demo``,
``moe_demo``, ``bench``, ``bench_nodes``, ``tune``, ``stress``, and ``import_timing`` (``epgen
build --time-import``).

Rule (``tests/codegen/test_imports.py``): the command line may import every other wing (core,
references, layers, harness); nothing imports it but ``epgen.__main__``. A module that a library
user or a test harness needs does not belong here.
"""

from epgen.cli.commands import main

__all__ = ["main"]
