"""List Python files past the size budget (docs/style.md rule 2: split past ~600 lines).

    python scripts/check_sizes.py [--limit 600]

Exceptions must be listed in EXCEPTIONS with a written reason. Exit status 1 when an unlisted file is over.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCEPTIONS: dict = {}  # "path/relative/to/root.py": "why it stays whole"


def oversized(limit: int) -> list:
    out = []
    for top in ("python", "sgl-kernel", "scripts", "test", "benchmark"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        n = sum(1 for _ in f)
                    rel = os.path.relpath(path, ROOT)
                    if n > limit and rel not in EXCEPTIONS:
                        out.append((rel, n))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=600)
    args = ap.parse_args()
    bad = oversized(args.limit)
    for rel, n in bad:
        print(f"{rel}: {n} lines (over {args.limit}); split it or list it in EXCEPTIONS with a reason")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
