# ROCm image for the DeepSeek-V4 engine: AMD Instinct MI355X (gfx950) by default, MI300X with GPU_ARCH=gfx942.
# Build from the repository root (the build context must be the repo, not docker/):
#   docker build -f docker/rocm.Dockerfile -t sglang-dsv4:rocm .
#   docker build -f docker/rocm.Dockerfile --build-arg GPU_ARCH=gfx942 -t sglang-dsv4:rocm-mi300x .
# Run (built-in tiny model; see docker/README.md for real checkpoints and the 8-GPU form):
#   docker run --device=/dev/kfd --device=/dev/dri --group-add video --ipc=host --shm-size 32g \
#       --security-opt seccomp=unconfined -p 30000:30000 sglang-dsv4:rocm
#   docker run ... -v /models:/models sglang-dsv4:rocm --model-path /models/DeepSeek-V4-Flash
# Linted in CI (test/test_docker.py, hadolint); never built on the development machines.

# ROCm 7.2 + PyTorch 2.9.1 on Python 3.10: the base upstream SGLang uses for its DeepSeek-V4 MI35x images.
ARG BASE_IMAGE=rocm/pytorch:rocm7.2_ubuntu22.04_py3.10_pytorch_release_2.9.1
FROM ${BASE_IMAGE}

# gfx950 = MI355X / MI350X, gfx942 = MI300X / MI325X.
ARG GPU_ARCH=gfx950
# Triton for ROCm from AMD's index. sgl-kernel needs triton>=3.6; the 2.9.1 base ships 3.5.x. Set
# TRITON_VERSION="" to keep the base image's Triton (a base that already has triton>=3.6).
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

# Keep the base image's ROCm torch: every later pip install is constrained to exactly this build, so no
# dependency can swap it for a CUDA wheel from PyPI.
RUN python3 -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /etc/pip-torch-constraint.txt \
    && cat /etc/pip-torch-constraint.txt

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

# Read by AITER (its build here and its JIT at run time): compile kernels for this architecture only.
ENV GPU_ARCHS=${GPU_ARCH}
# AITER_USE_SYSTEM_TRITON=1 stops AITER's setup.py from replacing the Triton installed above.
RUN if [ "${INSTALL_AITER}" = "1" ]; then \
      git clone "${AITER_REPO}" /opt/aiter \
      && git -C /opt/aiter checkout -f "${AITER_COMMIT}" \
      && git -C /opt/aiter submodule update --init --recursive \
      && python3 -m pip install --no-cache-dir -c /etc/pip-torch-constraint.txt -r /opt/aiter/requirements.txt \
           "setuptools_scm>=8" "packaging>=23" "psutil>=5" "ninja>=1.11" "pandas>=2" \
      && AITER_USE_SYSTEM_TRITON=1 PREBUILD_KERNELS="${AITER_PREBUILD_KERNELS}" GPU_ARCHS="${GPU_ARCH}" \
         python3 -m pip install --no-cache-dir --no-build-isolation -c /etc/pip-torch-constraint.txt \
           --config-settings editable_mode=compat -e /opt/aiter \
      && chown -R sglang:sglang /opt/aiter; \
    fi

# Our two packages from the build context (editable: mount a checkout over /opt/sglang/python to try a change
# without rebuilding).
WORKDIR /opt/sglang
COPY python/ python/
COPY sgl-kernel/ sgl-kernel/
COPY scripts/ scripts/
RUN python3 -m pip install --no-cache-dir -c /etc/pip-torch-constraint.txt -e python -e sgl-kernel \
    && python3 -c "import torch, triton, sglang.launch_server, sgl_kernel; \
assert torch.version.hip, 'the ROCm torch was replaced: ' + torch.__version__; \
assert tuple(int(x) for x in triton.__version__.split('.')[:2]) >= (3, 6), triton.__version__; \
print('torch', torch.__version__, 'HIP', torch.version.hip, 'triton', triton.__version__)"

# --- Runtime defaults (DeepSeek-V4 on MI355X, from the upstream recipes); each overridable with docker run -e.
# Our engine: use AITER kernels where the engine has them (follows INSTALL_AITER, so 0 when AITER is absent).
ENV SGLANG_USE_AITER=${INSTALL_AITER}
# Our engine: attention kernel of --attention-backend dsv4; the AMD recipes' value, which this engine reads as
# its Triton kernels (forced rather than auto, so a broken Triton fails loudly instead of falling back to torch).
ENV SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton
# PyTorch on ROCm: route BLAS GEMMs to hipBLASLt rather than rocBLAS.
ENV TORCH_BLAS_PREFER_HIPBLASLT=1
# AITER fused MoE: use the FP8-activation kernels from M >= 0 tokens (the recipes' value; AITER's default
# falls back to BF16 activations for small batches).
ENV AITER_BF16_FP8_MOE_BOUND=0
# Our engine: where the built-in tiny model and other generated files are kept (the user's, see above).
ENV HOME=/home/sglang
ENV SGLANG_CACHE_DIR=/home/sglang/.cache/sglang
# Not set here, because nothing in this image reads them: upstream SGLang's SGLANG_USE_ROCM700A,
# SGLANG_OPT_USE_AITER_BATCHED_GEMM and the SGLANG_DP_* switches; and
# GPU_MAX_HW_QUEUES=5, which the recipes set only with two-batch overlap (capping the queues slows other modes).

EXPOSE 30000
# Loading a full checkpoint takes minutes, hence the long start period (failures inside it do not count).
HEALTHCHECK --interval=30s --timeout=10s --start-period=1800s --retries=3 \
    CMD ["curl", "-fsS", "--max-time", "8", "http://localhost:30000/health"]

# Bound beyond loopback inside the container: pass --api-key and --admin-api-key (docker/README.md, "Exposure").
# Without an admin key the admin endpoints answer loopback clients only, and a published port's clients are not.
# Numeric, so an orchestrator can check it is not root without resolving names (Kubernetes' runAsNonRoot).
USER 10001:10001
# `docker run IMAGE --model-path /models/x ...` replaces CMD and keeps the host/port below.
ENTRYPOINT ["python3", "-m", "sglang.launch_server", "--host", "0.0.0.0", "--port", "30000"]
CMD ["--model-path", "tiny-deepseek-v4"]
