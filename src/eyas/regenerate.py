"""``eyas regenerate``: the verifier answers a dataset's prompts itself, so the draft trains on the distribution
it will be asked to predict.

A draft learns to guess the verifier's next tokens; trained on answers another model wrote (ShareGPT's are
ChatGPT's), it learns that model's phrasing, and part of what it learns is never accepted. EAGLE's authors
regenerate the answers with the target model (EAGLE-3, arXiv:2503.01840, and the EAGLE repo's
``ge_data``); SpecForge does it through an SGLang server. eyas runs the verifier with plain transformers
(batched ``generate``, any layout :func:`eyas.verifier.build_text_model` loads), so no serving engine is needed.

Each prompt's user turns are answered in order, each one after the verifier's own answers to the turns before
(a multi-turn conversation stays coherent); an answer cut at ``max_new_tokens`` ends its conversation there
(a later turn would follow an answer the verifier never finished). The output is a folder ``eyas prepare
--data`` reads as is: ``conversations.jsonl`` (OpenAI layout: ``{"id", "messages": [{role, content}]}``)
and ``manifest.json`` (stage ``regenerate``). Work is written in parts as it finishes, so an interrupted run
resumes from the last finished part; the conversations file appears, whole, only at the end.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.manifest import OutputLock, atomic_path, manifest_matches, read_manifest, sha256_json, write_json, write_manifest

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
    dtype: str = "auto",
    strict: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Answer a dataset's prompts with the verifier itself, turn by turn, and write the conversations for
    `eyas prepare`.

    Reads ShareGPT or OpenAI conversations (their user turns; the original answers are replaced), prompt sets
    such as mt-bench, or files of ``turns`` / ``prompt`` records. Writes OUT/conversations.jsonl and
    OUT/manifest.json; `eyas prepare --data OUT` then tokenizes the verifier's own answers. Skips itself when
    OUT already matches, and resumes an interrupted run.

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
        batch_size: prompts decoded together (left-padded).
        device: cpu or cuda (default: cuda when there is one).
        dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32.
        strict: stop at the first bad record instead of counting and skipping it.
        trust_remote_code: allow the verifier's own tokenizer code to run.
    """
    from eyas.data import ChatTemplate
    from eyas.datasets import load_prompts, open_source, source_sha256
    from eyas.evaluate import device_and_dtype, end_of_turn_ids
    from eyas.verifier import build_text_model, fingerprint, load_tokenizer, resolve

    if max_new_tokens < 1:
        raise EyasError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise EyasError(f"--batch-size must be at least 1, got {batch_size}")
    if max_turns is not None and max_turns < 1:
        raise EyasError(f"--max-turns must be at least 1, got {max_turns}")
    if temperature < 0:
        raise EyasError(f"--temperature must be 0 (greedy) or positive, got {temperature}")
    dev, dt = device_and_dtype(device, dtype)

    info = resolve(verifier)
    files, _, _ = open_source(data)
    tok = load_tokenizer(info, trust_remote_code=trust_remote_code)
    template = ChatTemplate(tok, where=str(info.path))  # refuses a template eyas could not mask afterwards
    inputs = {"verifier": fingerprint(info), "chat_template_sha256": template.sha256,
              "data": {"source": str(data), "sha256": source_sha256(files)}}  # fmt: skip
    settings = {"max_new_tokens": max_new_tokens, "max_samples": max_samples, "max_turns": max_turns,
                "temperature": temperature, "seed": seed, "batch_size": batch_size, "dtype": str(dt).removeprefix("torch."),
                "strict": strict}  # fmt: skip
    out_dir = Path(out)
    if (out_dir / CONVERSATIONS).is_file() and manifest_matches(out_dir, stage="regenerate", inputs=inputs,
                                                                 settings=settings):  # fmt: skip
        manifest = read_manifest(out_dir, stage="regenerate")
        print(f"regenerate: {out_dir} is up to date ({manifest['outputs']['conversations']} conversations); skipping")
        return manifest

    prompts, report = load_prompts(data, max_samples=max_samples, seed=seed, strict=strict)
    eos_ids = end_of_turn_ids(tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)
    with OutputLock(out_dir):
        model = build_text_model(info, dtype=dt, device=dev)
        limit = getattr(model.config, "max_position_embeddings", None)
        parts_root = out_dir / ".parts"
        key = sha256_json({"inputs": inputs, "settings": settings})[:16]
        if parts_root.is_dir():  # parts of other inputs or settings are stale
            for d in parts_root.iterdir():
                if d.name != key:
                    shutil.rmtree(d, ignore_errors=True)
        parts = parts_root / key
        parts.mkdir(parents=True, exist_ok=True)
        n_parts = -(-len(prompts) // PART)
        totals: dict[str, int] = {}
        started = time.perf_counter()
        resumed = 0
        from tqdm.auto import tqdm

        with tqdm(total=len(prompts), desc="regenerate", unit="prompt", file=sys.stderr, dynamic_ncols=True) as bar:
            for p in range(n_parts):
                chunk = prompts[p * PART : (p + 1) * PART]
                path = parts / f"part-{p:05d}.records"  # not a source suffix: a half-made folder is never data
                if path.is_file():  # finished by an earlier, interrupted run
                    part = json.loads(path.read_text())
                    resumed += 1
                    bar.update(len(chunk))
                else:
                    # seeded per part: a resumed run samples the same answers as an uninterrupted one
                    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + p)
                    part = _answer(chunk, model, tok, eos_ids=eos_ids, pad_id=pad_id, max_new_tokens=max_new_tokens,
                                   max_turns=max_turns, temperature=temperature, batch_size=batch_size, limit=limit,
                                   generator=gen, device=dev, bar=bar)  # fmt: skip
                    write_json(path, part)
                for k, v in part["counts"].items():
                    totals[k] = totals.get(k, 0) + v
        seconds = time.perf_counter() - started
        if totals.get("conversations", 0) == 0:
            raise EyasError(f"the verifier answered none of the {len(prompts)} prompts of {report.source}: every "
                            f"first answer was empty ({totals.get('empty_answers', 0)}) or its prompt too long "
                            f"({totals.get('prompt_too_long', 0)})")  # fmt: skip
        # the parts stay until the manifest is written: until then the folder is refused as data (unfinished)
        with atomic_path(out_dir / CONVERSATIONS) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for p in range(n_parts):
                for rec in json.loads((parts / f"part-{p:05d}.records").read_text())["records"]:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        outputs = {"prompts": len(prompts), "rows_in": report.rows_in, **{k: totals.get(k, 0) for k in _COUNTS}}
        manifest = write_manifest(
            out_dir, stage="regenerate", inputs=inputs, settings=settings, outputs=outputs,
            report=report.to_json(), verifier_path=str(info.path),
            timing={"seconds": round(seconds, 2), "resumed_parts": resumed,
                    "new_tokens_per_s": round(totals.get("new_tokens", 0) / max(seconds, 1e-9), 1)},
        )  # fmt: skip
        shutil.rmtree(parts_root, ignore_errors=True)
    _print_summary(out_dir, outputs)
    return manifest


#: What the manifest counts (``outputs``).
_COUNTS = ("conversations", "answers", "new_tokens", "cut_at_max_new_tokens", "empty_answers", "prompt_too_long")


@torch.no_grad()
def _answer(prompts, model, tok, *, eos_ids: set[int], pad_id: int, max_new_tokens: int, max_turns: int | None,
            temperature: float, batch_size: int, limit: int | None, generator: torch.Generator,
            device: torch.device, bar) -> dict[str, Any]:  # fmt: skip
    """One part: every prompt answered turn by turn -> ``{"records": [...], "counts": {...}}``; ``bar`` moves
    as each prompt gets its last answer."""
    from eyas.evaluate import encode_prompt

    last = [min(len(p.turns), max_turns or len(p.turns)) - 1 for p in prompts]  # the last turn answered
    answers: list[list[str]] = [[] for _ in prompts]
    open_ = [True] * len(prompts)  # still being answered
    counts = dict.fromkeys(_COUNTS, 0)

    def close(i: int) -> None:
        open_[i] = False
        bar.update(1)

    for t in range(max(last) + 1):
        todo = [i for i in range(len(prompts)) if open_[i]]
        encoded = {i: encode_prompt(tok, prompts[i].messages(answers[i])) for i in todo}
        for i in [i for i in todo if limit is not None and len(encoded[i]) + max_new_tokens > limit]:
            counts["prompt_too_long"] += 1
            todo.remove(i)
            close(i)
        todo.sort(key=lambda i: len(encoded[i]))  # similar lengths together: less left padding
        for a in range(0, len(todo), batch_size):
            batch = todo[a : a + batch_size]
            made = _generate(model, [encoded[i] for i in batch], eos_ids=eos_ids, pad_id=pad_id,
                             max_new_tokens=max_new_tokens, temperature=temperature, generator=generator,
                             device=device)  # fmt: skip
            for i, ids in zip(batch, made):
                counts["new_tokens"] += len(ids)
                finished = bool(ids) and ids[-1] in eos_ids
                # special tokens inside an answer are dropped: the template writes the turn's own controls
                text = tok.decode(ids[:-1] if finished else ids, skip_special_tokens=True).strip()
                if not text:  # an empty turn would be cut by `eyas prepare` anyway; end the conversation here
                    counts["empty_answers"] += 1
                    close(i)
                    continue
                answers[i].append(text)
                counts["answers"] += 1
                if not finished:
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


def _print_summary(out_dir: Path, o: dict[str, Any]) -> None:
    print(
        f"regenerate: {o['prompts']:,} prompts, {o['conversations']:,} conversations with {o['answers']:,} answers "
        f"by the verifier -> {out_dir / CONVERSATIONS}\n  {o['new_tokens']:,} new tokens; "
        f"{o['cut_at_max_new_tokens']:,} answers cut at --max-new-tokens, {o['empty_answers']:,} empty, "
        f"{o['prompt_too_long']:,} prompts past the verifier's context\n"
        f"  next: eyas prepare --verifier ... --data {out_dir} --out ..."
    )
