"""Helpers shared by the tools in scripts/ (rigs/ holds the harnesses tests share)."""
