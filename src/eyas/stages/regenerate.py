"""``eyas regenerate``: the verifier answers a dataset's prompts itself, so the draft trains on the distribution
it will be asked to predict.

A draft learns to guess the verifier's next tokens; trained on answers another model wrote (ShareGPT's are
ChatGPT's), it learns that model's phrasing, and part of what it learns is never accepted. EAGLE's authors
regenerate the answers with the target model (EAGLE-3, arXiv:2503.01840, and the EAGLE repo's
``ge_data``); SpecForge does it through an SGLang server. eyas decodes with the verifier itself through its
generation engine (:mod:`eyas.engine.generate`: continuous batching over a fixed token budget, CUDA graphs), so no
serving engine is needed; for a verifier too large for that, ``--server`` asks an OpenAI-compatible endpoint
(vLLM, SGLang) instead. Under ``torchrun`` the prompts are dealt out to the ranks.

Each prompt's user turns are answered in order, each one after the verifier's own answers to the turns before
(a multi-turn conversation stays coherent); an answer cut at ``max_new_tokens`` ends its conversation there
(a later turn would follow an answer the verifier never finished), and so does a turn whose prompt plus
``max_new_tokens`` would pass ``max_seq_len``. All conversations are in flight at once: a conversation's
next turn joins the queue as soon as its answer is back.

The output is a folder ``eyas prepare --data`` reads as is: ``conversations.jsonl`` (OpenAI layout: ``{"id",
"messages": [{role, content}]}``) and ``manifest.json`` (stage ``regenerate``). Each finished conversation is
appended to a journal as it completes, so a run killed at any moment (``kill -9`` included) resumes with
nothing lost or done twice; the conversations file appears, whole and in the prompts' order, only at the end.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from eyas.core import dist
from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.data.datasets import CONVERSATIONS
from eyas.core.errors import EyasError
from eyas.core.validate import ABOVE_0, AT_LEAST_0, AT_LEAST_1, SEQ_LEN, TOKENS
from eyas.core.files import Journal, atomic_path, read_journal, sha256_json
from eyas.core.manifest import StageOutput, check_out
from eyas.engine.remote import Answer, Server, without_credentials

__all__ = ["CONVERSATIONS", "regenerate"]


@dataclass(kw_only=True, frozen=True)
class RegenerateConfig(StageConfig):
    """Answer a dataset's prompts with the verifier itself, turn by turn, and write the conversations for
    `eyas prepare`.

    Reads ShareGPT or OpenAI conversations (their user turns; the original answers are replaced), prompt sets
    such as mt-bench, or files of ``turns`` / ``prompt`` records. Writes OUT/conversations.jsonl and
    OUT/manifest.json; `eyas prepare --data OUT` then tokenizes the verifier's own answers. Skips itself when
    OUT already matches, and resumes an interrupted run (kill it at any moment; run the same command again).
    The verifier runs here (one GPU, `--device-map auto` over several, or `torchrun --nproc-per-node N -m
    eyas.cli regenerate ...`, which deals the prompts out to the ranks), or behind an OpenAI-compatible
    server (`--server`)."""

    stage: ClassVar[str] = "regenerate"

    verifier: str = fields.verifier("; it writes the answers through its own chat template.")
    data: str = option(
        recorded=False,
        help="a .json/.jsonl/.parquet file or a folder of them (conversations or prompts), a named set "
        "(sharegpt, mt-bench, humaneval), an `eyas prompts` output, or a mix of those, "
        "comma-separated: sharegpt,runs/x/prompts.",
    )
    out: str = fields.out()
    max_new_tokens: int = option(
        1024,
        range=TOKENS,
        help="the most tokens one answer may have; an answer cut there ends its conversation (see --after-cut).",
    )
    after_cut: Literal["end", "continue"] = option(
        "end",
        recorded="when set",
        help="what follows an answer cut at --max-new-tokens: end the conversation there (a later turn would "
        "follow an answer the verifier never finished), or continue with the next user turn after the cut "
        "answer, as `eyas eval` decodes a multi-turn set: the answers eval itself decodes, for comparing the "
        "tau a draft's TTT accuracy predicts with the tau eval measures (bench/gpu/quality.sh predict).",
    )
    max_seq_len: int = option(
        2048,
        range=SEQ_LEN,
        help="the longest conversation in tokens: a turn whose prompt plus "
        "--max-new-tokens would pass it is not answered and ends the conversation "
        "(train on at most this many tokens: prepare's and train's --max-seq-len).",
    )
    max_samples: int | None = option(None, range=AT_LEAST_1, help="answer a seeded random sample of this many prompts.")
    max_turns: int | None = option(
        None, range=AT_LEAST_1, help="answer at most this many user turns of each prompt (default: all)."
    )
    temperature: float = option(
        0.0,
        range=AT_LEAST_0,
        help="0 decodes greedily; above 0 samples (seeded per prompt and turn, so a "
        "rerun writes the same answers whatever else shares the batch).",
    )
    loops: Literal["keep", "trim", "drop"] = option(
        "trim",
        help="what to do with an answer cut at --max-new-tokens that ends in a repetition loop: keep it, trim "
        "it to the text before the loop and its first copy, or drop the answer (and the conversation's later "
        "turns). The manifest counts loops either way. Trim by default: greedy SmolLM2's loop tails were 49% of its "
        "new tokens, and trimmed they stop flattering validation tau (1.68 against 1.52 decoded, where untrimmed "
        "data gave 2.37 against 1.86; docs/BENCHMARKS.md).",
    )
    loop_copies: int = option(
        1,
        range=AT_LEAST_1,
        recorded="when set",
        help="with --loops trim, how many copies of the loop to keep: 1 keeps none of its repeats, so the draft "
        "never sees a loop go on; 3 keeps two repeats, which teaches it to follow a loop the verifier falls into "
        "while decoding without letting loop tails fill the data.",
    )
    repetition_penalty: float = option(
        1.0,
        range=ABOVE_0,
        help="CTRL's repetition penalty on the verifier's answers here (1: none; "
        "1.1-1.3 breaks most loops, but the draft then learns answers the "
        "verifier does not write unpenalised; local verifier only).",
    )
    seed: int = option(0, range=AT_LEAST_0, help="the seed of the sample and of the sampling.")
    batch_tokens: int | None = option(
        None,
        recorded=False,
        range=TOKENS,
        help="the decoding budget in tokens of key/value cache (sequences decoded "
        "together = this // --max-seq-len); it fixes the memory whatever the "
        "prompts (default: 40% of the free GPU memory; 16k tokens on CPU).",
    )
    device: str | None = fields.device()
    device_map: str | dict[str, Any] | None = fields.device_map()
    dtype: str = fields.dtype()
    # --server and --server-model are recorded as one setting, the URL without its credentials and the model
    server: str | None = option(
        None,
        recorded=False,
        help="instead of loading the verifier, ask an OpenAI-compatible server that "
        "serves it (vLLM, SGLang): its base URL, http://host:port/v1. The "
        "verifier's tokenizer and chat template are still read here (prepare needs "
        "them); the server must serve that same model.",
    )
    server_model: str | None = option(
        None, recorded=False, help="the model name to ask the server for (default: the first one it lists)."
    )
    api_key_env: str = option(
        "OPENAI_API_KEY",
        recorded=False,
        help="the environment variable holding the server's API key, if it "
        "needs one (the key is sent only in the request header, never "
        "written).",
    )
    concurrency: int = option(
        16, recorded=False, range=AT_LEAST_1, help="with --server, the requests in flight at once."
    )
    server_timeout: float = option(
        600.0,
        recorded=False,
        range=ABOVE_0,
        help="the seconds one --server answer may take before it is retried (each "
        "is retried 6 times with backoff, as the openai client does): long "
        "enough for --max-new-tokens at a loaded server. The first request, "
        "/models, waits 20 s a try, so a server that never answers is named "
        "within about 2.5 minutes.",
    )
    strict: bool = option(False, help="stop at the first bad record instead of counting and skipping it.")
    trust_remote_code: bool = fields.trust_remote_code()
    chat_template: str | None = fields.chat_template(
        ". With --server the server renders them: start it with the same template (vLLM, SGLang: --chat-template)."
    )

    def check(self) -> None:
        if self.max_new_tokens >= self.max_seq_len:
            raise EyasError(f"--max-new-tokens {self.max_new_tokens} leaves no room for a prompt in --max-seq-len "
                            f"{self.max_seq_len}; raise --max-seq-len or lower --max-new-tokens")  # fmt: skip
        if self.batch_tokens is not None and self.batch_tokens < self.max_seq_len:
            raise EyasError(f"--batch-tokens {self.batch_tokens} holds no sequence of --max-seq-len "
                            f"{self.max_seq_len}; give at least {self.max_seq_len}")  # fmt: skip
        if self.device_map is not None and self.server:
            raise EyasError("--device-map loads the verifier here; with --server nothing is loaded: give one of them")
        if self.repetition_penalty != 1.0 and self.server:
            raise EyasError("--repetition-penalty applies to the verifier loaded here; with --server set the "
                            "server's own sampling instead")  # fmt: skip


def run(c: RegenerateConfig) -> dict[str, Any]:
    """Run `eyas regenerate` as ``c`` describes (see :class:`RegenerateConfig`)."""
    from eyas.data.chat import ChatTemplate
    from eyas.data.datasets import load_prompts, open_source, source_sha256
    from eyas.engine.generate import device_and_dtype
    from eyas.verifier.load import load_tokenizer
    from eyas.verifier.info import fingerprint, resolve

    check_out(c.out, stage="regenerate")  # another stage's folder, refused before the verifier loads (and again below)
    dev, dt = device_and_dtype(c.device, c.dtype)

    info = resolve(c.verifier)
    files, _, _ = open_source(c.data)
    tok = load_tokenizer(info, trust_remote_code=c.trust_remote_code, chat_template=c.chat_template)
    template = ChatTemplate(tok, where=c.chat_template or str(info.path))  # refuses one eyas could not mask afterwards
    inputs = {"verifier": fingerprint(info), "chat_template_sha256": template.sha256,
              "data": {"source": str(c.data), "sha256": source_sha256(files)}}  # fmt: skip
    if c.server:  # where the answers come from (a URL's user:password part is never recorded)
        settings = recorded_settings(c, server={"url": without_credentials(c.server), "model": c.server_model})
    else:  # precision moves greedy answers by a token now and then
        settings = recorded_settings(c, dtype=str(dt).removeprefix("torch."))
    out_dir = Path(c.out)
    with dist.init(device_type="cuda" if dev.type == "cuda" and not c.server else "cpu") as d:
        if c.device_map is not None and d.active:
            raise EyasError("--device-map spreads one verifier over all GPUs in one process; do not use it under "
                            "torchrun (or run one process)")  # fmt: skip
        with StageOutput(out_dir, stage="regenerate", d=d) as output:
            parts = out_dir / ".parts" / sha256_json({"inputs": inputs, "settings": settings})[:16]

            def open_out() -> dict[str, Any] | None:  # on rank 0: the finished output, or None: there is work
                finished = output.up_to_date(inputs=inputs, settings=settings, files=(CONVERSATIONS,))
                if finished is not None:
                    return finished
                if parts.parent.is_dir():  # journals of other inputs or settings are stale
                    for old in parts.parent.iterdir():
                        if old != parts:
                            shutil.rmtree(old, ignore_errors=True)
                parts.mkdir(parents=True, exist_ok=True)
                # an older output's manifest would vouch for the new conversations a crash could leave beside it
                output.unfinish()
                return None

            manifest = d.run_on_main(open_out)
            if manifest is not None:
                if d.is_main:
                    print(f"regenerate: {out_dir} is up to date ({manifest['outputs']['conversations']} "
                          "conversations); skipping")  # fmt: skip
                return manifest
            d.barrier("start of regeneration")
            prompts, report = load_prompts(c.data, max_samples=c.max_samples, seed=c.seed, strict=c.strict)
            finished = read_journals(parts)
            todo = [i for i in range(d.rank, len(prompts), d.world_size) if i not in finished]
            started = time.perf_counter()
            new_tokens, engine = 0, {}
            if todo:
                backend = _backend(c, info=info, tok=tok, device=dev, dtype=dt, d=d)
                mine = sum(1 for i in range(d.rank, len(prompts), d.world_size))
                desc = "regenerate" + (f" (rank 0 of {d.world_size})" if d.active else "")
                with Journal(parts / f"journal-rank{d.rank:03d}.jsonl") as journal:
                    new_tokens = _converse(prompts, todo, backend, max_turns=c.max_turns, journal=journal,
                                           done=mine - len(todo), total=mine, desc=desc, show=d.is_main,
                                           loops=LoopPolicy(c.loops, tok, copies=c.loop_copies),
                                           continue_after_cut=c.after_cut == "continue")  # fmt: skip
                engine = backend.report()
            seconds = max(d.all_gather(time.perf_counter() - started))
            new_tokens = sum(d.all_gather(new_tokens))
            resumed = len(finished)
            d.barrier("end of regeneration")

            def finish() -> dict[str, Any]:
                got = read_journals(parts)
                missing = [i for i in range(len(prompts)) if i not in got]
                if missing:
                    raise EyasError(f"{out_dir}: prompt(s) {missing[:5]} were answered by no rank; run again")
                totals = dict.fromkeys(_COUNTS, 0)
                # the journals stay until the manifest is written (until then the folder is refused as data), and
                # an error below leaves no conversations file (atomic_path drops it)
                with atomic_path(out_dir / CONVERSATIONS) as tmp, open(tmp, "w", encoding="utf-8") as f:
                    for i in range(len(prompts)):
                        entry = got[i]
                        for k, v in entry["counts"].items():
                            totals[k] += v
                        if entry["record"] is not None:
                            f.write(json.dumps(entry["record"], ensure_ascii=False) + "\n")
                    if totals["conversations"] == 0:
                        raise EyasError(f"the verifier answered none of the {len(prompts)} prompts of "
                                        f"{report.source}: every first answer was empty ({totals['empty_answers']}) "
                                        f"or its prompt too long ({totals['prompt_too_long']})")  # fmt: skip
                outputs = {"prompts": len(prompts), "rows_in": report.rows_in, **totals}
                m = output.finish(
                    outputs=outputs, report=report.to_json(), verifier_path=str(info.path),
                    chat_template=c.chat_template,
                    timing={"seconds": round(seconds, 2), "ranks": d.world_size, "resumed_conversations": resumed,
                            "new_tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1),
                            **({"engine": engine} if engine else {})},
                )  # fmt: skip
                shutil.rmtree(parts.parent, ignore_errors=True)
                _print_summary(out_dir, outputs, report)
                if engine:  # rank 0's decoder
                    from eyas.engine.generate import engine_summary

                    print(f"  engine: {engine_summary(engine, caller='answers and next turns')}")
                return m

            return d.run_on_main(finish)


regenerate = stage_function(RegenerateConfig, run, "regenerate")


#: What the manifest counts (``outputs``), summed over the conversations.
_COUNTS = (
    "conversations",
    "answers",
    "new_tokens",
    "cut_at_max_new_tokens",
    "empty_answers",
    "prompt_too_long",
    "loops",
    "loop_tokens",
    "trimmed_tokens",
    "dropped_answers",
)


class LoopPolicy:
    """``--loops``: finds a repetition loop at the end of an answer cut at ``--max-new-tokens`` (an answer the
    verifier ended itself is left alone) and keeps, trims (to the text before it and ``copies`` copies of it)
    or drops it, counting what it did in ``counts``."""

    def __init__(self, mode: str, tok, *, copies: int = 1) -> None:
        self.mode, self.tok, self.copies = mode, tok, copies

    def __call__(self, a: Answer, counts: dict[str, int]) -> Answer | None:
        from eyas.data.repetition import find_loop

        # the engine's own ids where it has them: tokenizing the text again costs about 2 ms an answer
        ids = a.ids if a.ids is not None else self.tok(a.text, add_special_tokens=False)["input_ids"]
        loop = find_loop(ids)
        if loop is None:
            return a
        counts["loops"] += 1
        counts["loop_tokens"] += len(ids) - loop.start
        if self.mode == "drop":
            counts["dropped_answers"] += 1
            return None
        if self.mode == "trim":
            keep = loop.trimmed_length(self.copies)
            counts["trimmed_tokens"] += len(ids) - keep
            text = self.tok.decode(ids[:keep], skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
            return Answer(text, a.finished, a.tokens, a.reasoning) if text else None
        return a


# --------------------------------------------------------------------------- the journal


def read_journals(parts: Path) -> dict[int, dict[str, Any]]:
    """Every finished conversation the journals in ``parts`` hold (one per rank), by prompt index."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(parts.glob("journal-rank*.jsonl")) if parts.is_dir() else ():
        for i, entry in read_journal(path).items():
            out.setdefault(i, entry)
    return out


# --------------------------------------------------------------------------- conversations


def _converse(prompts, todo: list[int], backend, *, max_turns: int | None, journal: Journal, done: int, total: int,
              desc: str, show: bool, loops: LoopPolicy | None = None,
              continue_after_cut: bool = False) -> int:  # fmt: skip
    """Every prompt of ``todo`` answered turn by turn, all conversations in flight at once: each next turn is
    submitted as soon as the answer before it is back. Each finished conversation goes to ``journal``; an
    answer cut at the limit goes through ``loops`` first, and ends its conversation unless
    ``continue_after_cut``. Returns the new tokens decoded."""
    from tqdm.auto import tqdm

    answers: dict[int, list[Answer]] = {i: [] for i in todo}
    counts = {i: dict.fromkeys(_COUNTS, 0) for i in todo}
    last = {i: min(len(prompts[i].turns), max_turns or len(prompts[i].turns)) - 1 for i in todo}
    new_tokens, t0 = 0, time.perf_counter()
    with tqdm(total=total, initial=done, desc=desc, unit="conv", file=sys.stderr, dynamic_ncols=True,
              disable=not show) as bar:  # fmt: skip
        # remaining=: the turns still to come after this one (the longest chains start first)
        backend.submit_many([(i, 0, _conversation(prompts[i], []), last[i]) for i in todo])
        for i, a in backend.results():
            c, said = counts[i], answers[i]
            c["new_tokens"] += a.tokens
            new_tokens += a.tokens
            over = True
            if a.text is None:
                c["prompt_too_long"] += 1
            elif not a.text:  # an empty turn would be cut by `eyas prepare` anyway; end the conversation here
                c["empty_answers"] += 1
            else:
                said.append(a)
                c["answers"] += 1
                if not a.finished:
                    c["cut_at_max_new_tokens"] += 1
                    kept = loops(a, c) if loops is not None else a
                    if kept is None:  # dropped: the conversation ends with the answer before it
                        said.pop()
                        c["answers"] -= 1
                    else:
                        said[-1] = kept
                        over = not continue_after_cut or len(said) > last[i]
                else:
                    over = len(said) > last[i]
            if not over:
                backend.submit(i, len(said), _conversation(prompts[i], said), remaining=last[i] - len(said))
                continue
            p = prompts[i]
            # Prompt.messages ends on the next user turn while one is left: that turn went unanswered, so it goes
            record = None
            if said:
                record = {"id": p.id, "messages": _conversation(p, said)[: 2 * len(said) + (1 if p.system else 0)]}
            c["conversations"] = int(record is not None)
            journal.append({"i": i, "record": record, "counts": c})
            del answers[i], counts[i]
            bar.update(1)
            # shown at the bar's own refresh: redrawing it for every conversation cost 45 us each, host time
            bar.set_postfix(tokens_per_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f}", refresh=False)
    return new_tokens


def _conversation(prompt, answers: list[Answer]) -> list[dict[str, str]]:
    """``prompt``'s messages up to its next user turn, each answer with the reasoning a server returned beside
    it as ``reasoning_content`` (the key `eyas prepare` hands to chat templates that render reasoning, such as
    Qwen3's ``<think>`` block, and servers read back)."""
    thoughts = iter(a.reasoning for a in answers)
    out = []
    for m in prompt.messages([a.text for a in answers]):
        reasoning = next(thoughts) if m["role"] == "assistant" else None
        out.append({**m, "reasoning_content": reasoning} if reasoning else m)
    return out


def _request_seed(seed: int, i: int, turn: int) -> int:
    """The sampling seed of prompt ``i``'s turn ``turn``: the same whichever rank or batch decodes it."""
    return (seed * 1_000_003 + i) * 1_009 + turn


def _backend(c: RegenerateConfig, *, info, tok, device, dtype, d):
    """Where ``c``'s answers come from: its ``--server``, or the verifier loaded here on ``device`` in ``dtype``
    (resolved from ``c``)."""
    if c.server:
        return ServerBackend(Server(c.server, c.server_model, max_new_tokens=c.max_new_tokens,
                                    temperature=c.temperature, seed=c.seed, concurrency=c.concurrency,
                                    api_key_env=c.api_key_env, timeout=c.server_timeout))  # fmt: skip
    from eyas.engine.generate import default_batch_tokens
    from eyas.verifier.load import build_text_model

    where = None if c.device_map else (d.device(device.type) if d.active else device)  # one GPU per rank
    model = build_text_model(info, dtype=dtype, device=where, device_map=c.device_map)
    budget = c.batch_tokens or default_batch_tokens(model, max_len=c.max_seq_len)
    return LocalBackend(model, tok, max_new_tokens=c.max_new_tokens, max_seq_len=c.max_seq_len, batch_tokens=budget,
                        temperature=c.temperature, seed=c.seed, repetition_penalty=c.repetition_penalty)  # fmt: skip


class LocalBackend:
    """Answers from the verifier loaded here, through the generation engine's continuous batching."""

    def __init__(self, model, tok, *, max_new_tokens: int, max_seq_len: int, batch_tokens: int, temperature: float,
                 seed: int, repetition_penalty: float = 1.0) -> None:  # fmt: skip
        from eyas.data.chat import end_of_turn_ids
        from eyas.engine.generate import BatchDecoder, RequestQueue

        # a verifier with a shorter context than --max-seq-len answers what fits its context
        max_seq_len = min(max_seq_len, getattr(model.config, "max_position_embeddings", None) or max_seq_len)
        self.tok, self.max_new_tokens, self.max_seq_len, self.seed = tok, max_new_tokens, max_seq_len, seed
        self.eos_ids = end_of_turn_ids(tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(self.eos_ids)
        # device_map spreads layers over devices: CUDA graphs record one device's stream only
        graphs = not getattr(model, "hf_device_map", None)
        self.decoder = BatchDecoder(model, eos_ids=self.eos_ids, max_len=max_seq_len, batch_tokens=batch_tokens,
                                    temperature=temperature, pad_id=pad, cuda_graphs=graphs,
                                    repetition_penalty=repetition_penalty)  # fmt: skip
        self.queue = RequestQueue(feed=self._ready)
        self._early: list[tuple[int, Answer]] = []
        self._waiting: list[tuple[int, int, list[dict[str, str]], int]] = []

    def submit(self, i: int, turn: int, messages: list[dict[str, str]], *, remaining: int = 0) -> None:
        self.submit_many([(i, turn, messages, remaining)])

    def submit_many(self, items: list[tuple[int, int, list[dict[str, str]], int]]) -> None:
        """:meth:`submit` of each ``(i, turn, messages, remaining)``. They wait untokenized until the engine next
        reads its queue (:meth:`_ready`), so that a block's next turns are tokenized in one batch: one
        conversation at a time took 1.1 ms (a fast tokenizer's call costs about as much as its text), in
        batches 0.5 ms on a loaded 2-core CPU, and far less on the GPU machine's 16 cores."""
        self._waiting += items

    def _ready(self) -> list:
        """The submitted conversations, tokenized through the chat template in batches -> their requests (a
        prompt too long to answer is answered at once, with nothing)."""
        from eyas.data.chat import encode_prompts
        from eyas.engine.generate import Request

        if not self._waiting:  # the engine reads its queue often
            return []
        items, self._waiting = self._waiting, []
        out = []
        for (i, turn, _, remaining), ids in zip(items, encode_prompts(self.tok, [m for _, _, m, _ in items])):
            if len(ids) + self.max_new_tokens > self.max_seq_len:
                self._early.append((i, Answer(None, False, 0)))
                continue
            out.append(Request(key=i, tokens=ids, max_new_tokens=self.max_new_tokens,
                               seed=_request_seed(self.seed, i, turn), priority=remaining))  # fmt: skip
        return out

    def report(self) -> dict[str, Any]:
        return self.decoder.report()

    def results(self) -> Iterator[tuple[int, Answer]]:
        while self._early or self.queue:
            while self._early:
                yield self._early.pop()
            for c in self.decoder.run(self.queue):
                ids = c.tokens[:-1] if c.finished else c.tokens
                # special tokens inside an answer are dropped: the template writes the turn's own controls. The
                # text as decoded, no clean-up: a tokenizer config asking for it (GGUF's) would strip spaces before
                # punctuation in some transformers versions and print a warning in others
                text = self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
                yield c.key, Answer(text, c.finished, len(c.tokens), ids=ids)
                while self._early:
                    yield self._early.pop()


class ServerBackend:
    """Answers from an OpenAI-compatible server (:class:`eyas.engine.remote.Server`), its ``concurrency`` requests in
    flight across all conversations: a conversation's next turn is sent as soon as its answer is back."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.pool = ThreadPoolExecutor(max_workers=server.concurrency)
        self.pending: dict[Future, int] = {}

    def submit(self, i: int, turn: int, messages: list[dict[str, str]], *, remaining: int = 0) -> None:
        self.pending[self.pool.submit(self.server.complete, messages)] = i

    def submit_many(self, items: list[tuple[int, int, list[dict[str, str]], int]]) -> None:
        for i, turn, messages, remaining in items:
            self.submit(i, turn, messages, remaining=remaining)

    def report(self) -> dict[str, Any]:
        return {}

    def results(self) -> Iterator[tuple[int, Answer]]:
        try:
            while self.pending:
                done, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
                for f in done:
                    yield self.pending.pop(f), f.result()
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.server.close()


def _print_summary(out_dir: Path, o: dict[str, Any], report) -> None:
    print(
        f"regenerate: {o['rows_in']:,} rows in the source, {o['prompts']:,} prompts, {o['conversations']:,} "
        f"conversations with {o['answers']:,} answers by the verifier -> {out_dir / CONVERSATIONS}\n"
        f"  {o['new_tokens']:,} new tokens; "
        f"{o['cut_at_max_new_tokens']:,} answers cut at --max-new-tokens, {o['empty_answers']:,} empty, "
        f"{o['prompt_too_long']:,} turns past --max-seq-len\n  {o['loops']:,} of the cut answers end in a "
        f"repetition loop ({o['loop_tokens']:,} tokens of loop; {o['trimmed_tokens']:,} trimmed, "
        f"{o['dropped_answers']:,} answers dropped)"
    )
    lines = report.summary_lines()
    if lines:  # as prepare reports them
        print("  dropped or noted (rows are numbered from 0 in the source):")
        print("\n".join(lines))
    print(f"  next: eyas prepare --verifier ... --data {out_dir} --out ...")
