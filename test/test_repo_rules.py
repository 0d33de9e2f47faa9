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
        assert var.name.startswith("SGLANG_") and var.doc, var.name


def test_files_within_size_budget():
    assert check_sizes.oversized(600) == []


def test_ruff_clean():
    """Pyflakes (undefined and unused names) and the 120-column limit over the whole tree (ruff.toml)."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", ROOT],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
