"""Helpers shared by the CPU tools in scripts/ (demo, quality)."""
