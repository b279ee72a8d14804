"""HiQCache test support: CPU stand-ins, live-server helpers, pool and L3 rigs.

Imported as ``tests.support`` by tests and scripts (the repository root is on
the path in both), never by the product. Modules:

- ``standins``: the CPU stand-ins for CUDA-only pieces (each says what it replaces).
"""
