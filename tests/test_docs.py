"""The docs stand on their own: the README starts with the two commands, every page a doc names
exists in the repository, a section named in another page exists there, and no doc points
outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
PAGE_NAME = re.compile(r"`?((?:\.\./|docs/)?[A-Z][A-Z_]*\.md)`?")
SECTION_REF = re.compile(r"\b([A-Z][A-Z_]*\.md)`?,? \"([^\"]+)\"")


def resolve(page: Path, name: str) -> Path:
    if name.startswith("docs/"):
        return ROOT / name
    return (page.parent / name).resolve()


def titles(page: Path) -> list[str]:
    """Headings and bold run-in titles, the places a section reference may point at."""
    text = page.read_text()
    headings = re.findall(r"(?m)^#+ (.+)$", text)
    return headings + re.findall(r"\*\*([^*]+)\*\*", text)


def test_readme_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make run", "make test"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_pages_exist(page: Path) -> None:
    for name in PAGE_NAME.findall(page.read_text()):
        assert resolve(page, name).is_file(), f"{page.name} names {name}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_sections_exist(page: Path) -> None:
    for name, quoted in SECTION_REF.findall(page.read_text()):
        section = " ".join(quoted.split())  # a reference may wrap across lines
        target = ROOT / "docs" / name
        assert any(t.startswith(section) for t in titles(target)), (
            f'{page.name} points to {name} "{section}", which has no such section'
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_pointers_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    home_paths = r"(?:^|[\s`(])/(?:home|root|Users)/"  # a machine's path, not the repository's
    for pattern in (home_paths, r"\bissue #?\d+", r"\bseed \d{3}\b"):
        assert not re.search(pattern, text, re.I), f"{page.name} matches {pattern}"
