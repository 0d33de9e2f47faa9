"""What the Docker images do when built and run, checked without Docker (test/test_docker.py checks their structure).

- The entry point (docker/entrypoint.sh) is run here, with `python3` on PATH replaced by a script that prints its
  arguments: the command lines it builds for each way of calling the image, whose recipe flags are the README's
  launch command for the image's GPUs and parse with launch_server's own parser.
- Every ENV an image sets names what reads it: this engine (then environ.py declares it), the entry point (then the
  script reads it), or a named runtime (HIP, ROCr, RCCL, PyTorch, AITER).
- Each image compiles the engine's Triton kernels for its targets at build time, after installing them.
- The pinned versions resolve: the base images' torch and the pinned Triton satisfy the ranges python/pyproject.toml
  and sgl-kernel/pyproject.toml declare, the constraint lines the images write parse as pip reads them, and the
  ROCm pins are still the ones upstream SGLang's ROCm image uses (recorded below, with where each was read).
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from test_docker import DOCKERFILES, ENTRYPOINT_SCRIPT, ROOT, _shell_commands, env_settings, instructions, \
    pip_install_args

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import update_capacity_docs as capacity_docs  # noqa: E402

SERVER = ["-m", "sglang.launch_server", "--host", "0.0.0.0", "--port", "30000"]
ROCM, CUDA = "docker/rocm.Dockerfile", "docker/Dockerfile"
# The README "Serve DeepSeek-V4" row each image's recipe flags come from: DeepSeek-V4-Flash on these GPUs.
IMAGE_RECIPE_ROW = {ROCM: (8, "MI355X"), CUDA: (4, "H200")}
# The runtimes an ENV may be read by besides this engine (named in the comment above it).
RUNTIME_READERS = ("the entrypoint", "HIP runtime", "ROCm runtime", "RCCL", "PyTorch", "AITER", "Python")
# What sgl_kernel.aot_check compiles for each image, after the install: the image's own GPU targets.
AOT_TARGETS = {ROCM: ["${GPU_ARCH}"], CUDA: ["sm90", "sm100"]}
AOT_KNOWN_TARGETS = {"gfx942", "gfx950", "sm90", "sm100"}

# The Triton each base torch requires, read from its wheel's metadata: torch 2.11.0 (PyPI, CUDA 13) requires
# triton==3.6.0 and Python >= 3.10 (`pip install --dry-run --no-deps --report` of torch==2.11.0); the rocm/pytorch
# 2.9.1 base's torch-2.9.1+rocm7.2.0.lw.git7e1940d4 pins triton==3.5.1 (upstream SGLang's docker/rocm.Dockerfile,
# which relaxes that pin the way rocm.Dockerfile does). A base with another torch needs its line here.
TORCH_TRITON = {"2.11.0": "3.6.0", "2.9.1": "3.5.1"}
TORCH_LOWEST_PYTHON = {"2.11.0": "3.10"}
ROCM_TORCH_BUILD = "2.9.1+rocm7.2.0.lw.git7e1940d4"
# rocm.Dockerfile's pins as upstream SGLang's docker/rocm.Dockerfile has them (its gfx950-rocm720 flavour, from
# which its DeepSeek-V4 MI355X images are built; read at commit 004ae46f). Changing one: check it against upstream
# or AMD's index first, then here and in docker/README.md.
UPSTREAM_ROCM_PINS = {
    "BASE_IMAGE": "rocm/pytorch:rocm7.2_ubuntu22.04_py3.10_pytorch_release_2.9.1",
    "TRITON_INDEX_URL": "https://pypi.amd.com/triton/release/rocm-7.2.0/simple/",
    "TRITON_VERSION": "3.7.0+amd.rocm7.2.0.git89002410",
    "AITER_COMMIT": "c16d44b93a528b2a4bfd6d8d3409116d465872a9",
}


def build_args(rel: str) -> dict:
    return dict(args.split("=", 1) for _, keyword, args in instructions(rel) if keyword == "ARG" and "=" in args)


def env_comments(rel: str) -> dict:
    """{ENV name: the comment block above its ENV instruction (or above the run of ENV lines it is part of)}."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = {}
    for i, line in enumerate(lines):
        match = re.match(r"ENV\s+(\w+)[=\s]", line)
        if not match:
            continue
        j = i - 1
        while j >= 0 and lines[j].startswith("ENV "):
            j -= 1
        comment = []
        while j >= 0 and lines[j].startswith("#"):
            comment.insert(0, lines[j].lstrip("# "))
            j -= 1
        out[match.group(1)] = " ".join(comment)
    return out


def _package_requirements(directory: str) -> tuple:
    with open(os.path.join(ROOT, directory, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    deps = [Requirement(r) for r in project["dependencies"]]
    return SpecifierSet(project["requires-python"]), {r.name: r for r in deps}


# --- the entry point ----------------------------------------------------------------------------------------------

def test_entrypoint_is_an_executable_bash_script():
    path = os.path.join(ROOT, ENTRYPOINT_SCRIPT)
    with open(path, encoding="utf-8") as f:
        assert f.readline().strip() == "#!/usr/bin/env bash"
    assert os.stat(path).st_mode & stat.S_IXUSR and os.access(path, os.X_OK), f"{ENTRYPOINT_SCRIPT} is not executable"
    # COPY keeps the mode of the checkout, which is git's: the image needs it committed executable.
    mode = subprocess.run(["git", "ls-files", "-s", ENTRYPOINT_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()
    assert mode and mode[0] == "100755", f"{ENTRYPOINT_SCRIPT} is committed as {mode[:1]}: git update-index --chmod=+x"


def run_entrypoint(tmp_path, args: list, env: dict) -> list:
    """The argv `python3` receives from the entry point (a stand-in python3 prints it, one word a line)."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    base = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", os.path.join(ROOT, ENTRYPOINT_SCRIPT), *args], env={**base, **env},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_entrypoint_command_lines(tmp_path):
    recipe = {"SERVE_DEFAULT_ARGS": "--tp 8 --speculative-algorithm EAGLE"}
    tiny = [*SERVER, "--model-path", "tiny-deepseek-v4"]
    assert run_entrypoint(tmp_path, [], recipe) == tiny  # no model named: the tiny model, without the recipe
    assert run_entrypoint(tmp_path, ["--log-level", "debug"], recipe) == [*tiny, "--log-level", "debug"]
    # A model as the first argument: the recipe flags, then the user's, whose --tp comes last and so wins.
    assert run_entrypoint(tmp_path, ["/models/DeepSeek-V4-Flash", "--tp", "1"], recipe) == [
        *SERVER, "--model-path", "/models/DeepSeek-V4-Flash", "--tp", "8", "--speculative-algorithm", "EAGLE",
        "--tp", "1"]
    # The model from the environment; a first argument names another.
    with_env = {**recipe, "MODEL_PATH": "/models/a"}
    assert run_entrypoint(tmp_path, ["--tp", "2"], with_env) == [
        *SERVER, "--model-path", "/models/a", "--tp", "8", "--speculative-algorithm", "EAGLE", "--tp", "2"]
    named = run_entrypoint(tmp_path, ["/models/b"], with_env)
    assert named[len(SERVER):len(SERVER) + 2] == ["--model-path", "/models/b"]
    # --model-path given: exactly the user's command line (the recipe, and MODEL_PATH, left out).
    for flag in (["--model-path", "/models/c"], ["--model-path=/models/c"]):
        assert run_entrypoint(tmp_path, [*flag, "--tp", "2"], with_env) == [*SERVER, *flag, "--tp", "2"]
    # An empty recipe serves the named model with launch_server's own defaults.
    assert run_entrypoint(tmp_path, ["/models/d"], {"SERVE_DEFAULT_ARGS": ""}) == [*SERVER, "--model-path", "/models/d"]


def _readme_recipe(gpus: int, gpu: str) -> list:
    readme = os.path.join(ROOT, "README.md")
    for row in capacity_docs.recipe_rows(readme, capacity_docs.read_lines(readme)):
        argv = capacity_docs.command_argv(row.launch, capacity_docs.LAUNCH)
        if (row.gpus, row.gpu) == (gpus, gpu) and argv[:2] == ["--model-path", "deepseek-ai/DeepSeek-V4-Flash"]:
            return argv[2:]
    pytest.fail(f"README.md has no 'Serve DeepSeek-V4' row for DeepSeek-V4-Flash on {gpus} × {gpu}")


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_recipe_flags_are_the_readme_launch_command(rel, tmp_path):
    from sglang.launch_server import build_parser

    env = {name: value for _, name, value in env_settings(rel)}
    expected = _readme_recipe(*IMAGE_RECIPE_ROW[rel])
    assert shlex.split(env["SERVE_DEFAULT_ARGS"]) == expected, (
        f"{rel}: SERVE_DEFAULT_ARGS is not the README's launch command for {IMAGE_RECIPE_ROW[rel]}: {expected}")
    argv = run_entrypoint(tmp_path, ["/models/DeepSeek-V4-Flash"], {"SERVE_DEFAULT_ARGS": env["SERVE_DEFAULT_ARGS"]})
    args = build_parser().parse_args(argv[2:])  # launch_server's parser accepts the whole command line
    assert (args.host, args.port, args.model_path) == ("0.0.0.0", 30000, "/models/DeepSeek-V4-Flash")
    assert args.tp_size == IMAGE_RECIPE_ROW[rel][0]


# --- the environment ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", DOCKERFILES)
def test_every_env_names_its_reader(rel):
    from sglang.srt.environ import envs

    declared = {var.name for var in envs.all()}
    comments = env_comments(rel)
    with open(os.path.join(ROOT, ENTRYPOINT_SCRIPT), encoding="utf-8") as f:
        script = f.read()
    names = {name for _, name, _ in env_settings(rel)}
    assert names == set(comments), (names, set(comments))
    for name, comment in comments.items():
        assert "Read by " in comment, f"{rel}: ENV {name} needs a comment above it saying what reads it ('Read by')"
        if name in declared:
            assert "this engine" in comment, f"{rel}: {name} is read by this engine (environ.py); say so"
            continue
        assert not name.startswith("SGLANG_"), f"{rel}: {name} is not declared in python/sglang/srt/environ.py"
        readers = [r for r in RUNTIME_READERS if r in comment]
        assert readers, f"{rel}: ENV {name}: this engine does not read it; name its reader, one of {RUNTIME_READERS}"
        if "the entrypoint" in readers:
            assert "${" + name in script, f"{rel}: {name}: the comment names the entrypoint, which does not read it"
    # The other way round: each variable the entry point reads is set by the images (MODEL_PATH is the user's).
    for name in set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", script)) - {"MODEL_PATH"}:
        assert name in names, f"{ENTRYPOINT_SCRIPT} reads {name}, which {rel} does not set"


def test_readme_lists_the_rocm_environment():
    with open(os.path.join(ROOT, "docker", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for _, name, _ in env_settings(ROCM):
        assert f"`{name}`" in readme, f"docker/README.md does not list ENV {name} of {ROCM}"


# --- build-time AOT compile ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", DOCKERFILES)
def test_kernels_are_compiled_at_build_time(rel):
    found = []
    for line, keyword, args in instructions(rel):
        if keyword == "RUN":
            for words in _shell_commands(args):
                words = [w for w in words if "=" not in w or w.startswith("-")]  # drop VAR=value prefixes
                if words[:3] == ["python3", "-m", "sgl_kernel.aot_check"]:
                    found.append((line, words[3:]))
    assert len(found) == 1, f"{rel}: one `python3 -m sgl_kernel.aot_check --target ...` RUN expected: {found}"
    line, argv = found[0]
    assert argv[:1] == ["--target"] and argv[1:] == AOT_TARGETS[rel], (rel, argv)
    kernel_install = max(n for n, _, args in pip_install_args(rel) if "sgl-kernel" in args)
    assert line > kernel_install, f"{rel}:{line}: the AOT compile must follow sgl-kernel's install ({kernel_install})"
    if rel == ROCM:  # ${GPU_ARCH}: the build stops on any value but the case statement's, each a known target
        case = next(a for _, k, a in instructions(rel) if k == "RUN" and 'case "${GPU_ARCH}" in' in a)
        allowed = re.search(r'case "\$\{GPU_ARCH\}" in\s+([\w|]+)\)', case).group(1).split("|")
        assert set(allowed) <= AOT_KNOWN_TARGETS and build_args(rel)["GPU_ARCH"] in allowed, allowed


# --- pinned versions ----------------------------------------------------------------------------------------------

def image_stack(rel: str) -> tuple:
    """(torch version, Triton version, Python version) the image ends up with, from its pins."""
    args = build_args(rel)
    tag = args["BASE_IMAGE"].split(":", 1)[1]
    if rel == ROCM:
        match = re.fullmatch(r"rocm[\d.]+_ubuntu[\d.]+_py(\d+\.\d+)_pytorch_release_(\d+\.\d+\.\d+)", tag)
        assert match, f"{rel}: BASE_IMAGE tag {tag!r} does not name its Python and torch"
        python, torch = match.groups()
        triton = args["TRITON_VERSION"] or TORCH_TRITON[torch]
    else:
        match = re.fullmatch(r"(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-(runtime|devel)", tag)
        assert match, f"{rel}: BASE_IMAGE tag {tag!r} does not name its torch"
        torch = match.group(1)
        assert torch in TORCH_LOWEST_PYTHON, f"record torch {torch}'s lowest Python in TORCH_LOWEST_PYTHON"
        python, triton = TORCH_LOWEST_PYTHON[torch], None
    assert torch in TORCH_TRITON, f"{rel}: torch {torch}: record the Triton its metadata requires in TORCH_TRITON"
    return torch, triton or TORCH_TRITON[torch], python


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_pinned_stack_satisfies_the_packages(rel):
    torch, triton, python = image_stack(rel)
    for directory in ("python", "sgl-kernel"):
        requires_python, deps = _package_requirements(directory)
        assert Version(python) in requires_python, f"{rel}: Python {python} is outside {directory}'s {requires_python}"
        assert deps["torch"].specifier.contains(torch), f"{rel}: torch {torch} is outside {directory}'s {deps['torch']}"
        if "triton" in deps:
            assert deps["triton"].specifier.contains(triton, prereleases=True), (
                f"{rel}: Triton {triton} is outside {directory}'s {deps['triton']}")


def test_rocm_triton_replaces_the_base_pin():
    """The base torch pins a Triton below sgl-kernel's range: the image installs the pinned one and relaxes that pin
    to a range the pinned Triton is in, so pip keeps both; the constraint lines it then writes parse and match."""
    args = build_args(ROCM)
    torch, triton, _ = image_stack(ROCM)
    _, kernel_deps = _package_requirements("sgl-kernel")
    assert not kernel_deps["triton"].specifier.contains(TORCH_TRITON[torch]) and args["TRITON_VERSION"]
    relax = [a for _, k, a in instructions(ROCM) if k == "RUN" and "Requires-Dist: triton" in a]
    relaxed = re.search(r"'Requires-Dist: (triton[^']*)'", relax[0]).group(1) if relax else ""
    assert relaxed and Requirement(relaxed).specifier.contains(triton), (relaxed, triton)
    for name, version in (("torch", ROCM_TORCH_BUILD), ("triton", triton)):
        assert Requirement(f"{name}=={version}").specifier.contains(version)  # the constraint file's line


def test_rocm_pins_are_upstreams():
    args = build_args(ROCM)
    for name, value in UPSTREAM_ROCM_PINS.items():
        assert args[name] == value, f"{ROCM}: {name}={args[name]!r}, upstream's is {value!r}: verify it, then update"
