"""The rigs HiQCache's tools and tests both stand on (never the product).

Imported as ``scripts.rigs`` from the repository root, by scripts/ and tests/
alike. Modules:

- ``standins``: the CPU stand-ins for CUDA-only pieces (each says what it replaces).
- ``cpu_site/``: put first on PYTHONPATH of a live server's processes; its
  sitecustomize installs the stand-ins there, next to the strict import-only
  ``sgl_kernel`` stand-in.
- ``server`` (on ``server_process``): one live patched SGLang server on CPU
  (start, /generate, /metrics, stop).
- ``model``: SmolLM2-135M-Instruct converted from the packaged GGUF, cached in build/.
- ``prom``: the Prometheus text parser for /metrics.
- ``hicache_harness``: SGLang's device and host pools and the real
  HiCacheController on CPU (the pool-level rigs), and the layouts and head
  geometries they are exercised over.
- ``l3_harness``: L3 storage backends (file, a real Mooncake master) on those rigs.
- ``gpu``: stand-ins for what a bare CUDA machine lacks, and pools on a chosen
  device (scripts/gpu_bench.py and tests/gpu/).
"""
