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
PYTEST_ARGS ?=
SGLANG_IMAGE_TAG ?= v0.5.23-cu130
IMAGE ?= hiqcache/sglang:0.5.23-hiq
# WikiText-2 test split, read in place (never copied into the repo).
TEXT_FILE ?= ../shared/data/wikitext-2/test.txt
QUALITY_ARGS ?=

.PHONY: help apply check-patches refresh wheel pr image test venv bench-codec quality demo gpu-check clean

help:
	@echo "make demo           main command: capacity + cache-hit experiments on CPU (table + results/demo.png)"
	@echo "make apply          build/sglang = pinned SGLang + sglang_overlay/ + patches/"
	@echo "make test           CPU test environment (.venv) + apply + pytest"
	@echo "make check-patches  series/patches agree and every patch applies to the pin"
	@echo "make refresh        regenerate patches/ + sglang_overlay/ from build/sglang [MSG=subject]"
	@echo "make wheel          patched wheel sglang-0.5.23+hiq.N into dist/"
	@echo "make pr             upstream-ready format-patch series into dist/pr/"
	@echo "make image          Docker image FROM lmsysorg/sglang:$(SGLANG_IMAGE_TAG) with the series"
	@echo "make bench-codec    INT8 codec throughput vs a plain BF16 copy (CPU)"
	@echo "make gpu-check      on a CUDA machine: GPU tests + INT8 vs BF16 benchmark, JSON in results/gpu-check/ (scripts/gpu_check.sh --help)"
	@echo "make quality        restored-KV quality on SmolLM2 + WikiText-2 via the real L2 path (CPU) [TEXT_FILE=...]"

apply:
	$(OVERLAY) apply

check-patches:
	$(OVERLAY) check

refresh:
	$(OVERLAY) refresh

# The stamp depends on every pinned input, so a changed lock rebuilds the venv.
$(VENV)/.stamp: sglang.lock requirements/cpu-test.txt requirements/test-tools.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-deps \
		-r requirements/cpu-test.txt -r requirements/test-tools.txt \
		"$$($(OVERLAY) fetch)"
	touch $@

venv: $(VENV)/.stamp

wheel: venv
	$(VPY) scripts/overlay.py wheel

pr:
	$(OVERLAY) pr

test: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m pytest $(PYTEST_ARGS) tests

# Same CPU memory, more reuse: experiments A and B at Qwen3-8B geometry with the
# real patched SGLang pools and radix cache (python -m scripts.demo --help for options).
DEMO_ARGS ?=
demo: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.demo $(DEMO_ARGS)

bench-codec: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.bench.codec

# Self-contained (installs the pinned wheel into a temp dir); no venv needed.
# Stage the carry set for a machine without network: scripts/gpu_check.sh prepare
GPU_CHECK_ARGS ?=
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

quality: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) -m scripts.quality --text-file $(TEXT_FILE) $(QUALITY_ARGS)

image:
	docker build --build-arg SGLANG_IMAGE_TAG=$(SGLANG_IMAGE_TAG) -t $(IMAGE) .

clean:
	rm -rf build/sglang dist
