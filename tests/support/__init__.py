"""Test tooling shared by several test modules (not part of the package)."""
