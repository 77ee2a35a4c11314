# kfrl GPU image: the GPU stages (rollout, log-probs, values, updates) and the resident engine
# (`kfrl engine serve`). Built from the repository root:
#   docker build -f docker/gpu.Dockerfile -t ghcr.io/kfrl/kfrl-gpu:0.1.0 .      (or: make images)
#
# Versions, and why:
# - Base nvidia/cuda:13.0.2-base-ubuntu24.04. CUDA 13.0 because vllm 0.33.0 (the newest vLLM on PyPI
#   that installs) pins torch==2.14.0, whose Linux wheels are CUDA 13.0 builds (cu130). The `base`
#   flavour, not `runtime` or `cudnn-runtime`, since the torch wheel brings its own CUDA user-space
#   libraries (cuBLAS, cuDNN, NCCL, nvrtc ... as pip packages): a runtime image would add ~3 GB of
#   copies that nothing loads. The base image still carries what the NVIDIA container toolkit reads
#   (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_CUDA=cuda>=13.0: the host
#   needs an NVIDIA driver >= 580). Pass CUDA_BASE=nvidia/cuda:13.0.2-devel-ubuntu24.04 for nvcc in
#   /usr/local/cuda (DeepSpeed's JIT-built ops look for it there).
# - Python 3.12: Ubuntu 24.04's own python3.12 (no third-party apt repository). PYTHON_VERSION names
#   the apt packages, so another value needs a base that ships that version.
# - constraints.txt cannot apply whole: it pins the CPU/dev install, and vLLM pins some of the same
#   packages itself (vllm 0.33.0: transformers<5.21, fastapi<0.137, lark==1.2.2; its mistral-common:
#   numpy<2.4 on Python <= 3.12), so `pip install -c constraints.txt ".[gpu]"` has no solution.
#   docker/gpu_constraints.py resolves the project, its `gpu` extra, torch, vllm and deepspeed
#   without constraints first (a dry run), then keeps every pin of constraints.txt that this world
#   allows and leaves out the rest (listed in the build log); torch, vllm and deepspeed are pinned
#   by the build arguments below. The image's full set is in /opt/venv/pip-freeze.txt.
ARG CUDA_BASE=nvidia/cuda:13.0.2-base-ubuntu24.04

# ---------------------------------------------------------------------------------------------------
# builder: a virtual environment in /opt/venv with torch, the project and its `gpu` extra.
FROM ${CUDA_BASE} AS builder

ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.14.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG VLLM_VERSION=0.33.0
ARG DEEPSPEED_VERSION=0.19.8

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DS_BUILD_OPS=0

# Ubuntu's packages are not version-pinned: the archive drops superseded versions, so a pin breaks
# the build at the next security update; the base image tag fixes the release (noble).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        gcc g++ libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && "python${PYTHON_VERSION}" -m venv /opt/venv

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /src

# Heavy layers first, so that a change to the project's source rebuilds only the last, small one:
# torch from the PyTorch index of the base image's CUDA version, then the dependencies (vLLM,
# DeepSpeed and the project's own) under the GPU constraints (see the top of this file).
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml constraints.txt docker/gpu_constraints.py /src/
RUN python /src/gpu_constraints.py requirements /src/pyproject.toml gpu \
        "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" "deepspeed==${DEEPSPEED_VERSION}" > /src/requirements-gpu.txt \
    && pip install --no-cache-dir --dry-run --ignore-installed --quiet --report /src/resolved.json \
        --extra-index-url "${TORCH_INDEX_URL}" -r /src/requirements-gpu.txt \
    && python /src/gpu_constraints.py constraints /src/resolved.json /src/constraints.txt \
        "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" "deepspeed==${DEEPSPEED_VERSION}" > /src/constraints-gpu.txt \
    && pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" -c /src/constraints-gpu.txt \
        -r /src/requirements-gpu.txt

COPY README.md /src/
COPY src /src/src
COPY components /src/components
COPY pipelines /src/pipelines
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" -c /src/constraints-gpu.txt "/src[gpu]" \
    && python -c "import torch, kfrl; assert torch.version.cuda, torch.__version__; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    && pip check \
    && pip freeze > /opt/venv/pip-freeze.txt

# ---------------------------------------------------------------------------------------------------
# runtime: the virtual environment, the interpreter it points at, and a C compiler with Python's
# headers (Triton, used by kfrl's decoder kernels, vLLM and torch.compile, builds small C launchers
# when a kernel first runs).
FROM ${CUDA_BASE}

ARG CUDA_BASE
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.14.0
ARG VLLM_VERSION=0.33.0
ARG KFRL_VERSION=0.1.0
ARG VCS_REF=unknown

LABEL org.opencontainers.image.title="kfrl-gpu" \
      org.opencontainers.image.description="kfrl GPU stages and resident engine: CUDA torch ${TORCH_VERSION}, vLLM ${VLLM_VERSION}, DeepSpeed" \
      org.opencontainers.image.version="${KFRL_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kfrl/kfrl" \
      org.opencontainers.image.base.name="${CUDA_BASE}"

# The commit the image was built from, for the runs it drives (MLflow's mlflow.source.git.commit).
ENV KFRL_GIT_COMMIT="${VCS_REF}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# The image's own `ubuntu` user holds uid 1000, which kfrl takes. The packages are not
# version-pinned, as in the builder: the archive drops superseded versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" gcc g++ libc6-dev ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && if id -u ubuntu >/dev/null 2>&1; then userdel ubuntu && rm -rf /home/ubuntu; fi \
    && if getent group ubuntu >/dev/null; then groupdel ubuntu; fi \
    && groupadd --gid 1000 kfrl \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/kfrl --shell /bin/bash kfrl \
    && install -d -o kfrl -g kfrl -m 0775 /home/kfrl/.cache /home/kfrl/.cache/kfrl /home/kfrl/.cache/huggingface /workspace

COPY --from=builder /opt/venv /opt/venv

# KFP's lightweight components run `python3 -m kfp.dsl.executor_main`: /opt/venv/bin comes first on
# PATH, so that is the venv's interpreter with kfp and kfrl. No credentials here: S3 and MLflow
# settings come from the pod's environment (cluster.secret).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/kfrl \
    XDG_CACHE_HOME=/home/kfrl/.cache \
    KFRL_CACHE_DIR=/home/kfrl/.cache/kfrl \
    HF_HOME=/home/kfrl/.cache/huggingface \
    GIT_PYTHON_REFRESH=quiet

USER 1000:1000
WORKDIR /workspace

# tini as PID 1 forwards SIGTERM, so `kfrl engine serve` stops when its pod is deleted. KFP tasks
# set their own command, which replaces both lines.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["kfrl", "--help"]
