"""``eyas prepare``: conversations -> token ids and an exact loss mask, through the verifier's own chat template.

A draft learns only what its data shows, and the usual silent failure is a
loss mask that is off by a token or covers the prompt. Here the mask is 1 on
exactly the tokens the assistant generates in each of its turns, the
end-of-turn token included, and 0 on everything else (system prompt, user
turns, the template's headers and the generation prompt).

How a turn is found. The whole conversation is rendered with the verifier's
template (locally, with its tokenizer; no server). Assistant turn
``i`` (message ``m``) starts where the rendering of ``messages[:m]`` with the
generation prompt ends (that text must be a prefix of the full rendering,
which holds for every template that renders a prompt the way it is later
served, Qwen3's included: it only rewrites assistant turns *after* the last
user turn), and ends after the first end-of-turn token that follows; the
end-of-turn token is what the template writes right after an assistant
message, found once by probing. Reasoning scaffolds (``<think>...</think>``)
are part of what the assistant generates, so they are masked wherever the
template renders them. The text is tokenized once, with
``add_special_tokens=False`` (the template writes BOS itself when the model
wants one; a second BOS from the tokenizer would be wrong), and character
offsets map each turn to its tokens. Where a token straddles the start of a
turn, the row is tokenized piecewise at the turn boundaries instead (encoding
each piece after a newline that is then dropped, as transformers'
``_encode_chat_piece`` does, so SentencePiece adds no prefix space).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal

import numpy as np
import pyarrow as pa

from eyas.data.chat import ChatTemplate, TemplateSplitError
from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.data.datasets import DROPS, iter_conversations, open_source, source_sha256
from eyas.data.prepared import PREPARED_ROWS, ROWS_SCHEMA, rows_table, write_rows
from eyas.data.repetition import find_loop
from eyas.core.errors import EyasError
from eyas.core.validate import AT_LEAST_0, AT_LEAST_1, SEQ_LEN
from eyas.core.files import atomic_path, sha256_json, write_json
from eyas.core.manifest import StageOutput

CHUNK = 128  # conversations per task handed to a worker
PART = 32  # chunks per part file on disk: the unit an interrupted run resumes from
CHARS_PER_TOKEN_CAP = 8  # a long row is first tokenized up to max_seq_len * 8 characters (see _encode_chunk)


# --------------------------------------------------------------------------- tokenizing (runs in workers)


@dataclass
class _Job:
    template: ChatTemplate
    max_seq_len: int
    on_overflow: str
    loop_tails: str = "scored"


def _unscore_loop_tails(ids: np.ndarray, mask: np.ndarray, eot_id: int | None) -> int:
    """Zero the loss mask of every assistant turn's loop copies after the first (in place); return the tokens
    unscored. A turn is a run of scored tokens; its end-of-turn token, which the template adds after a cut answer
    too, is left out of the search (a loop must repeat up to the end) and stays scored."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))  # run starts, ends
    unscored = 0
    for a, b in zip(edges[::2], edges[1::2]):
        end = b - 1 if eot_id is not None and b > a and ids[b - 1] == eot_id else b
        loop = find_loop(ids[a:end])
        if loop is not None:
            cut = a + loop.trimmed_length()
            mask[cut:end] = 0
            unscored += int(end - cut)
    return unscored


_JOB: _Job | None = None


def _init_worker(job: _Job) -> None:
    global _JOB
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _JOB = job


def _encode_piece(tok, text: str, first: bool) -> list[int]:
    """Token ids of ``text`` as it reads in the middle of a chat: encoded after a newline that is then
    dropped, so SentencePiece adds no prefix space (transformers' ``_encode_chat_piece`` trick)."""
    if first:
        return tok.encode(text, add_special_tokens=False)
    nl = tok.encode("\n", add_special_tokens=False)
    ids = tok.encode("\n" + text, add_special_tokens=False)
    return ids[len(nl) :] if ids[: len(nl)] == nl else tok.encode(text, add_special_tokens=False)


def _piecewise(tok, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int], list[int]]:
    cuts = sorted({0, len(text), *(x for s in spans for x in s)})
    starts = {a for a, _ in spans}
    ids: list[int] = []
    mask: list[int] = []
    ends: list[int] = []
    inside = False
    for lo, hi in zip(cuts, cuts[1:]):
        inside = lo in starts or (inside and not any(b == lo for _, b in spans))
        piece = _encode_piece(tok, text[lo:hi], first=lo == 0)
        ids += piece
        mask += [int(inside)] * len(piece)
        if inside and any(b == hi for _, b in spans):
            ends.append(len(ids))
    return ids, mask, ends


def _from_offsets(enc, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]] | None:
    """Mask and turn ends from one whole-text encoding; None if a token straddles a turn boundary."""
    n = len(enc.ids)
    mask = np.zeros(n, dtype=np.int8)
    ends = []
    for a, b in spans:
        i0, i1 = enc.char_to_token(a), enc.char_to_token(b - 1)
        if i0 is None or i1 is None or enc.token_to_chars(i0)[0] != a or enc.token_to_chars(i1)[1] != b:
            return None
        mask[i0 : i1 + 1] = 1
        ends.append(i1 + 1)
    return mask, ends


def _render(chunk: list[tuple[int, list[dict[str, str]]]], tmpl: ChatTemplate, notes: list) -> list[tuple]:
    """``(row, text, spans)`` for each conversation the template can render and split; the rest go to notes."""
    out = []
    for row, msgs in chunk:
        while msgs and msgs[-1]["role"] != "assistant":  # a trailing prompt has nothing to learn
            msgs = msgs[:-1]
        if not msgs:
            notes.append(("no_assistant", row, ""))
            continue
        hit = next((m for msg in msgs if (m := tmpl.control_re.search(msg["content"]))), None)
        if hit is not None:
            notes.append(("control_token_in_text", row, f"holds {hit.group(0)!r}"))
            continue
        try:
            text, spans = tmpl.spans(msgs)
        except TemplateSplitError as e:
            notes.append(("template_error", row, str(e)))
            continue
        except Exception as e:  # a template's raise_exception(), e.g. roles that must alternate
            notes.append(("template_error", row, f"{type(e).__name__}: {e}"))
            continue
        out.append((row, text, spans))
    return out


def _tokenize(tok, items: list[tuple[str, list[tuple[int, int]]]]) -> list[tuple[np.ndarray, np.ndarray, list, bool]]:
    """``(ids, mask, turn ends, split?)`` per ``(text, spans)``: one batched whole-text encoding, and the
    piecewise one for rows where a token straddles a turn boundary (or the tokenizer has no offsets)."""
    encs = [None] * len(items)
    if getattr(tok, "is_fast", False) and items:  # one batched call into the Rust tokenizer
        encs = tok.backend_tokenizer.encode_batch([t for t, _ in items], add_special_tokens=False)
    out = []
    for (text, spans), enc in zip(items, encs):
        got = _from_offsets(enc, spans) if enc is not None else None
        if got is not None:
            out.append((np.asarray(enc.ids, dtype=np.int32), got[0], got[1], False))
        else:
            ids, mask, ends = _piecewise(tok, text, spans)
            out.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8), ends, enc is not None))
    return out


def _encode_chunk(chunk: list[tuple[int, list[dict[str, str]]]]) -> dict[str, Any]:
    """Tokenize and mask a chunk of conversations; returns flat arrays plus what was dropped and why.

    A long conversation is first tokenized only up to the end of the last assistant turn within
    ``max_seq_len * CHARS_PER_TOKEN_CAP`` characters. The cut falls right after an end-of-turn token, and a
    tokenizer splits special tokens out before anything else, so the tokens before it are exactly those of
    the whole text; if that prefix already exceeds ``max_seq_len``, the rest cannot matter, otherwise the
    row is tokenized whole.
    """
    job = _JOB
    assert job is not None
    tok, cap = job.template.tok, job.max_seq_len * CHARS_PER_TOKEN_CAP
    notes: list[tuple[str, int, str]] = []
    rendered = _render(chunk, job.template, notes)
    items, partial = [], []
    for _, text, spans in rendered:
        keep = [s for s in spans if s[1] <= cap] if len(text) > cap else spans
        cut = 0 < len(keep) < len(spans)
        items.append((text[: keep[-1][1]], keep) if cut else (text, spans))
        partial.append(cut)
    encoded = _tokenize(tok, items)
    redo = [i for i, (enc, cut) in enumerate(zip(encoded, partial)) if cut and len(enc[0]) <= job.max_seq_len]
    for i, enc in zip(redo, _tokenize(tok, [rendered[i][1:] for i in redo])):
        encoded[i], partial[i] = enc, False
    out_ids, out_mask, lens, out_rows = [], [], [], []
    loop_tokens = loop_rows = 0
    for (row, _, _), (ids, mask, ends, _), cut in zip(rendered, encoded, partial):
        if len(ids) > job.max_seq_len:
            fit = [e for e in ends if e <= job.max_seq_len]
            if job.on_overflow == "drop" or not fit:
                notes.append(("too_long", row, f"{'more than ' if cut else ''}{len(ids)} tokens"))
                continue
            notes.append(("truncated", row, ""))
            ids, mask = ids[: fit[-1]], mask[: fit[-1]]
        if job.loop_tails == "unscored":  # the row's own mask (fresh from tokenizing): changed in place
            unscored = _unscore_loop_tails(ids, mask, job.template.eot_id)
            loop_tokens += unscored
            loop_rows += int(unscored > 0)
        out_ids.append(ids)
        out_mask.append(mask)
        lens.append(len(ids))
        out_rows.append(row)
    return {
        "ids": np.concatenate(out_ids) if out_ids else np.zeros(0, np.int32),
        "mask": np.concatenate(out_mask) if out_mask else np.zeros(0, np.int8),
        "lens": np.asarray(lens, dtype=np.int32),
        "rows": np.asarray(out_rows, dtype=np.int64),
        "notes": notes,
        "splits": sum(e[3] for e in encoded),
        "loop_tokens_unscored": loop_tokens,
        "loop_rows": loop_rows,
        "n": len(chunk),
        "max_id": int(max((int(x.max()) for x in out_ids if len(x)), default=-1)),
    }


def _run(job: _Job, tasks: list[tuple[int, list]], num_proc: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(index, result)`` for each ``(index, chunk)`` task, in order, from ``num_proc`` forked workers."""
    if num_proc <= 1 or len(tasks) <= 1:
        _init_worker(job)
        for i, chunk in tasks:
            yield i, _encode_chunk(chunk)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=_init_worker, initargs=(job,))
    try:
        pending: deque = deque()
        for i, chunk in tasks:  # a bounded window: results are collected as they come, in order
            pending.append((i, pool.submit(_encode_chunk, chunk)))
            if len(pending) >= 4 * num_proc:
                i0, fut = pending.popleft()
                yield i0, fut.result()
        while pending:
            i0, fut = pending.popleft()
            yield i0, fut.result()
    finally:  # on an error or Ctrl-C, queued chunks are cancelled rather than waited for
        pool.shutdown(wait=True, cancel_futures=True)


class _Parts:
    """Finished work on disk, ``PART`` chunks a file: rows as an Arrow file and what was noted as JSON,
    so an interrupted run resumes from the last finished part and memory holds one part at a time."""

    def __init__(self, out_dir: Path, key: str, n_chunks: int) -> None:
        root = out_dir / ".parts"
        if root.is_dir():  # parts of other inputs or settings are stale
            for d in root.iterdir():
                if d.name != key:
                    shutil.rmtree(d, ignore_errors=True)
        self.dir = root / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n = -(-n_chunks // PART)
        self.root = root

    def path(self, p: int, ext: str) -> Path:
        return self.dir / f"part-{p:05d}.{ext}"

    def done(self, p: int) -> dict[str, Any] | None:
        if self.path(p, "json").is_file() and self.path(p, "arrow").is_file():
            return json.loads(self.path(p, "json").read_text())
        return None

    def write(self, p: int, results: list[dict[str, Any]]) -> dict[str, Any]:
        tables = [rows_table(r["ids"], r["mask"], r["lens"], r["rows"]) for r in results]
        with atomic_path(self.path(p, "arrow")) as tmp, pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_file(sink, ROWS_SCHEMA) as w:
                for t in tables:
                    w.write_table(t)
        summary = {
            "notes": [n for r in results for n in r["notes"]],
            "splits": sum(r["splits"] for r in results),
            "tokens": sum(int(r["lens"].sum()) for r in results),
            "masked": sum(int(r["mask"].sum(dtype=np.int64)) for r in results),
            "rows": sum(len(r["lens"]) for r in results),
            "max_id": max(r["max_id"] for r in results),
            "n": sum(r["n"] for r in results),
            "loop_tokens_unscored": sum(r["loop_tokens_unscored"] for r in results),
            "loop_rows": sum(r["loop_rows"] for r in results),
        }
        write_json(self.path(p, "json"), summary)
        return summary

    def table(self) -> pa.Table:
        """Every part's rows, memory-mapped."""
        return pa.concat_tables(pa.ipc.open_file(pa.memory_map(str(self.path(p, "arrow")))).read_all()
                                for p in range(self.n))  # fmt: skip

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------- the stage


@dataclass(kw_only=True, frozen=True)
class PrepareConfig(StageConfig):
    """Tokenize conversations with the verifier's chat template and mark exactly the assistant's tokens.

    Writes OUT/rows (input_ids, loss_mask, seq_len, row_id) and OUT/manifest.json with every row that
    was cut or dropped, by reason and row number. Skips itself when OUT already matches."""

    stage: ClassVar[str] = "prepare"

    verifier: str = fields.verifier("; its tokenizer and chat template are used.")
    data: str = option(
        recorded=False,
        help="a .json/.jsonl/.parquet file or a folder of them (ShareGPT or OpenAI layout), or a named "
        "set: sharegpt, mt-bench, humaneval.",
    )
    out: str = fields.out()
    max_seq_len: int = option(2048, range=SEQ_LEN, help="the most tokens a row may have.")
    max_samples: int | None = option(
        None, range=AT_LEAST_1, help="keep a seeded random sample of this many conversations."
    )
    seed: int = option(0, range=AT_LEAST_0, help="the seed of that sample.")
    strict: bool = option(False, help="stop at the first bad row instead of counting and skipping it.")
    on_overflow: Literal["truncate", "drop"] = option(
        "truncate",
        help="a row longer than max-seq-len is cut after its last assistant turn that fits (truncate), or "
        "dropped (drop).",
    )
    num_proc: int | None = option(
        None, recorded=False, range=AT_LEAST_1, help="worker processes for tokenization (default: every core)."
    )
    loop_tails: Literal["scored", "unscored"] = option(
        "scored",
        recorded="when set",
        help="an assistant turn that ends in a repetition loop (eyas.data.repetition: a small verifier's greedy "
        "answers often do) keeps its text either way; unscored takes the loop's copies after the first out of the "
        "loss (as `eyas regenerate --loops trim` cuts them, but leaving the text the draft reads), so the "
        "loss weighs the text that teaches rather than repeats that are almost free to predict.",
    )
    trust_remote_code: bool = fields.trust_remote_code(" (recorded by hash).")
    chat_template: str | None = fields.chat_template(". Give the same to eval.")


def run(c: PrepareConfig) -> dict[str, Any]:
    """Run `eyas prepare` as ``c`` describes (see :class:`PrepareConfig`)."""
    from eyas.verifier.load import load_tokenizer, remote_code_hashes
    from eyas.verifier.info import fingerprint, resolve

    out_dir = Path(c.out)
    # the lock first: a second prepare into this --out stops here, before it reads anything, and another
    # stage's folder is refused before anything in it changes
    with StageOutput(out_dir, stage="prepare") as output:
        info = resolve(c.verifier)
        files, report, named = open_source(c.data, strict=c.strict)
        if named is not None and named.prompt_only:
            raise EyasError(
                f"{c.data} is a prompt-only set (no assistant answers to learn from): "
                f"have the verifier answer it first "
                f"(`eyas regenerate --verifier {c.verifier} --data {c.data} --out DIR`), then prepare DIR"
            )
        tok = load_tokenizer(info, trust_remote_code=c.trust_remote_code, chat_template=c.chat_template)
        template = ChatTemplate(tok, where=c.chat_template or info.path)
        inputs: dict[str, Any] = {
            "verifier": fingerprint(info),
            "chat_template_sha256": template.sha256,
            "data": {"source": report.source, "sha256": source_sha256(files)},
        }
        if c.trust_remote_code:
            inputs["remote_code"] = remote_code_hashes(info)
        settings = recorded_settings(c)
        manifest = output.up_to_date(inputs=inputs, settings=settings, files=(PREPARED_ROWS,))
        if manifest is not None:
            print(f"prepare: {out_dir} is up to date ({manifest['outputs']['rows']} rows); skipping")
            return manifest
        workers = c.num_proc or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else os.cpu_count() or 1)  # fmt: skip

        convs = list(iter_conversations(files, report, max_samples=c.max_samples, seed=c.seed))
        job = _Job(template, c.max_seq_len, c.on_overflow, c.loop_tails)
        chunks = [convs[i : i + CHUNK] for i in range(0, len(convs), CHUNK)]
        parts = _Parts(out_dir, sha256_json({"inputs": inputs, "settings": settings})[:16], len(chunks))
        started = time.perf_counter()
        totals = Counter()
        from tqdm.auto import tqdm

        def account(summary: dict[str, Any]) -> None:
            for reason, row, detail in summary["notes"]:
                report.add(reason, row, detail)
            if summary["max_id"] >= info.vocab_size:
                raise EyasError(
                    f"the tokenizer of {info.path} produced token id {summary['max_id']}, outside the model's "
                    f"vocab of {info.vocab_size}: the tokenizer does not belong to this checkpoint"
                )
            # a part an interrupted run wrote before --loop-tails existed has no loop counts (its key is the same)
            totals.update({k: summary.get(k, 0) for k in ("splits", "tokens", "masked", "rows", "loop_tokens_unscored",
                                                         "loop_rows")})  # fmt: skip
            bar.update(summary["n"])

        with tqdm(total=len(convs), desc="prepare", unit="conv", file=sys.stderr, dynamic_ncols=True) as bar:
            finished = {p: s for p in range(parts.n) if (s := parts.done(p)) is not None}
            for p in sorted(finished):  # resumed: what an earlier run finished
                account(finished[p])
            tasks = [(i, chunk) for i, chunk in enumerate(chunks) if i // PART not in finished]
            pending: dict[int, list[dict[str, Any]]] = {}
            for i, res in _run(job, tasks, workers):
                p = i // PART
                pending.setdefault(p, []).append(res)
                if len(pending[p]) == min(PART, len(chunks) - p * PART):
                    account(parts.write(p, pending.pop(p)))
        if totals["rows"] == 0:
            raise EyasError(
                f"no rows left from {report.source}: every conversation was dropped\n"
                + "\n".join(report.summary_lines())
            )
        seconds = time.perf_counter() - started
        table = parts.table()
        write_rows(out_dir, table)
        counts = report.counts
        outputs = {
            "rows": table.num_rows,
            "tokens": totals["tokens"],
            "masked_tokens": totals["masked"],
            "rows_in": report.rows_in,
            "rows_sampled": min(c.max_samples, report.rows_in) if c.max_samples else report.rows_in,
            "dropped_by_reason": {k: counts[k] for k in DROPS if counts[k]},
            "truncated_rows": counts["truncated"],
            "rows_split_at_turn_boundaries": totals["splits"],
        }
        if c.loop_tails == "unscored":
            outputs |= {"loop_rows": totals["loop_rows"], "loop_tokens_unscored": totals["loop_tokens_unscored"]}
        manifest = output.finish(
            outputs=outputs, report=report.to_json(), verifier_path=str(info.path), vocab_size=info.vocab_size,
            chat_template=c.chat_template, end_of_turn={"token": template.eot, "id": template.eot_id},
            timing={"tokenize_s": round(seconds, 2), "conversations_per_s": round(len(convs) / seconds, 1),
                    "num_proc": workers, "resumed_parts": len(finished)},
        )  # fmt: skip
        parts.remove()
    _print_summary(out_dir, outputs, report)
    return manifest


prepare = stage_function(PrepareConfig, run, "prepare")


def _print_summary(out_dir: Path, o: dict[str, Any], report) -> None:
    share = o["masked_tokens"] / max(o["tokens"], 1)
    print(
        f"prepare: {o['rows_in']:,} rows in the source, {o['rows_sampled']:,} used, {o['rows']:,} rows written "
        f"to {out_dir}\n  {o['tokens']:,} tokens, {o['masked_tokens']:,} masked ({share:.1%}), "
        f"mean {o['tokens'] / o['rows']:.0f} tokens/row"
    )
    if "loop_tokens_unscored" in o:
        print(f"  loop tails unscored: {o['loop_tokens_unscored']:,} tokens in {o['loop_rows']:,} rows "
              "(--loop-tails unscored)")  # fmt: skip
    lines = report.summary_lines()
    if lines:
        print("  cut, dropped or noted (rows are numbered from 0 in the source):")
        print("\n".join(lines))
