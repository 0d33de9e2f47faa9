"""The committed record of the ahead-of-time check's compile results (aot_manifest.json beside this file), so CI
verifies every launch of the plan without compiling ~1,450 of them on two cores each run.

A row is keyed by a hash of everything that decides its compile: the kernel's `JITFunction.cache_key` (its source,
line and the @triton.jit functions and constexpr globals it uses), the launch's signature, constexprs, specialization
attributes and options (`Launch.key`), the target and the Triton version. A kernel edit, a new launch configuration
or a new target gives new keys, which the check compiles; rows whose keys no launch has any more are dropped at the
next refresh. The manifest also names the Triton version it was built with: rows of another version say nothing about
this one (its compiler decides registers, spills and shared memory), so the check refuses such a manifest instead of
recompiling everything (README's install line pins Triton to the manifest's version).

    python -m sgl_kernel.aot_check --update-manifest      # compiles the launches the manifest lacks, drops stale rows
    python -m sgl_kernel.aot_check --manifest --sample 24  # CI: manifest rows + a rotating sample compiled again
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

MANIFEST_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_manifest.json")
# The compile's findings a row keeps (the rest of a check row comes from the plan: its label, signature, decode path)
RESULT_FIELDS = ("ok", "error", "regs", "spill", "shared", "shared_limit", "notes")
# What a sample's fresh compile must reproduce of its manifest row
COMPARED_FIELDS = ("ok", "regs", "spill", "shared")


class ManifestError(ValueError):
    """A manifest the check cannot use: missing, unreadable, or built with another Triton."""


def launch_hash(cache_key: str, launch_key: str, target: str, triton_version: str) -> str:
    """The manifest key of one launch on one target (`cache_key`: the kernel's JITFunction.cache_key; `launch_key`:
    aot_check.Launch.key())."""
    text = "\n".join((cache_key, launch_key, target, triton_version))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass
class Manifest:
    triton: str  # the Triton version every row was compiled with
    rows: dict = field(default_factory=dict)  # launch_hash -> {"target", "kernel", "config", *RESULT_FIELDS}

    @classmethod
    def load(cls, path: str, triton_version: str) -> "Manifest":
        """The manifest at `path`; ManifestError if there is none or its Triton is not `triton_version`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ManifestError(f"no AOT manifest at {path}: python -m sgl_kernel.aot_check --update-manifest "
                                f"writes it") from None
        except json.JSONDecodeError as e:
            raise ManifestError(f"AOT manifest {path} is not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), dict) or "triton" not in data:
            raise ManifestError(f"AOT manifest {path} lacks its 'triton' version or 'rows'")
        if data["triton"] != triton_version:
            raise ManifestError(f"AOT manifest {path} was compiled with Triton {data['triton']}, this is Triton "
                                f"{triton_version}: install triton=={data['triton']} (README's install line) or "
                                f"refresh it with python -m sgl_kernel.aot_check --update-manifest (~20 min on two "
                                f"cores)")
        return cls(data["triton"], data["rows"])

    def save(self, path: str) -> None:
        """One row a line, ordered by target, kernel and key: a refresh's diff shows the launches that changed."""
        order = sorted(self.rows.items(), key=lambda kv: (kv[1]["target"], kv[1]["kernel"], kv[0]))
        lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in order]
        with open(path, "w", encoding="utf-8") as f:
            f.write(f'{{"triton": {json.dumps(self.triton)},\n"rows": {{\n' + ",\n".join(lines) + "\n}}\n")


def rotating_sample(keys: list, size: int, day: int) -> list:
    """`size` of `keys` (about), spread over them: every n-th key from an offset that moves by one each `day`, so
    n days of runs compile every key once (n = len(keys) / size)."""
    if size <= 0 or not keys:
        return []
    keys = sorted(keys)
    step = max(1, -(-len(keys) // size))
    return keys[day % step::step]
