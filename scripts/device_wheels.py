"""Download the wheels a GPU machine's image lacks for this repository's server, benchmarks and tests into one folder
(default .whl/, which scripts/gpu_env.sh installs under /tmp/site on the GPU machine), for that machine's Python.

    python3 scripts/device_wheels.py [--dest .whl] [--python-version 3.12] [--exclude NAME ...]

Run it on a machine with network access where the package is installed (`pip install -e "python[test]"`): the set is
the dependency closure of the package's runtime requirements and the test tools the GPU scripts run (pytest, httpx),
at the versions installed here, less what every GPU image has (torch, triton, numpy, the CUDA libraries). Each wheel
is fetched with --no-deps for the target's Python and manylinux x86_64 (pure-Python wheels as they are), so the set
installs with `pip install --no-index --no-deps` and nothing resolves on the GPU machine, which has no network.
The whole set is ~41 MiB (2026-12-07); a call that carries more beside it (scripts/gpu_pd.sh's .pd, 24 MiB) stays
within the 64 MiB a call carries with `--exclude transformers hf-xet` (13 + 4 MiB: xgrammar, which imports
transformers, loads at a server's first constrained request, and nothing downloads there).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys

from packaging.requirements import Requirement

ROOTS = ("sglang", "pytest", "httpx")  # the package (its runtime requirements), and what the GPU scripts run beside it
ON_THE_IMAGE = re.compile(r"^(torch|triton|numpy|nvidia-.*|setuptools|pip|wheel|sglang|sgl-kernel)$")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                      "manylinux1_x86_64"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=ROOTS, python_version: str = "3.12") -> dict:
    """name -> installed version, for the roots' requirements (extras left out) and theirs, as installed here, as a
    Linux x86_64 machine with that Python needs them."""
    target = {"python_version": python_version, "python_full_version": python_version + ".0", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
    found, stack = {}, list(roots)
    while stack:
        name = _norm(stack.pop())
        if name in found or (ON_THE_IMAGE.match(name) and name not in roots):  # and what they need, on the image too
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: pip install -e \"python[test]\" first")
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(target):  # extras and other platforms' needs left out
                stack.append(req.name)
    return {n: v for n, v in found.items() if not ON_THE_IMAGE.match(n)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dest", default=".whl")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    ap.add_argument("--exclude", nargs="*", default=[], metavar="NAME", help="leave these out (and only these)")
    args = ap.parse_args(argv)
    wanted = closure(python_version=args.python_version)
    for name in args.exclude:
        wanted.pop(_norm(name), None)
    os.makedirs(args.dest, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    failed = []
    for name, version in sorted(wanted.items()):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               args.python_version, "--implementation", "cp", *platforms, "-d", args.dest, f"{name}=={version}"]
        if subprocess.run(cmd, capture_output=True, text=True).returncode:
            failed.append(f"{name}=={version}")
    size = sum(os.path.getsize(os.path.join(args.dest, f)) for f in os.listdir(args.dest))
    print(f"{len(wanted) - len(failed)} wheels in {args.dest} ({size / 2**20:.1f} MiB)")
    if failed:
        raise SystemExit(f"no wheel for Python {args.python_version} manylinux x86_64: {', '.join(failed)}")


if __name__ == "__main__":
    main()
