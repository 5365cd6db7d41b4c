"""What more than one of the CLI test files (test_cli_*.py) uses: ``OPS``, ``run``, ``_usage_error``,
``_fake_report_rows``."""

import subprocess
import sys

import pytest

from epgen.cli import main
from epgen.codegen.spec import LOW_LATENCY_OPS, CALLS


OPS = [op.value for op in CALLS + LOW_LATENCY_OPS]
"""The kernels of one rank-layout shape (EpConfig's default kernel_family "auto": both families), in order."""


def run(*argv):
    return subprocess.run([sys.executable, "-m", "epgen", *argv], capture_output=True, text=True, timeout=300)


def _usage_error(argv, capsys) -> str:
    """Run ``epgen argv`` in-process; assert it is a usage error (exit 2, no traceback); its stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err


def _fake_report_rows(specs) -> list[dict]:
    """Report rows of ``specs`` (KernelSpecs) from made-up resources shaped like the offline
    compilers' (3-digit VGPRs, AGPRs on gfx950, SGPRs on AMD), so no compiler is needed."""
    return [{"arch": s.arch, "op": s.op.value, "entry": s.name, "spec": s.as_dict(), "compiler": f"{s.arch} compiler 1.0",
             "registers": 100 + i % 28, "agprs": 0 if s.arch == "gfx950" else None,
             "sgprs": None if s.arch == "sm_90" else 40 + i % 30, "scratch_bytes": 0, "spill_bytes": 0,
             "shared_bytes": 104, "occupancy": 1 + i % 16, "occupancy_unit": "blocks/SM", "status": "ok"}
            for i, s in enumerate(specs)]
