"""HiQCache's tools: overlay.py (the patch series), common/ (shared helpers),
demo/, quality/ and bench/ (`make demo`, `make quality`, `make bench-codec`)."""
