"""Data sources: named sets, local conversation and prompt files, and the prompt view of them.

Sources. ``eyas prepare`` and ``eyas regenerate`` read conversations from a
local JSON, JSONL or parquet file (``.gz`` too), a folder of them, or a named
set (:data:`eyas.data.named_sets.NAMED_SETS`). Two layouts are understood: ShareGPT
(``conversations: [{from: human|gpt|system, value}]``) and OpenAI
(``messages: [{role, content}]``). :func:`iter_conversations` normalises both
into ``[{role: system|user|assistant, content: str}]`` and counts every row it
cuts or drops, by reason and row number, in a :class:`SourceReport`; with
``strict`` the first problem is an error instead. JSON arrays are decoded as a
stream, so a truncated file (the ShareGPT release is cut mid-record) yields
every complete record and reports the broken tail. :func:`load_prompts` gives
the prompt-only view (user turns) that evaluation and regeneration use.

The prepared rows ``eyas prepare`` writes are :mod:`eyas.data.prepared`'s.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.core.manifest import MANIFEST
from eyas.data.named_sets import NAMED_SETS, NamedSet, named_set_path

#: An `eyas regenerate` output's conversations, one JSON object a line (OpenAI layout), read by `eyas prepare`.
CONVERSATIONS = "conversations.jsonl"
#: the prompts `eyas prompts` writes (one ``{"id", "turns"}`` a line), read by `eyas regenerate`
PROMPTS = "prompts.jsonl"


# --------------------------------------------------------------------------- the source and its report

SOURCE_SUFFIXES = (".json", ".jsonl", ".parquet", ".json.gz", ".jsonl.gz")
MAX_ROWS_LISTED = 50  # row numbers kept per reason in a report

#: Roles eyas understands, from both layouts (case-insensitive). ShareGPT dumps call the model
#: gpt, chatgpt, bing or bard.
ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
}  # fmt: skip

#: Where a turn's reasoning may sit (transformers aliases the same three to ``reasoning_content``).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

#: Problems that are bad input: each is counted with its row numbers, and ``strict`` makes it fatal.
PROBLEMS = {
    "malformed": "not a conversation (bad JSON, or no list under 'conversations'/'messages'): row dropped",
    "unknown_role": "a turn with an unknown role: conversation cut before it",
    "empty_turn": "a turn with empty text: conversation cut before it",
    "no_user_turn": "no user turn for the verifier to answer: row dropped",
    "non_string_content": "a turn whose content is not text: conversation cut before it",
    "role_order": "two turns in a row from the same side, or a system turn after the first: cut before it",
    "broken_tail": "the file ends inside a record: the records before it were kept",
    "control_token_in_text": "a turn's text holds a control token of the tokenizer (e.g. <|im_end|>): row dropped",
    "template_error": "the chat template refused the conversation: row dropped",
}
#: What is counted but never fatal: normalisations and filters.
NOTES = {
    "leading_assistant": "assistant turns before the first user turn were skipped (a split conversation)",
    "no_assistant": "no assistant turn (after cuts): row dropped",
    "too_long": "longer than --max-seq-len (even its first assistant turn, when truncating): row dropped",
    "truncated": "longer than --max-seq-len: cut after the last assistant turn that fits",
}
#: Reasons that remove a whole row (the rest cut a conversation short or only note something).
DROPS = ("malformed", "control_token_in_text", "template_error", "no_assistant", "too_long")


@dataclass
class SourceReport:
    """What was read from a source and every row that was cut or dropped, by reason."""

    source: str
    files: list[dict[str, Any]] = field(default_factory=list)  # {path, first_row, rows}
    rows_in: int = 0
    counts: Counter = field(default_factory=Counter)
    rows: dict[str, list[int]] = field(default_factory=dict)
    details: dict[str, list[str]] = field(default_factory=dict)  # the first few of each reason, spelled out
    strict: bool = False

    def where(self, row: int) -> str:
        """'FILE: row N (record K of that file)' for a row number of the whole source."""
        f = next((f for f in reversed(self.files) if f["first_row"] <= row), None)
        if f is None:
            return f"{self.source}: row {row}"
        return f"{f['path']}: row {row} (record {row - f['first_row']} of that file)"

    def add(self, reason: str, row: int, detail: str = "") -> None:
        """Count one problem (or note) on ``row``; in strict mode a problem raises at once."""
        if self.strict and reason in PROBLEMS:
            raise EyasError(
                f"{self.where(row)}: {reason}: {detail or PROBLEMS[reason]}. Fix the source, or run without "
                "--strict to skip such rows (they are counted and reported)"
            )
        self.counts[reason] += 1
        listed = self.rows.setdefault(reason, [])
        if len(listed) < MAX_ROWS_LISTED:
            listed.append(row)
        said = self.details.setdefault(reason, [])
        if detail and len(said) < 5:
            said.append(f"row {row}: {detail}")

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "files": self.files,
            "rows_in": self.rows_in,
            "problems": {
                k: {"count": self.counts[k], "rows": self.rows.get(k, []), "what": PROBLEMS.get(k) or NOTES.get(k, k)}
                for k in sorted(self.counts)
            },
            "details": self.details,
        }

    def summary_lines(self) -> list[str]:
        """One line per reason: count, what happened, the first row numbers."""
        out = []
        for k in sorted(self.counts):
            rows = self.rows.get(k, [])[:8]
            more = ", ..." if self.counts[k] > len(rows) else ""
            what = PROBLEMS.get(k) or NOTES.get(k, k)
            out.append(f"  {k}: {self.counts[k]} ({what}); rows {', '.join(map(str, rows))}{more}")
        return out


def resolve_source(data: str | os.PathLike | list) -> tuple[str, list[Path], NamedSet | None]:
    """``data`` -> (description, files in reading order, the named set or None). A list, or names and paths
    separated by commas, is a mix: every source's files in turn (``sharegpt,runs/x/prompts``)."""
    parts = list(data) if isinstance(data, (list, tuple)) else None
    if parts is None and "," in str(data) and not Path(str(data)).exists():
        parts = [x.strip() for x in str(data).split(",") if x.strip()]
    if parts is not None:
        if len(parts) == 1:
            return resolve_source(parts[0])
        if not parts:
            raise EyasError("data: an empty list of sources")
        resolved = [resolve_source(x) for x in parts]
        return " + ".join(d for d, _, _ in resolved), [f for _, fs, _ in resolved for f in fs], None
    s = str(data)
    if s in NAMED_SETS and not Path(s).exists():
        ns = NAMED_SETS[s]
        return f"{s} ({ns.package})", [named_set_path(s)], ns
    p = Path(s).expanduser()
    if p.is_file():
        if not p.name.endswith(SOURCE_SUFFIXES):
            raise EyasError(f"{p}: not a .json, .jsonl or .parquet file (or .json.gz / .jsonl.gz)")
        return str(p), [p], None
    if p.is_dir():
        if (p / CONVERSATIONS).is_file() and _stage(p) == "regenerate":  # an `eyas regenerate` output: its data
            return f"{p} (eyas regenerate)", [p / CONVERSATIONS], None
        if (p / PROMPTS).is_file() and _stage(p) == "prompts":  # an `eyas prompts` output: the prompts
            return f"{p} (eyas prompts)", [p / PROMPTS], None
        if (p / ".parts").is_dir() and not (p / MANIFEST).is_file():  # work in parts, no manifest yet
            raise EyasError(f"{p} is an unfinished `eyas regenerate` output (or another stage's); run the same "
                            "command again to finish it")  # fmt: skip
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SOURCE_SUFFIXES))
        if not files:
            raise EyasError(f"{p} holds no .json, .jsonl or .parquet files")
        return str(p), files, None
    raise EyasError(f"data not found: {s} (a file, a folder, or one of the named sets: {', '.join(NAMED_SETS)})")


def _stage(folder: Path) -> str | None:
    """The stage whose manifest ``folder`` holds, if any."""
    with contextlib.suppress(EyasError, OSError, AttributeError):  # missing or unreadable: no stage
        return read_json(folder / MANIFEST, what="manifest").get("stage")
    return None


def source_sha256(files: list[Path]) -> str:
    """The content hash of a source's files, in order (recorded in manifests)."""
    from eyas.core.files import sha256_file

    if len(files) == 1:
        return sha256_file(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def _open_bytes(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _open_text(path: Path) -> io.TextIOBase:
    return io.TextIOWrapper(_open_bytes(path), encoding="utf-8-sig")  # a byte-order mark some editors write


def _json_stream(path: Path, report: SourceReport, row0: int, chunk: int = 1 << 24) -> Iterator[tuple[int, Any]]:
    """Records of a JSON array (or of concatenated JSON values), decoded one at a time from a buffered read.

    A file that ends inside a record yields every record before it and reports the tail, which is how
    the 125 MB ShareGPT release (cut mid-record) gives up its 17,671 complete conversations.
    """
    dec = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    row = row0
    with _open_text(path) as f:
        buf, eof = f.read(chunk), False
        base = 0  # characters dropped from the front of buf
        i = sep.match(buf).end()
        in_array = buf[i : i + 1] == "["
        i += in_array
        while True:
            i = sep.match(buf, i).end()
            if i >= len(buf) and not eof:
                buf, base, i = buf[i:] + f.read(chunk), base + i, 0
                eof = len(buf) < chunk
                continue
            if i >= len(buf) or (in_array and buf[i] == "]"):
                return
            try:
                obj, j = dec.raw_decode(buf, i)
            except json.JSONDecodeError as e:
                if not eof:
                    more = f.read(chunk)
                    eof = not more
                    buf, base, i = buf[i:] + more, base + i, 0
                    continue
                tail = len(buf) - i
                report.add("broken_tail", row, f"{path} ends inside a record: the last {tail} characters, from "
                           f"character {base + i}, are not a complete JSON value ({e.msg})")  # fmt: skip
                return
            yield row, obj
            row += 1
            i = j


_SKIPPED = object()  # a record already reported as malformed: it keeps its row number


def _jsonl(path: Path, report: SourceReport, row0: int) -> Iterator[tuple[int, Any]]:
    row = row0
    with _open_bytes(path) as f:  # lines decoded one by one: a line that is not UTF-8 is one malformed row
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8-sig" if line_no == 1 else "utf-8"))  # (a byte-order mark)
            except UnicodeDecodeError as e:
                report.add("malformed", row, f"{path}:{line_no} is not valid UTF-8 ({e.reason} at byte {e.start})")
                obj = _SKIPPED
            except json.JSONDecodeError as e:
                report.add("malformed", row, f"{path}:{line_no} is not valid JSON ({e.msg})")
                obj = _SKIPPED
            yield row, obj
            row += 1


def _parquet(path: Path, row0: int) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    row = row0
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise EyasError(f"{path} is not a readable parquet file ({type(e).__name__}: {e})") from e
    for batch in pf.iter_batches(batch_size=4096):
        for obj in batch.to_pylist():
            yield row, obj
            row += 1


def iter_records(files: list[Path], report: SourceReport) -> Iterator[tuple[int, Any]]:
    """Every record of every file, numbered across the whole source from 0."""
    row = 0
    for path in files:
        entry = {"path": str(path), "first_row": row, "rows": 0}
        report.files.append(entry)
        name = path.name.removesuffix(".gz")
        if name.endswith(".parquet"):
            it = _parquet(path, row)
        elif name.endswith(".jsonl"):
            it = _jsonl(path, report, row)
        else:
            it = _json_stream(path, report, row)
        try:
            for r, obj in it:
                entry["rows"] = r + 1 - entry["first_row"]
                report.rows_in = r + 1
                if obj is not _SKIPPED:
                    yield r, obj
        except UnicodeDecodeError as e:  # (a JSON file: decoded as one stream)
            raise EyasError(f"{path} is not valid UTF-8 text ({e.reason}) after its record {entry['rows']}: save it "
                            "as UTF-8") from e  # fmt: skip
        except (EOFError, OSError, zlib.error) as e:  # a .gz cut short or damaged, a read error
            raise EyasError(f"{path} cannot be read past its record {entry['rows']} ({e}): it is cut short or "
                            "damaged; download or write it again") from e  # fmt: skip
        row = entry["first_row"] + entry["rows"]


# --------------------------------------------------------------------------- normalisation


def _text(content: Any) -> str | None:
    """A turn's text: a string, or OpenAI content parts that are all text (joined). None otherwise."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    ):
        return "".join(p["text"] for p in content)
    return None


def normalize(obj: Any, row: int, report: SourceReport) -> list[dict[str, str]] | None:
    """One record (ShareGPT or OpenAI layout) -> ``[{role, content}]`` that alternates user/assistant after
    an optional system turn; None when the record is not a conversation.

    At the first bad turn the conversation is cut (what came before is kept) and the reason counted:
    nothing is dropped silently.
    """
    if not isinstance(obj, dict):
        report.add("malformed", row, f"a {type(obj).__name__}, not a JSON object")
        return None
    key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
    turns = obj.get(key) if key else None
    if not isinstance(turns, list):
        report.add("malformed", row, "no list under 'conversations' (ShareGPT) or 'messages' (OpenAI)")
        return None
    out: list[dict[str, str]] = []
    if isinstance(obj.get("system"), str) and obj["system"].strip():
        out.append({"role": "system", "content": obj["system"]})
    skipped_leading = False
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            report.add("malformed", row, f"turn {k} is a {type(turn).__name__}, not an object")
            break
        raw = turn.get("from", turn.get("role"))
        role = ROLES.get(raw.lower()) if isinstance(raw, str) else None
        if role is None:
            report.add("unknown_role", row, f"turn {k} has role {raw!r}")
            break
        text = _text(turn.get("value", turn.get("content")))
        if text is None:
            kind = type(turn.get("value", turn.get("content"))).__name__
            report.add("non_string_content", row, f"turn {k} ({role}) has {kind} content")
            break
        if not text.strip():
            report.add("empty_turn", row, f"turn {k} ({role}) is empty")
            break
        prev = out[-1]["role"] if out else None
        if role == "assistant" and prev in (None, "system"):
            skipped_leading = True  # a conversation split mid-way starts with the model's answer
            continue
        if role == prev or (role == "system" and out):
            report.add("role_order", row, f"turn {k} ({role}) follows a {prev} turn")
            break
        msg = {"role": role, "content": text}
        reasoning = next((turn[f] for f in REASONING_KEYS if isinstance(turn.get(f), str)), None)
        if role == "assistant" and reasoning:
            msg["reasoning_content"] = reasoning  # templates that know it (Qwen3) render it
        out.append(msg)
    if skipped_leading:
        report.add("leading_assistant", row)
    return out


def open_source(data: str | os.PathLike, *, strict: bool = False) -> tuple[list[Path], SourceReport, NamedSet | None]:
    """Resolve ``data`` and start its report (nothing is read yet)."""
    desc, files, named = resolve_source(data)
    return files, SourceReport(source=desc, strict=strict), named


def iter_conversations(
    files: list[Path], report: SourceReport, *, max_samples: int | None = None, seed: int = 0
) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """``(row_id, messages)`` for every record that is a conversation, in source order.

    With ``max_samples``, a seeded uniform sample of that many records (reservoir sampling, so the
    source is read once, as a stream), yielded in source order; only the sample is normalised.
    """
    records: Iterator[tuple[int, Any]] = iter_records(files, report)
    if max_samples is not None:  # sample records first, so every count in the report is about the sample
        rng = random.Random(seed)
        keep: list[tuple[int, Any]] = []
        for n, item in enumerate(records):
            if len(keep) < max_samples:
                keep.append(item)
            elif (j := rng.randint(0, n)) < max_samples:
                keep[j] = item
        records = iter(sorted(keep, key=lambda x: x[0]))
    for row, obj in records:
        conv = normalize(obj, row, report)
        if conv is not None:
            yield row, conv


# --------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    """A prompt for generation: the user turns in order (each later one follows the model's own answer to
    the one before, as MT-Bench's second turn does), an optional system prompt, and where it came from."""

    id: str
    turns: list[str]
    system: str | None = None
    category: str | None = None

    def messages(self, answers: list[str] = ()) -> list[dict[str, str]]:
        """The conversation up to the next user turn: system, then turn/answer pairs, ending on a user turn."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for i, turn in enumerate(self.turns[: len(answers) + 1]):
            out.append({"role": "user", "content": turn})
            if i < len(answers):
                out.append({"role": "assistant", "content": answers[i]})
        return out


def load_prompts(
    source: str | os.PathLike, *, max_samples: int | None = None, seed: int = 0, strict: bool = False
) -> tuple[list[Prompt], SourceReport]:
    """Prompts from a named set (``mt-bench``: both turns; ``humaneval``: the function stub; ``sharegpt``:
    the user turns) or a local file: records with ``turns`` (a list of strings), ``prompt`` (a string), or a
    conversation in either layout (its user turns)."""
    files, report, named = open_source(source, strict=strict)
    prompts: list[Prompt] = []
    for row, obj in iter_records(files, report):
        p = _prompt(obj, row, report)
        if p is not None:
            prompts.append(p)
    if max_samples is not None and max_samples < len(prompts):
        keep = sorted(random.Random(seed).sample(range(len(prompts)), max_samples))
        prompts = [prompts[i] for i in keep]
    if not prompts:
        dropped = "; ".join(f"{report.counts[k]} {k} ({(report.details.get(k) or [PROBLEMS.get(k, k)])[0]})"
                            for k in sorted(report.counts))  # fmt: skip
        raise EyasError(f"{report.source} holds no prompts: " + (
            f"every row was dropped: {dropped}" if dropped else
            "records need 'turns', 'prompt', or 'conversations'/'messages' with a user turn"))  # fmt: skip
    return prompts, report


def _prompt(obj: Any, row: int, report: SourceReport) -> Prompt | None:
    if isinstance(obj, dict):
        pid = str(obj.get("question_id", obj.get("task_id", obj.get("id", row))))
        cat = obj.get("category") if isinstance(obj.get("category"), str) else None
        turns = obj.get("turns")
        if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
            return Prompt(pid, list(turns), category=cat)
        if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            return Prompt(pid, [obj["prompt"]], category=cat)
        if "conversations" in obj or "messages" in obj:
            msgs = normalize(obj, row, report)
            if msgs is None:
                return None
            users = [m["content"] for m in msgs if m["role"] == "user"]
            system = next((m["content"] for m in msgs if m["role"] == "system"), None)
            if users:
                return Prompt(pid, users, system=system, category=cat)
            report.add("no_user_turn", row, "only " +
                       (", ".join(sorted({m["role"] for m in msgs})) or "no") + " turns")  # fmt: skip
            return None
    report.add("malformed", row, "no 'turns', 'prompt', 'conversations' or 'messages'")
    return None
