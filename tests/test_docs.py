"""The README stays a short page for a researcher arriving, and neither it nor the docs site tells the
story of the project's development: no issue numbers, commit hashes, "stop N" or microsecond
timings (those belong in the git log and in benchmark output). Pure file reads, no build: the
strict docs build itself is `make docs`, which CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250

HISTORY = {
    "an issue number": re.compile(r"\bissues? \d+|#\d+", re.IGNORECASE),
    # 7 to 40 hex digits with at least one letter and one digit: a commit hash, not a number or a word
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a development stop": re.compile(r"\bstop \d+", re.IGNORECASE),
    "a microsecond figure": re.compile(r"\d+ ?us\b|µs"),
}


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def history_in(text: str) -> list[str]:
    """'line N: <what> (<match>)' for every line of `text` that tells development history."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            match = pattern.search(line)
            if match:
                found.append(f"line {number}: {what} ({match.group(0)!r})")
    return found


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it under {MAX_README_LINES} and move the rest to docs/")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_development_history(page):
    found = history_in(page.read_text())
    assert not found, f"{page.relative_to(REPO)} tells development history: " + "; ".join(found)


def test_the_history_patterns_catch_what_they_should():
    """The patterns find each kind of history and leave ordinary prose and figures alone."""
    for text in ("see issue 22", "closes #14", "as 8c123d4 did", "after stop 3", "105 us a call", "3 µs"):
        assert history_in(text), text
    for text in ("10 clients, 1,000 rounds, 2024", "alpha 0.1 at 1e-3", "status: a defaced file", "the users",
                 "# Heading", "lambda_1 of 54.73", "1000000 samples"):
        assert not history_in(text), text


def test_the_readmes_relative_links_exist():
    """A link in the README to a file of the repository (docs pages, configs) names one that exists."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    missing = [t for t in targets if "://" not in t and not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_docs_page_is_in_the_nav():
    """mkdocs --strict reports a broken link or a nav entry without a page; a page left out of the nav
    would only be an info line, so it is checked here (the pages other helpers add come with theirs)."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def entries(nav) -> list[str]:
        out = []
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out.extend(entries(value) if isinstance(value, list) else [value])
        return out

    listed = set(entries(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - listed == set(), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - listed)}"


CODE_DIRS = ("fl_lightning", "benchmarks", "scripts", "tests")
CODE_HISTORY = {k: HISTORY[k] for k in ("an issue number", "a development stop")}


def code_files() -> list[Path]:
    return [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*")) if p.suffix in (".py", ".sh")
            and p.name != "test_docs.py"]


def test_no_development_history_in_code():
    """Comments and docstrings say why, not which issue or stop a line came from (the git log keeps
    that). Commit hashes are allowed here: the peers' code is pinned by its commits."""
    found = []
    for path in code_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in CODE_HISTORY.items():
                match = pattern.search(line)
                if match:
                    found.append(f"{path.relative_to(REPO)}:{number}: {what} ({match.group(0)!r})")
    assert not found, "code tells development history: " + "; ".join(found)
