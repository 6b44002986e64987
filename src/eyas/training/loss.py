"""The draft's training objective and the metrics that predict its acceptance length.

Targets (DESIGN.md, "Final hidden state and targets"): the verifier's own final
norm over its stored *pre-norm* last hidden state, then only the draft-vocab
rows of its head, ``softmax(lm_head[d2t rows](norm(h_last)))``, scaled and
softcapped as the verifier's own head does (:class:`LogitScaling`). The verifier's
greedy token over the *full* vocab is kept too: a position whose true argmax is
outside the draft vocab can never be accepted, so accuracy counts it as a miss.

Index convention (vLLM's proposer, ``eyas.draft.model``): TTT step ``k`` at index
``t`` predicts token ``x_{t+2+k}``; its target is the verifier's distribution at
index ``t+1+k``; it counts where ``loss_mask[t+2+k]`` is set and ``t+2+k`` lies in
the same packed document as ``t``.

The loss is the forward KL ``KL(p_verifier || q_draft)`` over the draft vocab
(a soft cross-entropy: the verifier's entropy is a constant), summed over kept
positions and divided by the number of loss-masked positions of the whole
optimizer step across ranks (known before the step, so no rank waits on
another), then summed over steps with per-step weights. It is computed by
:func:`ttt_loss` in chunks of positions with the gradient formed in the forward
pass (as Liger-Kernel's fused linear cross-entropy does), so the draft logits
``[positions, draft_vocab]`` are never stored for backward: memory grows with
the chunk, not with the sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eyas.training.precision import add_matmul

#: Positions per chunk of the fused loss (its kernel is compiled for this one shape).
CHUNK_TOKENS = 1024

#: Columns of the per-step statistics that :func:`ttt_loss` returns (sums over positions).
STAT_COLUMNS = ("kl_sum", "kept", "valid", "correct", "cond_correct", "cond_total")


@dataclass
class Targets:
    """The verifier's side of one batch, flattened over positions (``M`` = batch x sequence, padded by
    ``pad`` rows at the end so that every step's shifted slice exists)."""

    logits: torch.Tensor  # [M + pad, N] verifier logits over the draft vocab (compute dtype)
    argmax: torch.Tensor  # [M + pad] long: the verifier's argmax inside the draft vocab (draft ids)
    in_vocab: torch.Tensor  # [M + pad] bool: the verifier's full-vocab argmax is a draft-vocab token


#: Families whose causal-LM head scales ``lm_head(norm(h))`` by a config value, and how, as their
#: ``*ForCausalLM.forward`` in transformers does (5.17 and 5.24): ``model_type -> (config key, operation)``.
#: A family absent here applies no scale; ``final_logit_softcapping`` is read from every family's config.
_LOGIT_SCALES: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), ("logit_scale", "mul")),  # `logits * self.logit_scale`
    # muP (Granite): `logits / config.logits_scaling`; MiniCPM3 divides the hidden state by it before the head
    # (the same up to rounding)
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "minicpm3"),
        ("logits_scaling", "div"),
    ),  # fmt: skip
    "hyperclovax": ("logits_scaling", "mul"),  # `lm_head(h) * config.logits_scaling` ("cf. Granite, which divides")
}


@dataclass(frozen=True)
class LogitScaling:
    """What the verifier's own head does to ``lm_head(norm(h))`` before its softmax: a scale (Cohere's
    ``logit_scale`` multiplies, Granite's ``logits_scaling`` divides) and then final-logit softcapping
    ``cap * tanh(logits / cap)`` (Gemma-2; Gemma-3 when its config sets it).

    The draft's soft targets must be the verifier's own distribution: without these its temperature is wrong
    (the argmax is not), and so is the acceptance of sampled drafts. Read from the text config with
    :meth:`of`; applied by :class:`TargetHead`, the one place eyas turns verifier states into logits.
    """

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> "LogitScaling":
        """From a transformers text config (its class's defaults apply: Gemma-2's softcap is 30 unless set)."""
        key, op = _LOGIT_SCALES.get(getattr(config, "model_type", None), (None, None))
        value = getattr(config, key, None) if key else None
        cap = getattr(config, "final_logit_softcapping", None)
        return cls(multiply=value if op == "mul" else None, divide=value if op == "div" else None,
                   softcap=cap or None)  # fmt: skip

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Scale and cap ``logits`` in place, in the order and form transformers' heads use; returns them."""
        if self.multiply is not None:
            logits.mul_(self.multiply)
        if self.divide is not None:
            logits.div_(self.divide)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


class TargetHead:
    """The verifier's final norm and head rows, frozen, producing :class:`Targets` from pre-norm states.

    ``rows`` are the head rows of the draft vocab in draft-id order (target ids
    ascending, as ``d2t`` orders them); ``rest`` the other rows (ascending
    target ids ``rest_ids``), used only to find whether the full-vocab argmax is
    a draft token. Ties are broken as ``torch.argmax`` over the full vocab
    would (the lowest target id wins), so the flag equals a full-vocab argmax
    without materialising ``[M, V]`` logits. ``scaling`` is what the verifier's head applies after the
    product (:class:`LogitScaling`), to the draft rows and the rest alike.
    """

    def __init__(self, *, norm: nn.Module, rows: torch.Tensor, draft_target_ids: torch.Tensor,
                 rest: torch.Tensor | None, rest_ids: torch.Tensor | None, scaling: LogitScaling,
                 chunk_tokens: int = 1024) -> None:  # fmt: skip
        self.norm = norm
        self.scaling = scaling
        self.rows = rows
        self.draft_target_ids = draft_target_ids
        self.rest = rest
        self.rest_ids = rest_ids
        self.chunk_tokens = chunk_tokens

    @classmethod
    def for_verifier(cls, info, *, rows: torch.Tensor, draft_target_ids: torch.Tensor, rest: torch.Tensor | None = None,
                     rest_ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> "TargetHead":  # fmt: skip
        """The head of the verifier ``info`` (:func:`eyas.verifier.load.resolve`) as its own forward applies it: its
        final-norm module and its family's :class:`LogitScaling`, over the given head rows (already on
        ``device`` in ``dtype``). Training's targets and ``eyas eval --offline`` both build theirs here."""
        from eyas.verifier.load import build_final_norm
        from eyas.verifier.info import transformers_text_config

        return cls(norm=build_final_norm(info, dtype=dtype, device=str(device)), rows=rows,
                   draft_target_ids=draft_target_ids, rest=rest, rest_ids=rest_ids,
                   scaling=LogitScaling.of(transformers_text_config(info)))  # fmt: skip

    @torch.no_grad()
    def __call__(self, last: torch.Tensor, *, pad: int, rows: torch.Tensor | None = None) -> Targets:
        """``last [M, H]`` pre-norm verifier states -> :class:`Targets` with ``pad`` zero rows appended.

        ``rows`` (:func:`target_rows`): compute only the positions some TTT step reads; every other position
        gets zero logits, argmax 0 and ``in_vocab`` False, which no loss term or statistic reads.
        """
        M, N = last.shape[0], self.rows.shape[0]
        if rows is not None:
            last = last.index_select(0, rows)  # [R, H]
        R = last.shape[0]
        h = self.norm(last.to(self.rows.dtype)).to(self.rows.dtype)  # [R, H]
        if rows is None:
            logits = torch.empty(M + pad, N, dtype=self.rows.dtype, device=last.device)
            self.scaling.apply_(torch.mm(h, self.rows.t(), out=logits[:M]))  # [M, N]
            logits[M:].zero_()  # only the pad rows: the product writes the rest
            dmax, darg = logits[:M].max(dim=-1)  # first maximal index: the lowest target id among ties
        else:
            part = self.scaling.apply_(h @ self.rows.t())  # [R, N]
            dmax, darg = part.max(dim=-1)
            logits = torch.zeros(M + pad, N, dtype=part.dtype, device=last.device).index_copy_(0, rows, part)
            del part
        in_vocab = torch.ones(R, dtype=torch.bool, device=last.device)
        if self.rest is not None:
            dtid = self.draft_target_ids[darg]
            for a in range(0, R, self.chunk_tokens):
                b = min(a + self.chunk_tokens, R)
                rmax, rarg = self.scaling.apply_(h[a:b] @ self.rest.t()).max(dim=-1)  # [C]
                better = dmax[a:b] > rmax
                tie_lower = (dmax[a:b] == rmax) & (dtid[a:b] < self.rest_ids[rarg])
                in_vocab[a:b] = better | tie_lower
        # [R] -> [M + pad]: the pad rows (and, with rows, the positions not computed) read argmax 0, not in vocab
        if rows is None:
            argmax, in_vocab = F.pad(darg, (0, pad)), F.pad(in_vocab, (0, pad))
        else:
            argmax = darg.new_zeros(M + pad).index_copy_(0, rows, darg)
            in_vocab = in_vocab.new_zeros(M + pad).index_copy_(0, rows, in_vocab)
        return Targets(logits=logits, argmax=argmax, in_vocab=in_vocab)


def _soft_ce_chunk(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor):
    """KL(p || q) per position and its gradient w.r.t. the draft logits, ``(q - p) * weight``, in fp32 (or the
    logits' dtype when wider).

    logits, target_logits [C, N]; weight [C]. Returns (grad [C, N] in the logits' dtype, kl [C], argmax [C]).
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    logq = logits.to(acc).log_softmax(-1)
    logp = target_logits.to(acc).log_softmax(-1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    grad = (logq.exp() - p) * weight[:, None]
    return grad.to(logits.dtype), kl, logits.argmax(-1)


_chunk_fns: dict[bool, object] = {}


def _chunk_fn(compiled: bool):
    """:func:`_soft_ce_chunk`, compiled once per process when asked (fuses the softmax passes on GPU).

    Shapes start static, as dynamo's default does (a run's chunks are all ``chunk_tokens`` long; a second shape
    makes them dynamic): compiled for dynamic shapes, the chunk took 238 us per 1024 x 32000 chunk on an H200,
    0.83 TB/s for one pass over its bytes; static, 165 us, 1.19 TB/s (``bench/loss_kernel.py`` at commit 3ae919c;
    turning off Inductor's split reductions changed nothing at these shapes)."""
    if compiled not in _chunk_fns:
        _chunk_fns[compiled] = torch.compile(_soft_ce_chunk) if compiled else _soft_ce_chunk
    return _chunk_fns[compiled]


class _FusedTTTLoss(torch.autograd.Function):
    """Sum over steps and positions of ``weight * KL``, with the gradient computed chunk by chunk in forward.

    With ``rows`` (:func:`scored_rows`) only those positions are scored: the head, the softmax passes and the
    gradient run on them alone, and every other position gets zero gradient, zero KL and argmax -1.

    With ``align`` (``[S, M]`` long: each step's target token in draft ids, -2 where it is outside the draft vocab)
    step ``k`` weighs only the positions where every step before it drew its target (:func:`ttt_loss`'s
    ``aligned``): the weights of a step are known only once the steps before it have been scored, which they
    are here, in step order."""

    @staticmethod
    def forward(ctx, lm_head_weight, target_logits, weights, compute_dtype, chunk, compiled, grad, rows, align,
                *normed):  # fmt: skip
        need_w = grad and ctx.needs_input_grad[0]
        need_h = grad and any(ctx.needs_input_grad[_NORMED_AT:])
        W = lm_head_weight.to(compute_dtype)  # [N, H]
        Wt = W.t()  # [H, N]
        acc = torch.promote_types(compute_dtype, torch.float32)
        fn = _chunk_fn(compiled)
        grad_w = torch.zeros(W.shape, dtype=acc, device=W.device) if need_w else None
        M = normed[0].shape[0]
        w = weights  # [S, M], or [S, R] for the scored rows
        if rows is not None:  # the scored positions, then pad rows M, M+1, ... (past the end, weight 0)
            take = rows.clamp(max=M - 1)  # [R]: gathers; a pad row reads position M - 1 and adds nothing
            w = F.pad(weights, (0, chunk))[:, rows]  # [S, R]: a pad row's weight is an appended 0
            align = align[:, take] if align is not None else None  # [S, R]
        alive = None  # [M] or [R] bool: every step so far drew its target (with align)
        loss = torch.zeros((), dtype=acc, device=W.device)
        grads_h, kls, argmaxes = [], [], []
        for k, h in enumerate(normed):
            if rows is not None:
                h = h.index_select(0, take)  # [R, H]
            R = h.shape[0]
            wk = w[k] if alive is None else w[k] * alive  # [R]
            kl = torch.empty(R, dtype=acc, device=h.device)
            am = torch.empty(R, dtype=torch.long, device=h.device)
            gh = torch.empty(h.shape, dtype=compute_dtype, device=h.device) if need_h else None
            for a in range(0, R, chunk):
                b = min(a + chunk, R)
                hc = h[a:b].to(compute_dtype)  # [C, H]
                # step k at index t is scored against the verifier's distribution at index t+1+k
                tc = target_logits[a + 1 + k : b + 1 + k] if rows is None else target_logits[take[a:b] + 1 + k]
                g, kl[a:b], am[a:b] = fn(hc @ Wt, tc, wk[a:b])
                if gh is not None:
                    torch.mm(g, W, out=gh[a:b])  # [C, H], written in place (rows of a contiguous buffer)
                if grad_w is not None:
                    add_matmul(grad_w, g.t(), hc)  # [N, H]
            loss += (kl * wk).sum()
            if align is not None:  # the next step weighs the positions this one (and every one before) drew
                drew = am == align[k]
                alive = drew if alive is None else alive & drew
            if rows is not None:  # back to every position (distinct indices); the pad rows land past M, dropped
                kl = kl.new_zeros(M + chunk).index_copy_(0, rows, kl)[:M]
                am = am.new_full((M + chunk,), -1).index_copy_(0, rows, am)[:M]
                if gh is not None:
                    gh = gh.new_zeros(M + chunk, gh.shape[1]).index_copy_(0, rows, gh)[:M]
            grads_h.append(gh)
            kls.append(kl)
            argmaxes.append(am)
        kl_all, am_all = torch.stack(kls), torch.stack(argmaxes)  # [S, M]
        ctx.save_for_backward(*(g for g in grads_h if g is not None), *([grad_w] if grad_w is not None else []))
        ctx.has = (need_h, need_w)
        ctx.mark_non_differentiable(kl_all, am_all)
        return loss, kl_all, am_all

    @staticmethod
    def backward(ctx, grad_loss, _kl, _am):
        need_h, need_w = ctx.has
        saved = list(ctx.saved_tensors)
        grad_w = saved.pop() * grad_loss if need_w else None
        n = len(ctx.needs_input_grad) - _NORMED_AT
        grads_h = [g * grad_loss for g in saved] if need_h else [None] * n
        return (grad_w, *[None] * (_NORMED_AT - 1), *grads_h)


#: where the per-step normed states begin among :meth:`_FusedTTTLoss.forward`'s inputs
_NORMED_AT = 9


def step_masks(loss_mask: torch.Tensor, doc_ids: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """``valid[k, b, t]``: step ``k`` at index ``t`` is scored (``loss_mask[t+2+k]`` and the same document).

    loss_mask, doc_ids [B, T] -> [ttt_steps, B, T] bool. All steps at once from shifted views (a handful of
    operations whatever ``ttt_steps`` is: the training step is bound by how many the host dispatches).
    """
    T = loss_mask.shape[1]
    # right-padded so that every shift t + 2 + k exists; a padded index is never scored (mask 0, document -1)
    mask = F.pad(loss_mask, (0, ttt_steps + 1))  # [B, T + ttt_steps + 1]
    docs = F.pad(doc_ids, (0, ttt_steps + 1), value=-1)
    # unfold: [B, T + ttt_steps + 1] -> [B, ttt_steps + 2, T], window j = indices j .. j + T - 1;
    # j = 2 + k for step k
    ahead_mask, ahead_doc = mask.unfold(1, T, 1)[:, 2:], docs.unfold(1, T, 1)[:, 2:]  # [B, ttt_steps, T]
    here = doc_ids[:, None]  # [B, 1, T]
    return (ahead_mask & (ahead_doc == here) & (here >= 0)).transpose(0, 1)  # [ttt_steps, B, T]


def scored_rows(loss_mask: torch.Tensor, doc_ids: torch.Tensor, ttt_steps: int, *, chunk: int) -> torch.Tensor | None:
    """The flattened positions any TTT step scores (:func:`step_masks`), padded to a multiple of ``chunk`` with
    ``B*T, B*T + 1, ...`` (the loss' chunks keep one static shape); ``None`` when that skips no chunk.

    Prompts and packing padding are scored by no step: the draft's head, the loss' softmax passes and their
    gradient need not run there (a third or more of a chat dataset's positions). Every step's statistics stay
    as they were: a position any step scores is scored at every step, as the conditional accuracy reads the
    earlier steps' argmax there. Built by the data loader on the host, so the device never has to be asked how
    many positions there are (a sync). loss_mask, doc_ids [B, T] -> int64 [R] or None.
    """
    M = loss_mask.numel()
    rows = step_masks(loss_mask, doc_ids, ttt_steps).any(0).flatten().nonzero().flatten()  # [n]
    R = -(-rows.numel() // chunk) * chunk
    if R >= -(-M // chunk) * chunk:
        return None
    return torch.cat([rows, torch.arange(M, M + R - rows.numel())])


def target_rows(loss_mask: torch.Tensor, doc_ids: torch.Tensor, ttt_steps: int) -> torch.Tensor | None:
    """The flattened positions whose verifier distribution some TTT step reads (:class:`TargetHead`'s
    ``rows``); ``None`` when that leaves out less than an eighth of them.

    The loss reads the target at ``t + 1 + k`` for every step ``k`` at every position ``t`` some step scores
    (:func:`scored_rows`: the KL of a step that does not score ``t`` is computed and weighted 0; the
    conditional accuracy reads every earlier step's target), so the positions needed are those shifted by 1 to
    ``ttt_steps``. The rest (most of each prompt, the packing padding) need neither the verifier's head over the
    draft vocab nor, for the full-vocab accuracy, over the rest of it: for a 7168-wide verifier with a
    163,840-token vocab that head is 2 x 7168 x 163840 = 2.35 GFLOP a position. Built by the data loader on the
    host (no sync). Skipping costs a pass over the ``[M, N]`` target logits (the zeros, then the scatter):
    per position about 6N bytes against the head's 2HN FLOPs: 1.25N ps at 4.8 TB/s against 10.4N ps at 790
    TFLOP/s for H = 4096, an eighth of the matmul's time (less for wider verifiers). So below an eighth of the
    positions left out it is not worth it (a fully answered row leaves out only its first position).
    loss_mask, doc_ids [B, T] -> int64 [R] ascending, or None.
    """
    scored = step_masks(loss_mask, doc_ids, ttt_steps).any(0).flatten()  # [M]
    M = scored.numel()
    need = torch.zeros(M + ttt_steps, dtype=torch.bool)
    for k in range(ttt_steps):  # position t + 1 + k; past M only the pad rows, which are zero anyway
        need[1 + k : 1 + k + M] |= scored
    rows = need[:M].nonzero().flatten()
    return None if 8 * (M - rows.numel()) < M else rows


def ttt_loss(normed: Sequence[torch.Tensor], lm_head_weight: torch.Tensor, targets: Targets, valid: torch.Tensor,
             scale: torch.Tensor, *, drop_out_of_vocab: bool = False, compute_dtype: torch.dtype = torch.float32,
             chunk_tokens: int = CHUNK_TOKENS, compiled: bool = False, rows: torch.Tensor | None = None,
             aligned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The TTT loss of one micro-batch and its per-step statistics.

    ``normed``: per step the draft's normed output ``[M, H]`` (flattened
    positions); ``valid [S, M]`` from :func:`step_masks`; ``scale [S]`` the
    per-step weight divided by the step's loss-masked count over the whole
    optimizer step. With ``drop_out_of_vocab`` (EAGLE's choice) positions whose
    full-vocab target is outside the draft vocab carry no loss; the
    statistics still count them (as misses), so accuracy stays honest.
    ``rows`` (:func:`scored_rows`, built with ``chunk_tokens``): score only
    those positions; the loss, statistics and gradients are the same.

    ``aligned`` (GRIFFIN's token-alignable training, Hu et al. 2025, arXiv:2502.11018, whose mask keeps a
    position while the target stayed in the draft's top-k, for its trees; here a chain's top-1): step ``k``
    carries loss only at positions where the draft's argmax was the verifier's token at every step before it.
    Decoding never reaches step ``k`` of a round whose earlier draft was rejected, so elsewhere step ``k``
    learns from states (its own hidden state after a wrong token) it is never fed. The scale stays the step's
    whole count: a step's loss is the mean over positions of KL times "the chain got here", which weighs each
    step by how often decoding uses it. The statistics are unchanged (the conditional accuracy already counts
    only those positions).

    Returns ``(loss, stats [S, 6])``, the columns in :data:`STAT_COLUMNS` (sums).
    """
    S, M = len(normed), valid.shape[1]
    # target of step k at index t: the verifier at t + 1 + k; unfold gives every step's slice as one view
    in_vocab = targets.in_vocab.unfold(0, M, 1)[1 : 1 + S]  # [M + pad] -> [S, M]
    tgt = targets.argmax.unfold(0, M, 1)[1 : 1 + S]  # [S, M]
    kept = valid & in_vocab if drop_out_of_vocab else valid
    weights = kept.float() * scale[:, None]  # [S, M]
    # each step's target as the draft's argmax must read it to be right: outside the draft vocab, never (-2)
    align = tgt.masked_fill(~in_vocab, -2) if aligned else None  # [S, M]
    # the gradient is formed in forward only when a backward can follow (not under no_grad, as in validation)
    loss, kl, draft_argmax = _FusedTTTLoss.apply(lm_head_weight, targets.logits, weights, compute_dtype,
                                                 chunk_tokens, compiled, torch.is_grad_enabled(), rows, align,
                                                 *normed)  # fmt: skip
    correct = (draft_argmax == tgt) & in_vocab  # [S, M]
    # conditional on every earlier step being right: an exclusive running AND of `correct` over the steps
    earlier_right = torch.cat([torch.ones_like(correct[:1]), correct[:-1].cummin(0).values])  # [S, M]
    cond = valid & earlier_right
    cols = torch.stack([kl.double() * kept, kept, valid, correct & valid, correct & cond, cond], dim=-1)  # [S, M, 6]
    return loss, cols.sum(1)  # [S, 6] in STAT_COLUMNS order


def implied_tau(cond_acc: Sequence[float]) -> float:
    """The acceptance length the per-step conditional accuracies imply: ``1 + sum_k prod_{j<=k} cond_acc_j``.

    Under greedy verification a draft of ``K`` tokens is accepted up to its
    first miss, and the verifier adds one token of its own, so the expected
    tokens per verification round is ``1 + sum_{k<K} P(tokens 0..k all
    accepted)``; ``P(0..k) = prod_{j<=k} P(j | 0..j-1)``, which is what
    conditional accuracy at step ``j`` measures under teacher forcing (when
    steps before ``j`` were right, the teacher-forced inputs are exactly what
    the draft would have fed itself). ``eyas eval`` uses this to predict tau
    from a draft offline; a nan accuracy (no positions) ends the sum.
    """
    tau, run = 1.0, 1.0
    for a in cond_acc:
        if a is None or math.isnan(a):
            break
        run *= a
        tau += run
    return tau


def summarize(stats: torch.Tensor) -> dict[str, float | list[float]]:
    """Per-step ``loss``, ``acc``, ``cond_acc`` (lists) and ``tau`` from summed :func:`ttt_loss` statistics."""
    s = stats.detach().double().cpu()
    ratio = lambda a, b: [float(x / y) if y > 0 else float("nan") for x, y in zip(a, b)]  # noqa: E731
    cols = {name: s[:, i] for i, name in enumerate(STAT_COLUMNS)}
    loss = ratio(cols["kl_sum"], cols["kept"])
    acc = ratio(cols["correct"], cols["valid"])
    cond = ratio(cols["cond_correct"], cols["cond_total"])
    return {"loss": loss, "acc": acc, "cond_acc": cond, "tau": implied_tau(cond), "positions": int(s[0, 2])}
