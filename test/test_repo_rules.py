"""Repository rules that tooling enforces (docs/style.md rules 2 and 17; ruff.toml)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_sizes  # noqa: E402


def test_env_vars_are_read_only_in_environ():
    offenders = []
    pkg = os.path.join(ROOT, "python", "sglang")
    for dirpath, _, files in os.walk(pkg):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.endswith(".py") or path.endswith(os.path.join("srt", "environ.py")):
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if re.search(r"os\.(environ|getenv)", text):
                offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, f"read environment variables through sglang.srt.environ.envs: {offenders}"


def test_env_vars_are_documented():
    from sglang.srt.environ import envs

    for var in envs.all():
        assert (var.name.startswith("SGLANG_") or var.name in envs.LIBRARY_VARIABLES) and var.doc, var.name


def test_files_within_size_budget():
    assert check_sizes.oversized(600) == []


def test_ruff_clean():
    """Pyflakes (undefined and unused names) and the 120-column limit over the whole tree (ruff.toml)."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", ROOT],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# Wording about how the engine was developed (work sessions, our own issue numbers): the product speaks of itself
# only, and cites a measurement by its RESULTS.md section title, a date or a commit. Chat or HTTP "sessions" and
# upstream references written as owner/repo#N or project#N stay allowed.
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|"
             "twentieth|[0-9]+(?:st|nd|rd|th)")
PROCESS_WORDING = re.compile(
    rf"\b(?:{_ORDINALS}) sessions?\b"  # "the fifteenth session"
    r"|\b(?:this|last|next|previous|earlier|later|same|the) (?:device |gpu |work )?session(?:'s)?\b"
    r"|\bsessions? (?:note|with a device)\b"
    r"|\bissues? #?[0-9]+\b"  # "issue 16", "issue #16"
    r"|\(#[0-9]+\b|#[0-9]+'s\b"  # "(#12)", "#16's runs"
    r"|\b(?:see|in|per|from|by|after|since|fixes|fixed|closes) #[0-9]+\b",  # "see #12"
    re.IGNORECASE)


def process_wording(text: str) -> list:
    """(line number, line) of each line that speaks of the development process."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if PROCESS_WORDING.search(line)]


def test_process_wording_pattern():
    for bad in ("measured in the fifteenth session", "since the 3rd session", "see issue 16", "as in issue #13",
                "fixed (#12)", "as in #16's runs", "see #12", "not timed this session", "the session's device time",
                "last session's estimate"):
        assert process_wording(bad), bad
    for good in ("each multi-turn session resends the conversation", "aiohttp.ClientSession(timeout=t)",
                 "a live graph makes destroy_process_group hang: pytorch#115388", "Turn t of a session",
                 "colour #1f77b4", "{lambda()#3}::operator()", "layers.2.ffn #13", "the newline #2 may come",
                 "RESULTS.md, \"MoE kernels\" (2026-12-06, 3f99a54)"):
        assert not process_wording(good), good


def test_no_process_wording_in_the_tree():
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    offenders = []
    for rel in filter(None, files.split("\0")):
        path = os.path.join(ROOT, rel)
        if rel == "test/test_repo_rules.py":
            continue  # the rule's own examples
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data:
            continue  # binary (images)
        for n, line in process_wording(data.decode("utf-8", errors="replace")):
            offenders.append(f"{rel}:{n}: {line[:120]}")
    assert not offenders, ("rephrase without process wording (cite a RESULTS.md section, a date or a commit):\n"
                           + "\n".join(offenders[:40]) + (f"\n... {len(offenders) - 40} more" if len(offenders) > 40
                                                          else ""))
