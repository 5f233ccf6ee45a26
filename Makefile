# The README's two commands: `make demo` and `make test`. Both create .venv and install on first use; both are
# idempotent (the install step re-runs only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zlightning-installed
TORCH_PIN := torch==2.13.0

.PHONY: install demo demo-short test lint docs docs-check docs-serve browser deepspeed-venv bench gpu-check clean

install: $(STAMP)

# The native kernels (kernels/csrc) are part of the install: compiled once here, cached by a hash of sources + torch
# version under kernels/build, never at import. A failed build only warns: every op has a PyTorch fallback.
$(STAMP): pyproject.toml $(wildcard kernels/csrc/*)
	@echo ">> creating $(VENV) (if missing)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> installing $(TORCH_PIN) first (CPU build on this machine; never an unpinned torch)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	@echo ">> installing zlightning (editable) with test extras"
	$(PY) -m pip install --quiet -e ".[test]"
	@echo ">> building native kernels (zlightning.kernels; a few minutes the first time, cached afterwards)"
	-$(PY) -m zlightning.kernels._build
	@touch $(STAMP)
	@echo ">> install done"

demo: $(STAMP)
	@echo ">> training a byte-level GPT with zstack_zero3 on 2 processes (see examples/demo.py)"
	$(PY) examples/demo.py

demo-short: $(STAMP)
	$(PY) examples/demo.py --short

test: $(STAMP) lint docs browser deepspeed-venv
	@echo ">> running the test suite"
	@$(PY) -m pytest -q tests --durations=25; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# Lint and formatting over the whole tree (ruff) and type checking of the zlightning package and the kernels'
# Python layer (mypy; a separate run, since kernels/ is mapped into zlightning.kernels), configured in pyproject.toml;
# part of `make test`.
lint: $(STAMP)
	@echo ">> ruff check, ruff format --check and mypy zlightning, kernels, strategies, datamodules"
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy zlightning
	$(PY) -m mypy kernels
	$(PY) -m mypy strategies datamodules

# The documentation site (mkdocs.yml, docs/): guides and the API reference generated from the docstrings, built
# strictly (any warning fails) into site/. Part of `make test`; tests/test_docs_site.py checks the built pages in a
# headless Chromium and tests/test_docs_snippets.py runs every code block.
docs: $(STAMP)
	@echo ">> building the documentation site into site/ (strict)"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# A headless Chromium renders the built home page and an API page, and fails on a blank or broken page.
docs-check: docs browser
	$(PY) -m pytest -q tests/test_docs_site.py

# Debian's Chromium for the docs check (installed once, when missing and apt-get can run).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo ">> installing chromium (Debian) for the docs check"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# DeepSpeed 0.19.8 from PyPI in its own venv (DS_BUILD_OPS=0), never in .venv: the interoperability tests (its
# sampler state, its checkpoints, its own APIs called side by side) and the benchmarks' DeepSpeed peer run in it.
# About a minute the first time; the stamp keeps later runs from re-checking it.
DS_STAMP := benchmarks/.venv-deepspeed/.zlightning-ready
deepspeed-venv: $(DS_STAMP)

$(DS_STAMP): benchmarks/setup_deepspeed_venv.sh
	bash benchmarks/setup_deepspeed_venv.sh $(PYTHON)
	@touch $(DS_STAMP)

bench: $(STAMP)
	@echo ">> side-by-side benchmark: DDP, FSDP2, DeepSpeed ZeRO-3 (separate venv), zstack_zero3"
	$(PY) benchmarks/zero3.py

# Every GPU-marked test and the GPU measurements; writes benchmarks/results/gpu.md. Without a GPU it says so.
# Where $(PYTHON) already holds a CUDA build of torch (a GPU image, often offline), the check runs in it with an
# editable install of this tree (no dependencies fetched) and the native kernels built for that torch; otherwise in
# .venv like everything else.
gpu-check:
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		echo ">> $(PYTHON) has CUDA torch: installing this tree into it (--no-deps)"; \
		$(PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index -e . && \
		{ $(PYTHON) -m zlightning.kernels._build || echo ">> native kernels not built: PyTorch fallbacks measured"; } && \
		$(PYTHON) benchmarks/gpu_check.py; \
	else \
		$(MAKE) install && $(PY) benchmarks/gpu_check.py; \
	fi

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache kernels/build site build/docs-api
