"""The ``eyas`` command: one subcommand per stage, each built from its stage config's fields.

A stage config (:mod:`eyas.core.config`: a dataclass whose fields carry their type, default and help) *is* the
command: the flags, their types, choices, defaults and help come from it, as do the Python keyword function and
an ``eyas run`` section, so the three cannot drift apart. Stage modules are imported only when their subcommand
runs, so ``eyas --help`` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import importlib
import inspect as _inspect
import os
import sys
import typing
from typing import Any, Callable, Literal

from eyas.core.config import StageConfig, default_of, type_hints
from eyas.core.errors import EyasError, terminate_as_interrupt
from eyas.core.validate import check_arguments, unwrap_optional
from eyas.stages import STAGES

# name -> (module:config, module:runner, one-line help): every stage of eyas.stages.STAGES, then the pipeline's
# own two commands. Positional arguments and extra flag names are the config fields' own
# (`option(positional=..., aliases=...)`).
COMMANDS: dict[str, tuple[str, str, str]] = {
    **{s.name: (s.config, s.runner, s.help) for s in STAGES},
    "run": ("eyas.pipeline:RunConfig", "eyas.pipeline:run_pipeline",
            "run the stages a TOML config lists, in order, resumably"),
    "demo": ("eyas.demo:DemoConfig", "eyas.demo:run_demo", "run the whole pipeline on SmolLM2 at CPU scale"),
}  # fmt: skip


# --------------------------------------------------------------------------- config fields -> argparse


def split_items(s: str) -> list[str]:
    """``s`` split at its commas, each item stripped, empty ones dropped; a comma inside brackets or quotes does
    not split, so ``--set 'prompts.topics=["math", "coding"],train.lr=2e-3'`` is two overrides, and
    ``--topics "creative writing, math"`` two topics."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(s):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    items.append(s[start:])
    return [x.strip() for x in items if x.strip()]


def _list_of(inner: Any) -> Callable[[str], list]:
    def parse(s: str) -> list:
        return [inner(x) for x in split_items(s)]

    parse.__name__ = f"comma-separated {getattr(inner, '__name__', 'value')}s"
    return parse


def flag_names(f: dataclasses.Field) -> list[str]:
    """The flags a config field goes by on the command line (none for a positional-only one)."""
    aliases = f.metadata.get("aliases")
    if f.metadata.get("positional") and aliases is None:
        return []
    return ["--" + ("json" if f.name == "json_out" else f.name.replace("_", "-")), *(aliases or ())]


def _add_params(parser: argparse.ArgumentParser, config: type[StageConfig]) -> None:
    hints = type_hints(config)
    for f in dataclasses.fields(config):
        name = f.name
        tp = unwrap_optional(hints[name])
        help_ = f.metadata["help"].replace("%", "%%")  # argparse %-formats help strings
        default = default_of(f)
        required = default is dataclasses.MISSING
        kwargs: dict[str, Any] = {"help": help_}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default if not required else False
        else:
            origin = typing.get_origin(tp)
            if origin is Literal:
                kwargs["choices"] = list(typing.get_args(tp))
                kwargs["type"] = type(kwargs["choices"][0])
            elif origin in (list, tuple):
                inner = unwrap_optional((typing.get_args(tp) or (str,))[0])
                kwargs["type"] = _list_of(inner if inner in (int, float) else str)
            elif tp in (int, float):
                kwargs["type"] = tp
            else:
                kwargs["type"] = str
            if not required:
                kwargs["default"] = default
                if default not in (None, "") and help_:
                    kwargs["help"] = f"{help_} (default: {default})"
        if f.metadata.get("positional"):
            either = f.metadata.get("aliases") is not None  # positional or flag: both optional to argparse,
            if either:  # one checked in main()
                kwargs["default"] = argparse.SUPPRESS
            if not required or either:
                kwargs["nargs"] = "?"
            parser.add_argument(name, **kwargs)
            if not either:
                continue
            kwargs.pop("nargs")
            required = False
        if required and tp is not bool:
            kwargs["required"] = True
        parser.add_argument(*flag_names(f), dest=name, **kwargs)


def _load(target: str) -> Any:
    mod, _, name = target.partition(":")
    return getattr(importlib.import_module(mod), name)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s module is imported (for its config)."""
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train EAGLE-3 speculative-decoding drafts for any Hugging Face verifier; "
        "ship them to vLLM and SGLang.",
    )
    from eyas import __version__

    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (target, _, help_) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_, description=help_)
            continue
        config = _load(target)
        doc = _inspect.cleandoc(config.__doc__ or help_)
        p = sub.add_parser(name, help=help_, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_params(p, config)
    return parser


def _quiet_known_noise() -> None:
    """A normal run prints no warnings; these are known noise from our dependencies."""
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # tensorboard's TensorFlow probe
    warnings.filterwarnings("ignore", message=r".*`torch_dtype` is deprecated.*")
    # inductor's note when a compiled graph holds a float32 matmul with TF32 off: the verifier's rotary table
    # (positions times inverse frequencies, compiled with its layers: eyas.verifier.compile.OUTER_MODULES) is
    # one, and stays float32 on purpose: TF32 rounds the inverse frequencies to 10 bits of mantissa, so angles at
    # position 2,000 would be off by up to tenths of a radian, and every RoPE'd query and key with them
    warnings.filterwarnings("ignore", message=r"TensorFloat32 tensor cores for float32 matrix multiplication")


#: A folder where any command keeps a GGUF verifier's dequantized weights and tokenizer for the next command
#: (`eyas run` keeps them in its run folder by itself): a string of separate commands on one GGUF, as
#: bench/speculators_quality.py runs, then dequantizes and parses it once instead of in every command.
GGUF_WEIGHTS_ENV = "EYAS_GGUF_WEIGHTS"


def _gguf_weights_from_env():
    folder = os.environ.get(GGUF_WEIGHTS_ENV)
    if not folder:
        return contextlib.nullcontext()
    from eyas.verifier.load import gguf_weights_cache  # (transformers: imported only when asked for)

    return gguf_weights_cache(folder)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command is None:
        parser.print_help()
        return 0
    _quiet_known_noise()
    config = _load(COMMANDS[command][0])
    positional = [f.name for f in dataclasses.fields(config) if f.metadata.get("positional")]
    missing = [p for p in positional if p not in args]
    if missing:
        parser.error(f"eyas {command}: give {missing[0].upper()} (or --{missing[0].replace('_', '-')})")
    try:
        checked = check_arguments(config, args)  # ranges and places, before the stage starts
        with terminate_as_interrupt(), _gguf_weights_from_env():  # a time limit's stop ends a stage as Ctrl-C does
            _load(COMMANDS[command][1])(checked)
    except EyasError as e:
        print(f"eyas {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eyas {command}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        # Free what the stage left in reference cycles (Arrow tables read through `datasets`, process groups)
        # while the interpreter is whole: native thread pools torn down during its finalisation can abort a
        # process whose work succeeded (apache/arrow#34314; a two-rank extract aborted so once in CI).
        gc.collect()
    return 0


def entry() -> None:
    """The ``eyas`` command (and ``python -m eyas.cli``): :func:`main`, then the process's exit, watched."""
    code = main()
    # Work done and written, the process should end at once. If it is still alive two minutes later (a library's
    # thread or worker pool waited on at interpreter exit: one GPU run stalled so for minutes after its last
    # stage), print where every thread waits, so the stall names its cause. faulthandler's timer thread runs
    # outside the interpreter and ends with the process.
    faulthandler.dump_traceback_later(120, exit=False)
    sys.exit(code)


if __name__ == "__main__":
    entry()
