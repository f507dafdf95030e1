# Two commands on a fresh machine with only Python: `make demo` and `make test`.
# Both build .venv first (a CPU torch and triton; Triton kernels run in its CPU interpreter):
# `make demo` installs only what fuser needs, `make test` adds the test tools and sglang.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check
TORCH ?= 2.13.0
TRITON ?= 3.6.0

.PHONY: demo test gpu-test clean

# torch first and pinned, so that no dependency resolution can pull another (CUDA) torch.
$(VENV)/.installed-demo: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==$(TORCH) triton==$(TRITON) numpy
	$(PIP) -e .
	touch $@

# sglang 0.5.23 itself with --no-deps (it pins a CUDA torch), then what its imports need.
$(VENV)/.installed-test: $(VENV)/.installed-demo tests/serving/sglang_env/requirements.txt
	$(PIP) -e '.[test]'
	$(PIP) --no-deps sglang==0.5.23 apache-tvm-ffi==0.1.11
	$(PIP) -r tests/serving/sglang_env/requirements.txt
	touch $@

demo: $(VENV)/.installed-demo
	TRITON_INTERPRET=1 $(BIN)/fuser explain examples/dsv4/layer.py:tiny
	TRITON_INTERPRET=1 $(BIN)/fuser check examples/dsv4/layer.py:tiny

test: $(VENV)/.installed-test
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

# On a machine with a CUDA GPU and torch/triton installed (no venv): the GPU-marked tests.
gpu-test:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) kernels/*.py .pytest_cache
