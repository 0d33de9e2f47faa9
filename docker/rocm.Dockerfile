# ROCm image for the DeepSeek-V4 engine: AMD Instinct MI355X (gfx950) by default, MI300X with GPU_ARCH=gfx942.
# Build from the repository root (the build context must be the repo, not docker/):
#   docker build -f docker/rocm.Dockerfile -t sglang-dsv4:rocm .
#   docker build -f docker/rocm.Dockerfile --build-arg GPU_ARCH=gfx942 -t sglang-dsv4:rocm-mi300x .
# Run (built-in tiny model; a checkpoint directory or hub id as the first argument gets the MI355X recipe flags;
# docker/README.md has the rest):
#   docker run --device=/dev/kfd --device=/dev/dri --group-add video --ipc=host --shm-size 32g \
#       --security-opt seccomp=unconfined -p 30000:30000 sglang-dsv4:rocm
#   docker run ... -v /models:/models sglang-dsv4:rocm /models/DeepSeek-V4-Flash
# Linted and checked in CI (test/test_docker.py, hadolint); never built on the development machines.

# ROCm 7.2.0 + PyTorch 2.9.1 (torch-2.9.1+rocm7.2.0.lw.git7e1940d4) on Python 3.10: the base of upstream SGLang's
# gfx950-rocm720 flavour, from which its DeepSeek-V4 MI355X images (lmsysorg/sglang-rocm:*-rocm720-mi35x-*) are
# built. Its torch pins triton==3.5.1, below sgl-kernel's triton>=3.6, so the Triton step below replaces it.
ARG BASE_IMAGE=rocm/pytorch:rocm7.2_ubuntu22.04_py3.10_pytorch_release_2.9.1
FROM ${BASE_IMAGE}

# gfx950 = MI355X / MI350X, gfx942 = MI300X / MI325X.
ARG GPU_ARCH=gfx950
# AMD's ROCm Triton, the pin upstream SGLang installs on this base (the same index and version string). sgl-kernel
# needs triton>=3.6. Its distribution is named `triton`, which also satisfies xgrammar's unversioned `triton`
# requirement (a differently named Triton would let pip pull PyPI's CUDA one). TRITON_VERSION="" keeps the base
# image's Triton, for a base that already has triton>=3.6.
ARG TRITON_INDEX_URL=https://pypi.amd.com/triton/release/rocm-7.2.0/simple/
ARG TRITON_VERSION=3.7.0+amd.rocm7.2.0.git89002410
# AITER (AMD's kernel library) from its git repository at a pinned commit (the one upstream SGLang pins for its
# ROCm 7.2 images). INSTALL_AITER=0 skips it; the engine then runs its Triton kernels only.
ARG INSTALL_AITER=1
ARG AITER_REPO=https://github.com/ROCm/aiter.git
ARG AITER_COMMIT=c16d44b93a528b2a4bfd6d8d3409116d465872a9
# AITER PREBUILD_KERNELS (0: compile kernels on first use, 1: ahead of time, a much longer build).
ARG AITER_PREBUILD_KERNELS=0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

RUN case "${GPU_ARCH}" in \
      gfx950|gfx942) ;; \
      *) echo "GPU_ARCH=${GPU_ARCH}: use gfx950 (MI355X) or gfx942 (MI300X)" >&2; exit 1 ;; \
    esac

# git for the AITER clone, curl for the HEALTHCHECK (both usually present in rocm/pytorch; installed to be sure).
RUN apt-get update \
    && apt-get install -y --no-install-recommends git curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The server runs as this unprivileged user: what it writes at run time (the tiny model under SGLANG_CACHE_DIR,
# AITER's JIT modules in /opt/aiter, Triton's and torch's caches under its home, traces and IPC sockets under
# /tmp) needs no root.
RUN groupadd --gid 10001 sglang \
    && useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /bin/bash sglang \
    && mkdir -p /home/sglang/.cache/sglang \
    && chown -R sglang:sglang /home/sglang/.cache

# Triton >= 3.6. The base torch's metadata pins the Triton it shipped with (triton==3.5.x); that pin is relaxed
# to triton>=3.6 in place, so pip's resolver accepts the newer Triton instead of replacing torch.
RUN if [ -n "${TRITON_VERSION}" ]; then \
      python3 -m pip uninstall -y triton-rocm pytorch-triton-rocm \
      && python3 -m pip install --no-cache-dir --no-deps --index-url "${TRITON_INDEX_URL}" "triton==${TRITON_VERSION}" \
      && python3 -c "import pathlib, re, importlib.metadata as m; \
p = pathlib.Path(m.distribution('torch')._path) / 'METADATA'; \
t = re.sub(r'^Requires-Dist: (?:pytorch-triton-rocm|triton-rocm|triton) *==[^ ;]+', 'Requires-Dist: triton>=3.6', p.read_text(), flags=re.M); \
p.write_text(t)"; \
    fi

# Keep the base image's ROCm torch and the Triton above: every later pip install is constrained to exactly these
# builds, so no dependency can swap either for a CUDA wheel from PyPI. A Triton under another distribution name
# fails here: xgrammar requires one named `triton`, which pip would otherwise fetch from PyPI.
RUN python3 -c "import importlib.metadata as m; print('\\n'.join(n + '==' + m.version(n) for n in ('torch', 'triton')))" \
      > /etc/pip-constraints.txt \
    && cat /etc/pip-constraints.txt

# Read by AITER (its build here and its JIT at run time): compile kernels for this architecture only.
ENV GPU_ARCHS=${GPU_ARCH}
# AITER_USE_SYSTEM_TRITON=1 stops AITER's setup.py from replacing the Triton installed above.
RUN if [ "${INSTALL_AITER}" = "1" ]; then \
      git clone "${AITER_REPO}" /opt/aiter \
      && git -C /opt/aiter checkout -f "${AITER_COMMIT}" \
      && git -C /opt/aiter submodule update --init --recursive \
      && python3 -m pip install --no-cache-dir -c /etc/pip-constraints.txt -r /opt/aiter/requirements.txt \
           "setuptools_scm>=8" "packaging>=23" "psutil>=5" "ninja>=1.11" "pandas>=2" \
      && AITER_USE_SYSTEM_TRITON=1 PREBUILD_KERNELS="${AITER_PREBUILD_KERNELS}" GPU_ARCHS="${GPU_ARCH}" \
         python3 -m pip install --no-cache-dir --no-build-isolation -c /etc/pip-constraints.txt \
           --config-settings editable_mode=compat -e /opt/aiter \
      && chown -R sglang:sglang /opt/aiter; \
    fi

# Our two packages from the build context (editable: mount a checkout over /opt/sglang/python to try a change
# without rebuilding).
WORKDIR /opt/sglang
COPY python/ python/
COPY sgl-kernel/ sgl-kernel/
COPY scripts/ scripts/
COPY docker/entrypoint.sh docker/entrypoint.sh
RUN python3 -m pip install --no-cache-dir -c /etc/pip-constraints.txt -e python -e sgl-kernel \
    && python3 -c "import torch, triton, sglang.launch_server, sgl_kernel; \
assert torch.version.hip, 'the ROCm torch was replaced: ' + torch.__version__; \
assert tuple(int(x) for x in triton.__version__.split('.')[:2]) >= (3, 6), triton.__version__; \
print('torch', torch.__version__, 'HIP', torch.version.hip, 'triton', triton.__version__)"

# Every Triton kernel the engine launches, compiled ahead of time for this image's GPU at the engine's launch
# configurations (no GPU needed): an image whose Triton cannot compile them fails here instead of at the first
# request. The compiled files are thrown away; the server compiles into its own cache at run time.
RUN aot_cache="$(mktemp -d)" \
    && TRITON_CACHE_DIR="${aot_cache}" python3 -m sgl_kernel.aot_check --target "${GPU_ARCH}" \
    && rm -rf "${aot_cache}"

# --- Runtime environment. The comment above each ENV names what reads it; each is overridable with docker run -e.
# Upstream SGLang's DeepSeek-V4 MI355X recipes and its ROCm image set more; those nothing here reads are left out
# (docker/README.md lists them).
# Read by this engine: use AITER kernels where the engine has them (follows INSTALL_AITER, so 0 when AITER is absent).
ENV SGLANG_USE_AITER=${INSTALL_AITER}
# Read by this engine: attention kernel of --attention-backend dsv4; the AMD recipes' value, which this engine reads
# as its Triton kernels (forced rather than auto, so a broken Triton fails loudly instead of falling back to torch).
ENV SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton
# Read by PyTorch on ROCm: route BLAS GEMMs to hipBLASLt rather than rocBLAS (the DeepSeek-V4 recipes' value).
ENV TORCH_BLAS_PREFER_HIPBLASLT=1
# Read by AITER's fused MoE and by this engine (the DeepSeek-V4 MI355X recipes' value): every batch takes AITER's
# A8W4 kernels with the SwiGLU clamp, so the engine hands the MXFP4 experts to AITER on gfx950 (docs/platforms.md).
# -e AITER_BF16_FP8_MOE_BOUND=256 (AITER's default) keeps them on the engine's Triton MoE.
ENV AITER_BF16_FP8_MOE_BOUND=0
# Read by the HIP runtime: kernel arguments in device memory, which shortens every launch (upstream's ROCm image).
ENV HIP_FORCE_DEV_KERNARG=1
# Read by the ROCm runtime (ROCr): keep scratch memory allocated between kernels instead of reclaiming it after
# each (upstream's ROCm image).
ENV HSA_NO_SCRATCH_RECLAIM=1
# Read by RCCL, which carries the tensor-parallel all-reduces (torch.distributed's nccl backend on ROCm):
# upstream's ROCm image value.
ENV NCCL_MIN_NCHANNELS=112
# Read by the entrypoint: the README's 8 x MI355X launch command for DeepSeek-V4-Flash (the one model that fits 8
# MI355X today), added when a model is named; -e SERVE_DEFAULT_ARGS= serves with launch_server's own defaults.
ENV SERVE_DEFAULT_ARGS="--tp 8 --speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
# Read by Python, Triton and torch (their caches under $HOME) and by this engine (the tiny model under
# SGLANG_CACHE_DIR): the unprivileged user's (see above).
ENV HOME=/home/sglang
ENV SGLANG_CACHE_DIR=/home/sglang/.cache/sglang

EXPOSE 30000
# Loading a full checkpoint takes minutes, hence the long start period (failures inside it do not count).
HEALTHCHECK --interval=30s --timeout=10s --start-period=1800s --retries=3 \
    CMD ["curl", "-fsS", "--max-time", "8", "http://localhost:30000/health"]

# Bound beyond loopback inside the container: pass --api-key and --admin-api-key (docker/README.md, "Exposure").
# Without an admin key the admin endpoints answer loopback clients only, and a published port's clients are not.
# Numeric, so an orchestrator can check it is not root without resolving names (Kubernetes' runAsNonRoot).
USER 10001:10001
# docker/entrypoint.sh: `docker run IMAGE` serves the tiny model, `docker run IMAGE MODEL [FLAG...]` MODEL with the
# recipe flags above, `docker run IMAGE --model-path MODEL [FLAG...]` exactly the flags given.
ENTRYPOINT ["/opt/sglang/docker/entrypoint.sh"]
# No default arguments: the entrypoint picks the tiny model when none is named.
CMD []
