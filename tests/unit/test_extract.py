"""`eyas extract`: exact states on every verifier layout, batching without leaks, crash-safe resume, --verify,
fp8, the int4 verifier, speculators' layout, and the refusals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiny
from eyas.stages import extract as extract_mod
from eyas.engine import extractor as extractor_mod
from eyas.cli import main as cli_main
from eyas.core.errors import EyasError
from eyas.stages.extract import extract, plan_shards, plan_windows
from eyas.data.lengths import plan_batches
from eyas.data.features import FeatureReader, shard_name, verify

EXACT = ["llama", "qwen3", "deepseek_v3", "kimi_like"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _prepared(path: Path, verifier: Path, rows) -> Path:
    return tiny.write_prepared(path, rows, verifier=verifier)


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("rows_*.safetensors"))}


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip


@pytest.mark.parametrize("name", EXACT)
def test_states_equal_transformers_bit_for_bit(make_tiny, tmp_path, name):
    """fp32 on CPU, one row per forward: the aux states are transformers' output_hidden_states[i] bit for bit,
    the last state is the last decoder layer's output (pre-norm), whose norm is transformers' last entry."""
    t = make_tiny(name)
    rows = tiny.random_rows(4, seed=len(name))
    prep = _prepared(tmp_path / "prep", t.path, rows)
    m = extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), dtype="fp32", batch_tokens=1,
                shard_tokens=50)  # fmt: skip
    assert m["layer_ids"] == [2, 4, 5] and m["last_hidden_normed"] is False and m["dtype"] == "fp32"
    assert m["format"] == "eyas-features/1" and m["hidden_size"] == tiny.HIDDEN and m["num_rows"] == 4
    assert m["inputs"]["verifier"]["num_hidden_layers"] == tiny.LAYERS  # the verifier's identity
    shards = m["outputs"]["shards"]
    assert len(shards) > 1 and [s["rows"] for s in shards][0][0] == 0 and shards[-1]["rows"][1] == 4
    assert all(len(s["sha256"]) == 64 for s in shards)
    ref = t.reference()
    pre_norm = {}
    ref.model.layers[-1].register_forward_hook(
        lambda mod, args, out: pre_norm.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    reader = FeatureReader(tmp_path / "f")
    for i, (ids, mask) in enumerate(rows):
        with torch.no_grad():
            hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
        row = reader[i]
        assert torch.equal(row.input_ids, torch.tensor(ids)) and row.loss_mask.tolist() == [bool(x) for x in mask]
        assert torch.equal(row.aux_hidden_states, torch.cat([hs[k][0] for k in (2, 4, 5)], dim=-1))
        assert torch.equal(row.last_hidden_state, pre_norm["h"][0])
        assert torch.equal(ref.model.norm(row.last_hidden_state[None]), hs[-1])


def test_batched_equals_one_row_at_a_time(make_tiny, tmp_path, monkeypatch):
    """Length-sorted, right-padded batches give every row the states it gets alone (up to float summation
    order), and what sits in the padding never reaches a stored row (bit for bit)."""
    t = make_tiny("llama")
    rows = tiny.random_rows(9, seed=3, lo=2, hi=30)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    common = dict(verifier=str(t.path), data=str(prep), dtype="fp32", shard_tokens=60)
    extract(**common, out=str(tmp_path / "one"), batch_tokens=1)
    extract(**common, out=str(tmp_path / "batched"), batch_tokens=90)
    monkeypatch.setattr(extractor_mod, "PAD_ID", 17)
    extract(**common, out=str(tmp_path / "other_pad"), batch_tokens=90)
    assert _shard_bytes(tmp_path / "batched") == _shard_bytes(tmp_path / "other_pad")
    one, batched = FeatureReader(tmp_path / "one"), FeatureReader(tmp_path / "batched")
    for i in range(len(rows)):
        a, b = one.states(i), batched.states(i)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    # the plan really batched rows of different lengths together, and rows of different shards (a window)
    lengths = torch.tensor([len(r[0]) for r in rows]).numpy()
    assert any(len(b) > 1 and len({lengths[i] for i in b}) > 1 for b in plan_batches(lengths[:5], 90))
    shards = plan_shards(lengths, 60)
    shard_of = {r: k for k, (s, e) in enumerate(shards) for r in range(s, e)}
    w = plan_windows(shards)[0]
    assert len(shards) > 1 and any(len({shard_of[w[0][0] + i] for i in b}) > 1
                                   for b in plan_batches(lengths[w[0][0] : w[-1][1]], 90))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_streamed_shard_is_standard_safetensors(tmp_path, dtype):
    """The shard writer streams row pieces and hashes as it writes: safetensors' own loader reads the file as the
    concatenation of the pieces, and the returned sha256 is the file's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eyas.data.features import shard_tensors, write_shard
    from eyas.core.files import sha256_file

    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 17, 1]
    ids = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) > 0.5 for n in lengths]
    states = [torch.randn(n, 4, 24, generator=g).to(dtype) for n in lengths]
    scales = [torch.rand(4, generator=g) for _ in lengths] if dtype == torch.float8_e4m3fn else None
    entry = write_shard(
        tmp_path, start=10, end=14, tensors=shard_tensors(ids, masks, states, scales), layer_ids=[1, 2, 3]
    )
    path = tmp_path / entry["file"]
    assert entry["sha256"] == sha256_file(path) and entry["bytes"] == path.stat().st_size and entry["tokens"] == 23
    got = load_file(path)
    assert torch.equal(got["input_ids"], torch.cat(ids).int()) and torch.equal(got["loss_mask"], torch.cat(masks))
    assert torch.equal(got["cu_seqlens"], torch.tensor([0, 5, 5, 22, 23]))
    assert got["hidden_states"].dtype == dtype
    assert torch.equal(got["hidden_states"].view(torch.uint8), torch.cat(states).view(torch.uint8))
    if scales is not None:
        assert torch.equal(got["hidden_states_scale"], torch.stack(scales))
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["eyas_features"])
    assert meta["rows"] == [10, 14] and meta["layer_ids"] == [1, 2, 3]
    again = write_shard(tmp_path / "again", start=10, end=14, tensors=shard_tensors(ids, masks, states, scales),
                        layer_ids=[1, 2, 3])  # fmt: skip
    assert again["sha256"] == entry["sha256"]  # deterministic: resume compares hashes


def test_host_buffers_are_reused_by_identity():
    """Shard buffers come back to the pool and are handed out again (the smallest that fits); the pool keeps at
    most ``keep`` of them, the largest."""
    from eyas.engine.extractor import _HostBuffers

    grain = _HostBuffers.GRAIN
    pool = _HostBuffers(pinned=False, keep=2)
    a, b, c = pool.acquire(grain + 1), pool.acquire(10), pool.acquire(3 * grain)
    assert (a.numel(), b.numel(), c.numel()) == (2 * grain, grain, 3 * grain)
    for buf in (a, b, c):
        pool.release(buf)
    assert sorted(x.numel() for x in pool._free) == [2 * grain, 3 * grain]  # the smallest was dropped
    assert pool.acquire(5) is a and pool.acquire(5) is c
    assert pool.acquire(5) is not b and not pool._free


def test_plans():
    import numpy as np

    lengths = np.array([5, 0, 7, 3, 9, 2])
    assert plan_shards(lengths, 10) == [(0, 3), (3, 5), (5, 6)]
    assert plan_shards(np.array([], dtype=np.int64), 10) == [(0, 0)]
    batches = plan_batches(lengths, 18)
    assert batches == [[4, 2], [0, 3, 5]]  # longest first; the empty row 1 runs nowhere
    assert plan_batches(lengths, 1) == [[4], [2], [0], [3], [5]]
    shards = [(0, 2), (2, 3), (3, 7), (7, 9), (9, 10)]
    assert plan_windows(shards, 2) == [[(0, 2), (2, 3)], [(3, 7), (7, 9)], [(9, 10)]]
    assert plan_windows([(0, 0)]) == [[(0, 0)]]


def test_default_shards_stay_within_shard_bytes():
    """Default shards hold at most SHARD_BYTES of states (a shard's pinned buffer, rounded up to the pool's
    grain, stays exactly 1 GiB: PyTorch's pinned allocator would round anything above to 2 GiB), and come
    within one longest row of it."""
    import numpy as np

    from eyas.stages.extract import SHARD_BYTES
    from eyas.engine.extractor import _HostBuffers
    from eyas.data.features import NUM_STATES, STORAGE_DTYPES, bytes_per_token

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(450), 0.8, 40_000).astype(int), 16, 4096)
    for H, dtype in [(576, "bf16"), (576, "fp8"), (4096, "bf16"), (7168, "fp8")]:
        n = extract_mod.default_shard_tokens(lengths, H, dtype)
        shards = plan_shards(lengths, n)
        state_bytes = [int(lengths[s:e].sum()) * NUM_STATES * H * STORAGE_DTYPES[dtype].itemsize for s, e in shards]
        assert max(state_bytes) <= SHARD_BYTES, (H, dtype)
        grain = _HostBuffers.GRAIN
        assert max(-(-b // grain) * grain for b in state_bytes) == SHARD_BYTES, (H, dtype)
        full = [int(lengths[s:e].sum()) * bytes_per_token(H, dtype) for s, e in shards[:-1]]
        assert min(full) >= SHARD_BYTES - 2 * 4096 * bytes_per_token(H, dtype), (H, dtype)


def test_resume_inside_a_window_keeps_its_written_shards(make_tiny, tmp_path, monkeypatch):
    """A run that stops in the middle of a window (here: the writer fails on the window's third shard) is
    finished by a rerun that computes the whole window again, keeps the shards already written and writes the
    rest at their rows: byte-identical to an uninterrupted run."""
    t = make_tiny("llama")
    rows = tiny.random_rows(12, seed=23, lo=2, hi=12)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    args = dict(verifier=str(t.path), data=str(prep), dtype="fp8", shard_tokens=1, batch_tokens=40)
    ref = extract(**args, out=str(tmp_path / "ref"))
    write_shard, calls = extract_mod.features.write_shard, []

    def failing(*a, **k):
        calls.append(k["start"])
        if len(calls) == 7:  # window 1 (shards 4-7): shards 4 and 5 written, 6 fails, 7 never written
            raise OSError("disk gone")
        return write_shard(*a, **k)

    monkeypatch.setattr(extract_mod.features, "write_shard", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk gone"):
        extract(**args, out=str(out))
    monkeypatch.setattr(extract_mod.features, "write_shard", write_shard)
    written = sorted(p.name for p in out.glob("rows_*.safetensors"))
    assert written == [shard_name(i, i + 1) for i in range(6)]
    inodes = {n: (out / n).stat().st_ino for n in written}
    assert extract(**args, out=str(out))["outputs"]["shards"] == ref["outputs"]["shards"]
    assert {n: (out / n).stat().st_ino for n in written} == inodes
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "ref")


def _cli_extract(t, prep: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "eyas.cli", "extract", "--verifier", str(t.path), "--data", str(prep),
            "--out", str(out), "--dtype", "fp32", "--shard-tokens", "1", "--batch-tokens", "16", *extra]  # fmt: skip


def test_kill_9_then_rerun_is_byte_identical(make_tiny, tmp_path):
    t = make_tiny("llama")
    rows = tiny.random_rows(120, seed=5, lo=2, hi=12)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    ref = extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "ref"), dtype="fp32", shard_tokens=1,
                  batch_tokens=16)  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.Popen(_cli_extract(t, prep, out), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    progress = out / ".progress-rank0.json"
    kill_after = random.randint(1, 30)  # shards; then a random moment inside the next one
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if progress.is_file() and len(json.loads(progress.read_text())["shards"]) >= kill_after:
            break
        time.sleep(0.005)
    time.sleep(random.uniform(0, 0.02))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (out / "manifest.json").exists(), "the run finished before the kill; nothing was tested"
    finished = json.loads(progress.read_text())["shards"]
    assert 0 < len(finished) < 120
    stamps = {name: (out / name).stat().st_ino for name in finished}
    r = subprocess.run(_cli_extract(t, prep, out), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {name: (out / name).stat().st_ino for name in finished} == stamps  # finished shards were kept
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "ref")
    m = json.loads((out / "manifest.json").read_text())
    assert m["outputs"]["shards"] == ref["outputs"]["shards"]
    assert not list(out.glob(".progress-*")) and not list(out.glob(".*.tmp-*")) and not (out / ".eyas.lock").exists()
    assert verify(out)["shards"] == 120


def test_slow_writes_are_named_as_the_bound(make_tiny, tmp_path, monkeypatch, capsys):
    """When the writers cannot keep up, the forward waits for them (memory stays bounded) and the summary says
    that writing was the bound."""
    t = make_tiny("llama")
    prep = _prepared(tmp_path / "prep", t.path, tiny.random_rows(16, seed=29, lo=2, hi=6))
    write_shard = extract_mod.features.write_shard

    def slow(*a, **k):
        time.sleep(0.15)
        return write_shard(*a, **k)

    monkeypatch.setattr(extract_mod.features, "write_shard", slow)
    extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), dtype="fp32", shard_tokens=1,
            batch_tokens=8)  # fmt: skip
    out = capsys.readouterr().out
    assert "writing was the bound: the verifier waited" in out and "for its 1 writer thread(s)" in out
    assert verify(tmp_path / "f")["shards"] == 16


def test_shard_buffers_of_a_run_are_one_size(make_tiny, tmp_path):
    """Shards of one run differ in size by up to a row; their host buffers must not (a pool of mixed sizes kept
    pinning new 1 GiB buffers on a GPU): every buffer has the largest shard's size, and no more are made than
    can be in flight."""
    from eyas.verifier.load import build_text_model, resolve

    t = make_tiny("llama")
    rows = tiny.random_rows(40, seed=41, lo=2, hi=30)
    source = extract_mod.InMemoryRows(rows)
    ex = extractor_mod.Extractor(build_text_model(resolve(t.path)), layer_ids=[2, 4, 5], dtype="bf16", batch_tokens=64)
    ex.buffers.GRAIN = 1  # exact sizes (a GPU run rounds them up to 64 MiB)
    made = []
    acquire = ex.buffers.acquire

    def counting(nbytes):
        free = len(ex.buffers._free)
        buf = acquire(nbytes)
        if len(ex.buffers._free) == free:
            made.append(buf.numel())
        return buf

    ex.buffers.acquire = counting
    shards = extract_mod.plan_shards(source.lengths, 60)
    sizes = {int(source.lengths[s:e].sum()) for s, e in shards}
    assert len(sizes) > 2
    ex.run(source, extract_mod.plan_windows(shards), tmp_path / "f", progress=False)
    per_token = 4 * 64 * 2  # (3 aux states + last) x H x bf16
    assert set(made) == {max(sizes) * per_token}
    assert len(made) <= ex.buffers.keep and {b.numel() for b in ex.buffers._free} == set(made)


def test_one_reader_of_prepared_rows(make_tiny, tmp_path):
    """Extraction and online training read prepared rows through one reader: the same rows, and the records
    each stage's manifest keeps of them come from one hashing of the Arrow files (eval matches one against the
    other to know whether features hold a draft's training rows)."""
    from eyas.data.prepared import arrow_sha256
    from eyas.training.batches import PreparedRows

    rows = tiny.random_rows(5, seed=3)
    src = PreparedRows(_prepared(tmp_path / "prep", make_tiny("llama").path, rows))
    fetched = src.fetch(1, 4)
    for k, (ids, mask) in enumerate(fetched):
        row = src.row(1 + k)
        assert ids.tolist() == row.input_ids.tolist() == list(rows[1 + k][0])
        assert mask.tolist() == row.loss_mask.tolist() == [bool(m) for m in rows[1 + k][1]]
    trained, extracted = src.identity(), src.extracted_from()
    assert trained["rows"] == extracted["rows"] == 5 and extracted["tokens"] == sum(len(i) for i, _ in rows)
    assert extracted["arrow_sha256"] == arrow_sha256(trained["prepared"])


def test_verify_names_corrupted_and_missing_shards(make_tiny, tmp_path, capsys):
    t = make_tiny("llama")
    prep = _prepared(tmp_path / "prep", t.path, tiny.random_rows(6, seed=7))
    out = tmp_path / "f"
    m = extract(verifier=str(t.path), data=str(prep), out=str(out), dtype="bf16", shard_tokens=30)
    names = [s["file"] for s in m["outputs"]["shards"]]
    assert len(names) >= 3
    assert cli_main(["extract", "--verify", str(out)]) == 0
    assert "ok" in capsys.readouterr().out
    data = bytearray((out / names[1]).read_bytes())
    data[-3] ^= 0xFF
    (out / names[1]).write_bytes(bytes(data))
    (out / names[2]).unlink()
    with pytest.raises(EyasError) as e:
        verify(out)
    assert f"{names[1]}: sha256" in str(e.value) and f"{names[2]}: missing" in str(e.value)
    assert names[0] not in str(e.value)
    assert cli_main(["extract", "--verify", str(out)]) == 2
    assert names[2] in capsys.readouterr().err


def test_rerun_skips_and_reader_dtypes(make_tiny, tmp_path, capsys):
    t = make_tiny("qwen3")
    rows = tiny.random_rows(5, seed=11)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    args = dict(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), shard_tokens=40)
    m = extract(**args)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "f").iterdir()}
    # the summary's padding is the plan's: windows of shards, each batch padded to its longest row
    lengths = torch.tensor([len(r[0]) for r in rows]).numpy()
    w = plan_windows(plan_shards(lengths, 40))
    padded = sum(len(b) * lengths[x[0][0] + b[0]] for x in w for b in plan_batches(lengths[x[0][0] : x[-1][1]], 8192))
    assert f"({1 - lengths.sum() / padded:.0%} of the forward's tokens were padding)" in capsys.readouterr().out
    assert extract(**args)["outputs"] == m["outputs"]
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "f").iterdir()} == before
    reader = FeatureReader(tmp_path / "f", dtype=torch.bfloat16)
    assert reader.lengths.tolist() == [len(r[0]) for r in rows]
    row = reader[3]
    assert row.aux_hidden_states.dtype == torch.bfloat16 and row.aux_hidden_states.shape == (len(rows[3][0]), 3 * 64)
    assert row.last_hidden_state.shape == (len(rows[3][0]), 64) and row.input_ids.dtype == torch.int64
    with pytest.raises(EyasError, match="other inputs or settings"):
        extract(**{**args, "layers": [1, 3, 6]})


def test_fp8_halves_the_bytes_and_stays_close(make_tiny, tmp_path):
    t = make_tiny("llama")
    rows = tiny.random_rows(6, seed=13, lo=10, hi=40)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    # small shards: a window's batches mix rows of several shards, whose scales must reach their own rows
    made = {d: extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / d), dtype=d, batch_tokens=64,
                       shard_tokens=30) for d in ("fp32", "bf16", "fp8")}  # fmt: skip
    assert len(made["fp8"]["outputs"]["shards"]) > 2
    bpt = {d: m["outputs"]["bytes_per_token"] for d, m in made.items()}
    assert bpt["fp8"] < 0.55 * bpt["bf16"] < 0.3 * bpt["fp32"]
    exact, bf16, fp8 = (FeatureReader(tmp_path / d) for d in ("fp32", "bf16", "fp8"))
    for i in range(len(rows)):
        x = exact.states(i)  # [T, 4, H]
        _, _, q, scale = fp8.raw(i)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (4,)
        assert torch.equal(scale, x.abs().amax(dim=(0, 2)) / 448)  # one scale per (row, layer): amax / 448
        rel = (fp8.states(i) - x).norm(dim=-1) / x.norm(dim=-1)  # [T, 4]
        assert rel.max() < 0.08 and rel.median() < 0.04  # e4m3 keeps 3 mantissa bits
        torch.testing.assert_close(bf16.states(i), x, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_int4", "kimi_int4"])
def test_int4_verifier_matches_dequantized_reference(tmp_path, capsys, name):
    """compressed-tensors int4 (pack-quantized, group 32): every Linear of a Llama, or, as in Kimi-K2.5's int4
    release, the routed experts of a Kimi-like wrapper (config inside text_config, language_model.* keys). eyas
    inspect reports it; extraction on CPU (the weights kept packed, decompressed per matmul) matches a reference
    model built from independently dequantized weights."""
    build = {"llama_int4": tiny.llama_int4, "kimi_int4": lambda p: tiny.kimi_like(p, int4=True)}[name]
    t = build(tmp_path / name)
    cfg = json.loads((t.path / "config.json").read_text())
    q = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert cli_main(["inspect", str(t.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == "compressed-tensors"
    rows = tiny.random_rows(3, seed=17)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), dtype="fp32", batch_tokens=1)
    reader, ref = FeatureReader(tmp_path / "f"), t.reference()
    for i, (ids, _) in enumerate(rows):
        with torch.no_grad():
            hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(reader[i].aux_hidden_states, torch.cat([hs[k][0] for k in (2, 4, 5)], -1),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_speculators_offline_layout(make_tiny, tmp_path):
    """What speculators 0.9.0's ArrowDataset reads (train/data.py): a saved dataset with input_ids/loss_mask/
    seq_len in torch format, and hidden_states/hs_{i}.safetensors with hidden_states [T, 4, H] + token_ids."""
    import datasets
    from safetensors.torch import load_file

    t = make_tiny("llama")
    rows = tiny.random_rows(4, seed=19)
    prep = _prepared(tmp_path / "prep", t.path, rows)
    extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), dtype="fp8",
            speculators_out=str(tmp_path / "spec"))  # fmt: skip
    ds = datasets.load_from_disk(str(tmp_path / "spec"))
    reader = FeatureReader(tmp_path / "f")
    assert len(ds) == 4
    for i, (ids, mask) in enumerate(rows):
        hs = load_file(str(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(hs) == {"hidden_states", "token_ids"} and hs["hidden_states"].shape == (len(ids), 4, tiny.HIDDEN)
        assert hs["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(hs["token_ids"], ds[i]["input_ids"])  # speculators' own consistency check
        assert ds[i]["loss_mask"].tolist() == mask and int(ds[i]["seq_len"]) == len(ids)
        torch.testing.assert_close(hs["hidden_states"].float(), reader.states(i), rtol=2**-8, atol=1e-6)
    # a rerun of the finished command writes nothing again; other features' layout is rewritten
    mark = (tmp_path / "spec" / "manifest.json").stat().st_mtime_ns
    extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), dtype="fp8",
            speculators_out=str(tmp_path / "spec"))  # fmt: skip
    assert (tmp_path / "spec" / "manifest.json").stat().st_mtime_ns == mark
    extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "g"), speculators_out=str(tmp_path / "spec"))
    assert (tmp_path / "spec" / "manifest.json").stat().st_mtime_ns != mark


def test_refusals(make_tiny, tmp_path, monkeypatch):
    llama, qwen = make_tiny("llama"), make_tiny("qwen3")
    prep = _prepared(tmp_path / "prep", llama.path, tiny.random_rows(3, seed=23))
    with pytest.raises(EyasError, match="another verifier"):
        extract(verifier=str(qwen.path), data=str(prep), out=str(tmp_path / "a"))
    for bad in ([0, 2, 4], [2, 2, 4], [2, 4, 8], [2, 4]):
        with pytest.raises(EyasError, match="layer"):
            extract(verifier=str(llama.path), data=str(prep), out=str(tmp_path / "b"), layers=bad)
    with pytest.raises(EyasError, match="--verifier"):
        extract(data=str(prep), out=str(tmp_path / "c"))
    lock = tmp_path / "d" / ".eyas.lock"
    lock.parent.mkdir()
    lock.write_text(str(os.getppid()))  # a live process holds the directory
    with pytest.raises(EyasError, match="another eyas process"):
        extract(verifier=str(llama.path), data=str(prep), out=str(tmp_path / "d"))
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / ".progress-rank0.json").write_text(json.dumps({"plan": "another", "shards": {}}))
    with pytest.raises(EyasError, match="unfinished extraction made with other inputs or settings"):
        extract(verifier=str(llama.path), data=str(prep), out=str(tmp_path / "u"))
    import shutil

    from eyas.core import files

    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    with pytest.raises(EyasError, match="needs about"):
        extract(verifier=str(llama.path), data=str(prep), out=str(tmp_path / "e"))
    assert not list((tmp_path / "e").glob("rows_*"))
    assert shard_name(0, 12) == "rows_000000000-000000012.safetensors"


SPECULATORS_READS = """
import sys, torch
from speculators.train.data import ArrowDataset
from eyas.data.features import FeatureReader
ds = ArrowDataset(max_len=64, datapath=sys.argv[1], on_missing="raise", hidden_states_dtype=torch.bfloat16)
reader = FeatureReader(sys.argv[2])
assert len(ds) == len(reader)
for i in range(len(ds)):
    item, row = ds._get_raw_data(i), reader[i]
    assert torch.equal(item["input_ids"], row.input_ids)
    assert torch.equal(item["loss_mask"].bool(), row.loss_mask)
    assert torch.equal(item["hidden_states"], row.aux_hidden_states.to(torch.bfloat16))
    assert torch.equal(item["verifier_last_hidden_states"], row.last_hidden_state.to(torch.bfloat16))
print("ok", len(ds))
"""


def test_speculators_own_dataset_reads_the_layout(make_tiny, speculators_dir, tmp_path):
    """speculators 0.9.0's ArrowDataset (installed beside our torch by `make setup`) reads what we write."""
    t = make_tiny("llama")
    prep = _prepared(tmp_path / "prep", t.path, tiny.random_rows(5, seed=29))
    extract(verifier=str(t.path), data=str(prep), out=str(tmp_path / "f"), dtype="bf16",
            speculators_out=str(tmp_path / "spec"))  # fmt: skip
    env = _env()
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(speculators_dir)
    r = subprocess.run([sys.executable, "-c", SPECULATORS_READS, str(tmp_path / "spec"), str(tmp_path / "f")],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("ok 5"), r.stderr[-3000:]


def test_device_map_auto_gives_the_same_shards(make_tiny, tmp_path):
    """--device-map auto (accelerate's placement; all on the CPU here) writes what --device cpu writes."""
    t = make_tiny("llama")
    prep = _prepared(tmp_path / "prep", t.path, tiny.random_rows(4, seed=31))
    common = dict(verifier=str(t.path), data=str(prep), dtype="fp32", batch_tokens=1)
    extract(**common, out=str(tmp_path / "cpu"), device="cpu")
    extract(**common, out=str(tmp_path / "auto"), device_map="auto")
    assert _shard_bytes(tmp_path / "auto") == _shard_bytes(tmp_path / "cpu")
    with pytest.raises(EyasError, match="either --device or --device-map"):
        extract(**common, out=str(tmp_path / "x"), device="cpu", device_map="auto")
