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

.PHONY: demo test test-all install compile clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null && echo "keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
		|| $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# A small real training on the embedded default: KFP local runner, local store, local MLflow.
demo: $(STAMP)
	$(VENV)/bin/kfrl train --config configs/demo.yaml

test: $(STAMP)
	$(VENV)/bin/pytest -q -m "not gpu and not bench"

compile: $(STAMP)
	$(VENV)/bin/kfrl compile

clean:
	rm -rf kfrl-runs .pytest_cache
