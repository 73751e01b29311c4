"""The package version, in one place (the root re-exports it; the command line prints it)."""

__version__ = "0.3.0"
