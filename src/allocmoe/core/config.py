"""Typed configs: build a config dataclass from a dict, rejecting unknown fields before any work."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

from ..errors import AllocMoeError

C = TypeVar("C")


def checked_config(cls: type[C], value: C | dict[str, Any] | None) -> C:
    """None -> defaults; a dict -> cls(**dict) with unknown keys refused; an instance -> itself."""
    if value is None:
        return cls()
    if is_dataclass(value) and isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise AllocMoeError(f"{cls.__name__} must be a {cls.__name__} or a dict, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise AllocMoeError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    return cls(**value)
