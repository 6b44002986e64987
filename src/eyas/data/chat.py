"""Chats rendered through the verifier's own chat template: the template's identity (its hash, recorded and
compared by prepare, train and eval), its control and end-of-turn tokens, the prompt ids a decoder continues,
and :class:`ChatTemplate`, which finds where each assistant turn begins and ends in a rendered conversation
(``eyas prepare`` masks exactly those tokens; ``eyas regenerate`` refuses a template it could not mask).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re

from eyas.core.errors import EyasError

#: What to do about a tokenizer without a chat template (prepare, regenerate and eval render chats through one).
NO_TEMPLATE_HINT = ("give --chat-template FILE (a Jinja template) or --chat-template CHECKPOINT (that checkpoint's "
                    "template, e.g. the instruct model of the same family)")  # fmt: skip


def chat_template_hash(tokenizer) -> str | None:
    """sha256 of the tokenizer's chat template (prepare, train and eval compare it)."""
    tmpl = getattr(tokenizer, "chat_template", None)
    if not tmpl:
        return None
    text = tmpl if isinstance(tmpl, str) else json.dumps(tmpl, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def control_tokens(tokenizer) -> re.Pattern[str] | None:
    """A pattern matching the tokenizer's special (control) tokens, longest first; None when it has none."""
    control = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    control |= set(tokenizer.all_special_tokens)
    alternatives = [re.escape(t) for t in sorted(control, key=len, reverse=True) if t]
    return re.compile("|".join(alternatives)) if alternatives else None


def end_of_turn_token(tokenizer, rendered: str, answer: str) -> str | None:
    """The control token a chat template writes right after an assistant message (``<|im_end|>`` in ChatML):
    the first one after ``answer`` in ``rendered``, a conversation the template rendered. None when there is
    none (or ``answer`` is not in it). `eyas prepare` refuses such a template; `eyas eval` falls back on EOS."""
    k = rendered.find(answer)
    pattern = control_tokens(tokenizer)
    m = pattern.search(rendered, k + len(answer)) if k >= 0 and pattern is not None else None
    return m.group(0) if m else None


#: A one-exchange conversation :class:`ChatTemplate` renders to learn how the template closes an assistant turn.
PROBE_Q, PROBE_A = "eyas probe: a question?", "eyas probe: an answer."


class TemplateSplitError(Exception):
    """The template rendered this conversation in a way eyas cannot split at turn boundaries."""


class ChatTemplate:
    """The verifier's chat template, probed once: how each assistant turn is delimited in the rendered text."""

    def __init__(self, tokenizer, *, where: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise EyasError(f"the tokenizer of {where} has no chat template; eyas masks turns through it: "
                            f"{NO_TEMPLATE_HINT}")  # fmt: skip
        self.tok = tokenizer
        self.where = where
        self.sha256 = chat_template_hash(tokenizer)
        self.control_re = control_tokens(tokenizer)
        probe = [{"role": "user", "content": PROBE_Q}, {"role": "assistant", "content": PROBE_A}]
        full = self.render(probe)
        k = full.find(PROBE_A)
        if k < 0:
            raise EyasError(f"the chat template of {where} drops the assistant's text ({full!r}); eyas cannot mask it")
        eot = end_of_turn_token(tokenizer, full, PROBE_A)
        if eot is None:
            raise EyasError(
                f"the chat template of {where} writes no control token after an assistant message "
                f"(it renders {full[k:]!r}), so eyas cannot tell where an assistant turn ends; "
                "use a template that closes each turn with an end-of-turn token"
            )
        self.eot = eot
        self.eot_id = tokenizer.convert_tokens_to_ids(self.eot)
        try:  # two exchanges: the second must split where the first did
            self.spans(probe + [{"role": "user", "content": PROBE_Q + " 2"}, {"role": "assistant", "content": PROBE_A}])
        except TemplateSplitError as e:
            raise EyasError(f"the chat template of {where} cannot be split at turn boundaries: {e}") from None

    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span ``[start, end)`` of every assistant turn,
        from just after its generation prompt to the end of its end-of-turn token."""
        text = self.render(messages)
        spans: list[tuple[int, int]] = []
        for m, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt = self.render(messages[:m], generation_prompt=True)
            if not text.startswith(prompt):
                at = next((i for i, (x, y) in enumerate(zip(prompt, text)) if x != y), min(len(prompt), len(text)))
                raise TemplateSplitError(
                    f"the prompt for message {m} (rendered alone with the generation prompt) is not how the full "
                    f"conversation begins: they differ at character {at} ({prompt[at : at + 40]!r} vs "
                    f"{text[at : at + 40]!r})"
                )
            a = len(prompt)
            b = text.find(self.eot, a)
            if b < 0 or (spans and a < spans[-1][1]):
                raise TemplateSplitError(f"no {self.eot!r} closes assistant message {m}")
            spans.append((a, b + len(self.eot)))
        return text, spans


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied as the verifier's tokenizer ships it (no second BOS: the template writes it),
    ending with the generation prompt: the ids a decoder continues."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompts(tokenizer, conversations: list[list[dict[str, str]]], *, chunk: int = 4096) -> list[list[int]]:
    """:func:`encode_prompt` of each conversation, the templates rendered one by one and the texts tokenized
    ``chunk`` at a time in one call each: a fast tokenizer encodes a batch on all cores (ShareGPT's 17k first
    turns through SmolLM2's: 0.41 ms a prompt on a loaded 2-core CPU where one call each takes 0.90 ms, and
    regenerate's GPU waits for them before its first prefill)."""
    out: list[list[int]] = []
    for s in range(0, len(conversations), chunk):
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                 for m in conversations[s : s + chunk]]  # fmt: skip
        out += tokenizer(texts, add_special_tokens=False)["input_ids"]
    return out


def end_of_turn_ids(tokenizer) -> set[int]:
    """The ids that end an assistant turn: the control token the chat template writes right after an
    assistant message (``<|im_end|>`` in ChatML) plus the tokenizer's EOS.

    Passed explicitly to every decoding loop: on the GPU machine, ``generate`` on the GGUF SmolLM2 ran past
    ``<|im_end|>`` when left to its defaults.
    """
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    answer = "eyas probe answer"
    with contextlib.suppress(Exception):  # a template that cannot render the probe still leaves the EOS
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
        eot = end_of_turn_token(tokenizer, tokenizer.apply_chat_template(probe, tokenize=False), answer)
        if eot is not None:
            ids.add(tokenizer.convert_tokens_to_ids(eot))
    if not ids:
        raise EyasError("the verifier's tokenizer has no EOS token and its chat template no end-of-turn token")
    return ids
