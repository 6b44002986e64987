"""`eyas train` on tiny real verifiers: online == offline, learning, resume after kill -9, NaN stop, bad inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from eyas.core.errors import EyasError
from eyas.training.batches import Row, StepData, pack_rows, plan_epoch, row_counts
from eyas.stages.train import train
from eyas.training.trainer import STATE_FILE, checkpoint_dirs

COMMON = dict(max_seq_len=64, num_workers=0, log_every=2, warmup_steps=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(n: int, seed: int, vocab: int = tiny.VOCAB) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        L = int(rng.integers(10, 90))  # some rows exceed max_seq_len=64 and are truncated
        prompt = int(rng.integers(2, L // 2))
        rows.append((rng.integers(3, vocab, L).tolist(), [0] * prompt + [1] * (L - prompt)))
    return rows


@pytest.fixture(scope="module")
def inputs(make_tiny, tmp_path_factory):
    """A tiny Llama verifier, prepared rows for it, fp32 features and a draft vocab of half its tokens."""
    from eyas.stages.extract import extract

    root = tmp_path_factory.mktemp("train")
    verifier = make_tiny("llama").path
    prepared = tiny.write_prepared(root / "prepared", _rows(40, 0), verifier=verifier)
    torch.set_num_threads(1)
    extract(verifier=str(verifier), data=str(prepared), out=str(root / "features"), dtype="fp32")
    vocab = root / "vocab"
    vocab.mkdir()
    used = np.sort(np.random.default_rng(1).permutation(tiny.VOCAB)[:256])
    np.save(vocab / "d2t.npy", (used - np.arange(256)).astype(np.int64))
    t2d = np.zeros(tiny.VOCAB, dtype=bool)
    t2d[used] = True
    np.save(vocab / "t2d.npy", t2d)
    (vocab / "manifest.json").write_text(json.dumps({"stage": "vocab"}))
    return {"verifier": str(verifier), "prepared": str(prepared), "features": str(root / "features"),
            "vocab": str(vocab), "root": root}  # fmt: skip


def _records(out: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_dirs(out)[-1] / STATE_FILE, weights_only=True)["model"]


# --------------------------------------------------------------------------- packing


def test_packing_covers_each_row_once_and_plans_do_not_depend_on_world_size():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, 300)
    seqs = pack_rows(rng.permutation(300), lengths, 64)
    assert sorted(r for s in seqs for r in s) == list(range(300))
    assert all(lengths[s].sum() <= 64 for s in seqs)
    assert lengths.sum() / (64 * len(seqs)) > 0.9  # best fit packs tightly
    counts = rng.integers(0, 5, (300, 3))
    rows = np.arange(300)
    one = plan_epoch(rows, lengths, counts, seed=3, epoch=1, shuffle=True, max_len=64, seqs_per_micro_batch=2,
                     micro_batches_per_step=4)  # fmt: skip
    again = plan_epoch(rows, lengths, counts, seed=3, epoch=1, shuffle=True, max_len=64, seqs_per_micro_batch=2,
                       micro_batches_per_step=4)  # fmt: skip
    assert [s.micro_batches for s in one] == [s.micro_batches for s in again]
    assert all(len(s.micro_batches) == 4 for s in one)
    np.testing.assert_array_equal(sum(s.denom for s in one), counts.sum(0))
    other = plan_epoch(rows, lengths, counts, seed=3, epoch=2, shuffle=True, max_len=64, seqs_per_micro_batch=2,
                       micro_batches_per_step=4)  # fmt: skip
    assert [s.micro_batches for s in one] != [s.micro_batches for s in other]


def test_row_counts_match_the_step_masks():
    from eyas.training.loss import step_masks

    rng = np.random.default_rng(2)
    rows = [rng.random(int(n)) > 0.4 for n in rng.integers(1, 30, 20)]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    lengths, counts = row_counts(np.concatenate(rows), offsets, max_len=16, ttt_steps=3)
    for r, L, c in zip(rows, lengths, counts):
        assert L == min(len(r), 16)
        m = torch.from_numpy(r[:L])[None]
        np.testing.assert_array_equal(step_masks(m, torch.zeros_like(m, dtype=torch.long), 3).sum((1, 2)), c)


def test_online_verifier_rows_run_in_groups_of_similar_lengths():
    """Online, the verifier runs each row alone (right-padded) in groups, longest first, each padded to its own
    longest row, not the micro-batch's: every real token's states land where the packed batch has it."""
    lengths = [60, 5, 7, 30, 3, 12]
    rng = np.random.default_rng(0)
    rows = [Row(torch.from_numpy(rng.integers(3, 500, L)), torch.ones(L, dtype=torch.bool)) for L in lengths]

    class Source:
        online = True

        def row(self, i):
            return rows[i]

    data = StepData(Source(), [], rank=0, grad_accum=1, max_len=64, seqs=2, lengths=np.array(lengths))
    mb = data.collate([[0], [1, 2, 3, 4, 5]])  # 60 tokens, then 57 in five rows
    groups = mb["row_groups"].tolist()
    assert groups == [[0, 2, 60], [2, 6, 12]]  # [60, 30] padded to 60, [12, 7, 5, 3] to 12: 168 tokens, not 360
    # a stand-in for the verifier: each group's ids, as it would see them, flattened one group after another
    out = torch.cat([mb["row_ids"][a:b, :w].reshape(-1) for a, b, w in groups])
    assert torch.equal(out[mb["src"]], mb["input_ids"].reshape(-1)[mb["dst"]])
    assert sorted(mb["dst"].tolist()) == torch.nonzero(mb["doc_ids"].reshape(-1) >= 0).flatten().tolist()
    assert sorted(mb["row_attn"].sum(1).tolist()) == sorted(lengths)


# --------------------------------------------------------------------------- training


def test_online_equals_offline(inputs, tmp_path):
    """The verifier in the loop gives the loss and the weights that stored features give (also with the step's
    phases timed, which syncs at each)."""
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], epochs=1, max_steps=4, val_ratio=0.0, **COMMON)
    train(data=inputs["features"], out=str(tmp_path / "offline"), **kw)
    train(data=inputs["prepared"], online=True, out=str(tmp_path / "online"), profile_every=1, **kw)
    off, on = _records(tmp_path / "offline"), _records(tmp_path / "online")
    assert [r["step"] for r in off] == [r["step"] for r in on] == [2, 4]
    phases = ("data", "verifier", "targets", "forward", "backward", "optimizer")
    assert all(r[f"ms_{p}"] > 0 for r in on for p in phases) and not any("ms_verifier" in r for r in off)
    for a, b in zip(off, on):
        for k in range(3):
            assert a[f"loss_{k}"] == pytest.approx(b[f"loss_{k}"], rel=1e-5)
            assert a[f"acc_{k}"] == b[f"acc_{k}"]
    sa, sb = _final_state(tmp_path / "offline"), _final_state(tmp_path / "online")
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=1e-4, atol=1e-6, msg=name)


# transformers builds flex_attention's block mask with create_block_mask(_compile=True), which newer torch deprecates
@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning")
@pytest.mark.parametrize("packing", ["kept apart", "ignored", "flex"])
def test_online_verifier_packed_rows_or_each_row_alone(inputs, tmp_path, monkeypatch, capsys, packing):
    """Online, the verifier runs on the packed sequences as they are, its masks keeping each row to itself (from
    ``position_ids``), once its states on the first micro-batch equal each row's alone; through SDPA's dense mask
    or (``--verifier-attention flex``) flex_attention's block mask. A verifier whose attention ignores packing
    (here: transformers' packed-sequence detection taken away) fails that check, says so, and runs each row
    alone: either way the losses are the stored features'."""
    import transformers.masking_utils as masking

    from eyas.training import trainer as trainer_mod

    if packing == "ignored":
        monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    seen = []
    real = trainer_mod.Trainer._features

    def features(self, mb):
        out = real(self, mb)
        if "row_ids" in mb and mb["row_ids"].shape[0]:  # online, and rows to run
            seen.append(self.verifier_packed)
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "_features", features)
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], epochs=1, max_steps=4, val_ratio=0.0, **COMMON)
    train(data=inputs["features"], out=str(tmp_path / "offline"), **kw)
    capsys.readouterr()
    flex = {"verifier_attention": "flex"} if packing == "flex" else {}
    train(data=inputs["prepared"], online=True, out=str(tmp_path / "online"), **flex, **kw)
    note = "does not keep packed rows apart"
    assert seen and set(seen) == {packing != "ignored"}, seen
    assert (note in capsys.readouterr().out) == (packing == "ignored")
    for a, b in zip(_records(tmp_path / "offline"), _records(tmp_path / "online"), strict=True):
        for k in range(3):
            assert a[f"loss_{k}"] == pytest.approx(b[f"loss_{k}"], rel=1e-5)


def test_online_verifier_compiled_gives_the_eager_features(inputs, tmp_path, monkeypatch, capsys):
    """Online, the verifier's layers run compiled with symbolic shapes where the trainer compiles (CUDA by
    default): one compile for the packed sequences (and one for the rows alone that check them), and the states, so the losses, of the eager forward. The draft
    stays eager here (only the verifier's compile is under test)."""
    import torch._dynamo.utils as dynamo_utils

    from eyas.training import trainer as trainer_mod

    import eyas.stages.train as train_stage

    monkeypatch.setattr(train_stage, "compile_draft", lambda draft: None)
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["prepared"], online=True, epochs=1,
              max_steps=4, val_ratio=0.0, **COMMON)  # fmt: skip
    train(out=str(tmp_path / "eager"), **kw)
    dynamo_utils.counters.clear()
    seen = []
    real = trainer_mod.Trainer._features

    def features(self, mb):
        out = real(self, mb)
        seen.append(self.compile_verifier)
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "_features", features)
    monkeypatch.setattr(trainer_mod.TTTObjective, "__init__", _eager_objective(trainer_mod.TTTObjective.__init__))
    train(out=str(tmp_path / "compiled"), compile=True, **kw)
    assert seen and all(seen), seen  # compiled all along: no compiler error sent it back to eager
    # the packed sequences' one shape compiles once for every step; the rows alone of the first micro-batch's
    # check once more, and a group of one row may specialise once (dynamo's size-1 rule), whatever ran before
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 3
    assert "without torch.compile" not in capsys.readouterr().err
    eager, compiled = _records(tmp_path / "eager"), _records(tmp_path / "compiled")
    for a, b in zip(eager, compiled, strict=True):
        for k in range(3):
            assert a[f"loss_{k}"] == pytest.approx(b[f"loss_{k}"], rel=1e-5)


def _eager_objective(init):
    """``TTTObjective.__init__`` with ``compiled=False``: the draft and the loss eager whatever the trainer says."""

    def eager_init(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "compiled": False})

    return eager_init


def test_gradient_checkpointing_and_frozen_head_train_the_same_weights(inputs, tmp_path):
    """Recomputing the layer in backward gives the run without it, step for step; a frozen lm_head (speculators'
    setting) stays the verifier's rows while the rest learns."""
    from safetensors.torch import load_file

    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["features"], epochs=1, max_steps=4,
              val_ratio=0.0, freeze_lm_head=True, **COMMON)  # fmt: skip
    train(out=str(tmp_path / "plain"), **kw)
    train(out=str(tmp_path / "ckpt"), gradient_checkpointing=True, **kw)
    a, b = _final_state(tmp_path / "plain"), _final_state(tmp_path / "ckpt")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-8, msg=name)
    start = load_file(Path(inputs["verifier"]) / "model.safetensors")
    d2t = torch.from_numpy(np.load(Path(inputs["vocab"]) / "d2t.npy"))
    rows = start["lm_head.weight"][torch.arange(len(d2t)) + d2t]
    assert torch.equal(a["draft.lm_head.weight"], rows)
    written = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(written["lm_head.weight"], rows.to(written["lm_head.weight"].dtype))


def test_aligned_loss_is_recorded_and_trains_other_weights(inputs, tmp_path):
    """--aligned-loss reaches the loss (the run's weights differ from the plain run's from the same start) and is
    a recorded setting only when set, so drafts trained before it existed stay up to date."""
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["features"], epochs=1, max_steps=3,
              val_ratio=0.0, lr=3e-3, **COMMON)  # fmt: skip
    train(out=str(tmp_path / "plain"), **kw)
    train(out=str(tmp_path / "aligned"), aligned_loss=True, **kw)
    settings = {n: json.loads((tmp_path / n / "manifest.json").read_text())["settings"] for n in ("plain", "aligned")}
    assert "aligned_loss" not in settings["plain"] and settings["aligned"]["aligned_loss"] is True
    a, b = _final_state(tmp_path / "plain"), _final_state(tmp_path / "aligned")
    assert not torch.equal(a["draft.layers.0.self_attn.q_proj.weight"], b["draft.layers.0.self_attn.q_proj.weight"])


def test_deferred_weight_gradients_train_the_same_weights(inputs, tmp_path):
    """Deferred weight gradients (the default: each layer weight's gradient summed over the TTT steps by its
    matmuls, handed to autograd once) train the weights of the per-use run (--no-deferred-wgrad), over steps with
    gradient accumulation; with checkpointing the default turns them off and asking for them is refused before
    the first step."""
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["features"], epochs=1, max_steps=3,
              val_ratio=0.2, **{**COMMON, "grad_accum": 2})  # fmt: skip
    assert not train(out=str(tmp_path / "plain"), deferred_wgrad=False, **kw)["deferred_wgrad"]
    assert train(out=str(tmp_path / "deferred"), **kw)["deferred_wgrad"]
    a, b = _final_state(tmp_path / "plain"), _final_state(tmp_path / "deferred")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)
    res = train(out=str(tmp_path / "ckpt"), gradient_checkpointing=True, **{**kw, "max_steps": 1})
    assert not res["deferred_wgrad"]
    with pytest.raises(EyasError, match="--deferred-wgrad needs working weights and no --gradient-checkpointing"):
        train(out=str(tmp_path / "refused"), deferred_wgrad=True, gradient_checkpointing=True, **kw)


def test_compiled_ttt_steps_share_one_graph_and_train_the_same_weights(inputs, tmp_path, monkeypatch):
    """The compiled draft (compile_draft: every TTT step one shape, deferred weight gradients staged through slot
    0) compiles its TTT block once for training and once for validation, over steps, micro-batches and epochs,
    where each step once compiled its own; and it trains the weights of the uncompiled run."""
    import torch._dynamo.utils as dynamo_utils

    import eyas.stages.train as train_stage
    from eyas.training import trainer as trainer_mod

    def compile_draft(draft):  # compile_draft's settings, the eager backend: what is compiled, not inductor's code
        trainer_mod.compile_draft(draft)
        draft.ttt_block = torch.compile(type(draft).ttt_block.__get__(draft), backend="eager", dynamic=False)

    monkeypatch.setattr(trainer_mod.TTTObjective, "__init__", _eager_objective(trainer_mod.TTTObjective.__init__))
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["features"], epochs=2, max_steps=4,
              val_ratio=0.2, **{**COMMON, "grad_accum": 2})  # fmt: skip
    assert train(out=str(tmp_path / "eager"), compile=False, **kw)["deferred_wgrad"]
    monkeypatch.setattr(train_stage, "compile_draft", compile_draft)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    res = train(out=str(tmp_path / "compiled"), compile=True, **kw)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2  # with gradients, and without (validation)
    assert res["compiles"] == 2 and res["compile_seconds"] >= 0  # what the manifest and the summary report
    a, b = _final_state(tmp_path / "eager"), _final_state(tmp_path / "compiled")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_skipping_unscored_positions_trains_the_same_weights(inputs, tmp_path, monkeypatch):
    """With small loss chunks the loader hands the loss the positions some TTT step scores (the rows' prompts and
    the packing padding left out), and the verifier's head the positions whose targets some step reads; training
    follows the run that scores every position with targets everywhere: same weights, validation loss and
    statistics."""
    import eyas.training.batches
    from eyas.training.loss import _NORMED_AT, TargetHead, _FusedTTTLoss, target_rows

    seen, apply = [], _FusedTTTLoss.apply
    heads, call = [], TargetHead.__call__

    def head_spy(self, last, *, pad, rows=None):  # records how many positions the verifier's head ran on
        heads.append(last.shape[0] if rows is None else rows.numel())
        return call(self, last, pad=pad, rows=rows)

    monkeypatch.setattr(TargetHead, "__call__", head_spy)

    def spy(*args):  # records each loss call's scored rows (args[7]) against its positions (its first state's)
        rows, M = args[7], args[_NORMED_AT].shape[0]
        seen.append(None if rows is None else (int((rows < M).sum()), M))
        return apply(*args)

    monkeypatch.setattr(_FusedTTTLoss, "apply", spy)
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["features"], epochs=1, max_steps=4,
              val_ratio=0.2, **{**COMMON, "batch_tokens": 128})  # fmt: skip
    with monkeypatch.context() as m:  # the reference: targets at every position
        m.setattr(eyas.training.batches, "target_rows", lambda *a: None)
        train(out=str(tmp_path / "all"), loss_chunk_tokens=1024, **kw)  # 128 positions a micro-batch: one chunk
    assert seen and all(r is None for r in seen) and set(heads) == {128}
    seen.clear()
    heads.clear()
    assert eyas.training.batches.target_rows is target_rows
    train(out=str(tmp_path / "scored"), loss_chunk_tokens=8, **kw)
    skipped = [r for r in seen if r is not None]
    assert len(skipped) >= len(seen) // 2 and all(n < M for n, M in skipped), seen  # prompts and padding left out
    assert len(heads) == len(seen) and sum(heads) < 0.9 * 128 * len(heads), heads  # targets skipped there too
    a, b = _final_state(tmp_path / "all"), _final_state(tmp_path / "scored")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)
    va, vb = _records(tmp_path / "all", "val"), _records(tmp_path / "scored", "val")
    assert va and len(va) == len(vb)
    for x, y in zip(va, vb):  # the same statistics over the same positions
        for key in ("loss", "tau", "acc_0", "acc_1", "acc_2", "cond_acc_0", "cond_acc_1"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-9), key


def test_loader_embeddings_train_the_same_weights(inputs, tmp_path, monkeypatch):
    """The frozen embedding looked up by the data loader in host memory (the default on CUDA) trains exactly the
    weights of the draft looking it up itself."""
    from eyas.draft.model import Eagle3Draft

    seen, ttt = [], Eagle3Draft.ttt

    def spy(self, *args, inputs_embeds=None, **kwargs):  # records which path each forward took
        seen.append(inputs_embeds is not None)
        return ttt(self, *args, inputs_embeds=inputs_embeds, **kwargs)

    monkeypatch.setattr(Eagle3Draft, "ttt", spy)
    kw = dict(verifier=inputs["verifier"], vocab=inputs["vocab"], data=inputs["features"], epochs=1, max_steps=4,
              val_ratio=0.1, **COMMON)  # fmt: skip
    train(out=str(tmp_path / "device"), loader_embeddings=False, **kw)
    assert seen and not any(seen)
    seen.clear()
    train(out=str(tmp_path / "loader"), loader_embeddings=True, **kw)
    assert seen and all(seen)
    a, b = _final_state(tmp_path / "device"), _final_state(tmp_path / "loader")
    assert a.keys() == b.keys() and "draft.fc.weight" in a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    va, vb = _records(tmp_path / "device", "val"), _records(tmp_path / "loader", "val")
    assert va and [r["loss"] for r in va] == [r["loss"] for r in vb]
    with pytest.raises(EyasError, match="loader-embeddings"):
        train(out=str(tmp_path / "online"), loader_embeddings=True, online=True,
              **dict(kw, data=inputs["prepared"]))  # fmt: skip


def test_learns_and_writes_a_loadable_draft(inputs, tmp_path, capsys):
    from eyas.draft.checkpoint import load_draft, read_draft_config

    out = tmp_path / "run"
    kw = dict(verifier=inputs["verifier"], data=inputs["features"], vocab=inputs["vocab"], out=str(out), epochs=4,
              lr=3e-3, val_ratio=0.1, **COMMON)  # fmt: skip
    result = train(**kw)
    recs = _records(out)
    assert recs[-1]["loss_0"] < 0.5 * recs[0]["loss_0"]
    assert result["val"]["acc"][0] >= 0 and len(_records(out, "val")) == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "train" and manifest["outputs"]["val"]["tau"] >= 1.0
    covers = manifest["outputs"]["val"]["covers"]  # which rows and lengths the validation tau averages over
    assert covers["rows"] == len(manifest["outputs"]["val_rows"]) > 0 and covers["row_tokens_max"] > 0
    assert covers["scored_positions"] > 0 and "held-out rows" in covers["what"]
    assert manifest["outputs"]["accuracy"] == "draft argmax == verifier full-vocab argmax"
    assert (out / "training_curves.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    cfg, raw = read_draft_config(out)
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg.draft_vocab_size == 256 and cfg.aux_layer_ids == [2, 4, 5] and raw["norm_before_residual"] is False
    assert raw["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    draft = load_draft(out, verifier=inputs["verifier"])
    state = _final_state(out)
    for name, t in draft.state_dict().items():
        if name.startswith("draft.") or name in ("embed_tokens.weight",):
            continue
        want = state[f"draft.{name}"]
        torch.testing.assert_close(t, want.to(torch.bfloat16).to(t.dtype) if want.is_floating_point() else want,
                                   msg=name)  # fmt: skip
    # OUT/checkpoints/best: the draft of the validation with the highest tau (the first of equals), and which one it is
    vals = _records(out, "val")
    top = max(vals, key=lambda r: r["tau"])
    best = json.loads((out / "checkpoints" / "best" / "best.json").read_text())
    assert best == manifest["outputs"]["best"] and best["tau"] == top["tau"]
    first = next(r for r in vals if r["tau"] == top["tau"])
    assert best["step"] == first["step"] and best["epochs"] == first["epoch"] + 1  # validated at each epoch's end
    assert load_draft(out / "checkpoints" / "best", verifier=inputs["verifier"]).config == cfg
    same = (out / "checkpoints" / "best" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert same == (best["step"] == result["steps"])
    assert f"that draft is in {out / 'checkpoints' / 'best'}" in capsys.readouterr().out
    again = train(**kw)  # the same command again: nothing to do
    assert "already trained" in capsys.readouterr().out and again["steps"] == result["steps"]
    # another --verifier-name is another output (config.json records it): refused, never reported as trained
    with pytest.raises(EyasError, match="other inputs or settings"):
        train(**kw, verifier_name="org/another-name")
    assert raw == read_draft_config(out)[1]


def test_accuracy_within_the_draft_vocab_is_labelled_so(inputs, tmp_path, capsys):
    """--no-full-vocab-accuracy scores accuracy within the draft vocab; the manifest, the printed summary and the
    plot say which was computed."""
    train(verifier=inputs["verifier"], data=inputs["features"], vocab=inputs["vocab"], out=str(tmp_path / "out"),
          epochs=1, max_steps=2, val_ratio=0.2, full_vocab_accuracy=False, **COMMON)  # fmt: skip
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["outputs"]["accuracy"].startswith("draft argmax == verifier argmax within the draft vocab")
    assert "within the draft vocab" in capsys.readouterr().out


def test_resume_after_kill9_is_bit_identical(inputs, tmp_path):
    """SIGKILL mid-epoch, rerun the same command: the final weights equal an uninterrupted run's, bit for bit."""
    args = dict(verifier=inputs["verifier"], data=inputs["features"], vocab=inputs["vocab"], epochs=3,
                val_ratio=0.1, save_every=2, **COMMON)  # fmt: skip
    train(out=str(tmp_path / "whole"), **args)

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eyas.cli", "train", "--verifier-path", args["verifier"], "--data-dir",
           args["data"], "--vocab-mapping-dir", args["vocab"], "--output-dir", str(out), "--epochs", "3",
           "--val-ratio", "0.1", "--save-every", "2", "--max-seq-len", "64", "--num-workers", "0", "--log-every", "2",
           "--warmup-steps", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not checkpoint_dirs(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    killed_at = int(checkpoint_dirs(out)[-1].name.removeprefix("step-"))
    assert not (out / "manifest.json").exists() and (out / ".eyas.lock").exists()

    train(out=str(out), **args)  # the same run again: resumes
    whole, resumed = _final_state(tmp_path / "whole"), _final_state(out)
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    # the best validated draft survives the kill too
    for f in ("best.json", "model.safetensors"):
        assert (out / "checkpoints" / "best" / f).read_bytes() == \
            (tmp_path / "whole" / "checkpoints" / "best" / f).read_bytes(), f  # fmt: skip
    steps = [r["step"] for r in _records(out)]
    assert steps == sorted(set(steps)) and killed_at < steps[-1]  # no duplicated records after the resume


def test_nan_stops_and_keeps_the_last_good_checkpoint(inputs, tmp_path):
    """A row whose features hold NaN (a verifier that overflowed while extracting; the manifest vouches for the
    shard, so only training can notice): the run stops with a clear message and every checkpoint on disk is
    finite."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    feats = tmp_path / "features"
    shutil.copytree(inputs["features"], feats)
    shard = next(feats.glob("rows_*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(shard))
    a, b = t["cu_seqlens"][7].item(), t["cu_seqlens"][8].item()
    t["hidden_states"][a:b, 0] = float("nan")
    save_file(t, str(shard), metadata=meta)
    from eyas.core.files import sha256_file

    m = json.loads((feats / "manifest.json").read_text())
    next(e for e in m["outputs"]["shards"] if e["file"] == shard.name).update(
        sha256=sha256_file(shard), bytes=shard.stat().st_size
    )
    (feats / "manifest.json").write_text(json.dumps(m))
    out = tmp_path / "run"
    with pytest.raises(EyasError, match="nan/inf"):
        train(verifier=inputs["verifier"], data=str(feats), vocab=inputs["vocab"], out=str(out), epochs=2,
              val_ratio=0.0, save_every=1, **{**COMMON, "log_every": 1})  # fmt: skip
    assert not (out / "manifest.json").exists() and not (out / "model.safetensors").exists()
    for ckpt in checkpoint_dirs(out):
        state = torch.load(ckpt / STATE_FILE, weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_failed_checkpoint_write_keeps_the_last_one_and_resumes(inputs, tmp_path, monkeypatch):
    """The third checkpoint's write fails as a full disk fails torch.save (its zip writer raises RuntimeError):
    a clear error naming the checkpoint and the free space, nothing half-written beside the complete ones, and the
    same command then resumes from the newest complete checkpoint."""
    import eyas.training.trainer as trainer_mod

    args = dict(verifier=inputs["verifier"], data=inputs["features"], vocab=inputs["vocab"], out=str(tmp_path / "run"),
                epochs=1, max_steps=4, val_ratio=0.0, save_every=1, **COMMON)  # fmt: skip
    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) == 3:
            real_save(obj, f, *a, **kw)  # the bytes reach the file, then the writer fails at its end
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 705083904 vs 705083792")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(trainer_mod.torch, "save", failing_save)
    with pytest.raises(EyasError, match=r"writing checkpoint .*step-00000003 failed .* GiB free .*step-00000002"):
        train(**args)
    monkeypatch.setattr(trainer_mod.torch, "save", real_save)
    out = tmp_path / "run"
    assert [p.name for p in checkpoint_dirs(out)] == ["step-00000001", "step-00000002"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporary left
    res = train(**args)
    assert res["steps"] == 4 and checkpoint_dirs(out)[-1].name == "step-00000004"
    steps = [r["step"] for r in _records(out)]
    assert steps == sorted(set(steps)) and steps[-1] == 4  # no record written twice across the resume


def test_muon_groups_learn_and_resume_bit_identical(inputs, tmp_path, monkeypatch):
    """--optimizer muon (speculators' default, torch.optim.Muon): Muon on the layer's and fc's matrices, AdamW on
    the rest (norms, lm_head), every trainable weight in exactly one; it learns, and a run cut after its second
    checkpoint (the third's write fails) resumes to the weights of an uninterrupted run, bit for bit: both
    optimizers' states are in the checkpoint."""
    import eyas.training.trainer as trainer_mod
    from eyas.training.optim import build_optimizers

    class Layout(torch.nn.Module):  # the draft's parameter names and ranks
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4, bias=False)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False)])
            self.norm = torch.nn.LayerNorm(4, bias=False)
            self.lm_head = torch.nn.Linear(4, 16, bias=False)

    m = Layout()
    muon, adamw = build_optimizers(m, name="muon", lr=1e-3, weight_decay=0.01, fused=False)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    ids = lambda opt: {id(p) for g in opt.param_groups for p in g["params"]}  # noqa: E731
    assert ids(muon) == {id(m.fc.weight), id(m.layers[0].weight)}
    assert ids(adamw) == {id(m.norm.weight), id(m.lm_head.weight)}

    args = dict(verifier=inputs["verifier"], data=inputs["features"], vocab=inputs["vocab"], epochs=1, max_steps=4,
                val_ratio=0.0, save_every=1, optimizer="muon", lr=3e-3, **COMMON)  # fmt: skip
    train(out=str(tmp_path / "whole"), **args)
    recs = _records(tmp_path / "whole")
    assert recs[-1]["loss"] < recs[0]["loss"], recs
    real_save, calls = torch.save, []

    def failing_save(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) == 3:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(trainer_mod.torch, "save", failing_save)
    with pytest.raises(EyasError, match="step-00000003 failed"):
        train(out=str(tmp_path / "cut"), **args)
    monkeypatch.setattr(trainer_mod.torch, "save", real_save)
    train(out=str(tmp_path / "cut"), **args)
    whole, resumed = _final_state(tmp_path / "whole"), _final_state(tmp_path / "cut")
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


def test_bad_inputs_fail_before_the_first_step(inputs, make_tiny, tmp_path):
    from eyas.stages.extract import extract

    out = tmp_path / "out"
    base = dict(verifier=inputs["verifier"], out=str(out), epochs=1, **COMMON)
    other = make_tiny("qwen3").path  # same hidden size and vocab, other weights
    other_feats = tmp_path / "qwen3-features"
    other_rows = tiny.write_prepared(tmp_path / "qwen3-rows", _rows(4, 5), verifier=other)
    extract(verifier=str(other), data=str(other_rows), out=str(other_feats), dtype="fp32")
    with pytest.raises(EyasError, match="extracted from another verifier"):
        train(data=str(other_feats), **base)
    with pytest.raises(EyasError, match="tokenized for another verifier"):
        train(data=str(other_rows), online=True, **base)

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**tiny._common(hidden_size=32, num_attention_heads=2, num_key_value_heads=1))
    narrow = tiny._save(tiny._build(cfg, LlamaForCausalLM, 7), tiny.make_tokenizer(), tmp_path / "narrow", cfg,
                        LlamaForCausalLM)  # fmt: skip
    with pytest.raises(EyasError, match="hidden size 64 but .* has 32"):
        train(**{**base, "verifier": str(narrow.path), "data": inputs["features"]})

    bad = tmp_path / "vocab-other-tokenizer"
    bad.mkdir()
    np.save(bad / "d2t.npy", np.zeros(600, dtype=np.int64))
    np.save(bad / "t2d.npy", np.ones(600, dtype=bool))
    with pytest.raises(EyasError, match="made for another tokenizer"):
        train(data=inputs["features"], vocab=str(bad), **base)
    np.save(bad / "t2d.npy", np.ones(tiny.VOCAB, dtype=bool))
    np.save(bad / "d2t.npy", np.ones(tiny.VOCAB, dtype=np.int64))
    with pytest.raises(EyasError, match="does not map onto"):
        train(data=inputs["features"], vocab=str(bad), **base)
    with pytest.raises(EyasError, match="--layers"):
        train(data=inputs["features"], layers=[1, 2, 3], **base)
    with pytest.raises(EyasError, match="--loss-chunk-tokens must be at least 1"):
        train(data=inputs["features"], loss_chunk_tokens=0, **base)
    with pytest.raises(EyasError, match="--drop-out-of-vocab needs the verifier's full-vocab argmax"):
        train(data=inputs["features"], vocab=inputs["vocab"], drop_out_of_vocab=True, full_vocab_accuracy=False,
              **base)  # fmt: skip
    assert not out.exists()


def test_variant_flags_train_a_draft_that_loads_and_exports(inputs, tmp_path):
    """Each draft variant is one flag (and one `eyas run` key): a run with EAGLE-3.1's norms, a Qwen3-style layer
    and two layers trains, writes the config keys vLLM reads, loads back with the trained weights, and exports
    for vLLM, while the SGLang export is refused (no SGLang release runs a Qwen3-style draft layer)."""
    from eyas.draft.checkpoint import load_draft, read_draft_config
    from eyas.cli import main
    from eyas.stages.export import export
    from eyas.pipeline import check

    out = tmp_path / "run"
    assert main(["train", "--verifier", inputs["verifier"], "--data", inputs["features"], "--vocab", inputs["vocab"],
                 "--out", str(out), "--epochs", "1", "--max-steps", "2", "--max-seq-len", "64", "--num-workers", "0",
                 "--fc-norm", "--norm-output", "--draft-arch", "qwen3", "--num-layers", "2"]) == 0  # fmt: skip
    cfg, raw = read_draft_config(out)
    assert (cfg.fc_norm, cfg.norm_output, cfg.draft_arch, cfg.num_hidden_layers) == (True, True, "qwen3", 2)
    assert raw["fc_norm"] and raw["transformer_layer_config"]["model_type"] == "qwen3"
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2 and not raw["norm_before_fc"]
    draft, state = load_draft(out, verifier=inputs["verifier"]), _final_state(out)
    for name in ("fc_norm.2.weight", "layers.1.self_attn.q_norm.weight", "layers.1.mlp.down_proj.weight"):
        want = state[f"draft.{name}"].to(torch.bfloat16).float()  # the checkpoint holds bf16
        torch.testing.assert_close(draft.get_parameter(name).detach(), want, rtol=0, atol=0, msg=name)
    assert export(draft=str(out), out=str(tmp_path / "vllm"))["outputs"]["requires"]["min_version"] == "0.25.0"
    with pytest.raises(EyasError, match="draft_arch=qwen3, but no SGLang release"):
        export(draft=str(out), out=str(tmp_path / "sgl"), format="eagle")
    with pytest.raises(EyasError, match="norm_before_fc and fc_norm exclude each other"):
        train(verifier=inputs["verifier"], data=inputs["features"], out=str(tmp_path / "both"), norm_before_fc=True,
              fc_norm=True, **COMMON)  # fmt: skip
    config = tmp_path / "variants.toml"
    config.write_text('verifier = "x"\n[train]\nfc_norm = true\nnorm_output = true\ndraft_arch = "qwen3"\n'
                      "num_layers = 2\n")  # fmt: skip
    (_, _, [(stage, _, c)]) = check(str(config))
    assert stage == "train" and (c.fc_norm, c.draft_arch, c.num_layers) == (True, "qwen3", 2)


@pytest.mark.parametrize("how", ["run", "train"])
def test_time_limit_sigterm_ends_training_quietly(inputs, tmp_path, how):
    """A time limit's SIGTERM goes to the whole process group (`timeout`, batch schedulers): the loader's worker
    processes get it too. `eyas run` and `eyas train` end as after Ctrl-C, with the one line saying to run the
    command again, and no worker's death as a traceback before it."""
    out = tmp_path / "run" / "draft"
    settings = dict(epochs=1000, max_seq_len=64, num_workers=2, save_every=1, log_every=1)
    if how == "run":
        config = tmp_path / "run.toml"
        config.write_text(f'out = "{tmp_path / "run"}"\nverifier = "{inputs["verifier"]}"\n[train]\n'
                          f'data = "{inputs["features"]}"\nvocab = "{inputs["vocab"]}"\n'
                          + "".join(f"{k} = {v}\n" for k, v in settings.items()))  # fmt: skip
        args = ["run", str(config)]
    else:
        args = ["train", "--verifier", str(inputs["verifier"]), "--data", str(inputs["features"]), "--vocab",
                str(inputs["vocab"]), "--out", str(out),
                *(x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v)))]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eyas.cli", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.time() + 120
    while not (out.exists() and len(checkpoint_dirs(out)) >= 2) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 130 and "interrupted; run the same command again" in err, err[-3000:]
    assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]
