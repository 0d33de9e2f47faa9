"""The user documentation stays true to the tree: README.md within its budget, every link and every file a doc cites
exists, every RESULTS.md section a doc cites exists, and every launch_server flag is documented."""

from __future__ import annotations

import argparse
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docker/README.md", "benchmark/README.md",
        *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
README_MAX_LINES = 300

_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Paths of the tree a doc names in code spans: tests, scripts, benchmarks, packages.
_PATH = re.compile(r"`((?:test|scripts|benchmark|docs|docker|python|sgl-kernel)/[\w./-]*\w)`")
# A RESULTS.md section cited by title: RESULTS.md, "Title" (or RESULTS.md "Title").
_CITATION = re.compile(r"RESULTS\.md\)?,? \"([^\"]+)\"")


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(rel: str) -> set:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", read(rel), re.MULTILINE)}


def results_sections() -> set:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", read("benchmark/RESULTS.md"), re.MULTILINE)}


def existing_docs() -> list:
    return [d for d in DOCS if os.path.exists(os.path.join(ROOT, d))]


def test_readme_is_short():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: depth goes to docs/"


@pytest.mark.parametrize("doc", existing_docs())
def test_links_resolve(doc):
    base = os.path.dirname(os.path.join(ROOT, doc))
    broken = []
    for target in _LINK.findall(read(doc)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, doc)
        if not os.path.exists(full):
            broken.append(target)
        elif anchor and full.endswith(".md") and anchor not in anchors(os.path.relpath(full, ROOT)):
            broken.append(target)
    assert not broken, f"{doc}: links to nothing: {broken}"


@pytest.mark.parametrize("doc", existing_docs())
def test_cited_files_exist(doc):
    missing = [p for p in _PATH.findall(read(doc)) if not glob.glob(os.path.join(ROOT, p.split("::")[0]))]
    assert not missing, f"{doc} cites files that do not exist: {missing}"


@pytest.mark.parametrize("doc", existing_docs())
def test_cited_results_sections_exist(doc):
    sections = results_sections()
    missing = [t for t in (" ".join(c.split()) for c in _CITATION.findall(read(doc))) if t not in sections]
    assert not missing, f"{doc} cites RESULTS.md sections that do not exist: {missing}"


def test_every_server_flag_is_documented_in_its_group():
    """docs/server-options.md has a section per `--help` group (same title) naming each of the group's flags."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    sections = {}
    for m in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", read("docs/server-options.md"), re.MULTILINE | re.DOTALL):
        sections[m.group(1).strip().lower()] = m.group(2)
    groups = [g for g in parser._action_groups if any(a.option_strings != ["-h", "--help"] for a in g._group_actions)]
    assert len(groups) >= 8, "the parser lost its groups"
    missing = []
    for group in groups:
        text = sections.get(group.title.lower())
        if text is None:
            missing.append(f"section '## {group.title}'")
            continue
        for action in group._group_actions:
            missing += [f"{flag} (under '{group.title}')" for flag in action.option_strings if flag.startswith("--")
                        and not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert not missing, f"docs/server-options.md lacks: {missing}"
