"""One check of a stage's arguments, from its config's fields (:mod:`eyas.core.config`).

Every value is checked against its field's type (a config's ``epochs = "1"`` is refused, not passed on to fail
later) and every number against the :class:`Range` declared on its field (``option(..., range=AT_LEAST_1)``; a
name several stages take has one range) whenever a stage config is made (:func:`check_values`, so the Python API
is checked too). At the boundary, before any stage runs, the command line (:mod:`eyas.cli`) and an ``eyas run``
config (:mod:`eyas.pipeline`) also pass through :func:`check_arguments`: unknown and missing names, and the places
an argument names (an output folder that is a file or cannot be written, a CUDA device torch does not see), each
error naming the flag or key as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from eyas.core.errors import EyasError


@dataclass(frozen=True)
class Range:
    """The numbers an argument accepts: ``low`` and ``high`` bounds (None: unbounded), each inclusive unless
    marked open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, v: float) -> bool:
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        return self.high is None or (v < self.high or (not self.high_open and v == self.high))

    def __str__(self) -> str:
        num = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"  # noqa: E731 (2147483647, not 2.1e+09)
        low = None if self.low is None else f"{'above' if self.low_open else 'at least'} {num(self.low)}"
        high = None if self.high is None else f"{'below' if self.high_open else 'at most'} {num(self.high)}"
        return " and ".join(x for x in (low, high) if x)


#: The ranges most arguments take. Counts of work (epochs, steps, tokens to generate) are AT_LEAST_1: zero would
#: finish with nothing done and look like a result.
AT_LEAST_0, AT_LEAST_1, ABOVE_0 = Range(0), Range(1), Range(0, low_open=True)
#: A count of tokens in one sequence or batch: tensors are indexed with 32-bit offsets.
TOKENS = Range(1, 2**31 - 1)
#: A sequence's length: room for one token and the next it predicts, at least.
SEQ_LEN = Range(2, 2**31 - 1)
#: A share of a whole, 0 up to (not including) 1.
SHARE = Range(0, 1, high_open=True)

#: The largest whole number an argument takes: what numpy's and torch's int64 sizes hold with room to multiply.
MAX_INT = 2**62

#: Arguments that name a folder the stage writes (eval's ``--out`` may also name its ``.json`` report).
OUTPUTS = ("out", "speculators_out")


def unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X`` (``str | Path`` -> ``str``); any other annotation as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        if set(args) <= {str, Path}:
            return str
    return tp


def flag(name: str) -> str:
    """The command-line flag of an argument: ``ttt_steps`` -> ``--ttt-steps``."""
    return "--" + name.replace("_", "-")


def check_arguments(config: type, args: dict[str, Any], *, label: Callable[[str], str] = flag, where: str = "") -> Any:
    """``args`` made into a ``config`` (a stage config class, :mod:`eyas.core.config`), checked and normalised (an int
    where a float belongs becomes a float), or an :class:`EyasError` naming the first bad one as ``label(name)``
    (``--epochs``, ``[train] epochs``), after ``where`` (the config file) when given."""
    at = f"{where}: " if where else ""
    fields = {f.name: f for f in dataclasses.fields(config)}
    unknown = [k for k in args if k not in fields]
    if unknown:
        raise EyasError(f"{at}{label(unknown[0])} is not an argument of `eyas {config.stage}`; it takes "
                        f"{', '.join(sorted(fields))}")  # fmt: skip
    missing = [
        k
        for k, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and k not in args
    ]
    if missing:
        raise EyasError(f"{at}`eyas {config.stage}` needs a value for {label(missing[0])}")
    values = check_values(config, args, label=lambda n: f"{at}{label(n)}")
    for name, value in values.items():
        if name in OUTPUTS and value is not None:
            _check_writable(Path(value), f"{at}{label(name)}", report_file=config.stage == "eval" and name == "out")
            _check_owner(config.stage, name, Path(value), f"{at}{label(name)}")
        if name == "device" and value is not None:
            _check_device(str(value), f"{at}{label(name)}")
        if name == "device_map" and value is not None:  # a device, or a map of modules to devices
            for where in [value] if not isinstance(value, dict) else value.values():
                if where not in ("auto", "balanced", "balanced_low_0", "sequential", "disk"):
                    _check_device(f"cuda:{where}" if isinstance(where, int) else str(where), f"{at}{label(name)}")
    try:
        return config(**values)  # and the rules between its fields (StageConfig.check), which name flags
    except EyasError as e:
        raise EyasError(f"{at}[{config.stage}] {e}" if where else str(e)) from None


def check_values(config: type, values: dict[str, Any], *, label: Callable[[str], str] = flag) -> dict[str, Any]:
    """``values`` of ``config``'s fields checked against each field's type and range, normalised; an
    :class:`EyasError` names the first bad one as ``label(name)``."""
    hints = typing.get_type_hints(config)
    ranges = {f.name: f.metadata.get("range") for f in dataclasses.fields(config)}
    out = {}
    for name, value in values.items():
        value = _typed(value, hints.get(name, Any), label(name))
        allowed = ranges.get(name)
        if allowed is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            if value not in allowed:
                raise EyasError(f"{label(name)} must be {allowed}, got {value!r}")
        items = value if isinstance(value, list) else [value]
        nul = next((v for v in items if isinstance(v, str) and "\x00" in v), None)
        if nul is not None:  # no path, name or template holds one; the OS refuses it with a bare ValueError
            raise EyasError(f"{label(name)} {nul!r} holds a NUL character (\\x00): remove it")
        big = next((v for v in items if isinstance(v, int) and abs(v) > MAX_INT), None)
        if big is not None:  # beyond what numpy's and torch's sizes hold
            raise EyasError(f"{label(name)} {big} is too large: give at most {MAX_INT}")
        out[name] = value
    return out


def _describe(v: Any) -> str:
    kind = {bool: "true/false", int: "a whole number", float: "a number", str: "a string", list: "a list"}
    return f"{v!r} ({kind.get(type(v), type(v).__name__)})"


def _typed(value: Any, annotation: Any, what: str) -> Any:
    """``value`` checked against ``annotation``: bool, int, float (an int is taken), str (or a path), a
    ``Literal``'s choices, a dict, ``list[...]`` of those, each possibly optional, or a union of them."""
    if value is None:
        if annotation is Any or type(None) in typing.get_args(annotation):
            return None
        raise EyasError(f"{what} needs a value")
    tp = unwrap_optional(annotation)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # (X | Y: the first that takes the value; else X's error)
        refusals = []
        for member in (a for a in typing.get_args(tp) if a is not type(None)):
            try:
                return _typed(value, member, what)
            except EyasError as e:
                refusals.append(e)
        raise refusals[0]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise EyasError(f"{what} must be a table (a dict), got {_describe(value)}")
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise EyasError(f"{what} must be one of {', '.join(map(str, choices))}, got {_describe(value)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise EyasError(f"{what} must be a list, got {_describe(value)}")
        inner = (typing.get_args(tp) or (Any,))[0]
        return [_typed(v, inner, f"{what}[{i}]") for i, v in enumerate(value)]
    if tp is bool and not isinstance(value, bool):
        raise EyasError(f"{what} must be true or false, got {_describe(value)}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise EyasError(f"{what} must be a whole number, got {_describe(value)}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EyasError(f"{what} must be a number, got {_describe(value)}")
        if not math.isfinite(value):  # NaN passes every range comparison
            raise EyasError(f"{what} must be a finite number, got {value!r}")
        return float(value)
    if tp in (str, Path):
        if not isinstance(value, (str, os.PathLike)):
            raise EyasError(f"{what} must be a string (a name or a path), got {_describe(value)}")
        return str(value)
    return value


def _check_writable(path: Path, what: str, *, report_file: bool) -> None:
    """An output folder must be a folder (or not exist yet) under a folder this process may write; eval's
    ``--out`` may instead name its ``.json`` report, which is replaced."""
    folder = path.parent if report_file and path.suffix == ".json" and not path.is_dir() else path
    if folder.exists() and not folder.is_dir():
        raise EyasError(f"{what} {path} is a file, not a folder: choose another")
    existing = next(p for p in (folder, *folder.parents) if p.exists())  # ('.' or '/' at the end)
    if not existing.is_dir():
        raise EyasError(f"{what} {path}: {existing} is a file, so no folder can be made there: choose another")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise EyasError(f"{what} {path}: {existing} cannot be written by this user (read-only); choose another")


def _check_owner(stage: str, name: str, path: Path, what: str) -> None:
    """An output that would replace files eyas did not write (a verifier checkpoint, another stage's output, a
    JSON file that is no eval report) is refused before any stage runs; see :func:`eyas.core.manifest.check_out`."""
    from eyas.core.manifest import WRITES, check_out, check_report_out

    if stage == "eval" and name == "out":
        check_report_out(path, what=what)
    elif name == "out" and stage in WRITES:
        check_out(path, stage=stage, what=what)


def _check_device(device: str, what: str) -> None:
    """A device torch knows, and for CUDA one this machine has."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise EyasError(f"{what} {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise EyasError(f"{what} mps: this torch has no Apple GPU (MPS) to use here (torch {torch.__version__}); "
                        "use --device cpu")  # fmt: skip
    if dev.type not in ("cpu", "cuda", "mps"):
        raise EyasError(f"{what} {device!r}: eyas runs on cpu or cuda (cuda:N)")
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise EyasError(f"{what} {device}: torch sees no CUDA GPU on this machine (torch {torch.__version__}); "
                        "use --device cpu, or run where there is a GPU")  # fmt: skip
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise EyasError(f"{what} {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
