"""The package's version, on the lowest floor so every module can stamp files with it without
importing the package's public face (`allocmoe/__init__.py`, which imports every floor)."""

__version__ = "0.1.0"
