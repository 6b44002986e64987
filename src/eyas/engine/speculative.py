"""Speculative decoding of one prompt on the verifier, and plain decoding as its baseline and reference.

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
  from there: :class:`eyas.engine.generate.SequenceDecoder`).

Acceptance is greedy at ``T = 0`` (accept while the draft token is the
verifier's argmax, then emit the verifier's token) and standard speculative
sampling at ``T > 0`` (Leviathan et al. 2023, Chen et al. 2023: accept with
``min(1, p/q)``, resample from ``norm(max(0, p - q))``, bonus from ``p``), both
lossless: greedy outputs equal plain greedy decoding token for token, sampled
outputs follow the verifier's distribution.

Both loops decode one prompt at a time through :class:`eyas.engine.generate.SequenceDecoder` (slot cache, CUDA
graphs); :func:`acceptance_stats` turns the rounds' accepted counts into tau and per-position acceptance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from eyas.core.errors import EyasError
from eyas.engine.generate import SequenceDecoder
from eyas.draft.model import Eagle3Draft
from eyas.verifier.compile import CompiledOrEager


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


def fed_tokens(proposal: torch.Tensor, nxt: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The token each of a round's K + 1 fed positions reads in the draft's catch-up (position m + j reads token
    x_{m+j+1}): the accepted drafts of ``proposal [K]``, then the verifier's next token ``nxt [1]`` at index
    ``accepted [1]``; past it, rejected drafts, garbage a later forward overwrites before it is read."""
    return torch.cat([proposal, nxt]).index_copy(0, accepted, nxt)


def greedy_outcome(logits: torch.Tensor, proposal: torch.Tensor):
    """A greedy round's acceptance from the verifier's ``logits [K+1, V]`` over the last token and the drafts
    ``proposal [K]`` -> (accepted ``[1]``, the next token ``[1]``, the outcome the host reads ``[accepted, next,
    proposal...]`` ``[K+2]``, and the tokens the draft's catch-up reads at the K + 1 fed positions ``[K+1]``,
    :func:`fed_tokens`)."""
    accepted, nxt = verify_greedy(logits[None], proposal[None])  # [1], [1]
    return accepted, nxt, torch.cat([accepted, nxt, proposal]), fed_tokens(proposal, nxt, accepted)


class DraftRunner:
    """The draft's step function over its position-indexed cache, plus the draft-to-target vocab map.

    Its fixed shapes (catching up the K + 1 positions a round fed, one drafting step) are CUDA graphs on CUDA
    (:class:`eyas.engine.graphs.Graphs`); a prompt's catch-up of any length runs eagerly. With ``compile``, those
    fixed-shape forwards run through ``torch.compile`` (static shapes): at batch 1 a draft forward is about 120
    small kernels eagerly (embedding, RoPE, norms, the cache write and mask, the MLP, the head), three a round,
    and a graph replays every one of them; compiled, inductor fuses the elementwise ones. The verifier's layers
    are compiled the same way (:func:`eyas.verifier.compile.compiled_layers`).

    ``freeze`` (with ``compile``) compiles them with the draft's weights as constants, so its layer's gate/up are
    one matmul, and q/k/v another where they have one shape (:func:`eyas.verifier.compile.compile_frozen`; each
    shape compiled holds its copy
    of those weights). Only for a draft whose weights no longer change, as eval's (loaded from its checkpoint):
    weights updated in place later would not be seen. ``merge`` (with ``compile``) stores its layers' q/k/v and
    gate/up as one weight each, in place, so compiled they are one matmul each without freezing
    (:func:`eyas.verifier.merged.merge_projections`).
    """

    def __init__(self, draft: Eagle3Draft, *, graph_max_tokens: int = 0, cuda_graphs: bool = True,
                 compile: bool = False, freeze: bool = False, merge: bool = True) -> None:  # fmt: skip
        from eyas.engine.graphs import Graphs
        from eyas.verifier.compile import compile_frozen, compile_options, raise_recompile_limit
        from eyas.verifier.merged import merge_projections

        self.draft = draft
        p = draft.fc.weight
        self.device, self.dtype = p.device, p.dtype
        self.to_target = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=self.device))
        self.cache = None
        self.max_len = 0
        self.graphs = Graphs(self.device, enabled=cuda_graphs)
        self.graph_max_tokens = graph_max_tokens
        self._static: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self._rounds: dict[tuple[int, int], GreedyRounds] = {}
        forward = outcome = None
        if compile:
            raise_recompile_limit()  # a shape per catch-up length, again for each new cache
            if merge:  # its layers' q/k/v and gate/up one matmul each (eyas.verifier.merged)
                merge_projections(draft)
            forward = compile_frozen(self._forward) if freeze else \
                torch.compile(self._forward, dynamic=False, options=compile_options(False))  # fmt: skip
            outcome = torch.compile(greedy_outcome, dynamic=False, options=compile_options(False))
        self.compiled_forward = CompiledOrEager(self._forward, forward, "the draft's forward")
        # a greedy round's acceptance compiled with the draft: its argmax, then one or two kernels where eagerly
        # the comparison, the running product, the sum, the gather and the concatenations are eight launches
        self.outcome = CompiledOrEager(greedy_outcome, outcome, "a round's acceptance")
        self.frozen = compile and freeze

    def reset(self, max_len: int) -> None:
        if self.cache is not None and max_len <= self.max_len:
            self.cache.truncate(0)
            return
        self.max_len = max(max_len, 2 * self.max_len)
        self.cache = self.draft.new_cache(batch_size=1, max_len=self.max_len)
        self.graphs.graphs.clear()  # recorded against the old cache's buffers
        self._rounds.clear()

    def rounds(self, verifier: SequenceDecoder, K: int) -> "GreedyRounds":
        """The fused greedy rounds of ``K`` drafts against ``verifier`` (one per pair, kept with the cache)."""
        key = (id(verifier), K)
        if key not in self._rounds:
            self._rounds[key] = GreedyRounds(verifier, self, K)
        return self._rounds[key]

    def _forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                 fuse: bool = False, at: torch.Tensor | None = None):  # fmt: skip
        """One draft forward over the cache -> the logits ``[N]`` at the last position (at index ``at [1]``, a
        device tensor, when given) and its ``next_hidden`` ``[1, 1, H]``; with ``fuse``, ``hidden`` is the
        verifier's aux states ``[1, T, 3H]``, fused first."""
        if fuse:
            hidden = self.draft.fuse(hidden)
        normed, next_hidden = self.draft.step(input_ids, hidden, position_ids, self.cache)
        if at is None:
            return self.draft.compute_logits(normed[:, -1])[0].float(), next_hidden[:, -1:]  # [N], [1, 1, H]
        return self.draft.compute_logits(normed.index_select(1, at)[:, 0])[0].float(), next_hidden.index_select(1, at)

    def _run(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, fuse: bool = False,
             at: torch.Tensor | None = None):  # fmt: skip
        """:meth:`_forward` at a fixed shape: compiled with ``compile`` (eager from the first time compiling fails,
        after one note; the graphs run it twice eagerly before recording, so a failure comes before a capture)."""
        return self.compiled_forward(input_ids, hidden, position_ids, fuse, at)

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
        return self._catch_up("catch_up", next_ids, aux, start)

    def _catch_up(self, kind: str, ids: torch.Tensor, aux: torch.Tensor, start: int,
                  at: torch.Tensor | None = None):  # fmt: skip
        """The draft over ``ids [T]`` and ``aux [T, 3H]`` at ``start..``: a graph keyed by ``kind`` for a fixed
        short length, eagerly for a prompt's (its length varies); outputs at the last position, or at ``at``."""
        T = ids.shape[0]
        pos = torch.arange(start, start + T, device=self.device)[None]  # [1, T]
        aux = aux[None].to(self.dtype)  # [1, T, 3H]
        extra = () if at is None else (at,)
        if T <= self.graph_max_tokens and self.graphs.enabled:
            return self._graphed(kind, (ids[None], aux, pos, *extra), lambda *x: self._run(*x[:3], True, *x[3:]))
        return self._forward(ids[None], aux, pos, True, at)

    @torch.no_grad()
    def catch_up_round(self, fed: torch.Tensor, aux: torch.Tensor, start: int, accepted: torch.Tensor):
        """After a round, the ``K + 1`` positions the verifier fed from ``start``, whatever was accepted: each
        reads the token ``fed [K+1]`` that :func:`fed_tokens` gives it (from the round's proposal, the verifier's
        next token and ``accepted [1]``), with ``aux [K+1, 3H]`` the verifier's states there. Returns the draft
        logits ``[N]`` and ``next_hidden [1, 1, H]`` at index ``accepted`` (a device tensor: no host sync).

        One shape a round, as vLLM's padded drafter and :class:`GreedyRounds` run it: one compiled version and
        one graph instead of one per accepted count (K + 1 of each to compile and record before eval's loops
        run at speed). The positions past the accepted ones get garbage that the next round's drafting steps
        overwrite before a query at or after them reads them."""
        return self._catch_up("catch_up_round", fed, aux, start, accepted.reshape(1))

    def _chain(self, logits: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, K: int) -> torch.Tensor:
        drafted = [self.to_target[logits.argmax(-1, keepdim=True)]]  # [1] target ids
        for j in range(1, K):
            logits, hidden = self._run(drafted[-1][None], hidden, pos + (j - 1))
            drafted.append(self.to_target[logits.argmax(-1, keepdim=True)])
        return torch.cat(drafted)

    @torch.no_grad()
    def propose(self, logits: torch.Tensor, hidden: torch.Tensor, position: int | torch.Tensor,
                K: int) -> torch.Tensor:  # fmt: skip
        """Greedy drafting: ``K`` target ids ``[K]`` from the draft ``logits [N]`` of the last position and its
        ``next_hidden``, the steps after the first fed at ``position, position + 1, ..`` (an int, or a device
        tensor of one element: a position the host does not know yet). The K - 1 steps, the argmax and the vocab
        map are one CUDA graph (the same kernels as :meth:`step` K - 1 times, launched once)."""
        if isinstance(position, torch.Tensor):
            pos = position.reshape(1, 1).to(torch.long)
        else:
            pos = torch.full((1, 1), position, device=self.device, dtype=torch.long)
        if not self.graphs.enabled:
            return self._chain(logits, hidden.reshape(1, 1, -1), pos, K)
        key = ("chain", K)
        inputs = (logits, hidden.reshape(1, 1, -1), pos)
        if key not in self._static:
            self._static[key] = tuple(x.clone() for x in inputs)
        static = self._static[key]
        for s, x in zip(static, inputs):
            s.copy_(x)
        return self.graphs.run(key, lambda: self._chain(*static, K)).clone()

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
    """Plain decoding, one verifier forward per token (the baseline, and the reference for losslessness): the
    prompt's forward, then :meth:`SequenceDecoder.decode` (each step a graph with the token's pick inside, the
    host reading tokens a block at a time). At ``T > 0`` the steps sample at a uniform keyed by a
    seed drawn from ``generator`` (:func:`eyas.engine.generate.pick_tokens`)."""
    dev = verifier.device
    _sync(dev)
    t0 = time.perf_counter()
    n = len(prompt_ids)
    _check_room(verifier, n + max_new_tokens)
    with verifier.session():
        logits, _ = verifier.forward(torch.tensor(prompt_ids, device=dev), 0, last_only=True)
        tok = _pick(logits[-1], temperature, generator)
        tokens, done = _finish([int(tok)], max_new_tokens, eos_ids)
        seed = None
        if temperature > 0:
            at = generator.device if generator is not None else dev
            seed = torch.randint(2**62, (1,), generator=generator, device=at).to(dev)
        blocks = verifier.decode(tok, n, max_new_tokens - 1, temperature=temperature, seed=seed)
        while not done:
            tokens, done = _finish(tokens + next(blocks), max_new_tokens, eos_ids)
        blocks.close()
    _sync(dev)
    return Generation(tokens, time.perf_counter() - t0)


@torch.no_grad()
def speculative_generate(verifier: SequenceDecoder, draft: DraftRunner, prompt_ids: list[int], *,
                         max_new_tokens: int, draft_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None, fused: bool = False) -> Generation:  # fmt: skip
    """Speculative decoding of one prompt (see the module docstring for the loop's semantics). With ``fused``
    (greedy only), each round is one graph, :class:`GreedyRounds`.

    Invariant at the top of each round: the verifier's cache holds positions
    ``0..m-1``; the last emitted token ``x_m`` is not yet fed to it; the draft's
    cache holds positions ``0..m-1``, each computed from the verifier's state there.
    A round's accepted count is what the output keeps: draft tokens accepted past
    the end-of-turn token or ``max_new_tokens`` in the last round are not counted.
    """
    dev = verifier.device
    _sync(dev)
    t0 = time.perf_counter()
    _check_room(verifier, len(prompt_ids) + max_new_tokens + draft_tokens + 1)
    # fused rounds: recording a round's graph runs it three times, each past the last (see GreedyRounds); greedy
    # rounds by parts draft once more past the last round (_greedy)
    draft.reset(len(prompt_ids) + max_new_tokens + 2 * draft_tokens + 1 + (3 * (draft_tokens + 1) if fused else 0))
    with verifier.session():  # the verifier's attention switched once for the turn, not per forward
        if fused and temperature == 0:
            out = _greedy_rounds(verifier, draft, prompt_ids, max_new_tokens=max_new_tokens, K=draft_tokens,
                                 eos_ids=eos_ids)  # fmt: skip
        else:
            out = _speculative(verifier, draft, prompt_ids, max_new_tokens=max_new_tokens, K=draft_tokens,
                               eos_ids=eos_ids, temperature=temperature, generator=generator)  # fmt: skip
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    return out


def _speculative(verifier: SequenceDecoder, draft: DraftRunner, prompt_ids: list[int], *, max_new_tokens: int,
                 K: int, eos_ids: set[int], temperature: float,
                 generator: torch.Generator | None) -> Generation:  # fmt: skip
    logits, last, d_logits, hidden, out, done = _prompt(verifier, draft, prompt_ids, max_new_tokens=max_new_tokens,
                                                        eos_ids=eos_ids, temperature=temperature,
                                                        generator=generator)  # fmt: skip
    m = len(prompt_ids)  # position of `last`
    if temperature == 0:
        return _greedy(verifier, draft, out, done, last, d_logits, hidden, m, max_new_tokens=max_new_tokens, K=K,
                       eos_ids=eos_ids)  # fmt: skip
    while not done:
        drafted, q = [], []
        for j in range(K):
            if j:
                d_logits, hidden = draft.step(drafted[-1], hidden, m - 1 + j)
            probs = torch.softmax(d_logits / temperature, -1)  # [N] over the draft vocab
            drafted.append(draft.to_target[torch.multinomial(probs, 1, generator=generator)])
            q.append(torch.zeros_like(logits[-1]).index_copy_(0, draft.to_target, probs))  # [V], 0 off-vocab
        proposal = torch.cat(drafted)  # [K] target ids
        # The verifier's cache is rolled back to m by feeding from m: `last` and the K drafts.
        logits, aux = verifier.forward(torch.cat([last, proposal]), m)  # [K+1, V], [K+1, 3H]
        accepted, nxt = verify_sampled(torch.softmax(logits / temperature, -1)[None], torch.stack(q)[None],
                                       proposal[None], generator=generator)  # fmt: skip
        host = torch.cat([accepted, nxt, proposal]).tolist()  # the round's one device->host sync
        a, done = _account(out, host, max_new_tokens, eos_ids)
        draft.cache.truncate(m)  # drop drafted entries; recompute the accepted ones from the verifier
        last = nxt
        if not done:  # over all K + 1 fed positions
            d_logits, hidden = draft.catch_up_round(fed_tokens(proposal, nxt, accepted), aux, m, accepted)
        m += a + 1
    return out


def _greedy(verifier: SequenceDecoder, draft: DraftRunner, out: Generation, done: bool, last: torch.Tensor,
            d_logits: torch.Tensor, hidden: torch.Tensor, m: int, *, max_new_tokens: int, K: int,
            eos_ids: set[int]) -> Generation:  # fmt: skip
    """Greedy rounds by parts, each round's draft work queued before the host reads the round's outcome.

    After the verify forward and the acceptance, the outcome ``[accepted, next, proposal]`` is copied to the host
    behind an event (:class:`_Readback`), and the draft's catch-up over the K + 1 fed positions and the next
    round's K drafting steps (at a position on the device, ``m + accepted + 1``) are queued behind it; the host
    then waits for the copy alone, and does its accounting while the GPU runs the draft. The round's one sync no
    longer leaves the GPU idle while the host reads, counts, and launches the next draft's graphs. The last
    round's next drafts are never used (the draft cache is sized for them: :func:`speculative_generate`)."""
    proposal = draft.propose(d_logits, hidden, m, K) if not done else None  # [K] target ids
    while not done:
        # The verifier's cache is rolled back to m by feeding from m: `last` and the K drafts.
        logits, aux = verifier.forward(torch.cat([last, proposal]), m)  # [K+1, V], [K+1, 3H]
        accepted, nxt, outcome, fed = draft.outcome(logits, proposal)  # [1], [1], [K+2], [K+1]
        outcome = _Readback(outcome)
        draft.cache.truncate(m)  # drop drafted entries; recompute the accepted ones from the verifier
        d_logits, hidden = draft.catch_up_round(fed, aux, m, accepted)
        upcoming = draft.propose(d_logits, hidden, accepted + (m + 1), K)
        a, done = _account(out, outcome.get(), max_new_tokens, eos_ids)  # the round's one sync
        last, proposal = nxt, upcoming
        m += a + 1
    return out


class _Readback:
    """A device tensor's values for the host, without waiting for work queued after it: copied into pinned host
    memory (``non_blocking``) with an event recorded behind the copy; :meth:`get` waits for that event only."""

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def get(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def _prompt(verifier: SequenceDecoder, draft: DraftRunner, prompt_ids: list[int], *, max_new_tokens: int,
            eos_ids: set[int], temperature: float, generator: torch.Generator | None):  # fmt: skip
    """The prompt's forward, the first token and the draft's catch-up over the prompt -> (verifier logits,
    ``last [1]``, draft logits, ``next_hidden``, the :class:`Generation` begun, done)."""
    ids = torch.tensor(prompt_ids, device=verifier.device)
    logits, aux = verifier.forward(ids, 0, last_only=True)
    last = _pick(logits[-1], temperature, generator)  # [1]
    tokens, done = _finish([int(last)], max_new_tokens, eos_ids)
    # The draft's view of the prompt: position t reads token x_{t+1} and the verifier's state at t.
    d_logits, hidden = draft.catch_up(torch.cat([ids[1:], last]), aux, 0)
    return logits, last, d_logits, hidden, Generation(tokens, 0.0), done


def _account(out: Generation, host: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[int, bool]:
    """A round's ``[accepted, next token, proposal...]`` into ``out`` -> (accepted, done). What the output keeps
    past an end of turn or ``max_new_tokens`` is not counted as accepted."""
    a = host[0]
    before = len(out.tokens)
    out.tokens, done = _finish(out.tokens + host[2 : 2 + a] + [host[1]], max_new_tokens, eos_ids)
    kept = len(out.tokens) - before  # of the a + 1 tokens the round made
    out.accepted.append(min(a, kept))
    out.produced.append(kept)
    out.proposals.append(host[2:])
    return a, done


class GreedyRounds:
    """A whole greedy round as one CUDA graph per key length: the K - 1 drafting steps, the verifier's forward
    over ``last`` and the K drafts, the acceptance, and the draft's catch-up; the host replays it and reads
    ``[accepted, next token, proposal]`` once (the round's only sync).

    As in vLLM's padded drafter (``v1/spec_decode``'s ``propose`` with ``num_rejected_tokens`` kept on the GPU),
    the catch-up always runs over the ``K + 1`` positions the verifier fed, so its shape does not depend on the
    accepted count; the position ``m``, the last token and the draft's logits and state at the accepted prefix's
    end stay on the device. The positions past the accepted prefix get garbage that every later forward (the
    next round's drafting steps, its verify forward, its catch-up) overwrites before a query at or after them
    reads them, so neither cache needs truncating.
    """

    def __init__(self, verifier: SequenceDecoder, draft: DraftRunner, K: int) -> None:
        from eyas.engine.graphs import Graphs

        dev = verifier.device
        self.verifier, self.draft, self.K = verifier, draft, K
        self.graphs = Graphs(dev, enabled=verifier.graphs.enabled and draft.graphs.enabled,
                             compile_model=verifier.graphs.compile_model, freeze=verifier.graphs.freeze)  # fmt: skip
        cfg = draft.draft.config
        self.m = torch.zeros(1, dtype=torch.long, device=dev)  # position of `last`
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.d_logits = torch.zeros(cfg.draft_vocab_size, dtype=torch.float32, device=dev)
        self.hidden = torch.zeros(1, 1, cfg.hidden_size, dtype=draft.dtype, device=dev)
        self.out = torch.zeros(K + 2, dtype=torch.long, device=dev)  # [accepted, next, proposal]
        self.steps = torch.arange(K + 1, device=dev)

    def _round(self) -> None:
        v, d, K = self.verifier, self.draft, self.K
        proposal = d._chain(self.d_logits, self.hidden, self.m.view(1, 1), K)  # [K] target ids
        pos = (self.m + self.steps)[None]  # [1, K+1]
        v.slots.start.copy_(self.m)
        logits, aux = v._forward(torch.cat([self.last, proposal])[None], pos, 0)  # [K+1, V], [K+1, 3H]
        accepted, nxt, outcome, fed = d.outcome(logits, proposal)  # [1], [1], [K+2], [K+1]
        # the catch-up through the draft's compiled forward, as the rounds by parts run it (eagerly, a draft
        # forward is about 120 kernels inside the graph)
        d_logits, hidden = d._run(fed[None], aux[None].to(d.dtype), pos, True, accepted)  # [N], [1, 1, H]
        self.d_logits.copy_(d_logits)
        self.hidden.copy_(hidden)
        self.out.copy_(outcome)
        self.last.copy_(nxt)
        self.m.add_(accepted + 1)

    def run(self, m: int) -> list[int]:
        """One round from position ``m`` (the host's copy of ``self.m``) -> ``[accepted, next, proposal...]``."""
        v = self.verifier
        v.slots.keys = v.slots.key_length(m + self.K + 1, self.K + 1)
        self.graphs.run(("round", v.slots.keys), v._engage(self._round),
                        state=(self.m, self.last, self.d_logits, self.hidden))  # fmt: skip
        return self.out.tolist()


def _greedy_rounds(verifier: SequenceDecoder, draft: DraftRunner, prompt_ids: list[int], *, max_new_tokens: int,
                   K: int, eos_ids: set[int]) -> Generation:  # fmt: skip
    _, last, d_logits, hidden, out, done = _prompt(verifier, draft, prompt_ids, max_new_tokens=max_new_tokens,
                                                   eos_ids=eos_ids, temperature=0.0, generator=None)  # fmt: skip
    r = draft.rounds(verifier, K)
    m = len(prompt_ids)
    r.m.fill_(m)
    r.last.copy_(last)
    r.d_logits.copy_(d_logits)
    r.hidden.copy_(hidden.reshape(r.hidden.shape))
    while not done:
        a, done = _account(out, r.run(m), max_new_tokens, eos_ids)
        m += a + 1
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
