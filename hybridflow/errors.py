"""`ConfigError`: the one exception every config check raises.

A leaf module that imports nothing from hybridflow, so any layer may import it
without importing the config package (which does not re-export it).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A config value, key or combination that cannot run; names the key path."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)
