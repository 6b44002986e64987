"""``eyas regenerate``: the verifier answers a dataset's prompts itself, so the draft trains on the distribution
it will be asked to predict.

A draft learns to guess the verifier's next tokens; trained on answers another model wrote (ShareGPT's are
ChatGPT's), it learns that model's phrasing, and part of what it learns is never accepted. EAGLE's authors
regenerate the answers with the target model (EAGLE-3, arXiv:2503.01840, and the EAGLE repo's
``ge_data``); SpecForge does it through an SGLang server. eyas runs the verifier with plain transformers
(batched decoding with its own KV cache, any layout :func:`eyas.verifier.build_text_model` loads), so no
serving engine is needed; for a verifier too large for that, ``--server`` asks an OpenAI-compatible endpoint
(vLLM, SGLang) instead. Under ``torchrun`` the parts of the work are dealt out to the ranks.

Each prompt's user turns are answered in order, each one after the verifier's own answers to the turns before
(a multi-turn conversation stays coherent); an answer cut at ``max_new_tokens`` ends its conversation there
(a later turn would follow an answer the verifier never finished). The output is a folder ``eyas prepare
--data`` reads as is: ``conversations.jsonl`` (OpenAI layout: ``{"id", "messages": [{role, content}]}``)
and ``manifest.json`` (stage ``regenerate``). Work is written in parts as it finishes, so an interrupted run
resumes from the last finished part; the conversations file appears, whole, only at the end.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas import dist
from eyas.errors import EyasError
from eyas.manifest import (MANIFEST, OutputLock, atomic_path, manifest_matches, read_manifest, sha256_json,
                           write_json, write_manifest)

#: The output's conversations, one JSON object a line (what ``eyas prepare`` reads from a regenerate folder).
CONVERSATIONS = "conversations.jsonl"

#: Prompts a part of finished work holds (an interrupted run loses at most one part).
PART = 64


def regenerate(
    *,
    verifier: str,
    data: str,
    out: str,
    max_new_tokens: int = 1024,
    max_samples: int | None = None,
    max_turns: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 16,
    device: str | None = None,
    device_map: str | None = None,
    dtype: str = "auto",
    server: str | None = None,
    server_model: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    strict: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Answer a dataset's prompts with the verifier itself, turn by turn, and write the conversations for
    `eyas prepare`.

    Reads ShareGPT or OpenAI conversations (their user turns; the original answers are replaced), prompt sets
    such as mt-bench, or files of ``turns`` / ``prompt`` records. Writes OUT/conversations.jsonl and
    OUT/manifest.json; `eyas prepare --data OUT` then tokenizes the verifier's own answers. Skips itself when
    OUT already matches, and resumes an interrupted run. The verifier runs here (one GPU, `--device-map auto`
    over several, or `torchrun --nproc-per-node N -m eyas.cli regenerate ...`, which deals the prompts out to
    the ranks), or behind an OpenAI-compatible server (`--server`).

    Args:
        verifier: the verifier checkpoint (dir, .gguf, or 'smollm2'); it writes the answers through its own
            chat template.
        data: a .json/.jsonl/.parquet file or a folder of them (conversations or prompts), or a named set:
            sharegpt, mt-bench, humaneval.
        out: the output directory.
        max_new_tokens: the most tokens one answer may have; an answer cut there ends its conversation.
        max_samples: answer a seeded random sample of this many prompts.
        max_turns: answer at most this many user turns of each prompt (default: all).
        temperature: 0 decodes greedily; above 0 samples (seeded, so a rerun writes the same answers).
        seed: the seed of the sample and of the sampling.
        batch_size: prompts decoded together (left-padded), or requests in flight with --server.
        device: cpu or cuda (default: cuda when there is one).
        device_map: 'auto' spreads a verifier too large for one GPU over all of them (transformers' device map).
        dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32.
        server: instead of loading the verifier, ask an OpenAI-compatible server that serves it (vLLM, SGLang):
            its base URL, http://host:port/v1. The verifier's tokenizer and chat template are still read here
            (prepare needs them); the server must serve that same model.
        server_model: the model name to ask the server for (default: the first one it lists).
        api_key_env: the environment variable holding the server's API key, if it needs one (the key is sent
            only in the request header, never written).
        strict: stop at the first bad record instead of counting and skipping it.
        trust_remote_code: allow the verifier's own tokenizer code to run.
    """
    from eyas.data import ChatTemplate
    from eyas.datasets import load_prompts, open_source, source_sha256
    from eyas.evaluate import device_and_dtype
    from eyas.manifest import check_out
    from eyas.verifier import fingerprint, load_tokenizer, resolve

    check_out(out, stage="regenerate")  # another stage's folder: its manifest would be removed below
    if max_new_tokens < 1:
        raise EyasError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise EyasError(f"--batch-size must be at least 1, got {batch_size}")
    if max_turns is not None and max_turns < 1:
        raise EyasError(f"--max-turns must be at least 1, got {max_turns}")
    if temperature < 0:
        raise EyasError(f"--temperature must be 0 (greedy) or positive, got {temperature}")
    dev, dt = device_and_dtype(device, dtype)
    if device_map is not None and server:
        raise EyasError("--device-map loads the verifier here; with --server nothing is loaded: give one of them")

    info = resolve(verifier)
    files, _, _ = open_source(data)
    tok = load_tokenizer(info, trust_remote_code=trust_remote_code)
    template = ChatTemplate(tok, where=str(info.path))  # refuses a template eyas could not mask afterwards
    inputs = {"verifier": fingerprint(info), "chat_template_sha256": template.sha256,
              "data": {"source": str(data), "sha256": source_sha256(files)}}  # fmt: skip
    settings = {"max_new_tokens": max_new_tokens, "max_samples": max_samples, "max_turns": max_turns,
                "temperature": temperature, "seed": seed, "strict": strict}  # fmt: skip
    if server:  # where the answers come from (a URL's user:password part is never recorded)
        settings["server"] = {"url": _without_credentials(server), "model": server_model}
    else:  # padding and precision move greedy answers by a token now and then
        settings.update(batch_size=batch_size, dtype=str(dt).removeprefix("torch."))
    out_dir = Path(out)
    with dist.init(device_type="cuda" if dev.type == "cuda" and not server else "cpu") as d:
        if device_map is not None and d.active:
            raise EyasError("--device-map spreads one verifier over all GPUs in one process; do not use it under "
                            "torchrun (or run one process)")  # fmt: skip
        with contextlib.ExitStack() as stack:
            parts = out_dir / ".parts" / sha256_json({"inputs": inputs, "settings": settings})[:16]

            def open_out() -> bool:  # on rank 0: whether there is work, with the lock taken when there is
                done = manifest_matches(out_dir, stage="regenerate", inputs=inputs, settings=settings)
                if done and (out_dir / CONVERSATIONS).is_file():
                    return False
                stack.enter_context(OutputLock(out_dir))
                if parts.parent.is_dir():  # parts of other inputs or settings are stale
                    for old in parts.parent.iterdir():
                        if old != parts:
                            shutil.rmtree(old, ignore_errors=True)
                parts.mkdir(parents=True, exist_ok=True)
                # an older output's manifest would vouch for the new conversations a crash could leave beside it
                (out_dir / MANIFEST).unlink(missing_ok=True)
                return True

            if not d.run_on_main(open_out):
                manifest = read_manifest(out_dir, stage="regenerate")
                if d.is_main:
                    print(f"regenerate: {out_dir} is up to date ({manifest['outputs']['conversations']} "
                          "conversations); skipping")  # fmt: skip
                return manifest
            d.barrier("start of regeneration")
            prompts, report = load_prompts(data, max_samples=max_samples, seed=seed, strict=strict)
            n_parts = -(-len(prompts) // PART)
            mine = list(range(d.rank, n_parts, d.world_size))  # parts dealt out in turn: similar work per rank
            started = time.perf_counter()
            resumed = _regenerate_parts(
                prompts, mine, parts, d, info=info, tok=tok, server=server, server_model=server_model,
                api_key_env=api_key_env, device=dev, device_map=device_map, dtype=dt, max_new_tokens=max_new_tokens,
                max_turns=max_turns, temperature=temperature, seed=seed, batch_size=batch_size)  # fmt: skip
            seconds = max(d.all_gather(time.perf_counter() - started))
            resumed = sum(d.all_gather(resumed))
            d.barrier("end of regeneration")

            def finish() -> dict[str, Any]:
                missing = [p for p in range(n_parts) if not _part_path(parts, p).is_file()]
                if missing:
                    raise EyasError(f"{out_dir}: part(s) {missing[:5]} were not written by any rank; run again")
                totals = dict.fromkeys(_COUNTS, 0)
                # one pass over the parts; the parts stay until the manifest is written (until then the folder
                # is refused as data), and an error below leaves no conversations file (atomic_path drops it)
                with atomic_path(out_dir / CONVERSATIONS) as tmp, open(tmp, "w", encoding="utf-8") as f:
                    for p in range(n_parts):
                        part = json.loads(_part_path(parts, p).read_text())
                        for k, v in part["counts"].items():
                            totals[k] += v
                        for rec in part["records"]:
                            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    if totals["conversations"] == 0:
                        raise EyasError(f"the verifier answered none of the {len(prompts)} prompts of "
                                        f"{report.source}: every first answer was empty ({totals['empty_answers']}) "
                                        f"or its prompt too long ({totals['prompt_too_long']})")  # fmt: skip
                outputs = {"prompts": len(prompts), "rows_in": report.rows_in, **totals}
                m = write_manifest(
                    out_dir, stage="regenerate", inputs=inputs, settings=settings, outputs=outputs,
                    report=report.to_json(), verifier_path=str(info.path),
                    timing={"seconds": round(seconds, 2), "ranks": d.world_size, "resumed_parts": resumed,
                            "new_tokens_per_s": round(totals["new_tokens"] / max(seconds, 1e-9), 1)},
                )  # fmt: skip
                shutil.rmtree(parts.parent, ignore_errors=True)
                _print_summary(out_dir, outputs)
                return m

            return d.run_on_main(finish)


def _part_path(parts: Path, p: int) -> Path:
    return parts / f"part-{p:05d}.records"  # not a source suffix: a half-made folder is never read as data


def _regenerate_parts(prompts, mine: list[int], parts: Path, d, *, info, tok, server, server_model, api_key_env,
                      device, device_map, dtype, max_new_tokens, max_turns, temperature, seed,
                      batch_size) -> int:  # fmt: skip
    """This rank's parts of the work, each written when finished; returns how many an earlier run had written."""
    from tqdm.auto import tqdm

    from eyas.evaluate import end_of_turn_ids
    from eyas.verifier import build_text_model

    todo = [p for p in mine if not _part_path(parts, p).is_file()]
    backend: LocalVerifier | Server | None = None
    if todo and server:
        backend = Server(server, server_model, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                         batch_size=batch_size, api_key_env=api_key_env)  # fmt: skip
    elif todo:
        eos_ids = end_of_turn_ids(tok)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)
        where = None if device_map else (d.device(device.type) if d.active else device)  # one GPU per rank
        model = build_text_model(info, dtype=dtype, device=where, device_map=device_map)
        backend = LocalVerifier(model, tok, eos_ids=eos_ids, pad_id=pad_id, max_new_tokens=max_new_tokens,
                                temperature=temperature, batch_size=batch_size)  # fmt: skip
    def chunk(p: int) -> list:
        return prompts[p * PART : (p + 1) * PART]

    desc = "regenerate" + (f" (rank 0 of {d.world_size})" if d.active else "")
    with tqdm(total=sum(len(chunk(p)) for p in mine), desc=desc, unit="prompt", file=sys.stderr,
              dynamic_ncols=True, disable=not d.is_main) as bar:  # fmt: skip
        bar.update(sum(len(chunk(p)) for p in mine if p not in todo))  # finished earlier
        for p in todo:
            # seeded per part: a resumed run (or another rank count) samples the answers of an uninterrupted one
            gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + p)
            write_json(_part_path(parts, p), _answer(chunk(p), backend, max_turns=max_turns, generator=gen, bar=bar))
    return len(mine) - len(todo)


#: What the manifest counts (``outputs``).
_COUNTS = ("conversations", "answers", "new_tokens", "cut_at_max_new_tokens", "empty_answers", "prompt_too_long")


@dataclass
class Answer:
    """One generated turn: its text (None when the conversation no longer fits the verifier's context), whether
    the verifier ended it itself (else it was cut at ``max_new_tokens``), and how many tokens it took."""

    text: str | None
    finished: bool
    tokens: int


class LocalVerifier:
    """Answers from the verifier loaded here: batched, left-padded decoding with its own KV cache."""

    def __init__(self, model, tok, *, eos_ids: set[int], pad_id: int, max_new_tokens: int, temperature: float,
                 batch_size: int) -> None:  # fmt: skip
        self.model, self.tok, self.eos_ids, self.pad_id = model, tok, eos_ids, pad_id
        self.max_new_tokens, self.temperature, self.batch_size = max_new_tokens, temperature, batch_size
        self.limit = getattr(model.config, "max_position_embeddings", None)
        self.device = model.device  # with a device map: where the embedding (the first layer) sits

    def answer(self, conversations: list[list[dict[str, str]]], generator: torch.Generator) -> list[Answer]:
        from eyas.evaluate import encode_prompt

        encoded = [encode_prompt(self.tok, c) for c in conversations]
        out: list[Answer | None] = [None] * len(encoded)
        fits = []
        for i, ids in enumerate(encoded):
            if self.limit is not None and len(ids) + self.max_new_tokens > self.limit:
                out[i] = Answer(None, False, 0)
            else:
                fits.append(i)
        fits.sort(key=lambda i: len(encoded[i]))  # similar lengths together: less left padding
        for a in range(0, len(fits), self.batch_size):
            batch = fits[a : a + self.batch_size]
            made = _generate(self.model, [encoded[i] for i in batch], eos_ids=self.eos_ids, pad_id=self.pad_id,
                             max_new_tokens=self.max_new_tokens, temperature=self.temperature, generator=generator,
                             device=self.device)  # fmt: skip
            for i, ids in zip(batch, made):
                finished = bool(ids) and ids[-1] in self.eos_ids
                # special tokens inside an answer are dropped: the template writes the turn's own controls
                text = self.tok.decode(ids[:-1] if finished else ids, skip_special_tokens=True).strip()
                out[i] = Answer(text, finished, len(ids))
        return out  # type: ignore[return-value]


class Server:
    """Answers from an OpenAI-compatible chat-completions endpoint serving the verifier (vLLM, SGLang, ...), for
    verifiers too large to load here. ``batch_size`` requests run at once. The API key is read from the
    environment variable ``api_key_env`` (or a ``user:password@`` in the URL is used) and sent only in the
    Authorization header: never written anywhere."""

    def __init__(self, url: str, model: str | None, *, max_new_tokens: int, temperature: float, seed: int,
                 batch_size: int, api_key_env: str, retries: int = 3, timeout: float = 600.0) -> None:  # fmt: skip
        import base64
        import os
        from urllib.parse import unquote, urlsplit

        self.url = _without_credentials(url).rstrip("/")  # what messages may show
        self.auth = None
        if key := os.environ.get(api_key_env):
            self.auth = f"Bearer {key}"
        elif (u := urlsplit(url)).username:  # http://user:password@host/v1: basic authentication
            pair = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
            self.auth = "Basic " + base64.b64encode(pair).decode()
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.batch_size, self.retries, self.timeout = batch_size, retries, timeout
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """``(status, parsed JSON or text)``; connection failures retried with a growing pause, then an error."""
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json", **({"Authorization": self.auth} if self.auth else {})}
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url + path, data=data, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")[:500]
                if e.code < 500 or attempt == self.retries:
                    return e.code, text
            except (urllib.error.URLError, OSError) as e:
                if attempt == self.retries:
                    raise EyasError(f"the server {self.url} did not answer {path} ({e}); is it running, and is "
                                    "--server its OpenAI base URL (http://host:port/v1)?") from None  # fmt: skip
            time.sleep(2**attempt)
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        status, got = self._request("/models")
        try:
            return got["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise EyasError(f"{self.url}/models answered {status} {str(got)[:200]!r}: name the served model with "
                            "--server-model") from None  # fmt: skip

    def _one(self, messages: list[dict[str, str]]) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, **({"seed": self.seed} if self.temperature > 0 else {})}  # fmt: skip
        status, got = self._request("/chat/completions", body)
        if status == 400 and any(w in str(got).lower() for w in ("context", "too long", "maximum")):
            return Answer(None, False, 0)
        if status != 200:
            raise EyasError(f"{self.url}/chat/completions answered {status}: {str(got)[:300]}")
        try:
            choice = got["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise EyasError(f"{self.url}/chat/completions answered no choices[0].message: {str(got)[:300]}") from None
        tokens = int((got.get("usage") or {}).get("completion_tokens") or 0)
        return Answer(text.strip(), choice.get("finish_reason") != "length", tokens)

    def answer(self, conversations: list[list[dict[str, str]]], generator: torch.Generator) -> list[Answer]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=self.batch_size) as pool:
            return list(pool.map(self._one, conversations))


def _answer(prompts, backend, *, max_turns: int | None, generator: torch.Generator, bar) -> dict[str, Any]:
    """One part: every prompt answered turn by turn -> ``{"records": [...], "counts": {...}}``; ``bar`` moves
    as each prompt gets its last answer."""
    last = [min(len(p.turns), max_turns or len(p.turns)) - 1 for p in prompts]  # the last turn answered
    answers: list[list[str]] = [[] for _ in prompts]
    open_ = [True] * len(prompts)  # still being answered
    counts = dict.fromkeys(_COUNTS, 0)

    def close(i: int) -> None:
        open_[i] = False
        bar.update(1)

    for t in range(max(last) + 1):
        todo = [i for i in range(len(prompts)) if open_[i]]
        for i, a in zip(todo, backend.answer([prompts[i].messages(answers[i]) for i in todo], generator)):
            counts["new_tokens"] += a.tokens
            if a.text is None:
                counts["prompt_too_long"] += 1
                close(i)
            elif not a.text:  # an empty turn would be cut by `eyas prepare` anyway; end the conversation here
                counts["empty_answers"] += 1
                close(i)
            else:
                answers[i].append(a.text)
                counts["answers"] += 1
                if not a.finished:
                    counts["cut_at_max_new_tokens"] += 1
                    close(i)
                elif t == last[i]:
                    close(i)
    # Prompt.messages ends on the next user turn while one is left: that turn went unanswered, so it goes
    records = [{"id": p.id, "messages": p.messages(ans)[: 2 * len(ans) + (1 if p.system else 0)]}
               for p, ans in zip(prompts, answers) if ans]  # fmt: skip
    counts["conversations"] = len(records)
    return {"records": records, "counts": counts}


def _generate(model, prompts: list[list[int]], *, eos_ids: set[int], pad_id: int, max_new_tokens: int,
              temperature: float, generator: torch.Generator, device: torch.device) -> list[list[int]]:  # fmt: skip
    """Decode a batch of token-id prompts (left-padded) with the model's own KV cache; each result ends at its
    first end-of-turn id (kept) or after ``max_new_tokens``."""
    from transformers import DynamicCache

    from eyas.evaluate import cache_keyword
    from eyas.verifier import varying_shape_attention

    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every prompt ends where the answers begin
        ids[b, L - len(p) :] = torch.tensor(p)
        attn[b, L - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, L]: each prompt counts from 0 at its first token
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    eos = torch.tensor(sorted(eos_ids), device=device)
    cache = {cache_keyword(model): DynamicCache(config=model.config)}
    step_ids, step_pos = ids, position_ids
    for _ in range(max_new_tokens):
        with varying_shape_attention(device):  # the key length grows every step: no cuDNN plan per shape
            res = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, use_cache=True,
                        logits_to_keep=1, **cache)  # fmt: skip
        logits = res.logits[:, -1].float()  # [B, V]
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).flatten().to(device)
        nxt_cpu = nxt.cpu()
        for b in range(B):
            if not done[b]:
                out[b].append(int(nxt_cpu[b]))
        done |= torch.isin(nxt, eos).cpu()
        if bool(done.all()):
            break
        step_ids = nxt[:, None]  # [B, 1]
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=device)], dim=1)
    return out


def _without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` removed (what a manifest may record)."""
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    host = u.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if u.port:
        netloc += f":{u.port}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def _print_summary(out_dir: Path, o: dict[str, Any]) -> None:
    print(
        f"regenerate: {o['prompts']:,} prompts, {o['conversations']:,} conversations with {o['answers']:,} answers "
        f"by the verifier -> {out_dir / CONVERSATIONS}\n  {o['new_tokens']:,} new tokens; "
        f"{o['cut_at_max_new_tokens']:,} answers cut at --max-new-tokens, {o['empty_answers']:,} empty, "
        f"{o['prompt_too_long']:,} prompts past the verifier's context\n"
        f"  next: eyas prepare --verifier ... --data {out_dir} --out ..."
    )
