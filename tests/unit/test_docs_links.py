"""References to documents name documents and sections that exist in the repository.

The design document the project was started from lives outside the repository; users and
contributors have only the repository. Code and docs once cited it (43 places, issue 37): a
reader could not follow any of them. Every such reference now names a page of the repository
and a section heading in it, in the form ``docs/engine.md, "Recovery (global)"`` (also
``docs/engine.md "Savepoints"``, ``docs/engine.md ("Crash tests")``, single quotes in
messages, and relative Markdown links ``[`x.md`](x.md), "Heading"`` inside ``docs/``).

The rules:

* no file of the repository cites the outside design document;
* every ``docs/*.md`` and ``bench/*.md`` path named anywhere exists;
* every section a reference names is a heading of that page, or the bold title that opens a
  paragraph or a list item (the decisions of ``docs/checkpointing.md``): its text itself, or
  its text without its qualifier (``"Bounded runs"`` for ``Bounded runs (`--until-idle`)``,
  ``"Restoring after a code change"`` for ``Restoring after a code change: renamed, ...``).
  Backticks do not count.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Spelled in two parts so that this file does not cite it itself.
_OUTSIDE_DESIGN = "DESIGN" + ".md"

_SKIP_DIRS = {".git", ".venv", "bench/.venvs", "build", "dist", "out", ".eosflow"}
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".ini", ".json", ""}

# A page of the repository: docs/<name>.md, bench/<path>.md, README.md, CHANGELOG.md.
_PAGE = r"(?:docs/[\w-]+\.md|bench/[\w/-]+\.md|README\.md|CHANGELOG\.md)"
# The section: "X" (one line break allowed, a comment's '#' too) or 'X' (in messages).
_SECTION = r"(?:\"(?P<dq>[^\"\n]{1,150}(?:\n[ \t#]*[^\"\n]{1,150})?)\"|'(?P<sq>[^'\n]{1,150})')"
# page, then the section: `, "X"`, ` "X"`, ` ("X"`, or the link form `](page), "X"`.
_REFERENCE = re.compile(r"(?<![\w./-])(?P<page>" + _PAGE + r")\)?(?:,\s*|\s+)\(?" + _SECTION)
# Inside docs/: a sibling page by its bare name or a relative link, then the section.
_RELATIVE = re.compile(r"(?:\]\(|(?<![\w./`-]))(?P<page>[\w-]+\.md)\)?,\s*" + _SECTION)
_PAGE_PATH = re.compile(r"(?<![\w./-])((?:docs|bench)/[\w/-]+\.md)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# A paragraph or list item that opens with a bold title (the decisions of
# docs/checkpointing.md, the items of docs/brokers.md's "Tansu's differences").
_BOLD_TITLE = re.compile(r"^(?:[ \t]*[-*][ \t]+)?\*\*(.+?)\*\*", re.MULTILINE)


def _repository_files() -> list[Path]:
    """The files of the repository: git's view (tracked and new, not ignored), or a walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
        return [ROOT / n for n in names if (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for path in ROOT.rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel == d or rel.startswith(d + "/") for d in _SKIP_DIRS):
                continue
            if "__pycache__" in path.parts or not path.is_file():
                continue
            found.append(path)
        return found


def _text_files() -> Iterator[tuple[Path, str]]:
    for path in _repository_files():
        if path.suffix not in _TEXT_SUFFIXES:
            continue
        try:
            yield path, path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _normal(text: str) -> str:
    """A section name as compared: no backticks, one space between words."""
    text = re.sub(r"\s*\n[ \t#]*", " ", text)
    return " ".join(text.replace("`", "").split())


def _headings(page: Path) -> set[str]:
    """The sections of a page: its headings and the bold titles that open a paragraph or item."""
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)  # code blocks
    titles = _HEADING.findall(text) + _BOLD_TITLE.findall(text)
    return {_normal(t).rstrip(".") for t in titles}


def _names_heading(section: str, headings: set[str]) -> bool:
    wanted = _normal(section)
    return any(
        h == wanted or h.startswith(tuple(wanted + c for c in (" (", ":", ";"))) for h in headings
    )


def _references(path: Path, text: str) -> Iterator[tuple[int, Path, str]]:
    for m in _REFERENCE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, ROOT / m["page"], m["dq"] or m["sq"]
    if path.suffix == ".md" and path.parent == ROOT / "docs":
        for m in _RELATIVE.finditer(text):
            yield text.count("\n", 0, m.start()) + 1, path.parent / m["page"], m["dq"] or m["sq"]


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT).as_posix()}:{line}"


def test_no_file_cites_the_design_document_outside_the_repository() -> None:
    """Regression: 43 references to a document users do not have (issue 37)."""
    found = [
        _where(path, text.count("\n", 0, m.start()) + 1)
        for path, text in _text_files()
        for m in re.finditer(re.escape(_OUTSIDE_DESIGN), text)
    ]
    assert not found, (
        f"{_OUTSIDE_DESIGN} is not in the repository, so a reader cannot follow these references: "
        f"{found}. Point each at the page of docs/ that covers it, with its heading "
        '(docs/engine.md, "Recovery (global)"); add the content there if no page has it.'
    )


def test_cited_docs_pages_exist() -> None:
    missing = [
        f"{_where(path, text.count(chr(10), 0, m.start()) + 1)} names {m[1]}"
        for path, text in _text_files()
        for m in _PAGE_PATH.finditer(text)
        if not (ROOT / m[1]).is_file()
    ]
    assert not missing, f"pages that do not exist: {missing}"


def test_cited_sections_are_headings_of_their_page() -> None:
    """Regression: references named "Joins", "GC", "Record IDs" where no such heading was."""
    wrong = []
    checked = 0
    for path, text in _text_files():
        for line, page, section in _references(path, text):
            if not page.is_file():
                continue  # test_cited_docs_pages_exist reports it
            checked += 1
            if not _names_heading(section, _headings(page)):
                wrong.append(
                    f'{_where(path, line)}: {page.relative_to(ROOT).as_posix()}, "{section}"'
                )
    assert checked > 40, f"only {checked} references found: is the pattern still the one used?"
    assert not wrong, (
        "these references name a section that is not a heading of the page (use the heading's "
        f"text, or its text before ' (' or ':'): {wrong}"
    )


@pytest.mark.parametrize(
    ("section", "ok"),
    [
        ("Bounded runs", True),
        ("Bounded runs (`--until-idle`)", True),
        ("Bounded", False),
        ("Joins", False),
        ("Tables and joins", True),
    ],
)
def test_a_section_is_a_heading_or_the_heading_without_its_qualifier(
    section: str, ok: bool
) -> None:
    headings = {_normal("Bounded runs (`--until-idle`)"), _normal("Tables and joins")}
    assert _names_heading(section, headings) is ok
