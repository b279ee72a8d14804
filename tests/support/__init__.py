"""HiQCache test-only support (the rigs tools share live in scripts/rigs/).

Imported as ``tests.support`` by tests (the repository root is on the path),
never by the product or by scripts/. Modules:

- ``conformance``: the conformance grid and the reference a pool must restore.
- ``codec_inputs``: rows of chosen kinds and magnitudes, edge rows, bit equality.
- ``hybrid_model``: a tiny random-weight gpt-oss (sliding-window + full
  attention) for the live server, cached in build/.
- ``int4_reference``: the INT4/K8V4 spec reference the kernels are checked against.
- ``hash_grid``, ``copy_format``, ``l3_faults``: the byte-identity grid, a toy
  host format, L3 fault injection.
"""
