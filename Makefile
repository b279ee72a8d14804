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

.PHONY: help apply check-patches refresh wheel pr image test venv bench-codec clean

help:
	@echo "make apply          build/sglang = pinned SGLang + sglang_overlay/ + patches/"
	@echo "make test           CPU test environment (.venv) + apply + pytest"
	@echo "make check-patches  series/patches agree and every patch applies to the pin"
	@echo "make refresh        regenerate patches/ + sglang_overlay/ from build/sglang [MSG=subject]"
	@echo "make wheel          patched wheel sglang-0.5.23+hiq.N into dist/"
	@echo "make pr             upstream-ready format-patch series into dist/pr/"
	@echo "make image          Docker image FROM lmsysorg/sglang:$(SGLANG_IMAGE_TAG) with the series"
	@echo "make bench-codec    INT8 codec throughput vs a plain BF16 copy (CPU)"

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

bench-codec: venv apply
	PYTHONPATH=$(PATCHED_PATH) $(VPY) scripts/bench_codec.py

image:
	docker build --build-arg SGLANG_IMAGE_TAG=$(SGLANG_IMAGE_TAG) -t $(IMAGE) .

clean:
	rm -rf build/sglang dist
