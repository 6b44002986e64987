"""The ``eyas`` command: one subcommand per stage, each built from its Python function's signature.

A stage function (keyword-only arguments, annotated, documented in a Google
style ``Args:`` block) *is* the command: the flags, their types, defaults and
help come from it, so the CLI and the Python API cannot drift apart. Stage
modules are imported only when their subcommand runs, so ``eyas --help`` is
instant.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect as _inspect
import os
import re
import sys
import typing
from typing import Any, Callable, Literal

from eyas.errors import EyasError
from eyas.validate import check_arguments, unwrap_optional

# name -> (module:function, one-line help, positional params, extra flag aliases). A positional param that
# also has an aliases entry may be given either way (`eyas export SRC` or `eyas export --draft SRC`).
COMMANDS: dict[str, tuple[str, str, tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    "inspect": ("eyas.verifier_info:inspect", "describe a verifier checkpoint (dir, GGUF or 'smollm2') without "
                "loading it", ("path",), {}),
    "plan": ("eyas.plan:plan", "from a verifier's config alone: its memory packed and in bf16, GPUs, feature bytes, "
             "offline or online, GPU-hours", ("verifier",), {}),
    "regenerate": ("eyas.regenerate:regenerate", "answer a dataset's prompts with the verifier itself, for prepare "
                   "(resumable)", (), {}),
    "prepare": ("eyas.data:prepare", "tokenize conversations with the verifier's chat template and mask the "
                "assistant's tokens", (), {}),
    "vocab": ("eyas.vocab:vocab", "choose the draft vocabulary from prepared rows (d2t.npy, t2d.npy)", (), {}),
    "extract": ("eyas.extract:extract", "store the verifier's aux and last hidden states for offline training "
                "(resumable, torchrun-ready, --verify DIR checks a result)", (), {}),
    "train": ("eyas.train:train", "train the EAGLE-3 draft with training-time test, offline or --online "
              "(resumable, torchrun-ready: DDP or FSDP2)", (),
              {"verifier": ("--verifier-path",), "data": ("--data-dir",), "out": ("--output-dir",),
               "vocab": ("--vocab-mapping-dir",)}),
    "export": ("eyas.export:export", "write a draft in the vLLM (speculators) or SGLang (EAGLE) layout, or import "
               "an EAGLE/SpecForge/speculators draft", ("draft",), {"draft": (), "from_format": ("--from",)}),
    "eval": ("eyas.evaluate:evaluate", "measure a draft by real speculative decoding: tau, acceptance, lossless, speedup",
             (), {}),
    "run": ("eyas.pipeline:run", "run the stages a TOML config lists, in order, resumably", ("config",), {}),
    "demo": ("eyas.pipeline:demo", "run the whole pipeline on SmolLM2 at CPU scale", (), {}),
}  # fmt: skip


# --------------------------------------------------------------------------- signature -> argparse


def _doc_args(fn: Callable) -> dict[str, str]:
    """Parse the ``Args:`` block of a Google-style docstring."""
    doc = _inspect.getdoc(fn) or ""
    out: dict[str, str] = {}
    m = re.search(r"^Args:\n(.*?)(?:^\S|\Z)", doc, flags=re.S | re.M)
    if not m:
        return out
    current = None
    for line in m.group(1).splitlines():
        hit = re.match(r"^\s{4}(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
        if hit:
            current = hit.group(1)
            out[current] = hit.group(2)
        elif current and line.strip():
            out[current] += " " + line.strip()
    return out


def _list_of(inner: Any) -> Callable[[str], list]:
    def parse(s: str) -> list:
        return [inner(x) for x in s.replace(" ", "").split(",") if x]

    parse.__name__ = f"comma-separated {getattr(inner, '__name__', 'value')}s"
    return parse


def _add_params(parser: argparse.ArgumentParser, fn: Callable, positional: tuple[str, ...],
                aliases: dict[str, tuple[str, ...]]) -> None:  # fmt: skip
    hints = typing.get_type_hints(fn)
    docs = _doc_args(fn)
    for name, param in _inspect.signature(fn).parameters.items():
        tp = unwrap_optional(hints.get(name, str))
        help_ = docs.get(name, "").replace("%", "%%")  # argparse %-formats help strings
        required = param.default is _inspect.Parameter.empty
        kwargs: dict[str, Any] = {"help": help_}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = param.default if not required else False
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
                kwargs["default"] = param.default
                if param.default not in (None, "") and help_:
                    kwargs["help"] = f"{help_} (default: {param.default})"
        if name in positional:
            either = name in aliases  # positional or flag: both optional to argparse, one checked in main()
            if either:
                kwargs["default"] = argparse.SUPPRESS
            if not required or either:
                kwargs["nargs"] = "?"
            parser.add_argument(name, **{k: v for k, v in kwargs.items() if k != "required"})
            if not either:
                continue
            kwargs.pop("nargs")
            required = False
        flag = "--" + ("json" if name == "json_out" else name.replace("_", "-"))
        names = [flag, *aliases.get(name, ())]
        if required and tp is not bool:
            kwargs["required"] = True
        parser.add_argument(*names, dest=name, **kwargs)


def _load(target: str) -> Callable:
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s module is imported (for its signature)."""
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train EAGLE-3 speculative-decoding drafts for any Hugging Face verifier; "
        "ship them to vLLM and SGLang.",
    )
    from eyas import __version__

    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (target, help_, positional, aliases) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_, description=help_)
            continue
        fn = _load(target)
        doc = (_inspect.getdoc(fn) or help_).split("\n\nArgs:")[0]
        p = sub.add_parser(name, help=help_, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_params(p, fn, positional, aliases)
    return parser


def _quiet_known_noise() -> None:
    """A normal run prints no warnings; these are known noise from our dependencies."""
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # tensorboard's TensorFlow probe
    warnings.filterwarnings("ignore", message=r".*`torch_dtype` is deprecated.*")


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
    fn = _load(COMMANDS[command][0])
    positional = COMMANDS[command][2]
    missing = [p for p in positional if p not in args]
    if missing:
        parser.error(f"eyas {command}: give {missing[0].upper()} (or --{missing[0].replace('_', '-')})")
    try:
        args = check_arguments(fn, args, stage=command)  # ranges and places, before the stage starts
        fn(**args)  # positional on the command line, keywords in Python (stage functions are keyword-only)
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


if __name__ == "__main__":
    sys.exit(main())
