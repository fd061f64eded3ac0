"""The package's version, in a module of its own so that modules anywhere in the package read it without importing
the package's `__init__` (which imports them back for type checkers)."""

__version__ = "0.1.0.dev0"
