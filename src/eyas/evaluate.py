"""``eyas eval``: real speculative decoding on the verifier, so the acceptance length is measured, not guessed.

The draft proposes a chain of ``K`` tokens, the verifier checks them in one
forward pass per round, and both KV caches roll back on rejection. The loop
follows vLLM's EAGLE proposer (``v1/spec_decode/llm_base_proposer.py``; notes
§2.5) so what is measured here is what vLLM will serve:

- After a verifier forward over the accepted tokens, the draft's input at each
  new position ``t`` is the token ``x_{t+1}`` with the verifier's aux state at
  ``t`` (fused by ``fc``), at the verifier's position ``t``.
- Drafting step ``j`` feeds the previous draft token with the previous step's
  ``next_hidden`` (the second return of :meth:`Eagle3Draft.step`, the very
  function training-time test runs) at position ``+1``.
- After verification the draft cache keeps only positions whose state came
  from the verifier: drafted entries are truncated and the accepted positions
  are recomputed from the verifier's hidden states (DESIGN "Inference caches").
  The verifier's cache rolls back to the accepted prefix (the next round feeds
  from there: :class:`eyas.generate.SequenceDecoder`).

Acceptance is greedy at ``T = 0`` (accept while the draft token is the
verifier's argmax, then emit the verifier's token) and standard speculative
sampling at ``T > 0`` (Leviathan et al. 2023, Chen et al. 2023: accept with
``min(1, p/q)``, resample from ``norm(max(0, p - q))``, bonus from ``p``), both
lossless: greedy outputs equal plain greedy decoding token for token, sampled
outputs follow the verifier's distribution.

One prompt is decoded at a time (batch size 1, the latency setting speculative
decoding is for); the baseline is plain decoding of the same prompts through
the same engine (:mod:`eyas.generate`: slot cache, CUDA graphs) in the same
run, on the bare model: the aux-state capture is attached only during the
speculative loop's forwards and recorded only into its graphs.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.chat import encode_prompt, end_of_turn_ids
from eyas.errors import EyasError
from eyas.generate import SequenceDecoder, device_and_dtype
from eyas.model import DraftConfig, Eagle3Draft


# --------------------------------------------------------------------------- acceptance


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification. ``target_logits [B, K+1, V]`` at the last emitted token and the ``K`` drafts,
    ``draft_tokens [B, K]``. Returns ``(accepted [B], next_token [B])``: the number of leading draft tokens
    equal to the verifier's argmax, and the verifier's token after them (its correction at the first
    mismatch, or the bonus token after ``K`` accepts)."""
    greedy = target_logits.argmax(-1)  # [B, K+1]
    K = draft_tokens.shape[1]
    accepted = (draft_tokens == greedy[:, :K]).long().cumprod(-1).sum(-1)  # [B]
    return accepted, greedy.gather(1, accepted[:, None])[:, 0]


def verify_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor, *,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Speculative sampling (Leviathan et al. 2023, alg. 1; Chen et al. 2023, alg. 2).

    ``target_probs [B, K+1, V]`` (the verifier's ``p`` at the last emitted token and each draft),
    ``draft_probs [B, K, V]`` (``q``, the distribution each draft token was sampled from, over the target
    vocab: zero outside the draft vocab), ``draft_tokens [B, K]``. Draft ``j`` is accepted with probability
    ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the next token is drawn from
    ``norm(max(0, p_j - q_j))``, after ``K`` accepts from ``p_K``. The output then follows ``p`` exactly.
    Returns ``(accepted [B], next_token [B])``.
    """
    B, K = draft_tokens.shape
    idx = draft_tokens[..., None]
    p_d = target_probs[:, :K].gather(-1, idx)[..., 0]  # [B, K]
    q_d = draft_probs.gather(-1, idx)[..., 0]  # [B, K]
    u = torch.rand(B, K, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    accepted = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # u < p/q without dividing by q
    q_ext = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, K+1, V]: q_K = 0
    rows = torch.arange(B, device=accepted.device)
    residual = (target_probs[rows, accepted] - q_ext[rows, accepted]).clamp_min(0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    # p == q at the rejected position (possible only by rounding) leaves no residual mass: fall back to p.
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), target_probs[rows, accepted])
    return accepted, torch.multinomial(dist, 1, generator=generator)[:, 0]


# --------------------------------------------------------------------------- the draft with its cache


class DraftRunner:
    """The draft's step function over its position-indexed cache, plus the draft-to-target vocab map.

    Its fixed shapes (catching up 1..K+1 positions after a round, one drafting step) are CUDA graphs on CUDA
    (:class:`eyas.generate.Graphs`); a prompt's catch-up of any length runs eagerly.
    """

    def __init__(self, draft: Eagle3Draft, *, graph_max_tokens: int = 0, cuda_graphs: bool = True) -> None:
        from eyas.generate import Graphs

        self.draft = draft
        p = draft.fc.weight
        self.device, self.dtype = p.device, p.dtype
        self.to_target = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=self.device))
        self.cache = None
        self.max_len = 0
        self.graphs = Graphs(self.device, enabled=cuda_graphs)
        self.graph_max_tokens = graph_max_tokens
        self._static: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}

    def reset(self, max_len: int) -> None:
        if self.cache is not None and max_len <= self.max_len:
            self.cache.truncate(0)
            return
        self.max_len = max(max_len, 2 * self.max_len)
        self.cache = self.draft.new_cache(batch_size=1, max_len=self.max_len)
        self.graphs.graphs.clear()  # recorded against the old cache's buffers

    def _run(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor):
        normed, next_hidden = self.draft.step(input_ids, hidden, position_ids, self.cache)
        return self.draft.compute_logits(normed[:, -1])[0].float(), next_hidden[:, -1:]  # [N], [1, 1, H]

    def _graphed(self, kind: str, inputs: tuple[torch.Tensor, ...], fn) -> tuple[torch.Tensor, torch.Tensor]:
        """``fn`` over static copies of ``inputs`` as a CUDA graph keyed by ``kind`` and shape; outputs cloned
        (the next replay overwrites them)."""
        key = (kind, tuple(inputs[0].shape))
        if key not in self._static:
            self._static[key] = tuple(x.clone() for x in inputs)
        static = self._static[key]
        for s, x in zip(static, inputs):
            s.copy_(x)
        logits, hidden = self.graphs.run(key, lambda: fn(*static))
        return logits.clone(), hidden.clone()

    @torch.no_grad()
    def catch_up(self, next_ids: torch.Tensor, aux: torch.Tensor, start: int):
        """Positions ``start..start+T-1`` from the verifier: tokens ``next_ids [T]`` (each position's next
        token) with the verifier's aux states ``aux [T, 3H]``. Returns the draft logits ``[N]`` at the last
        position and its ``next_hidden [1, 1, H]``."""
        T = next_ids.shape[0]
        pos = torch.arange(start, start + T, device=self.device)[None]  # [1, T]
        aux = aux[None].to(self.dtype)  # [1, T, 3H]

        def run(ids, aux, pos):
            return self._run(ids, self.draft.fuse(aux), pos)

        if T <= self.graph_max_tokens and self.graphs.enabled:  # after a round: 1..K+1 positions, a graph each
            return self._graphed("catch_up", (next_ids[None], aux, pos), run)
        return run(next_ids[None], aux, pos)  # a prompt's length varies: eager

    @torch.no_grad()
    def step(self, token: torch.Tensor, hidden: torch.Tensor, position: int):
        """One drafting step: the previous draft ``token [1]`` and ``next_hidden`` at ``position``."""
        pos = torch.full((1, 1), position, device=self.device, dtype=torch.long)
        if self.graphs.enabled:
            return self._graphed("step", (token[None], hidden.reshape(1, 1, -1), pos), self._run)
        return self._run(token[None], hidden.reshape(1, 1, -1), pos)


# --------------------------------------------------------------------------- decoding loops


@dataclass
class Generation:
    """One decoded turn: the new tokens (cut after an end-of-turn token or at ``max_new_tokens``) and, for
    speculative decoding, per round the draft tokens accepted, the tokens it added to the output (``accepted +
    1`` but in a turn's last round, whose tokens past the end of turn or ``max_new_tokens`` are dropped: only
    what is kept counts) and the tokens proposed."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    proposals: list[list[int]] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut ``tokens`` after the first end-of-turn token or at ``max_new_tokens``; say whether decoding is done."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The verifier's next token from ``logits [V]``: argmax at ``T = 0``, else a sample of ``softmax(l / T)``."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)


def _check_room(verifier: SequenceDecoder, n: int) -> None:
    if n > verifier.capacity:
        raise EyasError(f"internal: a turn of {n} positions exceeds the verifier cache of {verifier.capacity}")


@torch.no_grad()
def plain_generate(verifier: SequenceDecoder, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> Generation:  # fmt: skip
    """Plain decoding, one verifier forward per token (the baseline, and the reference for losslessness)."""
    dev = verifier.device
    _sync(dev)
    t0 = time.perf_counter()
    n = len(prompt_ids)
    _check_room(verifier, n + max_new_tokens)
    logits, _ = verifier.forward(torch.tensor(prompt_ids, device=dev), 0, last_only=True)
    tokens: list[int] = []
    while True:
        tok = _pick(logits[-1], temperature, generator)
        tokens.append(int(tok))
        tokens, done = _finish(tokens, max_new_tokens, eos_ids)
        if done:
            break
        logits, _ = verifier.forward(tok, n + len(tokens) - 1)
    _sync(dev)
    return Generation(tokens, time.perf_counter() - t0)


@torch.no_grad()
def speculative_generate(verifier: SequenceDecoder, draft: DraftRunner, prompt_ids: list[int], *,
                         max_new_tokens: int, draft_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> Generation:  # fmt: skip
    """Speculative decoding of one prompt (see the module docstring for the loop's semantics).

    Invariant at the top of each round: the verifier's cache holds positions
    ``0..m-1``; the last emitted token ``x_m`` is not yet fed to it; the draft's
    cache holds positions ``0..m-1``, each computed from the verifier's state there.
    A round's accepted count is what the output keeps: draft tokens accepted past
    the end-of-turn token or ``max_new_tokens`` in the last round are not counted.
    """
    dev, K = verifier.device, draft_tokens
    _sync(dev)
    t0 = time.perf_counter()
    n = len(prompt_ids)
    _check_room(verifier, n + max_new_tokens + K + 1)
    draft.reset(n + max_new_tokens + K + 1)
    ids = torch.tensor(prompt_ids, device=dev)
    logits, aux = verifier.forward(ids, 0, last_only=True)
    last = _pick(logits[-1], temperature, generator)  # [1]
    tokens, done = _finish([int(last)], max_new_tokens, eos_ids)
    # The draft's view of the prompt: position t reads token x_{t+1} and the verifier's state at t.
    d_logits, hidden = draft.catch_up(torch.cat([ids[1:], last]), aux, 0)
    out = Generation(tokens, 0.0)
    m = n  # position of `last`
    while not done:
        drafted, q = [], []
        for j in range(K):
            if j:
                d_logits, hidden = draft.step(drafted[-1], hidden, m - 1 + j)
            if temperature == 0:
                drafted.append(draft.to_target[d_logits.argmax(-1, keepdim=True)])
            else:
                probs = torch.softmax(d_logits / temperature, -1)  # [N] over the draft vocab
                drafted.append(draft.to_target[torch.multinomial(probs, 1, generator=generator)])
                q.append(torch.zeros_like(logits[-1]).index_copy_(0, draft.to_target, probs))  # [V], 0 off-vocab
        proposal = torch.cat(drafted)  # [K] target ids
        # The verifier's cache is rolled back to m by feeding from m: `last` and the K drafts.
        logits, aux = verifier.forward(torch.cat([last, proposal]), m)  # [K+1, V], [K+1, 3H]
        if temperature == 0:
            accepted, nxt = verify_greedy(logits[None], proposal[None])
        else:
            accepted, nxt = verify_sampled(torch.softmax(logits / temperature, -1)[None], torch.stack(q)[None],
                                           proposal[None], generator=generator)  # fmt: skip
        host = torch.cat([accepted, nxt, proposal]).tolist()  # the round's one device->host sync
        a = host[0]
        before = len(tokens)
        tokens, done = _finish(tokens + host[2 : 2 + a] + [host[1]], max_new_tokens, eos_ids)
        kept = len(tokens) - before  # of the a + 1 tokens the round made
        out.accepted.append(min(a, kept))
        out.produced.append(kept)
        out.proposals.append(host[2:])
        draft.cache.truncate(m)  # drop drafted entries; recompute the accepted ones from the verifier
        last = nxt
        if not done:
            d_logits, hidden = draft.catch_up(torch.cat([proposal[:a], nxt]), aux[: a + 1], m)
        m += a + 1
    out.tokens = tokens
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------- statistics


def acceptance_stats(accepted: list[int], draft_tokens: int, *, produced: list[int] | None = None) -> dict[str, Any]:
    """tau and per-position acceptance from the accepted count of every speculative round.

    ``tau`` = tokens produced per verifier forward = mean over rounds of
    ``accepted + 1`` (vLLM's mean acceptance length, ``1 + accepted / drafts``),
    or of ``produced`` when given (the tokens each round kept: a turn's last round
    keeps none past its end).
    ``acceptance_per_position[j]`` is *unconditional*: the fraction of rounds in
    which draft token ``j`` was accepted (hence all before it too), vLLM's
    per-position acceptance rate. ``conditional_acceptance_per_position[j]`` is
    that fraction among rounds whose tokens ``0..j-1`` were accepted.
    """
    K = draft_tokens
    rounds = len(accepted)
    hist = [0] * (K + 1)
    for a in accepted:
        hist[a] += 1
    reached = [sum(hist[j:]) for j in range(K + 1)]  # rounds whose first j drafts were all accepted
    uncond = [reached[j + 1] / rounds if rounds else 0.0 for j in range(K)]
    cond = [reached[j + 1] / reached[j] if reached[j] else 0.0 for j in range(K)]
    tokens = sum(produced) if produced is not None else sum(accepted) + rounds
    return {
        "tau": tokens / rounds if rounds else 0.0,
        "rounds": rounds,
        "acceptance_per_position": uncond,
        "conditional_acceptance_per_position": cond,
        "accepted_length_histogram": hist,
    }


def predicted_tau(cond_acc: list[float]) -> float:
    """tau from per-step conditional accuracies: ``1 + sum_k prod_{j<=k} cond_acc_j`` (the expected tokens per
    round when step ``k`` is right with probability ``cond_acc_k`` given steps ``< k`` were)."""
    return 1.0 + sum(math.prod(cond_acc[: k + 1]) for k in range(len(cond_acc)))


def plot_histogram(path: Path, hist: list[int], *, tau: float, title: str) -> None:
    """A bar chart of accepted draft tokens per round, written atomically as a PNG (matplotlib's Agg canvas,
    without pyplot's global state)."""
    from matplotlib.figure import Figure

    from eyas.manifest import atomic_path

    fig = Figure(figsize=(5, 3.2), dpi=120)
    ax = fig.subplots()
    rounds = sum(hist) or 1
    ax.bar(range(len(hist)), [h / rounds for h in hist], color="#4c72b0")
    ax.set_xticks(range(len(hist)))
    ax.set_xlabel("draft tokens accepted in a round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(f"{title}\ntau = {tau:.2f} tokens per verifier forward", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


# --------------------------------------------------------------------------- prompts and templates


@dataclass
class EvalPrompt:
    """A prompt of one or more user turns; each later turn follows the verifier's own answer to the one before
    (MT-Bench's second turn)."""

    id: str
    turns: list[str]
    system: str | None = None


def _as_prompts(prompts: Any, *, num_prompts: int | None, seed: int) -> tuple[list[EvalPrompt], str]:
    """Named set, local file, or (from Python) a list of prompts -> ``(prompts, description)``.

    Names and files go through :func:`eyas.datasets.load_prompts`, as in ``eyas prepare``. A list may hold
    strings (one turn each), lists of strings (turns), dicts with ``turns`` or ``prompt``, or objects with
    ``turns`` (and optionally ``id``, ``system``).
    """
    if isinstance(prompts, (str, Path)):
        from eyas.datasets import load_prompts

        loaded, report = load_prompts(str(prompts), max_samples=num_prompts, seed=seed)
        return [EvalPrompt(str(p.id), list(p.turns), p.system) for p in loaded], report.source
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(EvalPrompt(str(i), [p]))
        elif isinstance(p, dict):
            turns = p.get("turns") or ([p["prompt"]] if "prompt" in p else None)
            if not turns:
                raise EyasError(f"prompt {i} has neither 'turns' nor 'prompt'")
            out.append(EvalPrompt(str(p.get("id", i)), list(turns), p.get("system")))
        elif isinstance(p, (list, tuple)):
            out.append(EvalPrompt(str(i), [str(t) for t in p]))
        else:
            out.append(EvalPrompt(str(getattr(p, "id", i)), list(p.turns), getattr(p, "system", None)))
    if not out:
        raise EyasError("no prompts to evaluate")
    return out[:num_prompts] if num_prompts else out, f"{len(out)} prompts given in Python"


def _conversation(p: EvalPrompt, answers: list[str], turn: int) -> list[dict[str, str]]:
    """The messages up to user turn ``turn``: system, then each earlier turn with its answer."""
    messages = [{"role": "system", "content": p.system}] if p.system else []
    for q, a in zip(p.turns[:turn], answers):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages + [{"role": "user", "content": p.turns[turn]}]


# --------------------------------------------------------------------------- drafts


def random_draft(info, *, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Eagle3Draft:  # fmt: skip
    """An untrained draft over the full vocab (Llama init; embedding and head from the verifier, as training
    starts): the floor any trained draft must beat."""
    from eyas.verifier import load_head_tensors

    cfg = DraftConfig.from_verifier(info.text_config, draft_vocab_size=info.vocab_size,
                                    aux_layer_ids=info.aux_layer_ids)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg)
    heads = load_head_tensors(info)
    draft.init_from_verifier(embed=heads.embed, lm_head_rows=heads.lm_head)
    draft.t2d.fill_(True)
    return draft.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------- offline prediction


@torch.no_grad()
def ttt_chain_lengths(draft: Eagle3Draft, input_ids: torch.Tensor, aux_hidden: torch.Tensor, greedy: torch.Tensor, *,
                      steps: int) -> torch.Tensor:  # fmt: skip
    """How many draft tokens a round starting at each index would accept, by training-time test.

    ``input_ids [T]``, ``aux_hidden [T, 3H]`` (the verifier's aux states), ``greedy [T]`` (the verifier's
    full-vocab argmax at each index). TTT step ``k`` at index ``t`` reads ``x_{t+1+k}`` and predicts
    ``x_{t+2+k}``; it is right when its argmax, mapped to the target vocab, equals ``greedy[t+1+k]``.
    Returns ``[T - steps - 1]``: the number of leading right steps at each ``t``. When the tokens are the
    verifier's own greedy output, this is exactly the accepted count of a decoding round whose last emitted
    token sits at ``t + 1`` (the draft then feeds its own tokens, which equal the data while it is right).
    """
    T = input_ids.shape[0]
    outs = draft.ttt(input_ids[None], aux_hidden[None].to(draft.fc.weight.dtype), steps=steps)
    t = torch.arange(T - steps - 1, device=input_ids.device)
    chain = torch.ones_like(t, dtype=torch.bool)
    length = torch.zeros_like(t)
    for k, normed in enumerate(outs):
        pred = draft.draft_to_target(draft.compute_logits(normed[0, t]).argmax(-1))
        chain = chain & (pred == greedy[t + 1 + k])
        length += chain.long()
    return length


@torch.no_grad()
def offline_accuracy(draft: Eagle3Draft, info, features: str | Path, *, steps: int, rows: list[int] | None = None,
                     max_rows: int = 256, device: str | torch.device = "cpu",
                     chunk: int = 256) -> dict[str, Any]:  # fmt: skip
    """Per-step conditional accuracy of the draft over extracted features, and the tau it predicts.

    Per row, :func:`ttt_chain_lengths` against the verifier's full-vocab argmax
    (from the stored pre-norm last state through the verifier's own final norm
    and head). Step ``k`` at index ``t`` counts where the token it predicts,
    ``x_{t+2+k}``, is loss-masked. ``conditional_accuracy[k]`` = P(step ``k``
    right | steps ``< k`` right); ``predicted_tau = 1 + sum_k prod_{j<=k}
    conditional_accuracy[j]``.
    """
    from eyas.features import FeatureReader
    from eyas.loss import TargetHead
    from eyas.verifier import load_head_tensors

    reader = FeatureReader(features, dtype=torch.float32)
    if list(reader.layer_ids) != list(draft.config.aux_layer_ids):
        raise EyasError(f"{features} holds aux layers {reader.layer_ids}, the draft reads "
                        f"{draft.config.aux_layer_ids}; extract features with the draft's --layers")  # fmt: skip
    rows = pick_offline_rows(rows, num_rows=len(reader), max_rows=max_rows)
    full = load_head_tensors(info, dtype=torch.float32, device=device).lm_head  # [V, H]
    # the whole head as "draft" rows in target-id order: the targets' argmax is the full-vocab argmax
    head = TargetHead.for_verifier(info, rows=full, draft_target_ids=torch.arange(len(full), device=device),
                                   device=device)  # fmt: skip
    reached = torch.zeros(steps, dtype=torch.long)  # per step: counted positions whose earlier steps were right
    right = torch.zeros(steps, dtype=torch.long)
    for i in rows:
        row = reader[i]
        T = row.input_ids.shape[0]
        if T < steps + 2:
            continue
        last = row.last_hidden_state.to(device)
        greedy = torch.cat([head(last[s : s + chunk], pad=0).argmax for s in range(0, T, chunk)])  # [T]
        length = ttt_chain_lengths(draft, row.input_ids.to(device), row.aux_hidden_states.to(device), greedy,
                                   steps=steps).cpu()  # fmt: skip
        mask = row.loss_mask.bool()
        t = torch.arange(length.shape[0])
        for k in range(steps):
            valid = mask[t + 2 + k]
            reached[k] += int((valid & (length >= k)).sum())
            right[k] += int((valid & (length > k)).sum())
    cond = [float(right[k]) / float(reached[k]) if reached[k] else 0.0 for k in range(steps)]
    return {"features": str(features), "rows": len(rows), "row_ids": rows, "positions": int(reached[0]),
            "conditional_accuracy": cond, "predicted_tau": predicted_tau(cond)}  # fmt: skip


def pick_offline_rows(rows: list[int] | None, *, num_rows: int, max_rows: int) -> list[int]:
    """The feature rows ``--offline`` scores: ``rows`` (the draft's validation rows) that the features hold, else
    the first ones; at most ``max_rows``."""
    return [r for r in rows if 0 <= r < num_rows][:max_rows] if rows else list(range(min(max_rows, num_rows)))


def _draft_manifest(draft_dir: str) -> dict[str, Any]:
    """The train stage's manifest beside a draft checkpoint ({} when there is none, e.g. an imported draft)."""
    from eyas.manifest import read_json

    with contextlib.suppress(EyasError):
        m = read_json(Path(draft_dir) / "manifest.json", what="draft manifest")
        return m if isinstance(m, dict) else {}
    return {}


def _trained_on(train_data: dict[str, Any], features: str | Path) -> bool:
    """Whether FEATURES hold the rows a draft was trained on, row for row: the train manifest's ``inputs.data``
    names the features themselves (offline training) or the prepared rows they were extracted from (online:
    extract's ``arrow_sha256`` hashes the same files' sha256 digests, in order)."""
    import hashlib

    from eyas.batches import FeatureRows

    held = FeatureRows(features, dtype=torch.float32)
    if "features" in train_data:
        return held.identity() == train_data
    made_from = (held.manifest.get("inputs") or {}).get("data") or {}
    prepared = train_data.get("prepared")
    return isinstance(prepared, list) and made_from.get("rows") == train_data.get("rows") and \
        made_from.get("arrow_sha256") == hashlib.sha256("".join(prepared).encode()).hexdigest()  # fmt: skip


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


# --------------------------------------------------------------------------- the stage


@dataclass
class Runners:
    """The decoders of one measurement, sharing one verifier model: the verifier for speculative decoding
    (capturing aux states; a graph per verification length ``K + 1`` of every ``K`` measured), the verifier for
    plain decoding (nothing attached: the baseline pays for no capture), and the draft."""

    spec: SequenceDecoder
    base: SequenceDecoder
    draft: DraftRunner
    draft_tokens: list[int]

    @classmethod
    def build(cls, model, draft: Eagle3Draft, *, draft_tokens: list[int], max_len: int, cuda_graphs: bool = True,
              compile: bool = True) -> "Runners":  # fmt: skip
        """Decoders for conversations of ``max_len`` positions, every fixed-shape forward recorded up front."""
        Ks = sorted(set(draft_tokens))
        kw = dict(capacity=max_len, cuda_graphs=cuda_graphs, compile=compile)
        r = cls(
            spec=SequenceDecoder(model, aux_layer_ids=draft.config.aux_layer_ids, graph_lengths=[K + 1 for K in Ks],
                                 **kw),  # fmt: skip
            base=SequenceDecoder(model, graph_lengths=(1,), **kw),
            draft=DraftRunner(draft, graph_max_tokens=max(Ks) + 1, cuda_graphs=cuda_graphs),
            draft_tokens=Ks,
        )  # fmt: skip
        r.draft.reset(max_len)
        r._warm_up()
        return r

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Record every graph the timed loops can replay, outside the timing: the plain step and each
        verification length at every key-length bucket up to the capacity, the draft's catch-ups over 1..K+1
        positions and its drafting step. (Eager decoding, as on CPU, has nothing to prepare.)"""
        from eyas.generate import _KEY_BUCKETS

        if not self.base.graphs.enabled:
            return
        cap = self.spec.capacity
        starts = sorted({min(b, cap) for b in _KEY_BUCKETS if b < cap} | {cap})
        Kmax = max(self.draft_tokens)
        ids = torch.arange(1, Kmax + 2, device=self.spec.device)
        for end in starts:
            self.base.forward(ids[:1], end - 1)
            for K in self.draft_tokens:
                _, aux = self.spec.forward(ids[: K + 1], end - K - 1)
        self.draft.reset(cap)
        for T in range(1, Kmax + 2):
            _, hidden = self.draft.catch_up(ids[:T], aux[:1].expand(T, -1), 0)
        self.draft.step(ids[:1], hidden, Kmax + 1)
        self.draft.reset(cap)


@dataclass
class SpecStats:
    """Speculative decoding at one ``K``: every round's accepted and kept counts, tokens and seconds."""

    accepted: list[int] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Measurement:
    """What speculative decoding (per ``K``) and plain decoding of a prompt set produced."""

    spec: dict[int, SpecStats] = field(default_factory=dict)
    base_tokens: int = 0
    base_seconds: float = 0.0
    turn_ids: list[list[int]] = field(default_factory=list)  # every decoded turn's prompt ids, in order
    turns: int = 0


def conversation_bound(plist: list[EvalPrompt], tokenizer, *, max_new_tokens: int, draft_tokens: int) -> int:
    """Positions the longest conversation can need: its turns with every answer at ``max_new_tokens`` (plus slack
    for re-tokenising an answer) and one verification round past the end."""
    return max(len(encode_prompt(tokenizer, _conversation(p, ["" for _ in p.turns[1:]], len(p.turns) - 1)))
               + len(p.turns) * (max_new_tokens + 16) for p in plist) + draft_tokens + 2  # fmt: skip


def measure(plist: list[EvalPrompt], tokenizer, runners: Runners, *, max_new_tokens: int, eos_ids: set[int],
            temperature: float = 0.0, seed: int = 0, baseline: bool = True,
            desc: str = "eyas eval") -> Measurement:  # fmt: skip
    """Decode every turn of every prompt speculatively (once per ``K``) and (with ``baseline``) plainly, one
    prompt at a time.

    A later turn follows the answer of plain decoding to the turn before (the verifier's own answer, greedy at
    ``T = 0``), so every loop decodes the same conversation; at ``T = 0`` every turn's outputs are compared.
    """
    from tqdm.auto import tqdm

    Ks = runners.draft_tokens
    dev = runners.spec.device
    g_spec = {K: torch.Generator(device=dev).manual_seed(seed) for K in Ks}
    g_base = torch.Generator(device=dev).manual_seed(seed + 1)
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature)
    m = Measurement(spec={K: SpecStats() for K in Ks})
    bar = tqdm(total=sum(len(p.turns) for p in plist), desc=desc, unit="turn", dynamic_ncols=True)
    for p in plist:
        answers: list[str] = []
        for ti in range(len(p.turns)):
            ids = encode_prompt(tokenizer, _conversation(p, answers, ti))
            m.turn_ids.append(ids)
            outs = {}
            for K in Ks:
                spec = speculative_generate(runners.spec, runners.draft, ids, draft_tokens=K, generator=g_spec[K],
                                            **kw)  # fmt: skip
                s = m.spec[K]
                s.accepted += spec.accepted
                s.produced += spec.produced
                s.tokens += len(spec.tokens)
                s.seconds += spec.seconds
                outs[K] = spec.tokens
            answer = outs[Ks[0]]
            if baseline:
                base = plain_generate(runners.base, ids, generator=g_base, **kw)
                m.base_tokens += len(base.tokens)
                m.base_seconds += base.seconds
                answer = base.tokens
                for K, toks in outs.items():
                    if temperature == 0 and base.tokens != toks:
                        first = next((i for i, (x, y) in enumerate(zip(base.tokens, toks)) if x != y),
                                     min(len(base.tokens), len(toks)))  # fmt: skip
                        m.spec[K].mismatches.append({
                            "prompt": p.id, "turn": ti, "turn_index": len(m.turn_ids) - 1, "first_difference": first,
                            **_divergence(runners.base.model, ids, base.tokens, toks, first)})  # fmt: skip
            answers.append(tokenizer.decode([t for t in answer if t not in eos_ids], skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False))  # (5.17 warns otherwise)
            m.turns += 1
            bar.update(1)
            bar.set_postfix({f"tau@{K}": f"{sum(m.spec[K].produced) / max(len(m.spec[K].produced), 1):.2f}"
                             for K in Ks})  # fmt: skip
    bar.close()
    return m


@torch.no_grad()
def _divergence(model, prompt_ids: list[int], plain: list[int], spec: list[int], at: int) -> dict[str, Any]:
    """Where two greedy outputs part: the verifier's logits there, from one fresh forward over the common
    prefix, and what the difference is.

    ``kind`` is ``near-tie`` when the two tokens' logits differ by no more than the compute dtype resolves at
    their size (two units in the last place: bf16 keeps 8 significant bits, so logits near 20 are 0.16 apart):
    one forward over K+1 tokens and one over a single token round such a tie differently. A larger gap is
    ``real``: the loops computed different things. An output that is a prefix of the other (one stopped
    early) is ``real`` too.
    """
    if at >= min(len(plain), len(spec)):
        return {"logit_gap": None, "kind": "real"}
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + plain[:at]], device=dev)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    a, b = logits[plain[at]], logits[spec[at]]
    gap = float(a.float() - b.float())
    tolerance = 2 * torch.finfo(logits.dtype).eps * max(abs(float(a)), abs(float(b)), 1.0)
    return {"plain_token": plain[at], "spec_token": spec[at], "logit_gap": gap,
            "kind": "near-tie" if abs(gap) <= tolerance else "real"}  # fmt: skip


def recheck_fp32_turns(env: dict[str, Any], m: Measurement, *, max_new_tokens: int, bound: int) -> None:
    """Decode every mismatched turn again in fp32 (copies of the verifier and the draft), plainly and
    speculatively at the mismatch's ``K``: a turn whose two outputs agree in fp32 was a near-tie of the compute
    dtype (``fp32: "equal"``, kind ``near-tie``); one that still differs is a real difference."""
    import copy

    bad = [(K, x) for K, s in m.spec.items() for x in s.mismatches]
    if not bad:
        return
    model32 = copy.deepcopy(env["model"]).float()
    runners = Runners.build(model32, copy.deepcopy(env["draft"]).float(), draft_tokens=sorted({K for K, _ in bad}),
                            max_len=bound, cuda_graphs=False)  # fmt: skip
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=env["eos_ids"])
    for K, x in bad:
        ids = m.turn_ids[x["turn_index"]]
        same = (speculative_generate(runners.spec, runners.draft, ids, draft_tokens=K, **kw).tokens
                == plain_generate(runners.base, ids, **kw).tokens)  # fmt: skip
        x["fp32"] = "equal" if same else "differ"
        x["kind"] = "near-tie" if same else "real"


def summarize(m: Measurement, *, draft_tokens: int, temperature: float, baseline: bool) -> dict[str, Any]:
    """The report's measured figures at one ``K``: acceptance statistics, losslessness, speeds and speedup."""
    s = m.spec[draft_tokens]
    spec_tps = s.tokens / s.seconds if s.seconds else 0.0
    base_tps = m.base_tokens / m.base_seconds if m.base_seconds else None
    return {
        **acceptance_stats(s.accepted, draft_tokens, produced=s.produced),
        "draft_tokens": draft_tokens,
        "lossless": (not s.mismatches) if (baseline and temperature == 0) else None,
        "mismatches": s.mismatches,
        "tokens_per_s": spec_tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps if base_tps else None,
        "num_turns": m.turns,
        "generated_tokens": s.tokens,
    }


def _report_paths(out: str | Path) -> tuple[Path, Path]:
    """``--out report.json`` names the report (the histogram goes beside it); any other path is a directory."""
    p = Path(out)
    if p.suffix == ".json":
        return p, p.with_name(p.stem + "_accepted_lengths.png")
    return p / "report.json", p / "accepted_lengths.png"


def setup(*, verifier: str, draft: str, device: str | None = None, dtype: str = "auto", seed: int = 0,
          trust_remote_code: bool = False, chat_template: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Load what a measurement needs once: the verifier (info, model, tokenizer with the chat template prompts are
    rendered with, end-of-turn ids) and the draft (a checkpoint dir, or 'random'), on ``device`` in ``dtype``."""
    from eyas.checkpoint import load_draft
    from eyas.chat import NO_TEMPLATE_HINT
    from eyas.verifier import build_text_model, load_tokenizer
    from eyas.verifier_info import resolve

    dev, dt = device_and_dtype(device, dtype)
    info = resolve(verifier)
    tokenizer = load_tokenizer(info, trust_remote_code=trust_remote_code, chat_template=chat_template)
    if not tokenizer.chat_template:
        raise EyasError(f"the tokenizer of {info.path} has no chat template; eyas eval renders prompts through it: "
                        f"{NO_TEMPLATE_HINT}")  # fmt: skip
    if str(draft) == "random":
        d, manifest = random_draft(info, seed=seed, device=dev, dtype=dt), {}
    else:
        d, manifest = load_draft(draft, verifier=info, device=dev, dtype=dt), _draft_manifest(draft)
    model = build_text_model(info, dtype=dt, device=dev)
    if model.config.vocab_size != d.config.vocab_size:
        raise EyasError(f"the draft {draft} is for a vocab of {d.config.vocab_size}, the verifier has "
                        f"{model.config.vocab_size}")  # fmt: skip
    return {"info": info, "device": dev, "dtype": dt, "tokenizer": tokenizer, "eos_ids": end_of_turn_ids(tokenizer),
            "draft": d, "draft_manifest": manifest, "model": model}  # fmt: skip


def evaluate(
    *,
    verifier: str,
    draft: str,
    prompts: str,
    out: str | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 256,
    draft_tokens: list[int] = [3],  # noqa: B006 (read only; a list so the CLI reads --draft-tokens 3,5,7)
    temperature: float = 0.0,
    seed: int = 0,
    offline: str | None = None,
    offline_rows: int = 256,
    device: str | None = None,
    dtype: str = "auto",
    cuda_graphs: bool = True,
    compile: bool = True,
    baseline: bool = True,
    recheck_fp32: bool = False,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """Measure a draft by real speculative decoding on the verifier: tau, per-position acceptance, losslessness,
    and the speedup over plain decoding of the same prompts in the same run.

    Each prompt's turns are decoded in order through the verifier's chat template; a later turn (MT-Bench's
    second) follows the verifier's own plain-decoded answer to the turn before, so every loop sees the same
    conversation. Several K (`--draft-tokens 3,5,7`) are measured on the same turns in one run. Prints a table;
    ``--out`` writes the report as JSON and a PNG histogram of accepted lengths.

    Args:
        verifier: the verifier checkpoint (dir, .gguf file, 'smollm2' or hub id).
        draft: a draft checkpoint dir (speculators eagle3 format, as `eyas train` writes it), or 'random' for an
            untrained draft (the floor of acceptance).
        prompts: 'mt-bench', 'humaneval', or a local JSON/JSONL/parquet file of prompts or conversations.
        out: where to write the report: a .json path (the histogram PNG goes beside it) or a directory.
        num_prompts: evaluate this many prompts (a seeded sample); default all.
        max_new_tokens: new tokens per turn at most (decoding also stops at the end-of-turn token).
        draft_tokens: K, the draft tokens proposed per round; several (3,5,7) are each measured on the same turns
            (the report's top-level figures are the first K's, every K's under by_draft_tokens).
        temperature: 0 for greedy acceptance; above 0 speculative sampling at this temperature.
        seed: seeds the prompt sample and all sampling.
        offline: an `eyas extract` features dir: also predict tau from the draft's per-step conditional accuracy
            on those features: the validation rows train held out when they are the features (or prepared rows)
            the draft trained on, else their first --offline-rows rows; the report says which.
        offline_rows: rows of --offline features to use at most.
        device: cuda or cpu (default: cuda when available).
        dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16.
        cuda_graphs: on CUDA, record every fixed-shape decoding forward (plain step, verification, draft steps)
            once as a CUDA graph and replay it, for both loops alike.
        compile: with CUDA graphs, compile the verifier's decoder layers (torch.compile, one layer's worth of
            compiling) for the recorded forwards of both loops alike: fewer, fused kernels a step.
        baseline: also run plain decoding (needed for the lossless check and the speedup).
        recheck_fp32: decode every turn whose speculative output differs from plain greedy decoding again in
            fp32, to tell near-ties of the compute dtype from real differences.
        trust_remote_code: allow the verifier's tokenizer to run checkpoint code (never on by default).
        chat_template: render prompts with this template instead of the tokenizer's own (a base model has none): a
            Jinja file, or a checkpoint (dir, .gguf, hub id) whose template to use; the one the draft's data was
            prepared with.
    """
    from eyas.manifest import versions, write_json
    from eyas.chat import chat_template_hash

    Ks = [draft_tokens] if isinstance(draft_tokens, int) else list(dict.fromkeys(int(k) for k in draft_tokens))
    if not Ks or min(Ks) < 1:
        raise EyasError(f"--draft-tokens must be one or more counts of at least 1, got {draft_tokens}")
    if temperature < 0:
        raise EyasError(f"--temperature must be 0 or more, got {temperature}")
    offline_rows_from = None
    if offline:  # the shards --offline will read are hashed now: a damaged one stops eval before decoding
        from eyas.features import FeatureReader

        offline_rows_from = choose_offline_rows(_draft_manifest(draft), offline)  # (rows, kind, why)
        feats = FeatureReader(offline)
        feats.check_shards(feats.shards_of(pick_offline_rows(offline_rows_from[0], num_rows=len(feats),
                                                             max_rows=offline_rows)))  # fmt: skip
    plist, source = _as_prompts(prompts, num_prompts=num_prompts, seed=seed)
    env = setup(verifier=verifier, draft=draft, device=device, dtype=dtype, seed=seed,
                trust_remote_code=trust_remote_code, chat_template=chat_template)  # fmt: skip
    dev, tokenizer, d = env["device"], env["tokenizer"], env["draft"]
    bound = conversation_bound(plist, tokenizer, max_new_tokens=max_new_tokens, draft_tokens=max(Ks))
    runners = Runners.build(env["model"], d, draft_tokens=Ks, max_len=bound, cuda_graphs=cuda_graphs,
                            compile=compile)  # fmt: skip
    graphs = runners.base.graphs.enabled
    m = measure(plist, tokenizer, runners, max_new_tokens=max_new_tokens, eos_ids=env["eos_ids"],
                temperature=temperature, seed=seed, baseline=baseline)  # fmt: skip
    if recheck_fp32 and temperature == 0:
        recheck_fp32_turns(env, m, max_new_tokens=max_new_tokens, bound=bound)
    by_k = {K: summarize(m, draft_tokens=K, temperature=temperature, baseline=baseline) for K in Ks}
    template_sha = chat_template_hash(tokenizer)
    K = Ks[0]
    report: dict[str, Any] = {
        **by_k[K],
        "num_prompts": len(plist),
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "prompts": source,
        "verifier": env["info"].path,
        "draft": str(draft),
        "draft_is_random": str(draft) == "random",
        "device": str(dev),
        "dtype": str(env["dtype"]).removeprefix("torch."),
        "cuda_graphs": graphs,
        "compile": graphs and runners.base.graphs.compile_model is not None,
        "batch_size": 1,
        "chat_template_sha256": template_sha,
        "chat_template": chat_template,  # --chat-template, or None: the tokenizer's own
        "end_of_turn_ids": sorted(env["eos_ids"]),
        "seed": seed,
        "versions": versions(),
    }
    if len(Ks) > 1:
        report["by_draft_tokens"] = {str(k): v for k, v in by_k.items()}
    trained_template = (env["draft_manifest"].get("inputs") or {}).get("chat_template_sha256")
    if trained_template and template_sha and trained_template != template_sha:
        report["warning"] = ("the draft was trained on data rendered with another chat template (give eval the one "
                             "prepare used: --chat-template)")  # fmt: skip
    if offline:
        rows, kind, why = offline_rows_from
        report["offline"] = offline_accuracy(d, env["info"], offline, steps=K, rows=rows, max_rows=offline_rows,
                                             device=dev)  # fmt: skip
        report["offline"].update(rows_from=kind, rows_note=why)
        report["predicted_tau"] = report["offline"]["predicted_tau"]
    if out:
        json_path, png_path = _report_paths(out)
        name = "random draft" if report["draft_is_random"] else Path(str(draft)).name
        plot_histogram(png_path, report["accepted_length_histogram"], tau=report["tau"],
                       title=f"{name} on {Path(env['info'].path).name}, K={K}, T={temperature:g}")  # fmt: skip
        report["histogram_png"] = str(png_path)
        write_json(json_path, report)
        report["report_json"] = str(json_path)
    _print_report(report)
    return report


def _print_report(r: dict[str, Any]) -> None:
    fmt = lambda xs: "  ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    rows = [
        ("prompts", f"{r['num_prompts']} ({r['num_turns']} turns, {r['generated_tokens']} tokens) from {r['prompts']}"),
        ("draft", r["draft"] + ("  (random: untrained)" if r["draft_is_random"] else "")),
        ("setting", f"K={r['draft_tokens']}  T={r['temperature']:g}  {r['device']} {r['dtype']}  "
                    f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}{'  compiled' if r['compile'] else ''}  batch 1"),
        ("tau (tokens per verifier forward)", f"{r['tau']:.3f}  over {r['rounds']} rounds"),
    ]  # fmt: skip
    if "predicted_tau" in r:
        rows.append(("tau predicted offline", f"{r['predicted_tau']:.3f}  (measured {r['tau']:.3f})"))
        off = r["offline"]
        rows.append(("offline rows", f"{off['rows']} rows of {off['features']}: {off['rows_note']}"))
    rows += [
        ("acceptance per position", fmt(r["acceptance_per_position"]) + "  (unconditional)"),
        ("conditional acceptance", fmt(r["conditional_acceptance_per_position"]) + "  (given the previous accepted)"),
        ("accepted-length histogram", " ".join(map(str, r["accepted_length_histogram"])) + "  (0..K drafts accepted)"),
    ]
    if r["lossless"] is not None:
        rows.append(("lossless (== plain greedy)", _lossless_line(r["mismatches"], r["dtype"])))
    speed = f"{r['tokens_per_s']:.1f} tokens/s"
    if r["baseline_tokens_per_s"]:
        speed += f"  vs plain {r['baseline_tokens_per_s']:.1f}: speedup {r['speedup']:.2f}x"
    rows.append(("speed", speed))
    for k, x in (r.get("by_draft_tokens") or {}).items():
        line = f"tau {x['tau']:.3f}"
        if x["speedup"]:
            line += f"  speedup {x['speedup']:.2f}x"
        if x["lossless"] is not None:
            line += f"  lossless {_lossless_line(x['mismatches'], r['dtype'])}"
        rows.append((f"K={k}", line))
    if r.get("warning"):
        rows.append(("warning", r["warning"]))
    if r.get("report_json"):
        rows.append(("report", f"{r['report_json']}  (histogram {r['histogram_png']})"))
    width = max(len(k) for k, _ in rows)
    print("\neyas eval")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _lossless_line(mismatches: list[dict[str, Any]], dtype: str) -> str:
    if not mismatches:
        return "yes"
    ties = sum(x.get("kind") == "near-tie" for x in mismatches)
    real = len(mismatches) - ties
    how = " (rechecked in fp32)" if any("fp32" in x for x in mismatches) else f" (by the logit gap in {dtype})"
    return f"NO: {len(mismatches)} turn(s) differ: {ties} near-tie(s), {real} real{how}"

