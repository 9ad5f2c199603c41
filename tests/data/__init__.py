"""Data-layer tests (a package so tests can share the helper modules here)."""
