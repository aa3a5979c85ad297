# Two commands on a fresh machine: `make demo` (generate text on the trained demo model) and `make test`.
# Both first run `setup`: a virtual environment, the Python dependencies, and the patched llama.cpp
# (built once per set of inputs and cached in ~/.cache/sparq-cpp, so a second run takes seconds).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BUILD_ARGS ?=

.PHONY: setup demo test test-slow build tree export check-series clean gpu-check
setup: $(VENV)/.deps build

$(VENV)/.deps: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

build: $(VENV)/.deps
	$(PY) -m sparq_cpp.pyext.build $(BUILD_ARGS)

demo: setup
	$(VENV)/bin/sparq-cpp generate -n 96 --sparq-r 16 --sparse-k 16

# pytest exits 5 when it collected nothing: that is a broken test run here, not a pass.
# tools/test-prereqs.sh installs what the aarch64 checks need where it can (root and apt-get), else says so.
test: setup
	@tools/test-prereqs.sh
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-slow: setup
	@$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# Developers: an editable patched tree, and patches/ and engine/ regenerated from its commits.
tree: $(VENV)/.deps
	$(PY) -m sparq_cpp.pyext.patchtree init $(TREE)

export:
	$(PY) -m sparq_cpp.pyext.patchtree export $(TREE)

# Every prefix of the series builds: the tree built after each patch in turn; names the first that does not.
check-series: $(VENV)/.deps
	$(PY) -m sparq_cpp.pyext.seriescheck $(SERIES_ARGS)

# The CUDA kernels' check for a machine with a GPU: .sparq-build/gpu-check (the patched llama.cpp of the current
# series, trimmed, and run.sh: stages under one deadline, a JSON summary and logs in $OUT; docs/gpu-check.md);
# tools/gpu_check.py. TREE=dir takes a `make tree` checkout; `.venv/bin/python -m tools.gpu_check --dry-run` prints the plan.
gpu-check: $(VENV)/.deps
	$(PY) -m tools.gpu_check $(if $(TREE),--tree $(TREE))

clean:
	rm -rf $(VENV) .sparq-build
