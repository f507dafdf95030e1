# Two commands on a fresh machine with only Python: `make demo` and `make test`.
# Both build .venv first (a CPU torch and triton; Triton kernels run in its CPU interpreter).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= 2.13.0
TRITON ?= 3.6.0

.PHONY: demo test gpu-test clean

$(VENV)/.installed: pyproject.toml Makefile tests/sglang_env/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==$(TORCH) triton==$(TRITON) numpy
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps sglang==0.5.23 apache-tvm-ffi==0.1.11
	$(BIN)/pip install -q --disable-pip-version-check -r tests/sglang_env/requirements.txt
	touch $@

demo: $(VENV)/.installed
	TRITON_INTERPRET=1 $(BIN)/fuser explain examples/dsv4/layer.py:tiny
	TRITON_INTERPRET=1 $(BIN)/fuser check examples/dsv4/layer.py:tiny

test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

# On a machine with a CUDA GPU and torch/triton installed (no venv): the GPU-marked tests.
gpu-test:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) kernels/*.py .pytest_cache
