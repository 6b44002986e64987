"""``eyas prompts``: the verifier writes its own user turns, so a draft's data is not bounded by a dataset.

ShareGPT holds 17,384 prompts; peers' best drafts train on 0.5-1.4M samples. Magpie (Xu et al. 2024,
arXiv:2406.08464) showed that an aligned model, given its chat template only up to the point where a user
message begins, writes a plausible user message itself: its template taught it what users say. eyas renders the
verifier's own template with a marker as the user's message and cuts before the marker (for ChatML:
``<|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n``), samples from there at temperature about 1 with
top-p, and stops at the template's end-of-turn token. The samples are decoded by the generation engine
(:class:`eyas.engine.generate.BatchDecoder`: continuous batching, CUDA graphs), the engine `eyas regenerate` uses.

``--topics`` steers what users ask about, as Magpie's own domain-specific runs do with a system message naming the
domain: sample ``i`` is drawn after the system message :data:`TOPIC_SYSTEM` with topic ``i mod n`` (math,
coding, writing, ...), so the prompts cover the kinds of request a draft will be measured on, where undirected
samples follow whatever the template's default system message invites. The steering system message is not
kept: each prompt is written with its topic as its ``category``, and `eyas regenerate` answers it as users ask
it, without that message.

Not every sample is a prompt worth answering: cut at ``--max-new-tokens``, empty, shorter than ``--min-words``,
repetitive (a loop, or few distinct 4-grams: :mod:`eyas.data.repetition`) and duplicate ones (after normalising case,
punctuation and spaces) are refused and counted. Rounds of samples continue until ``--num-prompts`` are kept
(or ``--max-attempts`` samples were drawn). Every sample's verdict goes to a journal as it comes back, so a run
killed at any moment resumes where it stopped.

Output: ``prompts.jsonl`` (``{"id": "self-N", "turns": [text]}``, in sample order) and ``manifest.json`` (stage
``prompts``); `eyas regenerate --data OUT` (alone or mixed: ``--data sharegpt,OUT``) answers them.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.data.datasets import PROMPTS
from eyas.core.errors import EyasError
from eyas.core.validate import AT_LEAST_0, AT_LEAST_1, TOKENS
from eyas.core.files import Journal, atomic_path, read_journal, sha256_json
from eyas.core.manifest import StageOutput, check_out

__all__ = ["PROMPTS", "prompts", "user_turn_prefix"]

#: the user message rendered to find where the template starts one (cut before it)
MARKER = "\u2063eyas-user-turn-marker\u2063"

#: the system message a sample of ``--topics`` is drawn after (Magpie's domain control: a system message naming
#: the domain before the user-turn prefix, Xu et al. 2024, section 2.3)
TOPIC_SYSTEM = "You are a helpful AI assistant. The user asks you about {topic}."


@dataclass(kw_only=True, frozen=True)
class PromptsConfig(StageConfig):
    """Have the verifier write user prompts itself (Magpie: sampled from its chat template's user-turn prefix),
    filtered and deduplicated, for `eyas regenerate` to answer.

    Writes OUT/prompts.jsonl and OUT/manifest.json; `eyas regenerate --data OUT` (or a mix, `--data
    sharegpt,OUT`) reads them. Skips itself when OUT already matches, and resumes an interrupted run."""

    stage: ClassVar[str] = "prompts"

    verifier: str = fields.verifier("; it needs a chat template.")
    out: str = fields.out()
    num_prompts: int = option(1000, range=AT_LEAST_1, help="how many prompts to keep.")
    temperature: float = option(
        1.0, range=AT_LEAST_0, help="sampling temperature of the user turns (Magpie samples at 1)."
    )
    top_p: float = option(0.95, help="nucleus sampling: only the most likely tokens holding this probability.")
    max_new_tokens: int = option(256, range=TOKENS, help="the longest prompt in tokens; a sample cut there is refused.")
    min_words: int = option(3, range=AT_LEAST_0, help="refuse prompts of fewer words.")
    system: str | None = option(
        None,
        help="a system message to render before the user turn (default: none, so the "
        "template's own default, if it has one, is used).",
    )
    topics: list[str] | None = option(
        None,
        recorded="when set",
        help="steer the prompts: sample i is drawn after a system message naming topic i mod n (comma-separated, "
        "e.g. math,coding,writing); each prompt records its topic as its category (default: none).",
    )
    max_attempts: int | None = option(
        None,
        range=AT_LEAST_1,
        help="stop after this many samples even if fewer prompts were kept (default: 4 x --num-prompts).",
    )
    seed: int = option(
        0, range=AT_LEAST_0, help="the sampling seed (each sample is seeded by its index: a rerun writes the same)."
    )
    batch_tokens: int | None = option(
        None,
        recorded=False,
        range=TOKENS,
        help="the decoding budget in tokens of key/value cache (default: 40% of "
        "the free GPU memory; 16k tokens on CPU).",
    )
    device: str | None = fields.device()
    dtype: str = fields.dtype()
    trust_remote_code: bool = fields.trust_remote_code()
    chat_template: str | None = fields.chat_template()

    def check(self) -> None:
        if not 0 < self.top_p <= 1:
            raise EyasError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise EyasError(f"--temperature must be above 0 to sample prompts, got {self.temperature}")
        if self.topics is not None:
            if self.system is not None:
                raise EyasError("--topics and --system both set a system message; give one of them")
            if not self.topics or not all(t.strip() for t in self.topics):
                raise EyasError(f"--topics needs non-empty topic names, got {self.topics!r}")
            if len({t.strip().lower() for t in self.topics}) != len(self.topics):
                raise EyasError(f"--topics names a topic twice: {self.topics!r}")

    def systems(self) -> list[str | None]:
        """The system message of each topic (sample i draws after ``systems()[i % n]``); ``[--system]`` without
        topics."""
        if self.topics is None:
            return [self.system]
        return [TOPIC_SYSTEM.format(topic=t.strip()) for t in self.topics]


def user_turn_prefix(tok, *, system: str | None = None) -> tuple[str, str]:
    """``(prefix, end)``: the text the chat template writes before a user message's content (with ``system``
    first when given), and the control token it writes after the content (the user turn's end)."""
    from eyas.data.chat import end_of_turn_token

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": MARKER}]
    try:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as e:  # a template that refuses a lone user message cannot be prompted this way
        raise EyasError(f"the chat template cannot render a user message alone ({type(e).__name__}: {e})") from e
    k = rendered.find(MARKER)
    if k <= 0:
        raise EyasError("the chat template does not write the user's message as given (or writes nothing "
                        f"before it): {rendered[:200]!r}")  # fmt: skip
    end = end_of_turn_token(tok, rendered, MARKER)
    if end is None:
        raise EyasError(f"the chat template writes no control token after a user message ({rendered[k:]!r}), so "
                        "a sampled user turn could not be told to end")  # fmt: skip
    return rendered[:k], end


def verdict(text: str, ids: list[int], *, finished: bool, min_words: int) -> str:
    """``"kept"`` or why a sampled user turn is refused (``unfinished``, ``empty``, ``too_short``,
    ``repetitive``). Duplicates are refused when the prompts are written (:func:`unique_in_order`)."""
    from eyas.data.repetition import distinct_ngram_ratio, find_loop

    if not finished:
        return "unfinished"
    if not text:
        return "empty"
    if len(text.split()) < min_words:
        return "too_short"
    if find_loop(ids, min_tokens=16) is not None or (len(ids) >= 24 and distinct_ngram_ratio(ids) < 0.5):
        return "repetitive"
    return "kept"


def unique_in_order(entries: dict[int, dict[str, Any]]) -> tuple[list[int], dict[str, int]]:
    """The kept samples' indices in sample order, each the first of its normalised text (duplicates after it are
    refused), and the count of each verdict. Judged in sample order, not in the order samples came back, so a
    resumed run chooses exactly what an uninterrupted one does."""
    from eyas.data.repetition import normalized

    seen: set[str] = set()
    kept, counts = [], {}
    for i in sorted(entries):
        v = entries[i]["verdict"]
        if v == "kept":
            key = normalized(entries[i]["text"])
            if not key or key in seen:
                v = "duplicate"
            else:
                seen.add(key)
                kept.append(i)
        counts[v] = counts.get(v, 0) + 1
    return kept, counts


def run(c: PromptsConfig) -> dict[str, Any]:
    """Run `eyas prompts` as ``c`` describes (see :class:`PromptsConfig`)."""
    from eyas.data.chat import ChatTemplate
    from eyas.engine.generate import device_and_dtype, engine_summary
    from eyas.verifier.load import load_tokenizer
    from eyas.verifier.info import fingerprint, resolve

    check_out(c.out, stage="prompts")
    dev, dt = device_and_dtype(c.device, c.dtype)
    info = resolve(c.verifier)
    tok = load_tokenizer(info, trust_remote_code=c.trust_remote_code, chat_template=c.chat_template)
    template = ChatTemplate(tok, where=c.chat_template or str(info.path))
    prefixes = [user_turn_prefix(tok, system=system) for system in c.systems()]
    ends = {end for _, end in prefixes}
    if len(ends) != 1:
        raise EyasError(f"the chat template ends a user turn differently after different system messages: {ends}")
    (end,) = ends
    prefix_ids = [tok(prefix, add_special_tokens=False)["input_ids"] for prefix, _ in prefixes]
    max_attempts = c.max_attempts or 4 * c.num_prompts
    inputs = {"verifier": fingerprint(info), "chat_template_sha256": template.sha256}
    settings = recorded_settings(c, max_attempts=max_attempts, dtype=str(dt).removeprefix("torch."))
    out_dir = Path(c.out)
    with StageOutput(out_dir, stage="prompts") as output:
        finished = output.up_to_date(inputs=inputs, settings=settings, files=(PROMPTS,))
        if finished is not None:
            print(f"prompts: {out_dir} is up to date ({finished['outputs']['prompts']} prompts); skipping")
            return finished
        output.unfinish()
        parts = out_dir / ".parts"
        journal = parts / f"journal-{sha256_json({'inputs': inputs, 'settings': settings})[:16]}.jsonl"
        for old in parts.glob("journal-*.jsonl") if parts.is_dir() else ():
            if old != journal:  # samples of other settings
                old.unlink()
        parts.mkdir(parents=True, exist_ok=True)
        entries = read_journal(journal)
        started, new_tokens = time.perf_counter(), 0
        decoder = None
        while True:
            kept = len(unique_in_order(entries)[0])
            # samples are drawn in rounds of consecutive indices; a killed round's missing ones are drawn again
            attempt = max(entries, default=-1) + 1
            missing = [i for i in range(attempt) if i not in entries]
            if kept >= c.num_prompts and not missing or attempt >= max_attempts and not missing:
                break
            if decoder is None:
                longest = max(len(ids) for ids in prefix_ids)
                decoder = _decoder(c, info, tok, dev, dt, end=end, max_len=longest + c.max_new_tokens)
            # a round: what is still needed over the share of samples kept so far (at least a tenth)
            rate = max(kept / attempt, 0.1) if attempt else 0.8  # (SmolLM2 kept 9 of its first 9)
            n = 0 if kept >= c.num_prompts else min(max_attempts - attempt,
                                                     math.ceil((c.num_prompts - kept) / rate * 1.1) + 8)  # fmt: skip
            tokens = _round(decoder, tok, prefix_ids, missing + list(range(attempt, attempt + n)), journal=journal,
                            min_words=c.min_words, seed=c.seed, max_new_tokens=c.max_new_tokens, done=kept,
                            total=c.num_prompts)  # fmt: skip
            new_tokens += tokens
            entries = read_journal(journal)
        seconds = time.perf_counter() - started
        order, counts = unique_in_order(entries)
        with atomic_path(out_dir / PROMPTS) as tmp, open(tmp, "w", encoding="utf-8") as f:
            written = 0
            by_topic: dict[str, int] = {}
            for i in order[: c.num_prompts]:
                row = {"id": f"self-{i}", "turns": [entries[i]["text"]]}
                if c.topics:
                    row["category"] = topic = c.topics[i % len(c.topics)].strip()
                    by_topic[topic] = by_topic.get(topic, 0) + 1
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
        if written == 0:
            raise EyasError(f"the verifier wrote no usable prompt in {len(entries)} samples ({counts}); try another "
                            "--temperature or --system")  # fmt: skip
        outputs = {"prompts": written, "samples": len(entries), "refused": {k: v for k, v in counts.items()
                                                                           if k != "kept"}}  # fmt: skip
        if c.topics:
            outputs["prompts_by_topic"] = by_topic
        engine = decoder.report() if decoder is not None else None  # where the sampling's time went
        m = output.finish(outputs=outputs, verifier_path=str(info.path),
                          user_turn_prefix=prefixes[0][0] if len(prefixes) == 1 else [p for p, _ in prefixes],
                          timing={"seconds": round(seconds, 2), "new_tokens": new_tokens,
                                  "new_tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1),
                                  **({"engine": engine} if engine else {})})  # fmt: skip
        journal.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            parts.rmdir()
        print(f"prompts: {written:,} prompts written by the verifier from {len(entries):,} samples -> "
              f"{out_dir / PROMPTS}\n  refused: {outputs['refused'] or 'none'}\n"
              + (f"  by topic: {by_topic}\n" if c.topics else "")
              + (f"  engine: {engine_summary(engine, caller='judging the samples')}\n" if engine else "") +
              f"  next: eyas regenerate --data {out_dir} (or a mix: --data sharegpt,{out_dir}) ...")  # fmt: skip
        return m


prompts = stage_function(PromptsConfig, run, "prompts")


def _decoder(c: PromptsConfig, info, tok, dev, dt, *, end: str, max_len: int):
    from eyas.engine.generate import BatchDecoder, default_batch_tokens
    from eyas.verifier.load import build_text_model

    model = build_text_model(info, dtype=dt, device=dev)
    eos = {tok.convert_tokens_to_ids(end)} | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    budget = c.batch_tokens or default_batch_tokens(model, max_len=max_len)
    return BatchDecoder(model, eos_ids=eos, max_len=max_len, batch_tokens=max(budget, max_len),
                        temperature=c.temperature, top_p=c.top_p, pad_id=pad)  # fmt: skip


def _round(decoder, tok, prefix_ids: list[list[int]], attempts: list[int], *, journal: Path, min_words: int,
           seed: int, max_new_tokens: int, done: int, total: int) -> int:  # fmt: skip
    """Samples ``attempts`` (each seeded by its index, sample ``i`` drawn after ``prefix_ids[i % n]``), judged
    and journaled as they come back: the tokens decoded."""
    from tqdm.auto import tqdm

    from eyas.engine.generate import Request, RequestQueue

    queue = RequestQueue(Request(key=i, tokens=prefix_ids[i % len(prefix_ids)], max_new_tokens=max_new_tokens,
                                 seed=seed * 1_000_003 + i) for i in attempts)  # fmt: skip
    tokens = 0
    with Journal(journal) as f, tqdm(total=total, initial=done, desc="prompts", unit="prompt", file=sys.stderr,
                                     dynamic_ncols=True) as bar:  # fmt: skip
        for comp in decoder.run(queue):
            ids = comp.tokens[:-1] if comp.finished else comp.tokens
            tokens += len(comp.tokens)
            text = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
            v = verdict(text, ids, finished=comp.finished, min_words=min_words)
            f.append({"i": comp.key, "verdict": v, "text": text})
            bar.update(int(v == "kept"))  # (duplicates are told apart at the end)
    return tokens
