"""Click options made from settings-model fields: a field's default, range, choices and help are
declared once, on the model, and the command line follows them."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import annotated_types
import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo

F = TypeVar("F", bound=Callable[..., Any])

# ``EngineConfig.flash_attn`` (None, True, False) as typed; unset (None) is auto.
FLASH_CHOICE = click.Choice(["auto", "on", "off"])


class FieldOption(click.Option):
    """A click option that stands for ``model.field``; ``deferred`` options default to None
    (resolved later, from the environment or the model file) and say so in their help."""

    def __init__(
        self,
        *args: Any,
        model: type[BaseModel],
        field: str,
        defaults: BaseModel | None = None,
        deferred: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.model = model
        self.field = field
        self.defaults = defaults
        self.deferred = deferred


def field_option(
    model: type[BaseModel],
    field: str,
    *decls: str,
    defaults: BaseModel | None = None,
    default: Any = ...,
    help_after: str = "",
    **kwargs: Any,
) -> Callable[[F], F]:
    """``click.option`` for ``model.field``: ``--field-name`` unless ``decls`` names it, its
    type, range or choices from the annotation and constraints, its help from the description
    (``help_after`` appended), its default from the field, or from ``defaults`` (an instance
    of ``model`` whose values a command starts from). ``default=None`` defers the default
    (the help should say where it comes from)."""
    if default not in (..., None):
        raise TypeError(f"{field}: a default comes from the model (or from defaults=)")
    info = model.model_fields[field]
    name = "--" + field.replace("_", "-")
    value = (
        getattr(defaults, field)
        if defaults is not None
        else info.get_default(call_default_factory=True)
    )
    deferred = default is None and value is not None
    options: dict[str, Any] = {
        "type": _click_type(info),
        "default": None if deferred else value,
        "help": " ".join(part for part in (info.description or "", help_after) if part),
        "show_default": not deferred and value is not None,
    }
    if _base(info.annotation) is bool and "type" not in kwargs:
        options.pop("type")
        decls = decls or (f"{name}/--no-{name[2:]}",)
    decls = decls or (name,)
    params = [d for d in decls if not d.startswith("-")]
    return click.option(
        *decls,
        *([] if params else [field]),
        cls=FieldOption,
        model=model,
        field=field,
        defaults=defaults,
        deferred=deferred,
        **{**options, **kwargs},
    )


def _base(annotation: Any) -> Any:
    """The annotation without ``None`` (``int | None`` -> ``int``)."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def _click_type(info: FieldInfo) -> Any:
    base = _base(info.annotation)
    if get_origin(base) is Literal:
        return click.Choice([str(arg) for arg in get_args(base)])
    if base not in (int, float):
        return base if base in (str, bool) else None
    bounds: dict[str, Any] = {}
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            bounds["min"] = meta.ge
        elif isinstance(meta, annotated_types.Gt):
            bounds.update(min=meta.gt, min_open=True)
        elif isinstance(meta, annotated_types.Le):
            bounds["max"] = meta.le
        elif isinstance(meta, annotated_types.Lt):
            bounds.update(max=meta.lt, max_open=True)
    if not bounds:
        return base
    if base is int:
        open_ = bounds.pop("min_open", False), bounds.pop("max_open", False)
        if open_[0]:
            bounds["min"] += 1
        if open_[1]:
            bounds["max"] -= 1
        return click.IntRange(**bounds)
    return click.FloatRange(**bounds)
