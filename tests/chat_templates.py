"""Real chat templates on tiny tokenizers, and verifier dirs that carry them.

The templates in ``tests/templates/`` are verbatim copies of the ``chat_template`` strings
shipped in ``meta-llama/Llama-3.1-8B-Instruct`` (``llama-3.1-instruct.jinja``: BOS written by
the template, ``|trim`` on every message, ``<|eot_id|>`` closing each turn) and
``Qwen/Qwen3-8B`` (``qwen3.jinja``: ChatML with ``<think>`` blocks kept only on assistant turns
after the last user turn) ``tokenizer_config.json`` files. Each is set on a byte-level BPE
trained here, with the special tokens that template writes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import tiny

TEMPLATES = Path(__file__).parent / "templates"
LLAMA31 = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]  # fmt: skip
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer(specials: list[str], *, bos: str | None, eos: str, template: str, add_bos: bool = False,
                   plain: list[str] = (), use_regex: bool = True, corpus: list[str] | None = None,
                   vocab_size: int = 400):  # fmt: skip
    """A byte-level BPE (< tiny.VOCAB ids, so it fits the tiny verifiers) with ``specials`` as special tokens,
    ``plain`` as added non-special tokens (Qwen3's ``<think>``), and ``template`` as its chat template.
    ``add_bos`` makes plain ``tok(text)`` prepend BOS, as Llama-3's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator((corpus or tiny.CORPUS) * 4, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    if plain:
        fast.add_tokens(list(plain))
    fast.chat_template = template
    assert len(fast) <= tiny.VOCAB
    return fast


def llama31_tokenizer():
    return chat_tokenizer(LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA31, add_bos=True)


def qwen3_tokenizer():
    return chat_tokenizer(QWEN3_SPECIALS, bos=None, eos="<|im_end|>", template=QWEN3, plain=["<think>", "</think>"])


def verifier_with(tok, base: Path, dest: Path) -> Path:
    """A copy of the tiny verifier at ``base`` whose tokenizer is ``tok``."""
    if not dest.exists():
        dest.mkdir(parents=True)
        for f in ("config.json", "model.safetensors", "generation_config.json"):
            if (base / f).is_file():
                shutil.copy(base / f, dest / f)
        tok.save_pretrained(dest)
    return dest


#: configs/completion.jinja: the template README offers for a base verifier (prompt, then the answer and EOS).
COMPLETION = Path(__file__).resolve().parents[1] / "configs" / "completion.jinja"


def without_template(base: Path, dest: Path) -> Path:
    """A copy of the tiny verifier at ``base`` whose tokenizer has no chat template (a base model's)."""
    tok = tiny.make_tokenizer()
    tok.chat_template = None
    return verifier_with(tok, base, dest)
