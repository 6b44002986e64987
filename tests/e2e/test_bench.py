"""The benchmark scripts still run (CPU smoke mode): they drive eyas' internals directly, so a refactor that
breaks them should fail here, not on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script,extra", [("extract_throughput.py", []),
                                          ("train_throughput.py", ["--torch-profile", "2"])])  # fmt: skip
def test_bench_smoke(tmp_path, script, extra):
    args = [sys.executable, str(BENCH / script), "--smoke", *extra]
    if script == "train_throughput.py":
        args += ["--workdir", str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["smoke"] is True if "smoke" in result else result["preset"] == "smoke"
    if script == "extract_throughput.py":
        (run,) = result["extract"].values()
        assert run["fp8"]["bytes_per_token"] < run["bf16"]["bytes_per_token"] and run["bf16"]["tokens_per_s"] > 0
        assert run["bf16"]["loop_tokens_per_s"] >= run["bf16"]["tokens_per_s"]
    else:
        assert result["steps"] == 6 and result["tokens_per_s"] > 0
        assert result["deferred_wgrad"] is True  # the default resolved by train() (working weights, no checkpointing)
        assert not list((tmp_path / "smoke").glob("eyas-*"))  # the run's output removed after the measurement
        assert "torch.profiler" in r.stderr
        lines = r.stderr.splitlines()
        host = json.loads(lines[lines.index("=== what the host dispatches") + 1])
        assert host["steps"] == 2 and host["eager_ops_per_step"] > 0 and host["host_ms_per_step"] > 0


def _json_lines(args: list[str], cwd: Path) -> list[dict]:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_online_verifier_ways_agree(tmp_path):
    """bench/online_verifier.py: the trainer's grouped rows (eager and through compiled layers) and the packed
    sequences (transformers' packed-sequence masks from position ids; eager, compiled, and compiled through
    flex_attention's block mask) give each real token the states the rows padded to the longest give (fp32,
    CPU)."""
    (r,) = _json_lines([str(BENCH / "online_verifier.py"), "--smoke"], tmp_path)
    assert r["smoke"] and r["micro_batches"] == 3 and r["real_tokens"] > 0, r
    ways = {"one_batch", "grouped", "packed", "grouped_compiled", "packed_compiled", "packed_flex_compiled"}
    assert all(v > 0 for v in r["tokens_per_s"].values()) and set(r["tokens_per_s"]) == ways, r
    assert all(v < 1e-5 for v in r["max_rel_diff_vs_one_batch"].values()), r


def test_loss_kernel_variants_equal_fp64(tmp_path):
    """Every compile setting bench/loss_kernel.py compares gives the fp64 reference's KL, gradient and argmax."""
    rows = _json_lines([str(BENCH / "loss_kernel.py"), "--rows", "48", "--vocab", "1000", "--iters", "1"], tmp_path)
    assert {r["variant"] for r in rows} == {"eager", "dynamic", "dynamic-nosplit", "static", "static-nosplit", "eyas"}
    for r in rows:  # bf16 inputs: the differences are bf16 rounding
        assert r["argmax_equal"] and r["kl_err"] < 1e-4 and r["grad_err"] < 1e-2, r


def test_attention_kernel_smoke(tmp_path):
    rows = _json_lines([str(BENCH / "attention_kernel.py"), "--smoke"], tmp_path)
    assert [r["variant"] for r in rows] == ["flex", "flex-tma", "flex-rows-safe", "flex-strided"]
    assert all("error" not in r and r["fwd_ms"] > 0 for r in rows), rows


def test_adamw_kernel_smoke(tmp_path):
    rows = _json_lines([str(BENCH / "adamw_kernel.py"), "--smoke"], tmp_path)
    assert [r["variant"] for r in rows] == ["torch-fused+refresh", "eyas-fused"]
    assert all(r["ms"] > 0 and r["params"] == 57600 for r in rows), rows


def test_scored_positions_counts_prompts_and_padding(tmp_path, make_tiny):
    """bench/scored_positions.py on hand-made rows: half of each row is prompt, so about half the positions are
    scored, and with chunks of 16 the loss runs on fewer rows than all."""
    import tiny

    rows = [(list(range(3, 43)), [0] * 20 + [1] * 20) for _ in range(12)]  # 40 tokens, the last 20 answer
    prepared = tiny.write_prepared(tmp_path / "prepared", rows, verifier=make_tiny("llama").path)
    out = _json_lines([str(BENCH / "scored_positions.py"), "--data", str(prepared), "--settings", "64:128",
                       "--chunks", "16", "1024"], tmp_path)  # fmt: skip
    by_chunk = {r["chunk"]: r for r in out}
    assert 0.3 < by_chunk[16]["scored_share"] < 0.5  # 18-20 of each 40-token document, packing padding aside
    assert by_chunk[16]["scored_share"] <= by_chunk[16]["loss_rows_share"] < 1.0
    assert by_chunk[1024]["loss_rows_share"] == 1.0  # 128 positions: one chunk either way
    assert by_chunk[16]["verifier_padding_grouped"] == by_chunk[16]["verifier_padding_one_batch"] == 1.0  # all 40
    # rows of unequal lengths: the verifier's groups of similar lengths compute on less padding than one batch
    rows = [(list(range(3, 3 + n)), [0] * (n // 2) + [1] * (n - n // 2)) for n in [60, 5, 7, 30, 3, 12] * 4]
    prepared = tiny.write_prepared(tmp_path / "unequal", rows, verifier=make_tiny("llama").path)
    (r,) = _json_lines([str(BENCH / "scored_positions.py"), "--data", str(prepared), "--settings", "64:128",
                        "--chunks", "16"], tmp_path)  # fmt: skip
    assert 1.0 <= r["verifier_padding_grouped"] < r["verifier_padding_one_batch"], r


def test_regenerate_throughput_smoke(tmp_path):
    """bench/regenerate_throughput.py drives the engine and transformers' static-cache generate on the same
    prompts; on the tiny greedy model both count the same tokens up to each answer's end of turn."""
    rows = _json_lines([str(BENCH / "regenerate_throughput.py"), "--smoke"], tmp_path)
    by = {r.get("method"): r for r in rows if "method" in r}
    assert set(by) == {"engine", "hf-static"} and all("error" not in r for r in by.values()), rows
    assert by["engine"]["tokens"] == by["hf-static"]["tokens"] > 0
    assert rows[-1]["summary"] and rows[-1]["engine_over_hf-static"] > 0
    # cold (compiling and recording timed), prefills compiled or not: the same answers
    cold = _json_lines([str(BENCH / "regenerate_throughput.py"), "--smoke", "--cold", "--methods",
                        "engine,engine-compiled-prefill"], tmp_path)  # fmt: skip
    by = {r.get("method"): r for r in cold if "method" in r}
    assert set(by) == {"engine", "engine-compiled-prefill"} and all(r["cold"] for r in by.values()), cold
    assert by["engine"]["tokens"] == by["engine-compiled-prefill"]["tokens"] == rows[0]["tokens"]
    assert all(r["prefill_seconds"] > 0 and r["prefill_forwards"] > 0 for r in by.values())


def _quality_sh(tmp_path, verifier, data, out, budget, sets, until="", keep_data="", run="q", sub="run", **seed):
    """``bash bench/gpu/quality.sh run`` as the GPU calls run it, on ``verifier`` at toy sizes."""
    import os

    env = {**os.environ, "UNTIL": until, "KEEP_DATA": keep_data, "GGUF_FILE": str(verifier), "DATA": str(data), "OUT": str(out), "R": str(tmp_path / run),
           "BUDGET": str(budget), "SET": sets, "PYTHON": sys.executable, **seed}  # fmt: skip
    out.mkdir(exist_ok=True)
    return subprocess.run(["bash", str(BENCH / "gpu" / "quality.sh"), sub], env=env, capture_output=True,
                          text=True, timeout=900, cwd=BENCH.parent)  # fmt: skip


def _tgz(root: Path, *names: str) -> bytes:
    """``names`` under ``root`` as a gzipped tar (the answers' format before KEEP_DATA's seed.tar)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name in names:
            t.add(root / name, arcname=name)
    return buf.getvalue()


def _quality_data(tmp_path: Path) -> tuple[Path, str]:
    """The carried prompt files quality.sh reads (4 ShareGPT-style conversations, MT-Bench and HumanEval as
    installed) and `--set` overrides that make every stage of the recipe a toy."""
    import gzip

    from eyas.data.named_sets import named_set_path

    data = tmp_path / "g"
    data.mkdir()
    with gzip.open(data / "sharegpt_prompts.jsonl.gz", "wt") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"s{i}", "turns": [f"Question {i}: what is {i} plus {i}?", "Why?"]}) + "\n")
    (data / "mt_bench.jsonl").write_bytes(named_set_path("mt-bench").read_bytes())
    (data / "humaneval.jsonl.gz").write_bytes(named_set_path("humaneval").read_bytes())
    return data, (
        "prompts.num_prompts=2,prompts.max_new_tokens=12,prompts.max_attempts=100,prompts.min_words=1,"
        "prompts.batch_tokens=2048,"
        "regenerate.max_new_tokens=8,regenerate.max_seq_len=256,regenerate.batch_tokens=1024,"
        "prepare.max_seq_len=256,prepare.num_proc=1,vocab.draft_vocab_size=128,train.max_steps=2,"
        "train.max_seq_len=256,train.batch_tokens=512,train.num_workers=0,train.val_ratio=0.2,"
        "eval.0.num_prompts=1,eval.0.max_new_tokens=4,eval.1.num_prompts=1,eval.1.max_new_tokens=4"
    )


def test_quality_sh_runs_the_recipe_config_resumably(make_tiny, tmp_path):
    """The GPU suite's logic end to end at toy scale: quality.sh wraps `eyas run configs/smollm2-gpu.toml` (every
    stage of the recipe: self-written prompts, regenerate, prepare, vocab, online training, export, both evals),
    with the carried prompt files standing in for the named sets. A call cut by its time limit exits 0 and says
    to call again; the next call finishes the run; one more skips every stage and gathers the same results."""
    data, sets = _quality_data(tmp_path)
    verifier = make_tiny("llama").path
    small = {"PREDICT_PROMPTS": "2", "PREDICT_TOKENS": "8"}
    early = _quality_sh(tmp_path, verifier, data, tmp_path / "out0", 900, sets, sub="predict", **small)
    assert early.returncode == 1 and "no trained draft" in early.stdout, early.stdout + early.stderr
    cut = _quality_sh(tmp_path, verifier, data, tmp_path / "out1", 2, sets)
    assert cut.returncode == 0 and "cut by the budget: call again" in cut.stdout, cut.stdout + cut.stderr
    part = _quality_sh(tmp_path, verifier, data, tmp_path / "out2", 900, sets, until="train", keep_data="1")
    assert part.returncode == 0 and "stages up to train done" in part.stdout, part.stdout + part.stderr
    # KEEP_DATA: the self-written prompts and the regenerated conversations came back, whole once the parts are
    # joined (xz where the machine has it)
    import tarfile

    joined = b"".join(f.read_bytes() for f in sorted((tmp_path / "out2").glob("seed.tar.*")))
    (tmp_path / "seed.tar").write_bytes(joined)
    with tarfile.open(tmp_path / "seed.tar") as t:
        for name in ("regenerated/conversations.jsonl", "prompts/prompts.jsonl"):
            assert t.extractfile(name).read() == (tmp_path / "q" / name).read_bytes(), name
    assert not (tmp_path / "q" / "eval").exists() and (tmp_path / "q" / "draft" / "manifest.json").is_file()
    # SEED: a new run folder (as on a fresh machine; another path than the seed's) seeded with those prompts and
    # answers: `eyas run` finds both up to date and starts at prepare; the same from the earlier format
    # (SEED_RUN: a call's run.tar.gz, for its prompts; SEED_DATA: the answers' regenerated.tgz parts); and from
    # another run folder on the same machine (SEED_FROM)
    (tmp_path / "regenerated.tgz.00").write_bytes(_tgz(tmp_path / "q", "regenerated/conversations.jsonl",
                                                       "regenerated/manifest.json"))  # fmt: skip
    for run, seed in (("q2", {"SEED": str(tmp_path / "out2" / "seed.tar.*")}),
                      ("q3", {"SEED_RUN": str(tmp_path / "out2" / "run.tar.gz"),
                              "SEED_DATA": str(tmp_path / "regenerated.tgz.*")}),
                      ("q4", {"SEED_FROM": str(tmp_path / "q")})):  # fmt: skip
        seeded = _quality_sh(tmp_path, verifier, data, tmp_path / f"out-{run}", 900, sets, until="vocab", run=run,
                             **seed)  # fmt: skip
        assert seeded.returncode == 0 and "seeded" in seeded.stdout, seeded.stdout + seeded.stderr
        log = (tmp_path / run / "run.log").read_text()
        assert log.count("is up to date") == 2 and "regenerate: " in log and "prepare: " in log, log[-3000:]
        assert (tmp_path / run / "vocab" / "manifest.json").is_file()
    bad = _quality_sh(tmp_path, verifier, data, tmp_path / "out-q5", 900, sets, until="vocab", run="q5",
                      SEED_FROM=str(tmp_path / "nothing"))  # fmt: skip
    assert bad.returncode == 1 and "could not seed" in bad.stdout and not (tmp_path / "q5" / "regenerated").exists()
    done = _quality_sh(tmp_path, verifier, data, tmp_path / "out2", 900, sets, PROFILE="1",
                       PROFILE_ATTENTION="sdpa", PROFILE_ARGS="--new-tokens 8 --prompt-len 12")  # fmt: skip
    assert done.returncode == 0 and "all stages done" in done.stdout, done.stdout + done.stderr
    # PROFILE: the trained draft's rounds on the verifier, q/k/v and gate/up separate and merged
    profiled = [json.loads(line) for line in (tmp_path / "out2" / "profile.jsonl").read_text().splitlines()]
    assert [r.get("merge") for r in profiled if "compare" not in r] == ["off", "on"], profiled
    assert all(r.get("spec_lossless") for r in profiled if "compare" not in r), [r.get("error") for r in profiled]
    assert [r["compare"] for r in profiled if "compare" in r] == ["merge on/off"], profiled
    got = json.loads((tmp_path / "out2" / "smollm2-quality.json").read_text())
    assert set(got["eval"]) == {"mt-bench", "humaneval"} and got["complete"] is True
    assert got["eval"]["mt-bench"]["K=3"]["num_prompts"] == 1 and got["eval"]["humaneval"]["K=3"]["lossless"]
    # MT-Bench's tau by turn and by category (one question sampled, both turns); HumanEval has no categories
    assert set(got["eval"]["mt-bench"]["K=3"]["tau_by_turn"]) == {"1", "2"}
    (category,) = got["eval"]["mt-bench"]["K=3"]["tau_by_category"]
    assert category in {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert got["eval"]["humaneval"]["K=3"]["tau_by_category"] == {}
    assert got["prompts"]["prompts"] == 2 and got["regenerate"]["prompts"] == 4 + 2  # ShareGPT's and its own
    assert got["train"]["runs"][0]["steps"] == 2 and got["train"]["runs"][0]["optimizer"] == "adamw"
    assert got["train"]["runs"][0]["compiles"] == 0  # on a CPU the trainer compiles nothing by default
    assert got["train"]["runs"][0]["ms_per_step"]["verifier"] > 0  # the recipe times its steps by phase
    assert {"prompts", "regenerate", "prepare", "vocab", "train", "eval mt-bench", "eval humaneval"} <= set(
        got["minutes_per_stage"])  # fmt: skip
    # the run as a point of the tau-against-data curve: its table row and its PNG
    curve, png = tmp_path / "curve.json", tmp_path / "curve.png"
    for cmd in (["add", str(tmp_path / "out2" / "smollm2-quality.json"), "--note", "toy"], ["show", "--png", str(png)]):
        shown = subprocess.run([sys.executable, str(BENCH / "quality_curve.py"), "--curve", str(curve), *cmd],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
    (pt,) = json.loads(curve.read_text())
    assert pt["mt-bench"]["tau"] == got["eval"]["mt-bench"]["K=3"]["tau"] and pt["steps"] == 2
    assert "| toy |" in shown.stdout and png.stat().st_size > 1000
    # a point replaces the one of its commit and note; another note at the commit (a lever) is a point of its own
    for note in ("toy", "toy lever"):
        subprocess.run([sys.executable, str(BENCH / "quality_curve.py"), "--curve", str(curve), "add",
                        str(tmp_path / "out2" / "smollm2-quality.json"), "--note", note], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
    assert [p["note"] for p in json.loads(curve.read_text())] == ["toy", "toy lever"]
    # predict: MT-Bench's own answers (the eval's sample and length), their features, eval --offline beside decoding
    pred = _quality_sh(tmp_path, verifier, data, tmp_path / "out-predict", 900, sets, sub="predict", **small)
    assert pred.returncode == 0 and "predict done" in pred.stdout, pred.stdout + pred.stderr
    rep = json.loads((tmp_path / "out-predict" / "predict.json").read_text())
    answers = [json.loads(x) for x in (tmp_path / "q" / "predict" / "answers" / "conversations.jsonl").open()]
    assert rep["num_prompts"] == len(answers) == 2 and rep["offline"]["rows"] == 2
    # both turns of each question, the second after a first answer cut at the limit too, as eval decodes them
    assert [sum(m["role"] == "assistant" for m in a["messages"]) for a in answers] == [2, 2], answers
    assert rep["offline"]["rows_from"] == "unseen" and rep["predicted_tau_walk"] >= 1
    again = _quality_sh(tmp_path, verifier, data, tmp_path / "out3", 900, sets)
    assert again.returncode == 0, again.stdout + again.stderr
    log = (tmp_path / "q" / "run.log").read_text()
    assert "regenerate: " in log and "is up to date" in log and "already measures this draft" in log
    assert json.loads((tmp_path / "out3" / "smollm2-quality.json").read_text())["eval"] == got["eval"]


def test_quality_sh_headtohead(make_tiny, tmp_path, speculators_dir):
    """`quality.sh headtohead` on the answers a `quality.sh run` call regenerated: refused before there are any;
    then bench/speculators_quality.py on them (speculators' dry run on CPU), both drafts measured on MT-Bench."""
    data, sets = _quality_data(tmp_path)
    verifier = make_tiny("llama").path
    h2h = {"H2H_ARGS": f"--speculators-path {speculators_dir} --speculators-dry-run --max-steps 2 --val-ratio 0.3 "
                       "--epochs 1 --seq-len 256 --max-seq-len 256 --max-new-tokens 4 --num-prompts 1 "
                       "--eyas-variant eyas-b:lr=0.001 --eyas-variant eyas-c:lr=0.0001 --eval-variants top"}  # fmt: skip
    early = _quality_sh(tmp_path, verifier, data, tmp_path / "out0", 900, sets, sub="headtohead", **h2h)
    assert early.returncode == 1 and "no finished regenerate" in early.stdout, early.stdout + early.stderr
    part = _quality_sh(tmp_path, verifier, data, tmp_path / "out1", 900, sets, until="regenerate")
    assert part.returncode == 0, part.stdout + part.stderr
    done = _quality_sh(
        tmp_path, verifier, data, tmp_path / "out2", 900, sets, sub="headtohead", COMMIT="abc1234", **h2h
    )
    assert done.returncode == 0 and "head to head done" in done.stdout, done.stdout + done.stderr
    got = json.loads((tmp_path / "out2" / "headtohead.json").read_text())
    assert got["data"]["rows"] == 6 and got["training"]["speculators_dry_run"] is True  # 4 ShareGPT + 2 its own
    assert {r["num_prompts"] for r in got["eval"].values()} == {1} and got["eyas_over_speculators"] > 0
    assert got["commit"] == "abc1234" and got["device"] == "cpu"
    # each finished eval and each eyas draft's last metrics come back beside it
    assert {p.name for p in (tmp_path / "out2").glob("eval-*.json")} == {f"eval-{n}.json" for n in got["eval"]}
    assert (tmp_path / "out2" / "eyas-b-metrics.jsonl").read_text().strip()
    # --eval-variants top: of the eyas drafts only the one with the highest validation tau, with the baseline
    val = got["training"]["eyas_validation_tau"]
    top = max(("eyas-b", "eyas-c"), key=val.__getitem__)
    winner = top if val[top] > val["eyas"] else "eyas"
    assert set(got["eval"]) == {"speculators", winner} and got["eyas_draft"] == winner, (val, got)
    assert got["eval"][winner]["speedup"] is not None


def test_eval_speedup_smoke(tmp_path):
    """bench/eval_speedup.py (eval's loops against transformers' static-cache generate): the same engine's
    speculative and plain loops agree token for token on a tiny random Llama, and the summary names the
    baseline it divides by."""
    rows = _json_lines([str(BENCH / "eval_speedup.py"), "--smoke"], tmp_path)
    runs = [r for r in rows if "mode" in r]
    assert runs and all(r["lossless"] is True and r["tokens_per_s"] > 0 for r in runs), runs
    assert rows[-1]["summary"] and rows[-1]["speedup"] > 0 and rows[-1]["baseline"]


def test_decode_profile_smoke(tmp_path):
    """bench/decode_profile.py (a plain step and a speculative round, round by round and fused, timed and
    profiled): every loop decodes what plain decoding does on a tiny random Llama, once per --inductor variant,
    --outer setting and draft layer count (--norm-ahead's and --decode-mlp's settings named in each row), the
    draft's cache read as eval reads it on CUDA (SDPA's, eval's on CPU, is every CPU eval test's)."""
    rows = _json_lines([str(BENCH / "decode_profile.py"), "--smoke", "--attention", "sdpa", "--inductor",
                        "default;max_autotune_gemm=True,coordinate_descent_tuning=True;no_such_setting=1",
                        "--outer", "off,on", "--norm-ahead", "off", "--decode-mlp", "on", "--blas", "default,cublaslt",
                        "--draft-layers", "1,2",
                        "--draft-attention", "matmul", "--max-len", "300"],
                       tmp_path)  # fmt: skip
    tuned = "max_autotune_gemm=True,coordinate_descent_tuning=True"
    # a setting this torch lacks, and a BLAS library this build lacks: one row each saying so, the rest measured
    errors = [r for r in rows if "error" in r]
    assert {(r["inductor"], r.get("blas")) for r in errors} == {
        ("no_such_setting=1", None),
        ("default", "cublaslt"),
        (tuned, "cublaslt"),
    }, errors
    rows = [r for r in rows if "error" not in r]
    assert {r["max_len"] for r in rows} == {300}  # the caches sized as eval sizes them to a long conversation
    assert [(r["inductor"], r["outer"], r["norm_ahead"], r["draft_layers"], r["draft_attention"]) for r in rows] == [
        (variant, outer, ahead, layers, attention)
        for variant in ("default", tuned)
        for outer in ("off", "on")
        for ahead in ("off",)
        for layers in (1, 2)
        for attention in ("matmul",)
    ]
    for r in rows:
        assert "error" not in r and r["spec_lossless"] is True and r["spec_fused_lossless"] is True, r
        assert r["plain_tokens_per_s"] > 0 and r["spec_fused_ms_per_round"] > 0 and r["decode_mlp"] == "on"
        gaps = ("short_gaps_ms_per_step", "long_gaps_ms_per_step", "graph_launch_ms_per_step")
        assert all(r[p][k] >= 0 for p in ("plain_step_profile", "spec_fused_round_profile") for k in gaps), r


def test_decode_profile_batched_smoke(tmp_path):
    """bench/decode_profile.py --batched (regenerate's batched step, timed and profiled per row count) runs its
    whole logic on a tiny random Llama."""
    rows = _json_lines([str(BENCH / "decode_profile.py"), "--smoke", "--batched", "4", "--attention", "sdpa"],
                       tmp_path)  # fmt: skip
    (r,) = rows
    assert (
        "error" not in r
        and r["rows"] == 4
        and r["ms_per_step"] > 0
        and r["agree_with_sdpa"] == 1.0
        and r["step_profile"]["kernels_per_step"] >= 0
        and isinstance(r["step_profile"]["few_per_step"], dict)  # (no CUDA kernels on a CPU)
    )


def test_decode_profile_prefill_smoke(tmp_path):
    """bench/decode_profile.py --prefill (regenerate's prefill, timed and profiled per size) runs its whole logic
    on a tiny random Llama: each size packs as many prompts of --prefill-len as fill it."""
    rows = _json_lines([str(BENCH / "decode_profile.py"), "--smoke", "--prefill", "1"], tmp_path)
    assert [(r.get("error"), r["prefill_tokens"], r["prompts"], r["prompt_len"]) for r in rows] == [
        (None, 40, 2, 20),
        (None, 80, 4, 20),
    ]
    assert all(r["ms_per_prefill"] > 0 and r["tokens_per_s"] > 0 and r["prefill_profile"]["kernels_per_step"] >= 0
               for r in rows)  # fmt: skip


def test_int4_memory_smoke(tmp_path):
    """bench/int4_memory.py at tiny dims, every stage: the packed int4 MoE verifier holds fewer bytes than its
    bf16 copy, their states agree within int4 tolerance, eyas plan's prediction is within a few percent of both,
    and the summary has the keys docs/BENCHMARKS.md and bench/results/int4.json report."""
    rows = _json_lines([str(BENCH / "int4_memory.py"), "--smoke", "--workdir", str(tmp_path), "--out",
                        str(tmp_path / "out"), "--decode-steps", "2", "--repeats", "1"], tmp_path)  # fmt: skip
    assert not [r for r in rows if "error" in r or "skipped" in r], rows
    by = {r["what"]: r for r in rows}
    assert by["load_packed"]["stacked"] and by["load_packed"]["moe_layers"] == 3
    s = json.loads((tmp_path / "out" / "int4.json").read_text())
    assert s["packed_over_bf16_bytes"] < 1 and s["aux_rel_diff"] < 0.05 and s["last_rel_diff"] < 0.05
    assert abs(s["plan_packed_bytes"] / s["packed_bytes"] - 1) < 0.05
    assert abs(s["plan_bf16_bytes"] / s["bf16_bytes"] - 1) < 0.05
    assert set(s["packed_over_bf16_tokens_per_s"]) == {"extract", "online"} and s["graphs"] is False  # CPU
    assert {"checkpoint_shape", "device", "commit", "decode_tokens_per_s", "kernels_us"} <= set(s)


def test_speculators_head_to_head_smoke(tmp_path, speculators_dir):
    """bench/speculators_quality.py end to end on CPU: the same conversations prepared, vocab, features in both
    layouts, speculators' own trainer (its dry run: it trains on CUDA only) and eyas' on them (the recipe's
    settings and a variant), every draft loaded and measured by eyas eval; run again, every stage finds its
    output done."""
    args = [str(BENCH / "speculators_quality.py"), "--smoke", "--out", str(tmp_path / "h2h"),
            "--speculators-path", str(speculators_dir), "--eyas-variant", "eyas-lr:lr=0.001,no-norm-output"]  # fmt: skip
    (result,) = _json_lines(args, tmp_path)
    assert result["data"]["rows"] == 24 and result["data"]["feature_tokens"] == result["data"]["tokens"] > 0
    for name in ("eyas", "speculators"):
        r = result["eval"][name]
        assert r["num_turns"] == 2 and r["tau"] >= 1.0 and r["lossless"], (name, r)
    variant = result["eval"]["eyas-lr"]  # measured without the plain baseline
    assert variant["num_turns"] == 2 and variant["tau"] >= 1.0 and variant["speedup"] is None, variant
    assert result["training"]["eyas_variants"] == {"eyas-lr": "--lr 0.001 --no-norm-output"}
    assert set(result["over_speculators"]) == {"eyas", "eyas-lr"}
    assert all(t > 1.0 for t in result["training"]["eyas_validation_tau"].values())
    saved = json.loads((tmp_path / "h2h" / "eyas-lr" / "config.json").read_text())
    assert saved["norm_output"] is False and json.loads((tmp_path / "h2h" / "eyas" / "config.json").read_text())[
        "norm_output"] is True  # fmt: skip
    written = json.loads((tmp_path / "h2h" / "speculators" / "draft" / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3" and "speculators_version" in written  # speculators' own save
    assert set(result["seconds"]) >= {"train speculators", "train eyas", "eval eyas", "eval speculators"}
    (again,) = _json_lines(args, tmp_path)
    # nothing ran again: each stage's seconds stay those of the call that finished it
    assert again["seconds"] == result["seconds"] and again["eval"] == result["eval"]
    assert result["device"] == "cpu" and result["commit"] is None
    assert "speculators' layout of these features, up to date" in (tmp_path / "h2h" / "headtohead.log").read_text()
