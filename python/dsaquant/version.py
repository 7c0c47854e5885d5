"""The package version (pyproject.toml and the plugin wheels carry the same string; tests/test_cli.py checks)."""
__version__ = "0.1.0"
