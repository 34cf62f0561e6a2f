"""Typed configs: every public config is a `Config`, a pydantic model checked at the door.

A `Config` subclass is written as a dataclass is (annotated fields with defaults, each with a one-line
why), and its constructor refuses, before the class's own `__post_init__` rules and before any work:
unknown fields (extra="forbid"), more positional values than fields, and any value whose type is not
its annotation's, strictly (pydantic's strict mode: no "32" for an int, no True for a count, no 1.5 for
a whole number) or a float that is NaN or infinite. Each refusal is an AllocMoeError naming the field
and the command-line flag that sets it, as the CLI says it (the CLI builds the same objects).
`checked_config`'s dicts and `replaced` go through the same constructor; `model_dump()` is the dict.

`__config_aliases__` maps a field's old name to its new one (one name per idea across the CLI, Python
and files: `calib_tokens`, `eval_tokens`, `windows_per_pass`, `sequences`): the old name is still taken,
as a keyword, a dict key and an attribute, with a DeprecationWarning naming the new one.
`__config_flags__` names the CLI flag of a field not spelled `--<field-name>`.
"""

from __future__ import annotations

import functools
import math
import typing
import warnings
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from ..errors import AllocMoeError

C = TypeVar("C")


class Config(BaseModel):
    """The base of every typed config (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True,
                              revalidate_instances="never", validate_default=False)
    __config_flags__: typing.ClassVar[dict[str, str]] = {}
    __config_aliases__: typing.ClassVar[dict[str, str]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for old, new in cls.__config_aliases__.items():
            setattr(cls, old, _alias_property(cls.__name__, old, new))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        name, names = cls.__name__, list(cls.model_fields)
        kwargs = renamed(cls, kwargs)
        if len(args) > len(names):
            raise AllocMoeError(f"{name} takes at most {len(names)} values, got {len(args)}; give its fields "
                                f"by name: {', '.join(names)}")
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise AllocMoeError(f"unknown {name} field(s) {unknown}; known: {sorted(names)}")
        given = dict(zip(names, args))
        twice = sorted(set(given) & set(kwargs))
        if twice:
            raise AllocMoeError(f"{name} got {twice} twice; give each field once")
        given.update(kwargs)
        for field_name, value in given.items():
            check_type(cls, field_name, value)
        super().__init__(**given)
        self.__post_init__()

    def __post_init__(self) -> None:
        """A subclass's own rules between fields, after the types are checked; raises AllocMoeError."""


def replaced(config: C, **changes: Any) -> C:
    """`config` with `changes`, through the constructor (checked as a new config is)."""
    return type(config)(**{**config.model_dump(), **changes})


def _alias_property(owner: str, old: str, new: str) -> property:
    """The deprecated attribute `old` of a config: reads and writes field `new`, warning once per use."""
    def warn():
        warnings.warn(f"{owner}.{old} is deprecated; use {owner}.{new}", DeprecationWarning, stacklevel=3)

    def get(self):
        warn()
        return getattr(self, new)

    def put(self, value):
        warn()
        setattr(self, new, value)

    return property(get, put, doc=f"deprecated alias of {new}")


def renamed(cls, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (a config's keyword arguments) with deprecated field names (cls.__config_aliases__) turned
    into the new ones, each with a DeprecationWarning naming the new name; both names at once are refused."""
    aliases = getattr(cls, "__config_aliases__", {})
    if not any(isinstance(key, str) and key in aliases for key in values):
        return values
    out = {}
    for key, value in values.items():
        new = aliases.get(key) if isinstance(key, str) else None
        if new is None:
            out[key] = value
            continue
        if new in values:
            raise AllocMoeError(f"{cls.__name__} got both {key} and {new}, which is its new name; give {new} alone")
        warnings.warn(f"{cls.__name__}({key}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=3)
        out[new] = value
    return out


_FLAGS = {"progress": "--quiet", "prefix_cache": "--no-prefix-cache"}     # fields whose flag turns them off


def flag_of(cls, name: str) -> str:
    """The command-line flag that sets field `name` of config class `cls`."""
    return getattr(cls, "__config_flags__", {}).get(name) or _FLAGS.get(name) or "--" + name.replace("_", "-")


@functools.lru_cache(maxsize=None)
def _adapters(cls) -> dict[str, Any]:
    from pydantic import TypeAdapter

    return {name: (field.annotation, TypeAdapter(field.annotation)) for name, field in cls.model_fields.items()}


def describe(hint) -> str:
    """An annotation in words: `int | None` -> 'a whole number or None'."""
    words = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", type(None): "None",
             dict: "a dict"}
    if hint in words:
        return words[hint]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        said = [describe(a) for a in args]
        return ", ".join(said[:-1]) + " or " + said[-1]
    if typing.get_origin(hint) is tuple:
        return f"a tuple of {describe(args[0]).removeprefix('a ')}s" if args else "a tuple"
    return getattr(hint, "__name__", str(hint))


def check_type(cls, name: str, value: Any) -> None:
    """Refuse `value` for field `name` of `cls` unless it is of the field's type, strictly."""
    from pydantic import ValidationError

    entry = _adapters(cls).get(name)
    if entry is None:
        return
    hint, adapter = entry
    if isinstance(value, Config):
        return                                  # a nested config: its own constructor checked it
    try:
        adapter.validate_python(value, strict=True)
    except ValidationError:
        raise AllocMoeError(f"{name} ({flag_of(cls, name)}) must be {describe(hint)}, got {value!r} "
                            f"({type(value).__name__}); give {describe(hint)}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise AllocMoeError(f"{name} ({flag_of(cls, name)}) must be a finite number, got {value!r}; give a number")


def checked_config(cls: type[C], value: C | dict[str, Any] | None) -> C:
    """None -> defaults; a dict -> cls(**dict) with unknown keys refused; an instance -> itself."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise AllocMoeError(f"{cls.__name__} must be a {cls.__name__} or a dict, got {type(value).__name__}; give "
                            f"{cls.__name__}(...) or a dict of its fields")
    known = set(cls.model_fields)
    value = renamed(cls, value)
    bad_keys = [key for key in value if not isinstance(key, str)]
    if bad_keys:
        raise AllocMoeError(f"{cls.__name__} field names must be strings, got {bad_keys[:3]}; known: {sorted(known)}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise AllocMoeError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    return cls(**value)


def check_counts(config, least: dict[str, int], flags: dict[str, str] | None = None,
                 most: dict[str, int] | None = None) -> None:
    """Refuse count fields that are not whole numbers >= their least value (None means "default"),
    or above their `most`, naming the command-line flag that sets each (`--<name>` unless `flags`
    or the class's own `__config_flags__` says otherwise)."""
    def flag(name):
        return (flags or {}).get(name) or flag_of(type(config), name)

    for name, low in least.items():
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise AllocMoeError(f"{name} ({flag(name)}) must be a whole number >= {low}, got {value!r}; give {low} "
                                "or more")
    for name, high in (most or {}).items():
        value = getattr(config, name)
        if value is not None and value > high:
            raise AllocMoeError(f"{name} ({flag(name)}) is {value}, above the most allocmoe takes, {high}; give "
                                f"{high} or less")


# -- a public function's arguments ------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _adapter(hint):
    from pydantic import TypeAdapter

    return TypeAdapter(hint)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_argument(function: str, name: str, value: Any, hint, fix: str | None = None, finite: bool = True) -> None:
    """Refuse argument `name` of public function `function` unless `value` is of type `hint`, strictly
    (no "32" for an int, no True for a count, and unless `finite` is False, no NaN or infinity)."""
    from pydantic import ValidationError

    try:
        _adapter(hint).validate_python(value, strict=True)
        bad = finite and isinstance(value, float) and not math.isfinite(value)
    except ValidationError:
        bad = True
    if bad:
        raise AllocMoeError(f"{function}: {name} must be {describe(hint)}, got {_shown(value)} "
                            f"({type(value).__name__}); give {fix or describe(hint)}")


def check_model_argument(function: str, model: Any, folder: tuple[type, ...] = ()) -> None:
    """Refuse a `model` that is not a loaded model (torch module with a transformers config); with
    `folder`, the types that name a model folder besides a path (the caller's models.ModelSpec:
    core imports no model-facing module), a model folder is accepted as well."""
    import os

    import torch

    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return
    if folder and isinstance(model, (str, os.PathLike, *folder)):
        return
    wanted = "a loaded model (allocmoe.load_model(...)[0])" + (" or a model folder's path" if folder else "")
    raise AllocMoeError(f"{function}: model must be {wanted}, got {_shown(model)} ({type(model).__name__}); "
                        "load it with allocmoe.load_model(FOLDER)")


def check_tokenizer_argument(function: str, tokenizer: Any, optional: bool = False) -> None:
    """Refuse a `tokenizer` that is not callable (a Hugging Face tokenizer is)."""
    if tokenizer is None and optional:
        return
    if not callable(tokenizer):
        raise AllocMoeError(f"{function}: tokenizer must be the model's tokenizer, got {_shown(tokenizer)} "
                            f"({type(tokenizer).__name__}); pass the tokenizer allocmoe.load_model returns")
