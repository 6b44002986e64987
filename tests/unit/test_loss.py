"""The fused TTT loss against a plain autograd reference; targets, masks and the implied tau."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eyas.training.loss import (
    LogitScaling,
    TargetHead,
    Targets,
    implied_tau,
    scored_rows,
    step_masks,
    summarize,
    target_rows,
    ttt_loss,
)


def _reference(normed, W, tlogits, valid, scale, in_vocab, tgt_argmax, drop, aligned=False):
    """Full logits, log_softmax and KL written out; the shifts done with explicit loops. ``aligned``: a step's
    loss only where every earlier step's argmax was the target (GRIFFIN's mask)."""
    S, M = valid.shape
    loss = 0.0
    stats = []
    prev = torch.ones(M, dtype=torch.bool)
    for k in range(S):
        logits = normed[k] @ W.t()  # [M, N]
        t = torch.stack([tlogits[i + 1 + k] for i in range(M)])
        p = t.log_softmax(-1).exp()
        kl = (p * (t.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)
        iv = torch.stack([in_vocab[i + 1 + k] for i in range(M)])
        ta = torch.stack([tgt_argmax[i + 1 + k] for i in range(M)])
        kept = valid[k] & iv if drop else valid[k]
        loss = loss + (kl * (kept & prev if aligned else kept) * scale[k]).sum()
        correct = (logits.argmax(-1) == ta) & iv
        cond = valid[k] & prev
        stats.append([(kl * kept).sum().detach(), kept.sum(), valid[k].sum(), (correct & valid[k]).sum(), (correct & cond).sum(),
                      cond.sum()])  # fmt: skip
        prev = prev & correct
    return loss, torch.tensor([[float(x) for x in row] for row in stats], dtype=torch.float64)


def _check_against_reference(normed, W, tlogits, valid, scale, in_vocab, drop, aligned=False, **loss_kw):
    """ttt_loss (loss, statistics, gradients) against :func:`_reference` in fp64; returns (stats, gradients)."""
    loss, stats = ttt_loss(normed, W, Targets(tlogits, tlogits.argmax(-1), in_vocab), valid, scale,
                           drop_out_of_vocab=drop, compute_dtype=torch.float64, aligned=aligned,
                           **loss_kw)  # fmt: skip
    loss.backward()
    got = [W.grad.clone()] + [h.grad.clone() for h in normed]
    for t in [W, *normed]:
        t.grad = None
    ref_loss, ref_stats = _reference(normed, W, tlogits, valid, scale, in_vocab, tlogits.argmax(-1), drop, aligned)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.double(), ref_stats, rtol=1e-12, atol=1e-12)
    for g, t in zip(got, [W, *normed]):
        torch.testing.assert_close(g, t.grad, rtol=1e-10, atol=1e-12)
    return ref_stats, got, ref_loss


@pytest.mark.parametrize("drop, aligned", [(False, False), (True, False), (False, True), (True, True)])
def test_fused_loss_equals_reference_value_and_grads(drop, aligned):
    torch.manual_seed(0)
    S, M, H, N = 3, 23, 8, 11
    W = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    normed = [torch.randn(M, H, dtype=torch.float64, requires_grad=True) for _ in range(S)]
    tlogits = torch.randn(M + S, N, dtype=torch.float64) * 3
    in_vocab = torch.rand(M + S) > 0.3
    targets = Targets(tlogits, tlogits.argmax(-1), in_vocab)
    valid = torch.rand(S, M) > 0.25
    scale = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    # make some draft argmaxes right so that accuracy and conditional accuracy are not trivially zero
    with torch.no_grad():
        normed[0][:10] = W[tlogits[1:11].argmax(-1)] * 5

    ref_stats, got, ref_loss = _check_against_reference(normed, W, tlogits, valid, scale, in_vocab, drop, aligned,
                                                        chunk_tokens=5)  # fmt: skip
    assert ref_stats[0, 3] > 0 and ref_stats[0, 4] > 0  # the accuracy path was exercised
    if aligned:  # a later step's gradient reaches only positions whose first step drew its target
        drew = (normed[0].detach() @ W.detach().t()).argmax(-1) == tlogits[1 : M + 1].argmax(-1)
        drew &= in_vocab[1 : M + 1]
        assert 0 < int(drew.sum()) < M and not got[2][~drew].any() and got[2][drew & valid[1]].any()

    with torch.no_grad():  # no gradient is formed (or needed) without autograd
        loss2, stats2 = ttt_loss(normed, W, targets, valid, scale, drop_out_of_vocab=drop,
                                 compute_dtype=torch.float64, chunk_tokens=7, aligned=aligned)  # fmt: skip
    torch.testing.assert_close(loss2, ref_loss.detach())
    torch.testing.assert_close(stats2.double(), ref_stats, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("drop, aligned", [(False, False), (True, False), (False, True)])
def test_fused_loss_on_scored_rows_equals_reference(drop, aligned):
    """Scoring only the positions some step scores (prompts and padding skipped) gives the reference's loss,
    statistics and gradients, every position's included (zero where nothing is scored)."""
    torch.manual_seed(2)
    S, B, T, H, N = 3, 2, 29, 8, 11
    # row 0: a prompt, an answer, a second document's prompt and answer, padding; row 1: one long prompt, answer
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[0, 6:12], loss_mask[0, 19:25], loss_mask[1, 20:] = True, True, True
    doc = torch.tensor([[0] * 12 + [1] * 13 + [-1] * 4, [0] * T])
    valid = step_masks(loss_mask, doc, S).flatten(1)  # [S, M]
    M = B * T
    rows = scored_rows(loss_mask, doc, S, chunk=5)
    n = int(valid.any(0).sum())
    assert rows is not None and rows.numel() % 5 == 0 and rows.numel() < M
    assert torch.equal(rows[:n], valid.any(0).nonzero().flatten())  # every position some step scores, in order
    assert torch.equal(rows[n:], torch.arange(M, M + rows.numel() - n))  # then distinct pads past the end
    W = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    normed = [torch.randn(M, H, dtype=torch.float64, requires_grad=True) for _ in range(S)]
    tlogits = torch.randn(M + S, N, dtype=torch.float64) * 3
    in_vocab = torch.rand(M + S) > 0.2
    with torch.no_grad():  # some right draft argmaxes, so the (conditional) accuracy is exercised
        normed[0][:] = W[tlogits[1 : M + 1].argmax(-1)] * 5
        normed[1][::2] = W[tlogits[2 : M + 2 : 2].argmax(-1)] * 5
    scale = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    ref_stats, got, _ = _check_against_reference(normed, W, tlogits, valid, scale, in_vocab, drop, aligned,
                                                 chunk_tokens=5, rows=rows)  # fmt: skip
    assert ref_stats[1, 4] > 0 and ref_stats[1, 5] > ref_stats[1, 4]  # conditional accuracy read earlier steps
    for h in got[1:]:  # nothing reaches a position no step scores
        assert not h[~valid.any(0)].any()
    # one document per row, all of it answer: only the last two positions of each row go unscored, which saves no
    # chunk of T positions (54 scored of 58): no rows, the loss runs on every position as before
    assert scored_rows(torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.long), S, chunk=T) is None


@pytest.mark.parametrize("drop", [False, True])
def test_targets_only_where_a_step_reads_them_give_the_same_loss(drop):
    """The verifier's head run only at :func:`target_rows` (the rest of each prompt and the padding skipped)
    gives the same loss, statistics and gradients as targets at every position, whether the loss itself runs
    on every position or only on the scored ones; the positions left out are exactly those no step reads."""
    torch.manual_seed(3)
    S, B, T, H, N, V = 3, 2, 29, 6, 9, 21
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[0, 6:12], loss_mask[0, 19:25], loss_mask[1, 20:] = True, True, True
    doc = torch.tensor([[0] * 12 + [1] * 13 + [-1] * 4, [0] * T])
    M = B * T
    valid = step_masks(loss_mask, doc, S).flatten(1)  # [S, M]
    need = target_rows(loss_mask, doc, S)
    scored = valid.any(0).nonzero().flatten().tolist()
    want = sorted({t + 1 + k for t in scored for k in range(S)} & set(range(M)))
    assert need is not None and need.tolist() == want and len(want) < M - 10
    assert target_rows(torch.ones(1, T, dtype=torch.bool), torch.zeros(1, T, dtype=torch.long), S) is None

    full = torch.randn(V, H, dtype=torch.float64) * 2
    draft_ids = torch.tensor(sorted(torch.randperm(V)[:N].tolist()))
    rest_ids = torch.tensor([i for i in range(V) if i not in set(draft_ids.tolist())])
    head = TargetHead(norm=nn.RMSNorm(H, dtype=torch.float64), rows=full[draft_ids], draft_target_ids=draft_ids,
                      rest=full[rest_ids], rest_ids=rest_ids, scaling=LogitScaling(), chunk_tokens=4)  # fmt: skip
    last = torch.randn(M, H, dtype=torch.float64)
    every, some = head(last, pad=S), head(last, pad=S, rows=need)
    for a, b in [(every.logits, some.logits), (every.argmax, some.argmax), (every.in_vocab, some.in_vocab)]:
        assert torch.equal(a[need], b[need])
    assert 0 < int(every.in_vocab[need].sum()) < len(want)  # both sides of the full-vocab check are exercised
    skipped = torch.ones(M + S, dtype=torch.bool)
    skipped[need] = False
    assert not some.logits[skipped].any() and not some.in_vocab[skipped].any() and not some.argmax[skipped].any()

    W = torch.randn(N, H, dtype=torch.float64)
    normed = [torch.randn(M, H, dtype=torch.float64) for _ in range(S)]
    with torch.no_grad():  # some right draft argmaxes, so the (conditional) accuracy is exercised
        normed[0][:] = W[every.logits[1 : M + 1].argmax(-1)] * 5
        normed[1][::2] = W[every.logits[2 : M + 2 : 2].argmax(-1)] * 5
    scale = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    for rows in [None, scored_rows(loss_mask, doc, S, chunk=5)]:
        results = []
        for targets in (every, some):
            Wg = W.clone().requires_grad_()
            hs = [h.clone().requires_grad_() for h in normed]
            loss, stats = ttt_loss(hs, Wg, targets, valid, scale, drop_out_of_vocab=drop,
                                   compute_dtype=torch.float64, chunk_tokens=5, rows=rows)  # fmt: skip
            loss.backward()
            results.append((loss.detach(), stats, Wg.grad, *[h.grad for h in hs]))
        assert results[0][1][1, 4] > 0  # conditional accuracy past the first step
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [13, 3, 1])  # 3 and 1: shorter than the last step's shift
def test_step_masks_brute_force(T):
    torch.manual_seed(1)
    B, S = 2, 3
    loss_mask = torch.rand(B, T) > 0.3
    doc = torch.tensor([[0] * 5 + [1] * 6 + [-1] * 2, [0] * 13])[:, :T]
    got = step_masks(loss_mask, doc, S)
    assert got.shape == (S, B, T)
    for k in range(S):
        for b in range(B):
            for t in range(T):
                j = t + 2 + k
                want = j < T and bool(loss_mask[b, j]) and doc[b, j] == doc[b, t] and doc[b, t] >= 0
                assert bool(got[k, b, t]) == want, (k, b, t)


def test_target_head_matches_full_vocab_argmax_with_ties():
    """in_vocab equals 'the argmax over the full vocab (lowest id among ties) is a draft token'. Small integers make
    every dot product exact, so ties are frequent and do not depend on how the matmul is split."""
    torch.manual_seed(2)
    V, H, M = 40, 4, 300
    full = torch.randint(-2, 3, (V, H)).double()
    draft_ids = torch.tensor(sorted(torch.randperm(V)[:15].tolist()))
    rest_ids = torch.tensor([i for i in range(V) if i not in set(draft_ids.tolist())])
    last = torch.randint(-2, 3, (M, H)).double()
    head = TargetHead(norm=nn.Identity(), rows=full[draft_ids], draft_target_ids=draft_ids, rest=full[rest_ids],
                      rest_ids=rest_ids, scaling=LogitScaling(), chunk_tokens=17)  # fmt: skip
    t = head(last, pad=2)
    logits = last @ full.t()
    want = torch.isin(logits.argmax(-1), draft_ids)
    ties = (logits == logits.max(-1, keepdim=True).values).sum(-1) > 1
    assert int(ties.sum()) > 50  # the tie-break path is exercised
    assert torch.equal(t.in_vocab[:M], want)
    assert 0 < int(want.sum()) < M and not bool(t.in_vocab[M:].any())
    assert torch.equal(t.argmax[:M], (last @ full[draft_ids].t()).argmax(-1))
    assert torch.equal(t.logits[M:], torch.zeros(2, len(draft_ids), dtype=torch.float64))


@pytest.mark.parametrize("name, scaling", [
    ("gemma2", LogitScaling(softcap=2.0)),
    ("gemma3", LogitScaling(softcap=3.0)),
    ("cohere", LogitScaling(multiply=0.25)),
    ("granite", LogitScaling(divide=4.0)),
    ("llama", LogitScaling()),
])  # fmt: skip
def test_targets_are_the_verifiers_own_logits(make_tiny, tmp_path, name, scaling):
    """The training targets from `eyas extract` features equal the verifier's own logits over the draft vocab,
    whatever its head does after the product (Gemma's softcapping, Cohere's and Granite's scales), and the
    full-vocab flag equals its own argmax. The reference is transformers' model itself, built from the
    checkpoint's state dict, not eyas's loading."""
    import tiny

    from eyas.stages.extract import extract
    from eyas.data.features import FeatureReader
    from eyas.verifier.load import load_head_tensors, resolve

    t = make_tiny(name)
    rows = tiny.random_rows(3, seed=4, lo=20, hi=30)
    extract(verifier=str(t.path), data=str(tiny.write_prepared(tmp_path / "prep", rows, verifier=t.path)),
            out=str(tmp_path / "feats"), dtype="fp32", device="cpu")  # fmt: skip
    info = resolve(t.path)
    full = load_head_tensors(info).lm_head
    draft_ids = torch.arange(0, tiny.VOCAB, 3)  # a third of the vocab: some argmaxes fall outside it
    rest_ids = torch.tensor(sorted(set(range(tiny.VOCAB)) - set(draft_ids.tolist())))
    head = TargetHead.for_verifier(info, rows=full[draft_ids], draft_target_ids=draft_ids, rest=full[rest_ids],
                                   rest_ids=rest_ids)  # fmt: skip
    assert head.scaling == scaling
    model = t.reference()
    reader = FeatureReader(tmp_path / "feats")
    outside = 0
    for i, (ids, _) in enumerate(rows):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].double()  # [T, V]
        got = head(reader[i].last_hidden_state, pad=0)
        torch.testing.assert_close(got.logits.double(), want[:, draft_ids], rtol=1e-4, atol=1e-4)
        assert torch.equal(got.in_vocab, torch.isin(want.argmax(-1), draft_ids))
        outside += int((~got.in_vocab).sum())
    assert outside > 0


def test_implied_tau():
    assert implied_tau([]) == 1.0
    assert implied_tau([1.0, 1.0, 1.0]) == 4.0
    assert math.isclose(implied_tau([0.8, 0.5, 0.5]), 1 + 0.8 + 0.4 + 0.2)
    assert math.isclose(implied_tau([0.5, float("nan"), 0.9]), 1.5)
    s = torch.tensor([[2.0, 4, 4, 3, 3, 4], [1.0, 2, 4, 1, 1, 3]])
    m = summarize(s)
    assert m["loss"] == [0.5, 0.5] and m["acc"] == [0.75, 0.25] and m["cond_acc"][0] == 0.75
    assert math.isclose(m["tau"], 1 + 0.75 + 0.75 / 3)
