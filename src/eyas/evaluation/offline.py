"""The acceptance length a draft's training-time-test accuracy predicts, from extracted features (``eyas eval
--offline``): per-step conditional accuracy against the verifier's full-vocab argmax, on the rows the train
stage held out when the features are the ones the draft trained on."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from eyas.core.errors import EyasError
from eyas.training.loss import implied_tau
from eyas.draft.model import Eagle3Draft


@torch.no_grad()
def ttt_chain_lengths(draft: Eagle3Draft, input_ids: torch.Tensor, aux_hidden: torch.Tensor, greedy: torch.Tensor, *,
                      ttt_steps: int) -> torch.Tensor:  # fmt: skip
    """How many draft tokens a round starting at each index would accept, by training-time test.

    ``input_ids [T]``, ``aux_hidden [T, 3H]`` (the verifier's aux states), ``greedy [T]`` (the verifier's
    full-vocab argmax at each index). TTT step ``k`` at index ``t`` reads ``x_{t+1+k}`` and predicts
    ``x_{t+2+k}``; it is right when its argmax, mapped to the target vocab, equals ``greedy[t+1+k]``.
    Returns ``[T - ttt_steps - 1]``: the number of leading right steps at each ``t``. When the tokens are the
    verifier's own greedy output, this is exactly the accepted count of a decoding round whose last emitted
    token sits at ``t + 1`` (the draft then feeds its own tokens, which equal the data while it is right).
    """
    T = input_ids.shape[0]
    outs = draft.ttt(input_ids[None], aux_hidden[None].to(draft.fc.weight.dtype), ttt_steps=ttt_steps)
    t = torch.arange(T - ttt_steps - 1, device=input_ids.device)
    chain = torch.ones_like(t, dtype=torch.bool)
    length = torch.zeros_like(t)
    for k, normed in enumerate(outs):
        pred = draft.draft_to_target(draft.compute_logits(normed[0, t]).argmax(-1))
        chain = chain & (pred == greedy[t + 1 + k])
        length += chain.long()
    return length


def walk_rounds(length: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """The rounds real decoding of each assistant turn of a row would make: ``(accepted, produced)`` per round.

    ``length [T']`` from :func:`ttt_chain_lengths` (the draft tokens a round accepts when its last emitted token
    sits at ``t + 1``), ``mask [T]`` the loss mask (an assistant turn: a run of masked tokens, its end-of-turn
    token last). As :func:`eyas.engine.speculative.speculative_generate` decodes: the prefill emits a turn's first
    token ``a``; a round from last emitted token ``m`` accepts ``L = length[m - 1]`` drafts and emits ``L + 1``
    tokens, fewer where the turn ends or ``max_new_tokens`` is reached; the next round starts at
    ``m + L + 1``. Pooled per-position accuracy (:func:`eyas.training.loss.implied_tau`) instead counts every index as a
    round start, so the easy stretches a real round jumps over (a repetition loop, a long quote) weigh as much as
    the hard tokens where rounds start; it also counts positions past ``max_new_tokens``, which eval never
    decodes."""
    m_ = mask.bool().tolist()
    accepted, produced = [], []
    t = 0
    while t < len(m_):
        if not m_[t]:
            t += 1
            continue
        a = t
        while t < len(m_) and m_[t]:
            t += 1
        e = t  # the turn is [a, e): its end-of-turn token at e - 1
        m = a
        while True:
            left = min(e - 1 - m, max_new_tokens - (m - a + 1))  # tokens this turn may still emit
            if left <= 0 or m - 1 >= len(length):
                break
            L = int(length[m - 1]) if m >= 1 else 0
            kept = min(L + 1, left)
            accepted.append(min(L, kept))
            produced.append(kept)
            m += kept
    return accepted, produced


@torch.no_grad()
def offline_accuracy(draft: Eagle3Draft, info, features: str | Path, *, ttt_steps: int, rows: list[int] | None = None,
                     max_rows: int = 256, device: str | torch.device = "cpu", chunk: int = 256,
                     max_new_tokens: int = 256) -> dict[str, Any]:  # fmt: skip
    """Per-step conditional accuracy of the draft over extracted features, and the tau it predicts.

    Per row, :func:`ttt_chain_lengths` against the verifier's full-vocab argmax
    (from the stored pre-norm last state through the verifier's own final norm
    and head). Step ``k`` at index ``t`` counts where the token it predicts,
    ``x_{t+2+k}``, is loss-masked. ``conditional_accuracy[k]`` = P(step ``k``
    right | steps ``< k`` right); ``predicted_tau = 1 + sum_k prod_{j<=k}
    conditional_accuracy[j]``. Beside it, ``walk`` (:func:`walk_rounds`): the rounds real decoding of the same
    turns would make, up to ``max_new_tokens`` a turn, and the tau, acceptance per position they give: the
    exact prediction of `eyas eval` on these conversations when they are the verifier's own greedy answers.
    """
    from eyas.engine.speculative import acceptance_stats

    from eyas.data.features import FeatureReader
    from eyas.training.loss import TargetHead
    from eyas.verifier.load import load_head_tensors

    reader = FeatureReader(features, dtype=torch.float32)
    if list(reader.layer_ids) != list(draft.config.aux_layer_ids):
        raise EyasError(f"{features} holds aux layers {reader.layer_ids}, the draft reads "
                        f"{draft.config.aux_layer_ids}; extract features with the draft's --layers")  # fmt: skip
    rows = pick_offline_rows(rows, num_rows=len(reader), max_rows=max_rows)
    full = load_head_tensors(info, dtype=torch.float32, device=device).lm_head  # [V, H]
    # the whole head as "draft" rows in target-id order: the targets' argmax is the full-vocab argmax
    head = TargetHead.for_verifier(info, rows=full, draft_target_ids=torch.arange(len(full), device=device),
                                   device=device)  # fmt: skip
    reached = torch.zeros(ttt_steps, dtype=torch.long)  # per step: counted positions whose earlier steps were right
    right = torch.zeros(ttt_steps, dtype=torch.long)
    walk_accepted: list[int] = []
    walk_produced: list[int] = []
    for i in rows:
        row = reader[i]
        T = row.input_ids.shape[0]
        if T < ttt_steps + 2:
            continue
        last = row.last_hidden_state.to(device)
        greedy = torch.cat([head(last[s : s + chunk], pad=0).argmax for s in range(0, T, chunk)])  # [T]
        # padded by K + 1 positions so that a chain is known at every index: a round near the row's end reads
        # no padding within the tokens it may still emit (its steps are causal), and the walk caps it there
        pad = ttt_steps + 1
        ids = torch.cat([row.input_ids, row.input_ids.new_zeros(pad)]).to(device)
        aux = torch.cat([row.aux_hidden_states, row.aux_hidden_states.new_zeros(pad, row.aux_hidden_states.shape[1])])
        whole = ttt_chain_lengths(draft, ids, aux.to(device), torch.cat([greedy, greedy.new_full((pad,), -1)]),
                                  ttt_steps=ttt_steps).cpu()  # fmt: skip  # [T]
        length = whole[: T - ttt_steps - 1]
        mask = row.loss_mask.bool()
        acc_, prod_ = walk_rounds(whole, mask, max_new_tokens=max_new_tokens)
        walk_accepted += acc_
        walk_produced += prod_
        t = torch.arange(length.shape[0])
        for k in range(ttt_steps):
            valid = mask[t + 2 + k]
            reached[k] += int((valid & (length >= k)).sum())
            right[k] += int((valid & (length > k)).sum())
    cond = [float(right[k]) / float(reached[k]) if reached[k] else 0.0 for k in range(ttt_steps)]
    walk = acceptance_stats(walk_accepted, ttt_steps, produced=walk_produced)
    return {"features": str(features), "rows": len(rows), "row_ids": rows, "positions": int(reached[0]),
            "conditional_accuracy": cond, "predicted_tau": implied_tau(cond),
            "walk": {"max_new_tokens": max_new_tokens, **{k: walk[k] for k in ("tau", "rounds",
                     "acceptance_per_position", "conditional_acceptance_per_position")}},
            "predicted_tau_walk": walk["tau"]}  # fmt: skip


def pick_offline_rows(rows: list[int] | None, *, num_rows: int, max_rows: int) -> list[int]:
    """The feature rows ``--offline`` scores: ``rows`` (the draft's validation rows) that the features hold, else
    the first ones; at most ``max_rows``."""
    return [r for r in rows if 0 <= r < num_rows][:max_rows] if rows else list(range(min(max_rows, num_rows)))


def draft_manifest(draft_dir: str) -> dict[str, Any]:
    """The train stage's manifest beside a draft checkpoint ({} when there is none, e.g. an imported draft)."""
    from eyas.core.files import read_json

    with contextlib.suppress(EyasError):
        m = read_json(Path(draft_dir) / "manifest.json", what="draft manifest")
        return m if isinstance(m, dict) else {}
    return {}


def _trained_on(train_data: dict[str, Any], features: str | Path) -> bool:
    """Whether FEATURES hold the rows a draft was trained on, row for row: the train manifest's ``inputs.data``
    names the features themselves (offline training) or the prepared rows they were extracted from (online:
    extract's ``arrow_sha256`` hashes the same files' sha256 digests, in order)."""
    from eyas.data.prepared import arrow_sha256
    from eyas.training.batches import FeatureRows

    held = FeatureRows(features, dtype=torch.float32)
    if "features" in train_data:
        return held.identity() == train_data
    made_from = (held.manifest.get("inputs") or {}).get("data") or {}
    prepared = train_data.get("prepared")
    return isinstance(prepared, list) and made_from.get("rows") == train_data.get("rows") and \
        made_from.get("arrow_sha256") == arrow_sha256(prepared)  # fmt: skip


def choose_offline_rows(manifest: dict[str, Any], features: str | Path) -> tuple[list[int] | None, str, str]:
    """Which rows of FEATURES ``eyas eval --offline`` predicts tau from, and why: ``(rows, or None for the first
    ones; kind; a sentence for the report)``.

    The validation rows the train stage held out (``outputs.val_rows`` of its manifest) when FEATURES are the
    rows it trained on; the first rows when they are other rows (none seen in training) or when there is no
    train manifest (an imported or random draft). Features the draft trained on without a record of held-out
    rows give an optimistic prediction, and the sentence says so.
    """
    data = (manifest.get("inputs") or {}).get("data")
    if not manifest or not isinstance(data, dict):
        return None, "unknown", "its first rows (the draft has no train manifest that says which rows it saw)"
    if not _trained_on(data, features):
        return None, "unseen", "its first rows (the draft was trained on other rows)"
    val = (manifest.get("outputs") or {}).get("val_rows")
    if isinstance(val, list) and val:
        return [int(r) for r in val], "validation", f"the validation rows train held out ({len(val)} recorded)"
    return None, "training", ("its first rows, which the draft trained on (its train manifest records no held-out "
                              "rows): an optimistic prediction")  # fmt: skip
