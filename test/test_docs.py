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
    missing = [t for t in _CITATION.findall(read(doc)) if t not in sections]
    assert not missing, f"{doc} cites RESULTS.md sections that do not exist: {missing}"


def test_every_server_flag_is_documented():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = read("docs/server-options.md")
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert len(flags) > 40, "the parser lost its flags"
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert not missing, f"docs/server-options.md does not mention: {missing}"
