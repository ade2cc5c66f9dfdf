"""The docs stand on their own: the README starts with the two commands, every page a doc names
exists in the repository, a section named in another page exists there, and no doc points
outside the repository. Their `kvmesh` commands use flags the parsers have, and a `kvmesh serve`
command in a code block carries the cluster token it needs to start. The repository paths they
name exist, and so do the tests they cite."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path

import pytest

from kvmesh.cli.main import build_parser
from kvmesh.cli.serve import ROLES

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


# Commands: every `--flag` after `kvmesh SUBCOMMAND` in a page (code blocks and inline code) is
# one that subcommand's parser has. BENCHMARKS.md and CHANGELOG.md record past runs as they ran.
COMMAND_PAGES = [p for p in PAGES if p.name not in {"BENCHMARKS.md", "CHANGELOG.md"}]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w*-])")  # not `--tls-*`
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
TOKEN_FLAGS = {"--cluster-token-file", "--insecure-no-auth"}
TOKEN_ENV = {"KVMESH_CLUSTER_TOKEN", "KVMESH_CLUSTER_TOKEN_FILE"}


def code_blocks(text: str) -> list[str]:
    """Lines of the fenced code blocks, a line continued with a backslash joined to the next."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def kvmesh_commands(line: str) -> list[tuple[list[str], list[str]]]:
    """(environment assignments, words after `kvmesh`) of each kvmesh command on a line."""
    commands = []
    for part in re.split(r" \| |&&|;|\$\(", line.replace("\\|", "|").split(" #")[0]):
        words = part.split()
        env = []
        while words and ENV_ASSIGNMENT.match(words[0]):
            env.append(words.pop(0))
        if words and (words[0] == "kvmesh" or words[0].endswith("/kvmesh")):
            commands.append((env, words[1:]))
    return commands


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    if parser.prog == "kvmesh serve":  # each role parses the rest of the command itself
        return {role: role_parser(role) for role in ROLES}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def role_parser(role: str) -> argparse.ArgumentParser:
    module = importlib.import_module(ROLES[role][0])
    if hasattr(module, "build_parser"):
        return module.build_parser()  # type: ignore[no-any-return]
    from kvmesh.service.options import parser

    return parser(role, transfer=role != "colocated")


def resolve_command(
    parser: argparse.ArgumentParser, words: list[str]
) -> tuple[list[argparse.ArgumentParser], list[str]]:
    """The parsers a command's subcommand words name (every alternative of `a|b` or of a
    placeholder such as ROLE) and the words left for them; none for a message (`ROLE:`)."""
    i = 0
    while i < len(words) and (choices := subcommands(parser)) is not None:
        word = words[i]
        if word.startswith("-"):  # an option of the command itself (`kvmesh --log-format json`)
            action = parser._option_string_actions.get(word)
            i += 2 if action is not None and action.nargs != 0 else 1
        elif word.endswith(":"):
            return [], []
        elif word in choices:
            parser, i = choices[word], i + 1
        elif all(name in choices for name in word.split("|")):
            return [choices[name] for name in word.split("|")], words[i + 1 :]
        elif word.isupper() or word == "...":
            return list(dict.fromkeys(choices.values())), words[i + 1 :]
        else:
            break
    return [parser], words[i:]


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: p.name)
def test_command_flags_exist(page: Path) -> None:
    top = build_parser()
    text = page.read_text()
    for line in code_blocks(text) + inline_code(text):
        for _env, words in kvmesh_commands(line):
            parsers, rest = resolve_command(top, words)
            for flag in FLAG.findall(" ".join(rest)):
                for parser in parsers:
                    assert flag in parser._option_string_actions, (
                        f"{page.name}: `{parser.prog}` has no {flag} ({line.strip()})"
                    )


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: p.name)
def test_serve_commands_carry_a_cluster_token(page: Path) -> None:
    """`kvmesh serve ROLE` refuses to start without a cluster token (or --insecure-no-auth)."""
    for line in code_blocks(page.read_text()):
        for env, words in kvmesh_commands(line):
            if words[:1] != ["serve"] or words[-1:] == ["..."] or "--help" in words:
                continue
            token = [w for w in words if w.split("=")[0] in TOKEN_FLAGS]
            token += [e for e in env if e.split("=")[0] in TOKEN_ENV]
            assert token, f"{page.name}: `{line.strip()}` exits 2: no cluster token"


# Code the pages name (the same pages): a backticked path that starts with one of the
# repository's folders (`kvmesh/engine/engine.py`, `deploy/k8s/`, `tests/x.py::test_y`; in a code
# block too) exists; a shorter one (`native/layers.py`, `ledger.py` in its section's table) ends
# some file's path; a cited test (`test_...`) is defined under tests/.
PRUNED = {".git", ".venv", ".bench", "__pycache__", "node_modules"}
TOP_FOLDERS = {
    p.name
    for p in ROOT.iterdir()
    if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".egg-info")
}
CODE_SUFFIXES = {".py", ".pyi", ".proto", ".sh", ".cpp", ".h"}
REPO_PATH = re.compile(r"((?:[\w-]+/)*[\w-]+\.[a-z]+|(?:[\w-]+/)+)(?:::(\w+))?")
BLOCK_PATH = re.compile(rf"(?<![\w/.$-])(?:{'|'.join(sorted(TOP_FOLDERS))})/[\w./-]*")


def repository_files() -> list[str]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in PRUNED and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(folder, name), ROOT) for name in names]
    return files


FILES = repository_files()


def checked(path: str) -> bool:
    """Not checked: a folder below the section's (`memory/`), a file name that is not source
    code (`config.json`, a model's)."""
    if path.split("/")[0] in TOP_FOLDERS:
        return True
    return not path.endswith("/") and ("/" in path or Path(path).suffix in CODE_SUFFIXES)


def find(path: str) -> Path | None:
    if path.split("/")[0] in TOP_FOLDERS:
        return ROOT / path if (ROOT / path).exists() else None
    found = [f for f in FILES if f == path or f.endswith("/" + path)]
    return ROOT / found[0] if found else None


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: p.name)
def test_named_paths_exist(page: Path) -> None:
    text = page.read_text()
    for span in inline_code(text):
        match = REPO_PATH.fullmatch(span.strip())
        if match is None or not checked(match[1]):
            continue
        found = find(match[1])
        assert found is not None, f"{page.name} names `{span}`, which does not exist"
        if match[2] is not None:
            assert re.search(rf"def {match[2]}\b", found.read_text()), (
                f"{page.name} names `{span}`: {match[1]} defines no {match[2]}"
            )
    for line in code_blocks(text):
        for path in BLOCK_PATH.findall(line):
            if path.endswith("/") or "." in path.rsplit("/", 1)[-1]:  # not `deploy/NAME`
                assert find(path) is not None, f"{page.name}: `{line.strip()}` names {path}"


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: p.name)
def test_cited_tests_exist(page: Path) -> None:
    tests = [f for f in FILES if f.startswith("tests/") and f.endswith(".py")]
    defined = {Path(f).stem for f in tests}
    defined |= set(re.findall(r"def (test_\w+)", "\n".join((ROOT / f).read_text() for f in tests)))
    for span in inline_code(page.read_text()):
        for name in re.findall(r"(?<![\w/.])test_\w+(?![\w.])", span):
            assert name in defined, f"{page.name} cites {name}, which no test under tests/ defines"
