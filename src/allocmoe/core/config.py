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


def check_counts(config, least: dict[str, int], flags: dict[str, str] | None = None) -> None:
    """Refuse count fields that are not whole numbers >= their least value (None means "default"),
    naming the command-line flag that sets each (`--<name>` unless `flags` says otherwise)."""
    for name, low in least.items():
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            flag = (flags or {}).get(name, "--" + name.replace("_", "-"))
            raise AllocMoeError(f"{name} ({flag}) must be a whole number >= {low}, got {value!r}; give {low} or more")
