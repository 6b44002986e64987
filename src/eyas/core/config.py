"""Stage configs: each stage is a small typed dataclass whose fields carry their help, plus ``run(config)``.

One config per stage is the single source of its arguments: the ``eyas`` command's flags (:mod:`eyas.cli`), an
``eyas run`` TOML section (:mod:`eyas.pipeline`) and the Python keyword function (``eyas.stages.train.train(**kw)``,
made here by :func:`stage_function`) are all generated from its fields, and :mod:`eyas.core.validate` checks every
value against the field's type and the range declared on it. Fields several stages share are declared once, in
:mod:`eyas.core.fields`.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, ClassVar, Literal

from eyas.core.validate import Range, check_values


def option(default: Any = MISSING, *, help: str, positional: bool = False, aliases: tuple[str, ...] | None = None,
           range: Range | None = None, recorded: bool | Literal["when set"] = True) -> Any:  # fmt: skip
    """A config field: its default (none: the argument is required) and its help, shown by ``--help``.

    ``positional``: the command line takes it as ``eyas STAGE VALUE``; with ``aliases`` (even empty) it is
    also a ``--flag``. ``aliases``: more flag names for it (``--verifier-path`` for ``--verifier``). ``range``:
    the numbers it accepts (:class:`eyas.core.validate.Range`); a name several stages take has one range.
    ``recorded=False``: not one of the settings a stage's manifest records (:func:`recorded_settings`), so not
    one that decides whether a finished output is up to date: a run control (``--log-every``, ``--out``, the
    device), or an input the manifest records as such (``--verifier`` by its fingerprint).
    ``recorded="when set"``: recorded only at another value than its default, so outputs made before the option
    existed stay up to date."""
    metadata = {"help": help, "positional": positional, "aliases": aliases, "range": range, "recorded": recorded}
    if isinstance(default, list):  # a list default is copied per config, as dataclasses require
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(kw_only=True, frozen=True)
class StageConfig:
    """The base of every stage config: constructing one checks and normalises each value against its field's
    type and range (:func:`eyas.core.validate.check_values`), then the rules between fields (:meth:`check`); the
    error names the field as its flag (``--epochs``), as the stages' own errors do, wherever the value came
    from, so ``eyas run`` refuses a bad section before its first stage runs."""

    #: the stage's command name (``eyas train``), for error messages
    stage: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, value in check_values(type(self), vars(self)).items():
            object.__setattr__(self, name, value)  # (frozen: normalised once, here)
        self.check()

    def check(self) -> None:
        """The rules between fields (each value alone is checked by its type and range): a stage config with
        such rules overrides this and raises an :class:`eyas.core.errors.EyasError` naming the flags."""


def recorded_settings(config: StageConfig, **derived: Any) -> dict[str, Any]:
    """The settings a stage's manifest records, by name: every field of ``config`` but those marked
    ``recorded=False`` (and those ``recorded="when set"`` left at their default), and ``derived``, what the stage resolved (``--draft-vocab-size`` left to its default, the
    precision ``--dtype auto`` chose) or made of them (train's draft shape), in place of a field of that name or
    beside them. A rerun whose settings match the manifest's is up to date. (``eyas eval`` writes a report, not
    a manifest: it keeps an earlier report made with every argument but ``--out`` the same.)"""
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if _records(f, config)}
    return {**settings, **derived}


def _records(f: dataclasses.Field, config: StageConfig) -> bool:
    """Whether a manifest records field ``f`` of ``config`` (:func:`option`'s ``recorded``)."""
    recorded = f.metadata.get("recorded", True)
    if recorded == "when set":
        return getattr(config, f.name) != default_of(f)
    return bool(recorded)


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value, or :data:`dataclasses.MISSING` when the field is required."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def changed(config: StageConfig) -> dict[str, Any]:
    """The fields of ``config`` that are required or set to other than their default, by name."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != default_of(f)}  # fmt: skip


def type_hints(config: type[StageConfig]) -> dict[str, Any]:
    """Each field's annotation, resolved (the stage modules use postponed annotations)."""
    hints = typing.get_type_hints(config)
    return {f.name: hints[f.name] for f in dataclasses.fields(config)}


def describe(config: type[StageConfig]) -> str:
    """A config's docstring followed by a Google-style ``Args:`` block made from its fields' help."""
    lines = [inspect.cleandoc(config.__doc__ or ""), "", "Args:"]
    for f in dataclasses.fields(config):
        lines.append(f"    {f.name}: {f.metadata['help']}")
    return "\n".join(lines)


def stage_function(config: type[StageConfig], run: Callable[[Any], Any], name: str) -> Callable[..., Any]:
    """The Python API of a stage, ``name(**fields)``: builds the config (checked) and returns ``run(config)``.

    Its signature and docstring are made from the config's fields, so ``help(eyas.stages.train.train)`` and
    ``inspect.signature`` show every argument with its default; positional fields may also be given by
    position, in their order, as the command line takes them."""
    positional = [f.name for f in dataclasses.fields(config) if f.metadata.get("positional")]
    hints = type_hints(config)
    params = []
    for f in sorted(dataclasses.fields(config), key=lambda f: f.name not in positional):  # positional ones first
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name in positional else inspect.Parameter.KEYWORD_ONLY
        default = inspect.Parameter.empty if default_of(f) is MISSING else default_of(f)
        params.append(inspect.Parameter(f.name, kind, annotation=hints[f.name], default=default))
    signature = inspect.Signature(params, return_annotation=typing.get_type_hints(run).get("return", Any))

    def stage(*args: Any, **kwargs: Any) -> Any:
        return run(config(**signature.bind(*args, **kwargs).arguments))  # (a TypeError as a def's would raise)

    stage.__signature__ = signature
    stage.__name__ = stage.__qualname__ = name
    stage.__module__ = config.__module__
    stage.__doc__ = describe(config)
    return stage
