"""Two gloo processes under torchrun (DDP and FSDP2) train what one process does at the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiny
from eyas.stages.train import train
from eyas.training.trainer import STATE_FILE, checkpoint_dirs

ARGS = dict(epochs=1, max_seq_len=64, num_workers=0, log_every=2, val_ratio=0.1, warmup_steps=2, lr=3e-4)


@pytest.fixture(scope="module")
def features(make_tiny, tmp_path_factory):
    import numpy as np

    from eyas.stages.extract import extract

    root = tmp_path_factory.mktemp("dist")
    verifier = make_tiny("llama").path
    rng = np.random.default_rng(4)
    rows = []
    for _ in range(36):
        L = int(rng.integers(10, 70))
        rows.append((rng.integers(3, tiny.VOCAB, L).tolist(), [0] * 3 + [1] * (L - 3)))
    prepared = tiny.write_prepared(root / "prepared", rows, verifier=verifier)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    extract(verifier=str(verifier), data=str(prepared), out=str(root / "features"), dtype="fp32")
    torch.set_num_threads(old)
    return str(verifier), str(root / "features")


@pytest.fixture(scope="module")
def one_process(features, tmp_path_factory):
    """The reference: one process, two micro-batches per step, each weight gradient formed per use by autograd."""
    verifier, feats = features
    out = tmp_path_factory.mktemp("one") / "run"
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    train(verifier=verifier, data=feats, out=str(out), grad_accum=2, deferred_wgrad=False, **ARGS)
    torch.set_num_threads(old)
    return out


def _log(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


@pytest.mark.parametrize("mode", ["ddp", "ddp-per-use", "fsdp"])
def test_two_ranks_equal_one_process(features, one_process, tmp_path, mode):
    """ddp: with deferred weight gradients (the default), whose sum reaches each weight once per backward (DDP's
    hooks fire once), against the per-use one-process reference; ddp-per-use: without them."""
    verifier, feats = features
    out = tmp_path / mode
    mode, per_use = mode.removesuffix("-per-use"), mode.endswith("-per-use")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eyas.cli",
           "train", "--verifier", verifier, "--data", feats, "--out", str(out), "--grad-accum", "1", "--dist", mode,
           *flags]  # fmt: skip
    if mode == "ddp":  # the embedding looked up by the loader: DDP must leave the frozen table out of its checks
        cmd.append("--loader-embeddings")
    if per_use:
        cmd.append("--no-deferred-wgrad")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    ref, got = _log(one_process), _log(out)
    assert [r["step"] for r in ref] == [r["step"] for r in got]
    for a, b in zip(ref, got):
        # The gradient norm sees any error in how ranks combine gradients (Adam's update would hide a scale).
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        for k in range(3):
            assert b[f"loss_{k}"] == pytest.approx(a[f"loss_{k}"], rel=1e-5)
    sa = torch.load(checkpoint_dirs(one_process)[-1] / STATE_FILE, weights_only=True)
    sb = torch.load(checkpoint_dirs(out)[-1] / STATE_FILE, weights_only=True)
    assert sa["global_step"] == sb["global_step"]
    for name, t in sa["model"].items():
        torch.testing.assert_close(sb["model"][name], t, rtol=0, atol=1e-6, msg=name)
    val_a = json.loads((one_process / "manifest.json").read_text())["outputs"]["val"]
    val_b = json.loads((out / "manifest.json").read_text())["outputs"]["val"]
    assert val_b["loss"] == pytest.approx(val_a["loss"], rel=1e-5) and val_b["positions"] == val_a["positions"]
