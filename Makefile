# Two entry points (README quickstart): `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN := torch==2.13.0
DEFAULT_MODEL := build/tiny-model
HOST ?= 127.0.0.1
PORT ?= 9999

.PHONY: venv venv-test serve test model clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a later unpinned resolve then finds it satisfied (no CUDA wheels).
	$(PIP) install -q $(TORCH_PIN)
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

$(DEFAULT_MODEL)/config.json: $(VENV)/.installed scripts/make_tiny_model.py
	$(PY) scripts/make_tiny_model.py --out $(DEFAULT_MODEL)

model: $(DEFAULT_MODEL)/config.json

serve: $(VENV)/.installed $(DEFAULT_MODEL)/config.json
	$(VENV)/bin/verispec serve -m $(DEFAULT_MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf build $(VENV)
