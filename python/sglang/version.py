"""The package version, in a module of its own so the HTTP server can report it without importing the engine."""

__version__ = "0.1.0.dev0"
