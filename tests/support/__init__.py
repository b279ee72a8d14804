"""HiQCache test support: CPU stand-ins, live-server helpers, pool and L3 rigs.

Imported as ``tests.support`` by tests and scripts (the repository root is on
the path in both), never by the product. Modules:

- ``standins``: the CPU stand-ins for CUDA-only pieces (each says what it replaces).
- ``cpu_site/``: put first on PYTHONPATH of a live server's processes; its
  sitecustomize installs the stand-ins there, next to the strict import-only
  ``sgl_kernel`` stand-in.
- ``server``: one live patched SGLang server on CPU (start, /generate, /metrics, stop).
- ``model``: SmolLM2-135M-Instruct converted from the packaged GGUF, cached in build/.
- ``hybrid_model``: a tiny random-weight gpt-oss (sliding-window + full
  attention) for the live server, cached in build/.
- ``prom``: the Prometheus text parser for /metrics.
- ``hicache_harness``: SGLang's device and host pools and the real
  HiCacheController on CPU (the pool-level rigs most tests build).
- ``l3_harness``: L3 storage backends (file, a real Mooncake master) on those rigs.
- ``int4_reference``: the INT4/K8V4 spec reference the kernels are checked against.
- ``hash_grid``, ``copy_format``, ``l3_faults``: the byte-identity grid, a toy
  host format, L3 fault injection.
"""
