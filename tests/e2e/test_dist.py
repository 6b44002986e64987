"""Distributed runs: torchrun ranks split the work and produce what one process does; a dead rank makes the
others stop instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import tiny
from eyas.stages.extract import extract, WINDOW_SHARDS

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env(**extra: str) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT in native code, seen once in CI) prints every thread's stack
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_cpu_ranks_equal_one_process(make_tiny, tmp_path):
    import torch

    t = make_tiny("llama")
    rows = [([(7 * i + j) % (tiny.VOCAB - 3) + 3 for j in range(3 + i % 11)], [j % 2 for j in range(3 + i % 11)])
            for i in range(23)]  # fmt: skip
    prep = tiny.write_prepared(tmp_path / "prep", rows, verifier=t.path)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "one"), dtype="fp32",
                      shard_tokens=20, batch_tokens=32)  # fmt: skip
    finally:
        torch.set_num_threads(old)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "eyas.cli", "extract", "--verifier", str(t.path), "--data", str(prep), "--out", str(tmp_path / "two"),
           "--dtype", "fp32", "--shard-tokens", "20", "--batch-tokens", "32", "--device", "cpu"]  # fmt: skip
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    # more shards than a window holds: both ranks extract (windows are dealt out whole)
    assert two["outputs"]["shards"] == one["outputs"]["shards"] and len(one["outputs"]["shards"]) > WINDOW_SHARDS
    for s in one["outputs"]["shards"]:
        assert (tmp_path / "two" / s["file"]).read_bytes() == (tmp_path / "one" / s["file"]).read_bytes()
    assert not list((tmp_path / "two").glob(".progress-*"))


DEAD_RANK = textwrap.dedent("""
    import os, sys
    from eyas.core import dist
    from eyas.core.errors import EyasError
    d = dist.init(device_type="cpu")
    if d.rank == 1:
        os._exit(3)  # dies without a word, as a killed or crashed rank does
    try:
        d.barrier("test barrier")
    except EyasError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
""")


def test_dead_rank_makes_the_others_exit(tmp_path):
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DEAD_RANK],
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                EYAS_DIST_TIMEOUT_S="30",
            ),
        )  # fmt: skip
        for r in range(2)
    ]
    t0 = time.time()
    _, err = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=60)
    assert procs[1].returncode == 3
    assert procs[0].returncode == 2, err[-2000:]
    assert "rank 0/2" in err and "test barrier" in err
    assert time.time() - t0 < 90
