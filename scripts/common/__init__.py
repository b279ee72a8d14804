"""Helpers shared by the tools in scripts/ (and, for server.py, tests.support)."""
