"""HiQCache's tools: overlay.py (the patch series), common/ (shared helpers),
rigs/ (CPU stand-ins and harnesses, shared with tests/), demo/, quality/ and
bench/ (`make demo`, `make quality`, `make bench-codec`), kernel_compile.py."""
