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
  The verifier's cache is cropped to the accepted prefix.

Acceptance is greedy at ``T = 0`` (accept while the draft token is the
verifier's argmax, then emit the verifier's token) and standard speculative
sampling at ``T > 0`` (Leviathan et al. 2023, Chen et al. 2023: accept with
``min(1, p/q)``, resample from ``norm(max(0, p - q))``, bonus from ``p``), both
lossless: greedy outputs equal plain greedy decoding token for token, sampled
outputs follow the verifier's distribution.

One prompt is decoded at a time (batch size 1, the latency setting speculative
decoding is for); the baseline is plain decoding of the same prompts through
the same forward and cache in the same run.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from eyas.errors import EyasError
from eyas.model import DraftConfig, Eagle3Draft
from eyas.verifier import varying_shape_attention

CompileMode = Literal["auto", "none", "default", "reduce-overhead"]
CacheKind = Literal["auto", "static", "dynamic"]


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


# --------------------------------------------------------------------------- the verifier with a rollback cache


def _set_cache_length(cache, length: int) -> None:
    """Roll a transformers cache back to its first ``length`` positions.

    A static cache keeps its buffers (their addresses are what CUDA graphs
    captured) and only moves its write pointer: stale entries past it are
    masked and then overwritten. A dynamic cache is cropped. Works on
    transformers 5.17 (no ``StaticLayer.crop``) and newer ones.
    """
    from transformers import StaticCache

    if isinstance(cache, StaticCache):
        lengths = [layer.cumulative_length for layer in cache.layers if getattr(layer, "is_initialized", False)]
        if lengths:  # two multi-tensor kernels for all layers, not one launch per layer (30 for SmolLM2)
            torch._foreach_mul_(lengths, 0)
            torch._foreach_add_(lengths, length)
        return
    current = int(cache.get_seq_length())
    if current > length:
        cache.crop(length - current)  # a negative count: the form every transformers 5 release accepts


def has_sliding_window(config) -> bool:
    """Whether the verifier has sliding-window attention layers (their static cache cannot be rolled back)."""
    from transformers import StaticCache

    return any(getattr(layer, "is_sliding", False) for layer in StaticCache(config=config, max_cache_len=1).layers)


#: The oldest transformers whose DynamicCache rolls a sliding-window layer back correctly, as proven by
#: tests/test_evaluate.py::test_sliding_window_verifier_rolls_back (5.17 has `activate_past_recording`, but
#: decoding with it recorded fails there: the sliding mask and the recorded keys disagree by one position).
SLIDING_ROLLBACK_MIN_TRANSFORMERS = (5, 24)


def sliding_rollback_supported() -> bool:
    """Whether this transformers can decode a sliding-window verifier with rollback."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) >= SLIDING_ROLLBACK_MIN_TRANSFORMERS


def cache_keyword(model) -> str:
    """The name the model's forward takes its KV cache by: transformers 5.24 renamed ``past_key_values`` to
    ``cache``; 5.17 (the GPU machine's) knows only the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class VerifierRunner:
    """The verifier's forward over new tokens with a KV cache that can be rolled back.

    :meth:`forward` returns full-vocab logits and, when aux layer ids were
    given, the aux states (captured by :class:`eyas.verifier.HiddenStateCapture`
    as they pass, in the draft's layer order). With ``compile_mode`` the
    fixed-shape decoding calls (``T`` = 1 or ``K + 1`` new tokens) run through
    ``torch.compile`` over a static cache; a prefill of any length runs eagerly.
    """

    def __init__(self, model, *, aux_layer_ids: list[int] | None, static: bool,
                 compile_mode: str | None = None, compiled_lengths: tuple[int, ...] = ()) -> None:  # fmt: skip
        from eyas.verifier import HiddenStateCapture

        self.model = model
        self.static = static
        self.device = next(model.parameters()).device
        self.capture = HiddenStateCapture(model, aux_layer_ids) if aux_layer_ids else None
        self._cache_kw = cache_keyword(model)
        if has_sliding_window(model.config):
            if static:
                raise EyasError("a static cache cannot roll back a sliding-window verifier (its buffer is circular): "
                                "use --cache dynamic")  # fmt: skip
            if not sliding_rollback_supported():
                import transformers

                need = ".".join(map(str, SLIDING_ROLLBACK_MIN_TRANSFORMERS))
                raise EyasError(f"speculative decoding of a sliding-window verifier needs transformers >= {need} (its "
                                f"caches roll back correctly from there); this is {transformers.__version__}")  # fmt: skip
        self.cache = None
        self.max_len = 0
        self.compiled_lengths = set(compiled_lengths) if compile_mode else set()
        self._compiled = torch.compile(self._forward, mode=compile_mode, dynamic=False) if compile_mode else None

    def __enter__(self) -> "VerifierRunner":
        if self.capture is not None:
            self.capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.capture is not None:
            self.capture.__exit__(*exc)

    def reset(self, max_len: int) -> None:
        """Start a new sequence of at most ``max_len`` positions (a static cache is kept and reused when large
        enough, so compiled graphs stay valid)."""
        from transformers import DynamicCache, StaticCache

        if self.static and self.cache is not None and max_len <= self.max_len:
            _set_cache_length(self.cache, 0)
            return
        cfg = self.model.config
        if self.static:
            self.max_len = max(max_len, 2 * self.max_len)
            self.cache = StaticCache(config=cfg, max_cache_len=self.max_len)
        else:
            self.max_len = max_len
            self.cache = DynamicCache(config=cfg)
            if hasattr(self.cache, "activate_past_recording"):  # sliding-window layers keep what a rollback needs
                self.cache.activate_past_recording()

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        _set_cache_length(self.cache, length)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                         logits_to_keep=logits_to_keep, **{self._cache_kw: self.cache})  # fmt: skip
        aux = self.capture.aux()[0] if self.capture is not None else None  # [T, 3H]
        return out.logits[0], aux  # [T', V]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start: int, *, last_only: bool = False):
        """``input_ids [T]`` at positions ``start..start+T-1`` -> (logits ``[T or 1, V]`` float32, aux
        ``[T, 3H]`` or None). The cache then holds ``start + T`` positions."""
        T = input_ids.shape[0]
        if start + T > self.max_len:
            raise EyasError(f"internal: {start + T} positions exceed the verifier cache of {self.max_len}")
        pos = torch.arange(start, start + T, device=self.device)[None]  # [1, T]
        if self._compiled is not None and T in self.compiled_lengths and not last_only:
            torch.compiler.cudagraph_mark_step_begin()
            logits, aux = self._compiled(input_ids[None], pos, 0)
            # CUDA-graph outputs live in a pool the next replay overwrites: copy what the caller keeps.
            return logits.float().clone(), None if aux is None else aux.clone()
        # Eager forwards (prefills of any length; every decoding step with a dynamic cache, whose key length
        # grows) see a new shape almost every call: no cuDNN attention plan per shape (eyas.verifier).
        with varying_shape_attention(self.device):
            logits, aux = self._forward(input_ids[None], pos, 1 if last_only else 0)
        return logits.float(), aux


# --------------------------------------------------------------------------- the draft with its cache


class DraftRunner:
    """The draft's step function over its position-indexed cache, plus the draft-to-target vocab map."""

    def __init__(self, draft: Eagle3Draft, *, compile_mode: str | None = None, compiled_max_tokens: int = 0) -> None:
        self.draft = draft
        p = draft.fc.weight
        self.device, self.dtype = p.device, p.dtype
        self.to_target = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=self.device))
        self.cache = None
        self.max_len = 0
        self._step = torch.compile(self._run, mode=compile_mode, dynamic=False) if compile_mode else self._run
        self.compiled = compile_mode is not None
        self.compiled_max_tokens = compiled_max_tokens if self.compiled else 1 << 30

    def reset(self, max_len: int) -> None:
        if self.cache is not None and max_len <= self.max_len:
            self.cache.truncate(0)
            return
        self.max_len = max(max_len, 2 * self.max_len)
        self.cache = self.draft.new_cache(batch_size=1, max_len=self.max_len)
        if self.compiled:  # the cache is mutated in place: give CUDA graphs fixed addresses
            for t in (self.cache.k, self.cache.v, self.cache.valid):
                torch._dynamo.mark_static_address(t)

    def _run(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor):
        normed, next_hidden = self.draft.step(input_ids, hidden, position_ids, self.cache)
        return self.draft.compute_logits(normed[:, -1])[0].float(), next_hidden[:, -1:]  # [N], [1, 1, H]

    @torch.no_grad()
    def catch_up(self, next_ids: torch.Tensor, aux: torch.Tensor, start: int):
        """Positions ``start..start+T-1`` from the verifier: tokens ``next_ids [T]`` (each position's next
        token) with the verifier's aux states ``aux [T, 3H]``. Returns the draft logits ``[N]`` at the last
        position and its ``next_hidden [1, 1, H]``."""
        T = next_ids.shape[0]
        pos = torch.arange(start, start + T, device=self.device)[None]  # [1, T]
        hidden = self.draft.fuse(aux[None].to(self.dtype))  # [1, T, H]
        if T <= self.compiled_max_tokens:  # after a verification round: 1..K+1 positions, one graph each
            return self._step(next_ids[None], hidden, pos)
        return self._run(next_ids[None], hidden, pos)  # a prompt's length varies: eager

    @torch.no_grad()
    def step(self, token: torch.Tensor, hidden: torch.Tensor, position: int):
        """One drafting step: the previous draft ``token [1]`` and ``next_hidden`` at ``position``."""
        pos = torch.full((1, 1), position, device=self.device, dtype=torch.long)
        # hidden may be a [1, 1, H] view of a longer output: give it the one stride compiled graphs were built for
        return self._step(token[None], hidden.view(-1).view(1, 1, -1), pos)


# --------------------------------------------------------------------------- decoding loops


@dataclass
class Generation:
    """One decoded turn: the new tokens (cut after an end-of-turn token or at ``max_new_tokens``) and, for
    speculative decoding, the draft tokens accepted and proposed in each round."""

    tokens: list[int]
    seconds: float
    accepted: list[int] = field(default_factory=list)
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


@torch.no_grad()
def plain_generate(verifier: VerifierRunner, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> Generation:  # fmt: skip
    """Plain decoding, one verifier forward per token (the baseline, and the reference for losslessness)."""
    dev = verifier.device
    _sync(dev)
    t0 = time.perf_counter()
    n = len(prompt_ids)
    verifier.reset(n + max_new_tokens + 1)
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
def speculative_generate(verifier: VerifierRunner, draft: DraftRunner, prompt_ids: list[int], *, max_new_tokens: int,
                         draft_tokens: int, eos_ids: set[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> Generation:  # fmt: skip
    """Speculative decoding of one prompt (see the module docstring for the loop's semantics).

    Invariant at the top of each round: the verifier's cache holds positions
    ``0..m-1``; the last emitted token ``x_m`` is not yet fed to it; the draft's
    cache holds positions ``0..m-1``, each computed from the verifier's state there.
    """
    dev, K = verifier.device, draft_tokens
    _sync(dev)
    t0 = time.perf_counter()
    n = len(prompt_ids)
    verifier.reset(n + max_new_tokens + K + 1)
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
        logits, aux = verifier.forward(torch.cat([last, proposal]), m)  # [K+1, V], [K+1, 3H]
        if temperature == 0:
            accepted, nxt = verify_greedy(logits[None], proposal[None])
        else:
            accepted, nxt = verify_sampled(torch.softmax(logits / temperature, -1)[None], torch.stack(q)[None],
                                           proposal[None], generator=generator)  # fmt: skip
        host = torch.cat([accepted, nxt, proposal]).tolist()  # the round's one device->host sync
        a = host[0]
        out.accepted.append(a)
        out.proposals.append(host[2:])
        tokens, done = _finish(tokens + host[2 : 2 + a] + [host[1]], max_new_tokens, eos_ids)
        verifier.rollback(m + a + 1)  # keep `last` and the accepted drafts
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


def acceptance_stats(accepted: list[int], draft_tokens: int) -> dict[str, Any]:
    """tau and per-position acceptance from the accepted count of every speculative round.

    ``tau`` = tokens produced per verifier forward = mean over rounds of
    ``accepted + 1`` (vLLM's mean acceptance length, ``1 + accepted / drafts``).
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
    return {
        "tau": (sum(accepted) + rounds) / rounds if rounds else 0.0,
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


def end_of_turn_ids(tokenizer) -> set[int]:
    """The ids that end an assistant turn: the control token the chat template writes right after an
    assistant message (``<|im_end|>`` in ChatML) plus the tokenizer's EOS.

    Passed explicitly to every decoding loop: on the GPU machine, ``generate`` on the GGUF SmolLM2 ran past
    ``<|im_end|>`` when left to its defaults.
    """
    from eyas.verifier import end_of_turn_token

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    answer = "eyas probe answer"
    with contextlib.suppress(Exception):  # a template that cannot render the probe still leaves the EOS
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
        eot = end_of_turn_token(tokenizer, tokenizer.apply_chat_template(probe, tokenize=False), answer)
        if eot is not None:
            ids.add(tokenizer.convert_tokens_to_ids(eot))
    if not ids:
        raise EyasError("the verifier's tokenizer has no EOS token and its chat template no end-of-turn token")
    return ids


def _conversation(p: EvalPrompt, answers: list[str], turn: int) -> list[dict[str, str]]:
    """The messages up to user turn ``turn``: system, then each earlier turn with its answer."""
    messages = [{"role": "system", "content": p.system}] if p.system else []
    for q, a in zip(p.turns[:turn], answers):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages + [{"role": "user", "content": p.turns[turn]}]


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied as the verifier's tokenizer ships it (no second BOS: the template writes it)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    from eyas.verifier import build_final_norm, load_head_tensors

    reader = FeatureReader(features, dtype=torch.float32)
    if list(reader.layer_ids) != list(draft.config.aux_layer_ids):
        raise EyasError(f"{features} holds aux layers {reader.layer_ids}, the draft reads "
                        f"{draft.config.aux_layer_ids}; extract features with the draft's --layers")  # fmt: skip
    rows = pick_offline_rows(rows, num_rows=len(reader), max_rows=max_rows)
    norm = build_final_norm(info, dtype=torch.float32, device=str(device))
    head = load_head_tensors(info, dtype=torch.float32, device=device).lm_head  # [V, H]
    reached = torch.zeros(steps, dtype=torch.long)  # per step: counted positions whose earlier steps were right
    right = torch.zeros(steps, dtype=torch.long)
    for i in rows:
        row = reader[i]
        T = row.input_ids.shape[0]
        if T < steps + 2:
            continue
        last = row.last_hidden_state.to(device)
        greedy = torch.cat([(norm(last[s : s + chunk]) @ head.T).argmax(-1) for s in range(0, T, chunk)])  # [T]
        length = ttt_chain_lengths(draft, row.input_ids.to(device), row.aux_hidden_states.to(device), greedy,
                                   steps=steps).cpu()  # fmt: skip
        mask = row.loss_mask.bool()
        t = torch.arange(length.shape[0])
        for k in range(steps):
            valid = mask[t + 2 + k]
            reached[k] += int((valid & (length >= k)).sum())
            right[k] += int((valid & (length > k)).sum())
    cond = [float(right[k]) / float(reached[k]) if reached[k] else 0.0 for k in range(steps)]
    return {"features": str(features), "rows": len(rows), "positions": int(reached[0]),
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


def _validation_rows(manifest: dict[str, Any]) -> list[int] | None:
    """The validation rows the train stage recorded (``val_rows`` in its outputs or settings), if any."""
    for section in ("outputs", "settings"):
        val = (manifest.get(section) or {}).get("val_rows")
        if isinstance(val, list) and val:
            return [int(r) for r in val]
    return None


# --------------------------------------------------------------------------- the stage

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}  # fmt: skip


@dataclass
class Runners:
    """The three decoding engines of one measurement, sharing one verifier model: the verifier for speculative
    decoding (capturing aux states), the verifier for plain decoding (no capture), and the draft."""

    spec: VerifierRunner
    base: VerifierRunner
    draft: DraftRunner
    draft_tokens: int
    compile_mode: str | None
    static: bool

    @classmethod
    def build(cls, model, draft: Eagle3Draft, *, draft_tokens: int, static: bool, compile_mode: str | None,
              max_len: int) -> "Runners":  # fmt: skip
        """Runners with caches for ``max_len`` positions, the fixed decoding shapes compiled and warmed up."""
        K = draft_tokens
        if compile_mode:
            # One graph per decoding shape: verifier 1 and K+1 tokens, draft 1..K+1 positions, per runner.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 8 * (K + 4)))
        r = cls(
            spec=VerifierRunner(model, aux_layer_ids=draft.config.aux_layer_ids, static=static,
                                compile_mode=compile_mode, compiled_lengths=(K + 1,)),
            base=VerifierRunner(model, aux_layer_ids=None, static=static, compile_mode=compile_mode,
                                compiled_lengths=(1,)),
            draft=DraftRunner(draft, compile_mode=compile_mode, compiled_max_tokens=K + 1),
            draft_tokens=K, compile_mode=compile_mode, static=static,
        )  # fmt: skip
        for runner in (r.spec, r.base, r.draft):  # one cache each for the run: static buffers keep their addresses
            runner.reset(max_len)
        if compile_mode:
            r._warm_up(max_len)
        return r

    @torch.no_grad()
    def _warm_up(self, max_len: int) -> None:
        """Compile (and, with CUDA graphs, record) every fixed shape the timed loops use, outside the timing:
        verifier forwards over 1 (plain) and K + 1 (verification) tokens, draft steps over 1..K+1 positions.
        Each cache is first filled by an eager prefill, so static buffers are allocated outside any graph."""
        K = self.draft_tokens
        ids = torch.arange(1, K + 3, device=self.spec.device)
        for _ in range(3):  # cudagraph trees: warm up, record, replay
            self.base.reset(max_len)
            self.base.forward(ids[:2], 0, last_only=True)
            self.base.forward(ids[2:3], 2)
            with self.spec:
                self.spec.reset(max_len)
                _, aux = self.spec.forward(ids, 0)  # K + 2 tokens: eager, fills the cache
                _, aux = self.spec.forward(ids[: K + 1], 0)
            self.draft.reset(max_len)
            self.draft.catch_up(ids, torch.cat([aux, aux[:1]]), 0)  # K + 2 positions: eager
            for T in range(1, K + 2):
                _, hidden = self.draft.catch_up(ids[:T], aux[:T], 0)
            self.draft.step(ids[:1], hidden, K + 1)


@dataclass
class Measurement:
    """What speculative and plain decoding of a prompt set produced."""

    accepted: list[int] = field(default_factory=list)
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    base_tokens: int = 0
    base_seconds: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
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
    """Decode every turn of every prompt speculatively and (with ``baseline``) plainly, one prompt at a time.

    A later turn follows the answer of plain decoding to the turn before (the verifier's own answer, greedy at
    ``T = 0``), so both loops decode the same conversation; at ``T = 0`` every turn's two outputs are compared.
    """
    from tqdm.auto import tqdm

    K = runners.draft_tokens
    dev = runners.spec.device
    g_spec = torch.Generator(device=dev).manual_seed(seed)
    g_base = torch.Generator(device=dev).manual_seed(seed + 1)
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature)
    m = Measurement()
    bar = tqdm(total=sum(len(p.turns) for p in plist), desc=desc, unit="turn")
    for p in plist:
        answers: list[str] = []
        for ti in range(len(p.turns)):
            ids = encode_prompt(tokenizer, _conversation(p, answers, ti))
            m.turn_ids.append(ids)
            with runners.spec:
                spec = speculative_generate(runners.spec, runners.draft, ids, draft_tokens=K, generator=g_spec, **kw)
            m.accepted += spec.accepted
            m.spec_tokens += len(spec.tokens)
            m.spec_seconds += spec.seconds
            answer = spec.tokens
            if baseline:
                base = plain_generate(runners.base, ids, generator=g_base, **kw)
                m.base_tokens += len(base.tokens)
                m.base_seconds += base.seconds
                answer = base.tokens
                if temperature == 0 and base.tokens != spec.tokens:
                    first = next((i for i, (x, y) in enumerate(zip(base.tokens, spec.tokens)) if x != y),
                                 min(len(base.tokens), len(spec.tokens)))  # fmt: skip
                    m.mismatches.append({"prompt": p.id, "turn": ti, "first_difference": first,
                                         **_divergence(runners.base.model, ids, base.tokens, spec.tokens, first)})
            answers.append(tokenizer.decode([t for t in answer if t not in eos_ids], skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False))  # (5.17 warns otherwise)
            m.turns += 1
            bar.update(1)
            bar.set_postfix(tau=f"{acceptance_stats(m.accepted, K)['tau']:.2f}")
    bar.close()
    return m


@torch.no_grad()
def _divergence(model, prompt_ids: list[int], plain: list[int], spec: list[int], at: int) -> dict[str, Any]:
    """Where two greedy outputs part: the verifier's logits there, from one fresh forward over the common prefix.

    A gap between the two tokens' logits near the dtype's rounding (bf16: a few hundredths) means a near-tie
    that one forward over K+1 tokens and one over 1 token round differently; a large gap means a bug.
    """
    if at >= min(len(plain), len(spec)):
        return {"logit_gap": None}
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + plain[:at]], device=dev)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    return {"plain_token": plain[at], "spec_token": spec[at],
            "logit_gap": float(logits[plain[at]] - logits[spec[at]])}  # fmt: skip


def summarize(m: Measurement, *, draft_tokens: int, temperature: float, baseline: bool) -> dict[str, Any]:
    """The report's measured figures: acceptance statistics, losslessness, speeds and speedup."""
    spec_tps = m.spec_tokens / m.spec_seconds if m.spec_seconds else 0.0
    base_tps = m.base_tokens / m.base_seconds if m.base_seconds else None
    return {
        **acceptance_stats(m.accepted, draft_tokens),
        "lossless": (not m.mismatches) if (baseline and temperature == 0) else None,
        "mismatches": m.mismatches,
        "tokens_per_s": spec_tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps if base_tps else None,
        "num_turns": m.turns,
        "generated_tokens": m.spec_tokens,
    }


def _report_paths(out: str | Path) -> tuple[Path, Path]:
    """``--out report.json`` names the report (the histogram goes beside it); any other path is a directory."""
    p = Path(out)
    if p.suffix == ".json":
        return p, p.with_name(p.stem + "_accepted_lengths.png")
    return p / "report.json", p / "accepted_lengths.png"


def device_and_dtype(device: str | None, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` (default: cuda when there is one) and ``--dtype`` (auto: bf16 on a GPU, fp32 on CPU)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise EyasError(f"--dtype must be auto, fp32, bf16 or fp16, got {dtype!r}")
    return dev, _DTYPES[dtype]


def setup(*, verifier: str, draft: str, device: str | None = None, dtype: str = "auto", seed: int = 0,
          trust_remote_code: bool = False) -> dict[str, Any]:  # fmt: skip
    """Load what a measurement needs once: the verifier (info, model, tokenizer, end-of-turn ids) and the draft
    (a checkpoint dir, or 'random'), on ``device`` in ``dtype``."""
    from eyas.checkpoint import load_draft
    from eyas.verifier import build_text_model, load_tokenizer, resolve

    dev, dt = device_and_dtype(device, dtype)
    info = resolve(verifier)
    tokenizer = load_tokenizer(info, trust_remote_code=trust_remote_code)
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
    draft_tokens: int = 3,
    temperature: float = 0.0,
    seed: int = 0,
    offline: str | None = None,
    offline_rows: int = 256,
    device: str | None = None,
    dtype: str = "auto",
    cache: CacheKind = "auto",
    compile: CompileMode = "auto",
    baseline: bool = True,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Measure a draft by real speculative decoding on the verifier: tau, per-position acceptance, losslessness,
    and the speedup over plain decoding of the same prompts in the same run.

    Each prompt's turns are decoded in order through the verifier's chat template; a later turn (MT-Bench's
    second) follows the verifier's own plain-decoded answer to the turn before, so both loops see the same
    conversation. Prints a table; ``--out`` writes the report as JSON and a PNG histogram of accepted lengths.

    Args:
        verifier: the verifier checkpoint (dir, .gguf file, 'smollm2' or hub id).
        draft: a draft checkpoint dir (speculators eagle3 format, as `eyas train` writes it), or 'random' for an
            untrained draft (the floor of acceptance).
        prompts: 'mt-bench', 'humaneval', or a local JSON/JSONL/parquet file of prompts or conversations.
        out: where to write the report: a .json path (the histogram PNG goes beside it) or a directory.
        num_prompts: evaluate this many prompts (a seeded sample); default all.
        max_new_tokens: new tokens per turn at most (decoding also stops at the end-of-turn token).
        draft_tokens: K, the draft tokens proposed per round.
        temperature: 0 for greedy acceptance; above 0 speculative sampling at this temperature.
        seed: seeds the prompt sample and all sampling.
        offline: an `eyas extract` features dir: also predict tau from the draft's per-step conditional accuracy
            on those features (the validation rows the train stage recorded, else the first --offline-rows).
        offline_rows: rows of --offline features to use at most.
        device: cuda or cpu (default: cuda when available).
        dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16.
        cache: the verifier's KV cache: static (CUDA graphs can capture it) or dynamic; auto picks static on CUDA.
        compile: torch.compile mode for the fixed-shape decoding steps of both loops: none, default or
            reduce-overhead (CUDA graphs); auto picks reduce-overhead on CUDA and none on CPU.
        baseline: also run plain decoding (needed for the lossless check and the speedup).
        trust_remote_code: allow the verifier's tokenizer to run checkpoint code (never on by default).
    """
    from eyas.manifest import versions, write_json
    from eyas.verifier import chat_template_hash

    if draft_tokens < 1:
        raise EyasError(f"--draft-tokens must be at least 1, got {draft_tokens}")
    if temperature < 0:
        raise EyasError(f"--temperature must be 0 or more, got {temperature}")
    if offline:  # the shards --offline will read are hashed now: a damaged one stops eval before decoding
        from eyas.features import FeatureReader

        feats = FeatureReader(offline)
        scored = pick_offline_rows(_validation_rows(_draft_manifest(draft)), num_rows=len(feats), max_rows=offline_rows)
        feats.check_shards(feats.shards_of(scored))
    plist, source = _as_prompts(prompts, num_prompts=num_prompts, seed=seed)
    env = setup(verifier=verifier, draft=draft, device=device, dtype=dtype, seed=seed,
                trust_remote_code=trust_remote_code)  # fmt: skip
    dev, tokenizer, d = env["device"], env["tokenizer"], env["draft"]
    K = draft_tokens
    # auto: static on CUDA (CUDA graphs need it) unless sliding-window layers make it impossible to roll back
    sliding = has_sliding_window(env["model"].config)
    static = cache == "static" or (cache == "auto" and dev.type == "cuda" and not sliding)
    if compile == "auto":  # fixed shapes need the static cache; a growing dynamic one would recompile every token
        mode = "reduce-overhead" if static and dev.type == "cuda" else None
    else:
        mode = None if compile == "none" else compile
    bound = conversation_bound(plist, tokenizer, max_new_tokens=max_new_tokens, draft_tokens=K)
    runners = Runners.build(env["model"], d, draft_tokens=K, static=static, compile_mode=mode, max_len=bound)
    m = measure(plist, tokenizer, runners, max_new_tokens=max_new_tokens, eos_ids=env["eos_ids"],
                temperature=temperature, seed=seed, baseline=baseline)  # fmt: skip
    template_sha = chat_template_hash(tokenizer)
    report: dict[str, Any] = {
        **summarize(m, draft_tokens=K, temperature=temperature, baseline=baseline),
        "num_prompts": len(plist),
        "draft_tokens": K,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "prompts": source,
        "verifier": env["info"].path,
        "draft": str(draft),
        "draft_is_random": str(draft) == "random",
        "device": str(dev),
        "dtype": str(env["dtype"]).removeprefix("torch."),
        "cache": "static" if static else "dynamic",
        "compile": mode or "none",
        "batch_size": 1,
        "chat_template_sha256": template_sha,
        "end_of_turn_ids": sorted(env["eos_ids"]),
        "seed": seed,
        "versions": versions(),
    }
    trained_template = (env["draft_manifest"].get("inputs") or {}).get("chat_template_sha256")
    if trained_template and template_sha and trained_template != template_sha:
        report["warning"] = "the draft was trained on data rendered with another chat template"
    if offline:
        rows = _validation_rows(env["draft_manifest"])
        report["offline"] = offline_accuracy(d, env["info"], offline, steps=K, rows=rows, max_rows=offline_rows,
                                             device=dev)  # fmt: skip
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
                    f"{r['cache']} cache  compile={r['compile']}  batch 1"),
        ("tau (tokens per verifier forward)", f"{r['tau']:.3f}  over {r['rounds']} rounds"),
    ]  # fmt: skip
    if "predicted_tau" in r:
        rows.append(("tau predicted offline", f"{r['predicted_tau']:.3f}  (measured {r['tau']:.3f})"))
    rows += [
        ("acceptance per position", fmt(r["acceptance_per_position"]) + "  (unconditional)"),
        ("conditional acceptance", fmt(r["conditional_acceptance_per_position"]) + "  (given the previous accepted)"),
        ("accepted-length histogram", " ".join(map(str, r["accepted_length_histogram"])) + "  (0..K drafts accepted)"),
    ]
    if r["lossless"] is not None:
        bad = len(r["mismatches"])
        gaps = [abs(x["logit_gap"]) for x in r["mismatches"] if x.get("logit_gap") is not None]
        why = f"; logit gap at the first difference <= {max(gaps):.3g} (a near-tie in {r['dtype']}?)" if gaps else ""
        rows.append(("lossless (== plain greedy)", "yes" if r["lossless"] else f"NO: {bad} turn(s) differ{why}"))
    speed = f"{r['tokens_per_s']:.1f} tokens/s"
    if r["baseline_tokens_per_s"]:
        speed += f"  vs plain {r['baseline_tokens_per_s']:.1f}: speedup {r['speedup']:.2f}x"
    rows.append(("speed", speed))
    if r.get("warning"):
        rows.append(("warning", r["warning"]))
    if r.get("report_json"):
        rows.append(("report", f"{r['report_json']}  (histogram {r['histogram_png']})"))
    width = max(len(k) for k, _ in rows)
    print("\neyas eval")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
