# The two commands (see README.md):  make train   and   make test
# Needs Python 3.11 with pip and venv; everything else is installed here (torch 2.13.0 CPU from pip).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
ISO := .venv-isolated
PACKAGES := packages/core packages/attn-kda packages/attn-dsa packages/moe-chunked
PLUGINS := $(filter-out packages/core,$(PACKAGES))
EXAMPLES := examples/megaseq-sliding-window
RECIPE ?= recipes/genome-cpu.toml

.PHONY: setup train test test-isolated test-integration lint clean

# A venv with pip new enough for dependency groups, the CPU torch wheel, and every workspace package editable.
$(VENV)/.installed: pyproject.toml $(addsuffix /pyproject.toml,$(PACKAGES) $(EXAMPLES))
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "pip>=25.1"
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q --group dev $(addprefix -e ,$(PACKAGES) $(EXAMPLES))
	touch $@

setup: $(VENV)/.installed

# Main job: fetch chr20 + chrX (Debian packages, no root needed), train the default recipe, print the
# held-out loss by context position next to the Markov baseline.
train: setup
	$(VENV)/bin/megaseq data fetch grch37-chr20
	$(VENV)/bin/megaseq data fetch grch37-chrX
	$(VENV)/bin/megaseq train $(RECIPE)

# Every test. Each package's tests run in an environment holding only core and that package, so a plugin
# that silently needs another plugin fails; cross-package tests and the example plugin run in the full venv.
test: test-isolated test-integration

$(ISO)/.installed: pyproject.toml packages/core/pyproject.toml
	rm -rf $(ISO)
	$(PYTHON) -m venv $(ISO)
	$(ISO)/bin/python -m pip install -q "pip>=25.1"
	$(ISO)/bin/python -m pip install -q torch==2.13.0
	$(ISO)/bin/python -m pip install -q --group dev -e packages/core
	touch $@

test-isolated: $(ISO)/.installed
	$(ISO)/bin/python -m pytest packages/core/tests
	set -e; for p in $(PLUGINS); do \
	  $(ISO)/bin/python -m pip install -q --no-deps -e $$p; \
	  $(ISO)/bin/python -m pytest $$p/tests || { $(ISO)/bin/python -m pip uninstall -q -y $$(basename $$p | sed 's/^/megaseq-/'); exit 1; }; \
	  $(ISO)/bin/python -m pip uninstall -q -y megaseq-$$(basename $$p); \
	done

test-integration: setup
	$(VENV)/bin/ruff check packages examples tests benchmarks
	$(VENV)/bin/python -m pytest tests $(addsuffix /tests,$(EXAMPLES))

lint: setup
	$(VENV)/bin/ruff check packages examples tests benchmarks

clean:
	rm -rf $(VENV) $(ISO) runs
