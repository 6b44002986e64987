"""The arguments several stages take, each declared once: ``verifier``; ``trust_remote_code`` and
``chat_template`` (how its tokenizer renders conversations); ``out``; and where the verifier runs, ``device``,
``device_map`` and ``dtype``.

Each function here is one field's declaration: its help, default and range. A stage config names it at the
place the field has among its arguments (the order of its flags, its Python signature and its ``eyas run`` lines),
and adds what is particular to the stage as a ``note``, which ends the shared help in place of its final period::

    verifier: str = fields.verifier("; its tokenizer and chat template are used.")

A stage that takes the argument optionally gives ``default=None``. The annotation stays the stage's: a name has
one type in every stage (tests/unit/test_config.py holds them to it).

None of them is a setting a manifest records as it is (``recorded=False``): the verifier and the chat template are
inputs, recorded by fingerprint and sha256; the output folder and the device do not change what is made; the
precision ``--dtype auto`` resolves to is recorded by the stages it matters to.
"""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any

from eyas.core.config import option


def _help(shared: str, note: str) -> str:
    return shared.removesuffix(".") + note if note else shared


def verifier(note: str = "", *, default: Any = MISSING, positional: bool = False,
             aliases: tuple[str, ...] | None = None) -> Any:  # fmt: skip
    """``--verifier``: the checkpoint the stage reads."""
    return option(default, help=_help("the verifier checkpoint (dir, .gguf, 'smollm2' or hub id).", note),
                  positional=positional, aliases=aliases, recorded=False)  # fmt: skip


def trust_remote_code(note: str = "") -> Any:
    """``--trust-remote-code``: off unless asked for."""
    return option(False, help=_help("allow the verifier's own tokenizer code to run.", note), recorded=False)


def chat_template(note: str = "") -> Any:
    """``--chat-template``: a template in place of the tokenizer's own."""
    return option(None, help=_help("render with this template instead of the tokenizer's own (a base model has "
                                   "none): a Jinja file, or a checkpoint (dir, .gguf, hub id) whose template to use; "
                                   "its sha256 is recorded.", note), recorded=False)  # fmt: skip


def out(note: str = "", *, default: Any = MISSING, aliases: tuple[str, ...] | None = None) -> Any:
    """``--out``: the folder the stage writes."""
    return option(default, help=_help("the output directory.", note), aliases=aliases, recorded=False)


def device(note: str = "") -> Any:
    """``--device``: where the verifier (or the draft) runs."""
    return option(None, help=_help("cpu, cuda or cuda:N (default: cuda when there is one).", note), recorded=False)


def device_map(note: str = "") -> Any:
    """``--device-map``: a verifier spread over the GPUs of one process."""
    return option(None, help=_help("'auto' spreads a verifier too large for one GPU over all of them (transformers' "
                                   "device map; a dict in Python places each module itself); one process only.",
                                   note), recorded=False)  # fmt: skip


def dtype(note: str = "") -> Any:
    """``--dtype`` of a stage that runs the verifier: its compute precision (extract's and export's ``--dtype``
    are the stored precision, and declared by them)."""
    return option("auto", help=_help("auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32.", note), recorded=False)
