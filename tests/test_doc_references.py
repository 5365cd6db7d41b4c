"""Every place the code names a page of the documentation, the page is there: a mention of
``README.md`` or ``docs/<page>.md`` in the sources (``codegen/``, ``runtime/``, ``templates/``,
``tools/``) names a file of the checkout, and a quoted section after it (``docs/moe.md, "Which
alignment"``) is text of that page (a heading or a bullet's lead)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("codegen", "runtime", "templates", "tools")
REFERENCE = re.compile(r"\b(README(?:\.md)?|docs/[\w/.-]+?\.md)(?:(?:,|'s)? \"([^\"]+)\")?")
"""A page named in a source, and the quoted section that may follow it."""


def _broken(root: Path) -> list[str]:
    bad = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".py", ".j2", ".sh") or not path.is_file():
                continue
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                for page, section in REFERENCE.findall(line):
                    target = root / ("README.md" if page.startswith("README") else page)
                    where = f"{path.relative_to(root)}:{line_no}"
                    if not target.is_file():
                        bad.append(f"{where}: {page} is not a file of the checkout")
                    elif section and section not in target.read_text():
                        bad.append(f"{where}: {page} has no section {section!r}")
    return bad


def test_every_page_the_code_names_exists_with_its_section():
    bad = _broken(ROOT)
    assert not bad, "references to documentation that is not there:\n  " + "\n  ".join(bad)


def test_a_missing_page_and_a_missing_section_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "moe.md").write_text("# Expert layout\n* Which alignment: ...\n")
    (tmp_path / "README.md").write_text("# epgen\n## Tests\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "op.py").write_text('"""Contract: README.md, "Contract". See docs/moe.md, "Which '
                                                'alignment" and docs/gone.md; README "Tests"."""\n')
    assert _broken(tmp_path) == ["runtime/op.py:1: README.md has no section 'Contract'",
                                 "runtime/op.py:1: docs/gone.md is not a file of the checkout"]
