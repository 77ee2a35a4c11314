# kfrl CPU image: the driver (`kfrl train`, the pipelines' driver task), scoring and advantage stages.
# No CUDA: torch from PyTorch's CPU index, the project without the `gpu` extra. Built from the
# repository root:
#   docker build -f docker/cpu.Dockerfile -t ghcr.io/kfrl/kfrl-cpu:0.1.0 .      (or: make images)
#
# Versions, and why:
# - Base python:3.11-slim-trixie (Debian 13; PYTHON_VERSION picks another Python): 3.11 is what
#   constraints.txt was resolved on, and slim has no compilers or docs (every pinned dependency ships
#   a wheel or is pure Python). The image's full set is in /opt/venv/pip-freeze.txt.
# - torch 2.13.0 from https://download.pytorch.org/whl/cpu: the CPU build that `make` installs and
#   the test suite runs on (about 200 MB, against several GB for the CUDA build PyPI serves).
ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------------------------------------------
# builder: a virtual environment in /opt/venv with CPU torch and the project.
FROM python:${PYTHON_VERSION}-slim-trixie AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /src
# torch first, alone from the CPU index; torch==TORCH_VERSION is then a constraint of the project's
# install, so that pip fails rather than replace it with PyPI's CUDA build.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && echo "torch==${TORCH_VERSION}" > /src/constraints-torch.txt

COPY constraints.txt pyproject.toml README.md /src/
COPY src /src/src
COPY components /src/components
COPY pipelines /src/pipelines
RUN pip install --no-cache-dir -c /src/constraints.txt -c /src/constraints-torch.txt /src \
    && python -c "import torch, kfrl; assert torch.version.cuda is None, torch.__version__; print('torch', torch.__version__)" \
    && pip check \
    && pip freeze > /opt/venv/pip-freeze.txt

# ---------------------------------------------------------------------------------------------------
# runtime: the virtual environment on the same base (its interpreter is the base's /usr/local/bin).
FROM python:${PYTHON_VERSION}-slim-trixie

ARG PYTHON_VERSION
ARG TORCH_VERSION=2.13.0
ARG KFRL_VERSION=0.1.0
ARG VCS_REF=unknown

LABEL org.opencontainers.image.title="kfrl-cpu" \
      org.opencontainers.image.description="kfrl driver, scoring and advantage stages: CPU torch ${TORCH_VERSION}" \
      org.opencontainers.image.version="${KFRL_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kfrl/kfrl" \
      org.opencontainers.image.base.name="python:${PYTHON_VERSION}-slim-trixie"

# The commit the image was built from, for the runs it drives (MLflow's mlflow.source.git.commit).
ENV KFRL_GIT_COMMIT="${VCS_REF}"

ENV DEBIAN_FRONTEND=noninteractive

# Debian's packages are not version-pinned: the archive drops superseded versions, so a pin breaks
# the build at the next point release; the base image tag fixes the release (trixie).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
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

# tini as PID 1 forwards SIGTERM to kfrl; KFP tasks set their own command, which replaces both lines.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["kfrl", "--help"]
