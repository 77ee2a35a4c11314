# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
# torch: the CPU wheel (2.13.0) on machines without an NVIDIA GPU; with a GPU, a CUDA torch already
# importable in the venv is kept (install one first, or let `pip install torch` pick the CUDA build).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)

.PHONY: demo demo-tools test test-portability test-all install compile clean images

# The venv itself, before anything installs into it: `make -j2` runs the two installs below side by
# side, and two `venv` creations of the same folder at once fail ("File exists").
$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null && echo "keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
		|| $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# A small real training on the embedded default: KFP local runner, local store, local MLflow.
demo: $(STAMP)
	$(VENV)/bin/kfrl train --config configs/demo.yaml

demo-tools: $(STAMP)
	$(VENV)/bin/kfrl train --config configs/demo_tools.yaml

# checkov (the Terraform security scan of tests/test_terraform.py) lives in its own venv: its pins
# (boto3, networkx, packaging, ...) conflict with constraints.txt.
CHECKOV := $(VENV)/checkov/bin/checkov
$(CHECKOV): infra/terraform/requirements-checkov.txt | $(PY)
	@test -x $(VENV)/checkov/bin/python || $(PYTHON) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/python -m pip install -q -r infra/terraform/requirements-checkov.txt
	@touch $(CHECKOV)

# Two pytest workers, each taking whole test files in collection order (tests/conftest.py collects the
# longest first, builds the builtin models before any test runs and gives each worker one torch thread):
# the tests wait on subprocesses and servers much of the time, so two keep 2 cores busier than one.
PYTEST := $(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The two venvs install side by side: pip keeps about one core busy, so the second one's install costs
# little more than the first's.
test:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(CHECKOV)
	$(PYTEST) -m "not gpu and not bench"
	@$(MAKE) --no-print-directory test-portability

# The portability gate: the numerics-sensitive tests (marker `numerics`) once more under a foreign
# machine's kernels: ATen's generic kernels instead of this CPU's AVX2/AVX-512 ones, MKL's compatible
# code path, oneDNN held to SSE4.1. The builtin tiny model is trained with those kernels too, in a cache
# of its own, so it comes out as another machine's model would (built once, ~1 min, then cached). A test
# that holds only on one CPU's kernels fails here, on the developer's machine (tests/numerics.py).
FOREIGN_KERNELS := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 \
	KFRL_CACHE_DIR=$(CURDIR)/$(VENV)/cache-foreign-kernels

test-portability: $(STAMP)
	$(FOREIGN_KERNELS) $(PYTEST) -m "numerics and not gpu and not bench"

compile: $(STAMP)
	$(VENV)/bin/kfrl compile

clean:
	rm -rf kfrl-runs .pytest_cache

# Container images from docker/ (the build context is this folder; see .dockerignore):
# $(IMAGE_REPO)/kfrl-gpu:$(VERSION) and $(IMAGE_REPO)/kfrl-cpu:$(VERSION); PUSH=1 pushes them too.
# The builder is docker, else podman (DOCKER=... picks another). IMAGE_BUILD_FLAGS go to both builds,
# GPU_BUILD_FLAGS / CPU_BUILD_FLAGS to one (e.g. GPU_BUILD_FLAGS="--build-arg VLLM_VERSION=...").
IMAGE_REPO ?= ghcr.io/kfrl
VERSION ?= $(or $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml),0.1.0)
DOCKER ?= $(shell for b in docker podman; do command -v $$b >/dev/null 2>&1 && { echo $$b; break; }; done)
IMAGE_BUILD_FLAGS ?=
GPU_BUILD_FLAGS ?=
CPU_BUILD_FLAGS ?=
VCS_REF ?= $(or $(shell git rev-parse HEAD 2>/dev/null),unknown)

images:
	@test -n "$(DOCKER)" || { echo "make images: no container builder found: install docker or podman (or set DOCKER=<builder>)" >&2; exit 1; }
	$(DOCKER) build -f docker/gpu.Dockerfile --build-arg KFRL_VERSION=$(VERSION) --build-arg VCS_REF=$(VCS_REF) $(IMAGE_BUILD_FLAGS) $(GPU_BUILD_FLAGS) -t $(IMAGE_REPO)/kfrl-gpu:$(VERSION) .
	$(DOCKER) build -f docker/cpu.Dockerfile --build-arg KFRL_VERSION=$(VERSION) --build-arg VCS_REF=$(VCS_REF) $(IMAGE_BUILD_FLAGS) $(CPU_BUILD_FLAGS) -t $(IMAGE_REPO)/kfrl-cpu:$(VERSION) .
ifeq ($(PUSH),1)
	$(DOCKER) push $(IMAGE_REPO)/kfrl-gpu:$(VERSION)
	$(DOCKER) push $(IMAGE_REPO)/kfrl-cpu:$(VERSION)
endif
