"""The README's install lines resolve from PyPI alone (``pip install --dry-run``, nothing installed).

The resolve is marked ``network`` and deselected by default (pyproject.toml ``addopts``): it needs
PyPI and takes about a minute (torch's CUDA dependencies publish no separate metadata, so the
resolver downloads their wheels). ``.ci/run`` runs it with ``-m network``. ``--isolated`` ignores pip's configuration and ``PIP_*`` variables (a local index or
wheel folder) and ``--ignore-installed`` what is already installed (a local CPU torch build): either
could hide a conflict between our pins and torch's that a fresh machine meets.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple/pip/"
RESOLVE_TIMEOUT_S = 600


def readme_install_lines() -> list[str]:
    """The ``python -m pip install`` commands of the README's first code block, up to ``&&``."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "README.md has no ```bash block with the install commands"
    return [ln.split("&&")[0].strip() for ln in block.group(1).splitlines() if ln.startswith("python -m pip install ")]


def _dry_run(line: str) -> subprocess.CompletedProcess:
    args = shlex.split(line)[len(("python", "-m", "pip", "install")):]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--isolated", "--ignore-installed",
           "--quiet", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S, check=False)


def test_readme_has_both_install_lines():
    lines = readme_install_lines()
    assert len(lines) == 2 and all('"torch==' in ln and "-e" in ln for ln in lines), lines


@pytest.mark.network
def test_readme_install_lines_resolve_from_pypi():
    try:
        urllib.request.urlopen(PYPI, timeout=5).close()
    except OSError as exc:
        pytest.skip(f"PyPI unreachable ({PYPI}: {exc}): cannot check the README's install lines")
    lines = readme_install_lines()
    with ThreadPoolExecutor(max_workers=len(lines)) as pool:
        results = list(pool.map(_dry_run, lines))
    failed = [f"{line}\n  exit {r.returncode}: "
              + "\n  ".join([ln for ln in r.stderr.splitlines() if "ERROR" in ln or "depends on" in ln]
                            or r.stderr.splitlines()[-10:])
              for line, r in zip(lines, results) if r.returncode != 0]
    assert not failed, "README install lines do not resolve from PyPI:\n" + "\n".join(failed)
