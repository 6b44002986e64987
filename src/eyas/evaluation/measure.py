"""Measuring a draft on a prompt set: every turn decoded speculatively (once per ``K``) and plainly, one prompt at
a time, on the same conversation (a later turn follows the verifier's own answer to the one before), with
each greedy difference located and classified; :func:`summarize` gives one ``K``'s figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.data.chat import encode_prompt
from eyas.core.errors import EyasError
from eyas.core.memory import free_memory
from eyas.engine.generate import SequenceDecoder
from eyas.draft.model import Eagle3Draft
from eyas.engine.speculative import DraftRunner, acceptance_stats, plain_generate, speculative_generate


# --------------------------------------------------------------------------- prompts and templates


@dataclass
class EvalPrompt:
    """A prompt of one or more user turns; each later turn follows the verifier's own answer to the one before
    (MT-Bench's second turn)."""

    id: str
    turns: list[str]
    system: str | None = None
    category: str | None = None  # MT-Bench's (writing, roleplay, ..., coding): the report's tau by category


def as_prompts(prompts: Any, *, num_prompts: int | None, seed: int) -> tuple[list[EvalPrompt], str, list[str]]:
    """Named set, local file, or (from Python) a list of prompts -> ``(prompts, description, dropped)``.

    Names and files go through :func:`eyas.data.datasets.load_prompts`, as in ``eyas prepare``; ``dropped`` is
    its report's line per reason a row was dropped (a record without turns, a line that is not JSON) or cut short
    (a turn of an unknown role: the turns before it kept), with the first rows numbered, so a measurement says
    which prompts it left out or shortened (empty for a list). A list may hold
    strings (one turn each), lists of strings (turns), dicts with ``turns`` or ``prompt``, or objects with
    ``turns`` (and optionally ``id``, ``system``).
    """
    if isinstance(prompts, (str, Path)):
        from eyas.data.datasets import load_prompts

        loaded, report = load_prompts(str(prompts), max_samples=num_prompts, seed=seed)
        plist = [EvalPrompt(str(p.id), list(p.turns), p.system, p.category) for p in loaded]
        return plist, report.source, [line.strip() for line in report.summary_lines()]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(EvalPrompt(str(i), [p]))
        elif isinstance(p, dict):
            turns = p.get("turns") or ([p["prompt"]] if "prompt" in p else None)
            if not turns:
                raise EyasError(f"prompt {i} has neither 'turns' nor 'prompt'")
            out.append(EvalPrompt(str(p.get("id", i)), list(turns), p.get("system"), p.get("category")))
        elif isinstance(p, (list, tuple)):
            out.append(EvalPrompt(str(i), [str(t) for t in p]))
        else:
            out.append(EvalPrompt(str(getattr(p, "id", i)), list(p.turns), getattr(p, "system", None),
                                  getattr(p, "category", None)))  # fmt: skip
    if not out:
        raise EyasError("no prompts to evaluate")
    return out[:num_prompts] if num_prompts else out, f"{len(out)} prompts given in Python", []


def conversation(p: EvalPrompt, answers: list[str], turn: int) -> list[dict[str, str]]:
    """The messages up to user turn ``turn``: system, then each earlier turn with its answer."""
    messages = [{"role": "system", "content": p.system}] if p.system else []
    for q, a in zip(p.turns[:turn], answers):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages + [{"role": "user", "content": p.turns[turn]}]


# --------------------------------------------------------------------------- decoding a prompt set


@dataclass
class Runners:
    """The decoders of one measurement, sharing one verifier model: the verifier for speculative decoding
    (capturing aux states; a graph per verification length ``K + 1`` of every ``K`` measured), the verifier for
    plain decoding (nothing attached: the baseline pays for no capture), and the draft."""

    spec: SequenceDecoder
    base: SequenceDecoder
    draft: DraftRunner
    draft_tokens: list[int]
    fused_rounds: bool = False  # greedy rounds as one graph each (speculative.GreedyRounds)

    @classmethod
    def build(cls, model, draft: Eagle3Draft, *, draft_tokens: list[int], max_len: int, cuda_graphs: bool = True,
              compile: bool = True, attention: str = "auto", fused_rounds: bool = False,
              freeze: bool | None = False, merge: bool = True) -> "Runners":  # fmt: skip
        """Decoders for conversations of ``max_len`` positions, every fixed-shape forward recorded up front.
        ``freeze``: compile the verifier's layers and the draft's forwards with their weights as constants
        (:func:`eyas.verifier.compile.compile_frozen`; neither changes while eval measures); ``None`` each where
        its copies of the weights are cheap (:func:`eyas.engine.graphs.freeze_fits`). ``merge``: where they compile,
        the verifier's and the draft's q/k/v and gate/up stored as one weight each, in place (one matmul each;
        :mod:`eyas.verifier.merged`)."""
        from eyas.engine.graphs import freeze_fits

        Ks = sorted(set(draft_tokens))
        kw = dict(capacity=max_len, cuda_graphs=cuda_graphs, compile=compile, attention=attention, freeze=freeze,
                  merge=merge)  # fmt: skip
        compile_draft = compile and cuda_graphs and draft.fc.weight.device.type == "cuda"
        # the draft compiles a shape per K's catch-up (its K + 1 fed positions) and its drafting step
        freeze_draft = freeze if freeze is not None else freeze_fits(draft.layers, shapes=len(Ks) + 1)
        r = cls(
            spec=SequenceDecoder(model, aux_layer_ids=draft.config.aux_layer_ids, graph_lengths=[K + 1 for K in Ks],
                                 **kw),  # fmt: skip
            base=SequenceDecoder(model, graph_lengths=(), **kw),  # plain steps: SequenceDecoder.decode's graphs
            draft=DraftRunner(draft, graph_max_tokens=max(Ks) + 1, cuda_graphs=cuda_graphs, compile=compile_draft,
                              freeze=compile_draft and freeze_draft, merge=merge),  # fmt: skip
            draft_tokens=Ks,
            fused_rounds=fused_rounds,
        )  # fmt: skip
        r.draft.reset(max_len)
        r._warm_up()
        return r

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Record every graph the timed loops can replay, outside the timing: the plain (greedy) step and each
        verification length at every key-length bucket up to the capacity (through FlexAttention one key length
        serves them all: the rest replay), each K's acceptance (compiled) and catch-up over the K + 1 positions a
        round feeds, the draft's drafting step and its greedy K-step chains, and with ``fused_rounds`` each K's
        round at every bucket; and the prompts' forward, compiled with symbolic shapes, so that no turn's timing
        holds its compile. (Eager decoding, as on CPU, has nothing to prepare.)"""
        from eyas.engine.slots import FLEX_MAX_NEW, KEY_BUCKETS

        if not self.base.graphs.enabled:
            return
        cap = self.spec.capacity
        prompt = torch.arange(1, min(cap, 2 * FLEX_MAX_NEW + 1) + 1, device=self.spec.device)
        for decoder in (self.base, self.spec):  # the second one's hidden-state capture included
            decoder.forward(prompt, 0, last_only=True)
        starts = sorted({min(b, cap) for b in KEY_BUCKETS if b < cap} | {cap})
        Kmax = max(self.draft_tokens)
        ids = torch.arange(1, Kmax + 2, device=self.spec.device)
        verified = {}
        for end in starts:
            for _ in self.base.decode(ids[:1], end - 1, 1):  # the plain step (greedy) at this key bucket
                pass
            for K in self.draft_tokens:
                verified[K], aux = self.spec.forward(ids[: K + 1], end - K - 1)
        # fused rounds run up to three rounds past the last position while their graphs are recorded; rounds by
        # parts draft K more past the last round (speculative._greedy): one allocation for every turn to come
        self.draft.reset(cap + Kmax + (4 * (Kmax + 1) if self.fused_rounds else 0))
        at = torch.zeros(1, dtype=torch.long, device=ids.device)
        for K in self.draft_tokens:
            self.draft.outcome(verified[K], ids[1 : K + 1])  # the round's acceptance (compiled with the draft)
            logits, hidden = self.draft.catch_up_round(ids[: K + 1], aux[:1].expand(K + 1, -1), 0, at)
        self.draft.step(ids[:1], hidden, Kmax + 1)
        for K in self.draft_tokens:
            self.draft.propose(logits, hidden, Kmax + 1, K)
        if self.fused_rounds:  # each round's graph per key bucket
            with self.spec.session():
                for K in self.draft_tokens:
                    for end in starts:
                        self.draft.rounds(self.spec, K).run(end - K - 1)
        self.draft.reset(cap)


@dataclass
class SpecStats:
    """Speculative decoding at one ``K``: every round's accepted and kept counts, tokens and seconds."""

    accepted: list[int] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    # rounds and kept tokens by the turn's number (1: a prompt's first) and by the prompt's category
    by_turn: dict[int, list[int]] = field(default_factory=dict)
    by_category: dict[str, list[int]] = field(default_factory=dict)

    def add_turn(self, spec, *, turn: int, category: str | None) -> None:
        """Count one turn's speculative decoding (:func:`speculative_generate`'s result), turn ``turn``
        (numbered from 1) of a prompt of ``category``."""
        self.accepted += spec.accepted
        self.produced += spec.produced
        self.tokens += len(spec.tokens)
        self.seconds += spec.seconds
        for groups, key in ((self.by_turn, turn), (self.by_category, category)):
            if key is not None:
                counts = groups.setdefault(key, [0, 0])
                counts[0] += len(spec.produced)
                counts[1] += sum(spec.produced)


@dataclass
class Measurement:
    """What speculative decoding (per ``K``) and plain decoding of a prompt set produced."""

    spec: dict[int, SpecStats] = field(default_factory=dict)
    base_tokens: int = 0
    base_seconds: float = 0.0
    turn_ids: list[list[int]] = field(default_factory=list)  # every decoded turn's prompt ids, in order
    turns: int = 0
    # each turn too long for the decoders' capacity ({prompt, turn from 1, prompt_tokens}), its prompt's later
    # turns not decoded either (they would follow it)
    skipped: list[dict[str, Any]] = field(default_factory=list)


def conversation_bound(plist: list[EvalPrompt], tokenizer, *, max_new_tokens: int, draft_tokens: int) -> int:
    """Positions the longest conversation can need: its turns with every answer at ``max_new_tokens`` (plus slack
    for re-tokenising an answer) and one verification round past the end."""
    return max(len(encode_prompt(tokenizer, conversation(p, ["" for _ in p.turns[1:]], len(p.turns) - 1)))
               + len(p.turns) * (max_new_tokens + 16) for p in plist) + draft_tokens + 2  # fmt: skip


def measure(plist: list[EvalPrompt], tokenizer, runners: Runners, *, max_new_tokens: int, eos_ids: set[int],
            temperature: float = 0.0, seed: int = 0, baseline: bool = True,
            desc: str = "eyas eval") -> Measurement:  # fmt: skip
    """Decode every turn of every prompt speculatively (once per ``K``) and (with ``baseline``) plainly, one
    prompt at a time.

    A later turn follows the answer of plain decoding to the turn before (the verifier's own answer, greedy at
    ``T = 0``), so every loop decodes the same conversation; at ``T = 0`` every turn's outputs are compared.
    A turn whose prompt with ``max_new_tokens`` and a round past them would pass the decoders' capacity is not
    decoded, nor are its prompt's later turns: each is listed in the measurement's ``skipped``.
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
            ids = encode_prompt(tokenizer, conversation(p, answers, ti))
            if len(ids) + max_new_tokens + max(Ks) + 2 > runners.spec.capacity:  # conversation_bound's slack
                m.skipped.append({"prompt": p.id, "turn": ti + 1, "prompt_tokens": len(ids)})
                bar.update(len(p.turns) - ti)
                break
            m.turn_ids.append(ids)
            outs = {}
            for K in Ks:
                spec = speculative_generate(runners.spec, runners.draft, ids, draft_tokens=K, generator=g_spec[K],
                                            fused=runners.fused_rounds, **kw)  # fmt: skip
                m.spec[K].add_turn(spec, turn=ti + 1, category=p.category)
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
            answers.append(
                tokenizer.decode(
                    [t for t in answer if t not in eos_ids],
                    skip_special_tokens=True,
                    clean_up_tokenization_spaces=False,
                )
            )  # (5.17 warns otherwise)
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


def fp32_copy_fits(model, *, fraction: float = 0.5) -> bool:
    """Whether an fp32 copy of ``model`` (what :func:`recheck_fp32_turns` builds) takes under ``fraction`` of the
    memory free where its weights are: a small verifier, on one device. A big one (or one spread over several
    devices) is not copied without being asked."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return False
    (device,) = devices
    need = 4 * sum(p.numel() for p in model.parameters())
    free = free_memory(device)
    return free is not None and need < fraction * free


def recheck_fp32_turns(env: dict[str, Any], m: Measurement, *, max_new_tokens: int, bound: int,
                       only_real: bool = False) -> None:  # fmt: skip
    """Decode every mismatched turn again in fp32 (copies of the verifier and the draft), plainly and
    speculatively at the mismatch's ``K``: a turn whose two outputs agree in fp32 was a near-tie of the compute
    dtype (``fp32: "equal"``, kind ``near-tie``); one that still differs is a real difference. ``only_real``:
    only the turns the logit gap judged ``real`` (:func:`_divergence`'s two units in the last place are a rough
    bound: bf16 rounding through a 30-layer verifier parted SmolLM2's greedy outputs at a gap of 0.75, which
    fp32 decoding of the same turn showed a tie of the dtype)."""
    import copy

    bad = [(K, x) for K, s in m.spec.items() for x in s.mismatches if not only_real or x["kind"] == "real"]
    if not bad:
        return
    from eyas.verifier.load import cast_floating

    model32 = copy.deepcopy(env["model"])
    cast_floating(model32, torch.float32)  # `.float()` refuses a quantized model, GGUF's dequantized one included
    for b in model32.buffers():
        b.data = b.data.float() if b.is_floating_point() else b.data
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
        # where a prompt set's tau comes from: MT-Bench's second turns follow the verifier's own first answer,
        # its categories ask for different kinds of text
        "tau_by_turn": _taus(s.by_turn),
        "tau_by_category": _taus(s.by_category),
    }


def _taus(groups: dict[Any, list[int]]) -> dict[str, dict[str, float | int]]:
    """``{key: [rounds, kept tokens]}`` -> ``{str(key): {"tau", "rounds"}}``, in key order."""
    return {str(k): {"tau": kept / rounds if rounds else 0.0, "rounds": rounds}
            for k, (rounds, kept) in sorted(groups.items())}  # fmt: skip
