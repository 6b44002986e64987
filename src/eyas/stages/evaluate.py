"""``eyas eval``: real speculative decoding on the verifier, so the acceptance length is measured, not guessed.

The loops follow vLLM's EAGLE proposer (:mod:`eyas.engine.speculative`), greedy verification is lossless and checked
against plain decoding of the same turns, and the speedup is against plain decoding of the same prompts in the
same run through the same engine (:mod:`eyas.evaluation.measure`). One prompt is decoded at a time (batch size 1, the
latency setting speculative decoding is for); the baseline runs on the bare model: the aux-state capture is
attached only during the speculative loop's forwards and recorded only into its graphs. With ``--offline`` the
tau the draft's TTT accuracy predicts stands beside the measured one (:mod:`eyas.evaluation.offline`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from eyas.data.chat import end_of_turn_ids
from eyas.core import fields
from eyas.core.config import StageConfig, default_of, option, stage_function
from eyas.core.errors import EyasError
from eyas.core.validate import AT_LEAST_0, AT_LEAST_1, SEQ_LEN, TOKENS
from eyas.engine.generate import device_and_dtype
from eyas.evaluation.measure import (
    Runners,
    as_prompts,
    conversation_bound,
    fp32_copy_fits,
    measure,
    recheck_fp32_turns,
    summarize,
)
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.evaluation.offline import choose_offline_rows, draft_manifest, offline_accuracy, pick_offline_rows
from eyas.verifier.compile import compile_work


# --------------------------------------------------------------------------- drafts


def random_draft(info, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 num_layers: int = 1) -> Eagle3Draft:  # fmt: skip
    """An untrained draft over the full vocab (Llama init; embedding and head from the verifier, as training
    starts): the floor any trained draft must beat. ``num_layers``: its decoder layers (train's --num-layers)."""
    from eyas.verifier.load import load_head_tensors

    cfg = DraftConfig.from_verifier(info.text_config, draft_vocab_size=info.vocab_size,
                                    aux_layer_ids=info.aux_layer_ids, num_hidden_layers=num_layers)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg)
    heads = load_head_tensors(info)
    draft.init_from_verifier(embed=heads.embed, lm_head_rows=heads.lm_head)
    draft.t2d.fill_(True)
    return draft.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------- the stage


def setup(*, verifier: str, draft: str, device: str | None = None, dtype: str = "auto", seed: int = 0,
          trust_remote_code: bool = False, chat_template: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Load what a measurement needs once: the verifier (info, model, tokenizer with the chat template prompts are
    rendered with, end-of-turn ids) and the draft (a checkpoint dir, or 'random'), on ``device`` in ``dtype``."""
    from eyas.draft.checkpoint import load_draft
    from eyas.data.chat import NO_TEMPLATE_HINT
    from eyas.draft.attention import decode_attn_implementation
    from eyas.verifier.load import build_text_model, load_tokenizer
    from eyas.verifier.info import resolve

    dev, dt = device_and_dtype(device, dtype)
    info = resolve(verifier)
    tokenizer = load_tokenizer(info, trust_remote_code=trust_remote_code, chat_template=chat_template)
    if not tokenizer.chat_template:
        raise EyasError(f"the tokenizer of {info.path} has no chat template; eyas eval renders prompts through it: "
                        f"{NO_TEMPLATE_HINT}")  # fmt: skip
    if str(draft) == "random":
        d, manifest = random_draft(info, seed=seed, device=dev, dtype=dt), {}
    else:
        d, manifest = load_draft(draft, verifier=info, device=dev, dtype=dt), draft_manifest(draft)
    d.attn_implementation = decode_attn_implementation(dev)  # the cache it drafts through
    model = build_text_model(info, dtype=dt, device=dev)
    if model.config.vocab_size != d.config.vocab_size:
        raise EyasError(f"the draft {draft} is for a vocab of {d.config.vocab_size}, the verifier has "
                        f"{model.config.vocab_size}")  # fmt: skip
    return {"info": info, "device": dev, "dtype": dt, "tokenizer": tokenizer, "eos_ids": end_of_turn_ids(tokenizer),
            "draft": d, "draft_manifest": manifest, "model": model}  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class EvalConfig(StageConfig):
    """Measure a draft by real speculative decoding on the verifier: tau, per-position acceptance, losslessness,
    and the speedup over plain decoding of the same prompts in the same run.

    Each prompt's turns are decoded in order through the verifier's chat template; a later turn (MT-Bench's
    second) follows the verifier's own plain-decoded answer to the turn before, so every loop sees the same
    conversation. Several K (`--draft-tokens 3,5,7`) are measured on the same turns in one run. Prints a table;
    ``--out`` writes the report as JSON and a PNG histogram of accepted lengths."""

    stage: ClassVar[str] = "eval"

    verifier: str = fields.verifier()
    draft: str = option(
        help="a draft checkpoint dir (speculators eagle3 format, as `eyas train` writes it), or "
        "'random' for an untrained draft (the floor of acceptance)."
    )
    prompts: str | list[Any] = option(
        help="'mt-bench', 'humaneval', or a local JSON/JSONL/parquet file of prompts "
        "or conversations (in Python or a config, also a list of prompts: strings, "
        "lists of turns, or records with turns)."
    )
    out: str | None = option(
        None, help="where to write the report: a .json path (the histogram PNG goes beside it) or a directory."
    )
    num_prompts: int | None = option(
        None, range=AT_LEAST_1, help="evaluate this many prompts (a seeded sample); default all."
    )
    max_new_tokens: int = option(
        256, range=TOKENS, help="new tokens per turn at most (decoding also stops at the end-of-turn token)."
    )
    max_seq_len: int = option(
        4096,
        range=SEQ_LEN,
        recorded="when set",  # reports made before it existed stay up to date: no turn of theirs reached it
        help="the longest conversation in tokens (at most the verifier's max_position_embeddings): a turn whose "
        "prompt (earlier turns and answers included) plus --max-new-tokens would pass it is skipped with its "
        "prompt's later turns, and the report lists it; the decoders' caches are sized by it, not by the "
        "longest prompt.",
    )
    draft_tokens: list[int] = option(
        [3],
        help="K, the draft tokens proposed per round; several (3,5,7) are each "
        "measured on the same turns (the report's top-level figures are the "
        "first K's, every K's under by_draft_tokens).",
    )
    temperature: float = option(
        0.0, range=AT_LEAST_0, help="0 for greedy acceptance; above 0 speculative sampling at this temperature."
    )
    seed: int = option(0, range=AT_LEAST_0, help="seeds the prompt sample and all sampling.")
    offline: str | None = option(
        None,
        help="an `eyas extract` features dir: also predict tau from the draft's "
        "per-step conditional accuracy on those features: the validation rows "
        "train held out when they are the features (or prepared rows) the draft "
        "trained on, else their first --offline-rows rows; the report says which.",
    )
    offline_rows: int = option(256, range=AT_LEAST_1, help="rows of --offline features to use at most.")
    device: str | None = fields.device()
    dtype: str = fields.dtype()
    cuda_graphs: bool = option(
        True,
        help="on CUDA, record every fixed-shape decoding forward (plain step, "
        "verification, draft steps) once as a CUDA graph and replay it, for both "
        "loops alike.",
    )
    compile: bool = option(
        True,
        help="with CUDA graphs, compile the verifier's decoder layers (torch.compile, one "
        "layer's worth of compiling) for the recorded forwards of both loops alike, and the "
        "draft's fixed-shape forwards: fewer, fused kernels a step.",
    )
    fused_rounds: bool = option(
        False,
        help="with CUDA graphs at temperature 0, replay each speculative round (the drafting steps, the "
        "verification, the acceptance and the draft's catch-up) as one CUDA graph with one host read a round "
        "(vLLM's padded drafting), instead of a graph per part and the host between them.",
    )
    freeze: bool = option(
        False,
        help="with --compile, compile the verifier's layers and the draft with their weights as constants "
        "(inductor's freezing: gate/up one matmul, and q/k/v one where their weights have one shape, which "
        "grouped-query attention's do not) where the copies of "
        "the weights this makes are a small part of the free GPU memory; off by default until a GPU run "
        "measures what it saves against the compiling it adds (bench/decode_profile.py --freeze off,on).",
    )
    baseline: bool = option(True, help="also run plain decoding (needed for the lossless check and the speedup).")
    recheck_fp32: bool = option(
        False,
        help="decode every turn whose speculative output differs from plain greedy "
        "decoding again in fp32, to tell near-ties of the compute dtype from real "
        "differences (without it, only the turns whose logit gap looks real are).",
    )
    trust_remote_code: bool = fields.trust_remote_code(" (never on by default).")
    chat_template: str | None = fields.chat_template(". Give the one the draft's data was prepared with.")

    def check(self) -> None:
        if self.draft_tokens and self.max_new_tokens + max(self.draft_tokens) + 2 >= self.max_seq_len:
            raise EyasError(f"--max-new-tokens {self.max_new_tokens} leaves no room for a prompt in --max-seq-len "
                            f"{self.max_seq_len}; raise --max-seq-len or lower --max-new-tokens")  # fmt: skip


def run(c: EvalConfig) -> dict[str, Any]:
    """Run `eyas eval` as ``c`` describes (see :class:`EvalConfig`)."""
    from eyas.core.files import sha256_json, write_json
    from eyas.core.manifest import check_report_out, report_paths, versions
    from eyas.data.chat import chat_template_hash

    if c.out:  # before any work: the report replaces only an earlier report, or nothing
        check_report_out(c.out)
    Ks = list(dict.fromkeys(c.draft_tokens))
    if not Ks or min(Ks) < 1:
        raise EyasError(f"--draft-tokens must be one or more counts of at least 1, got {c.draft_tokens}")
    offline_rows_from = None
    if c.offline:  # the shards --offline will read are hashed now: a damaged one stops eval before decoding
        from eyas.data.features import FeatureReader

        offline_rows_from = choose_offline_rows(draft_manifest(c.draft), c.offline)  # (rows, kind, why)
        feats = FeatureReader(c.offline)
        feats.check_shards(feats.shards_of(pick_offline_rows(offline_rows_from[0], num_rows=len(feats),
                                                             max_rows=c.offline_rows)))  # fmt: skip
    plist, source, dropped = as_prompts(c.prompts, num_prompts=c.num_prompts, seed=c.seed)
    # what this report measures: every setting but --out, the draft's manifest, the prompts themselves; an
    # existing report of the same is kept (a rerun of `eyas run` after a time limit skips finished evals)
    settings = {k: v for k, v in dataclasses.asdict(c).items() if k != "out"}
    for f in dataclasses.fields(c):  # an option recorded "when set", at its default: as before it existed
        if f.metadata.get("recorded") == "when set" and getattr(c, f.name) == default_of(f):
            del settings[f.name]
    measured = sha256_json({"settings": settings,
                            "draft": draft_manifest(c.draft) if str(c.draft) != "random" else "random",
                            "prompts": [dataclasses.asdict(p) for p in plist]})  # fmt: skip
    if c.out and (old := _existing_report(c.out, measured)) is not None:
        print(f"eval: {report_paths(c.out)[0]} already measures this draft on these prompts; skipping")
        return old
    clock = [time.perf_counter()]  # where eval's time goes, stage by stage (the report's `seconds`)
    compiled_before = compile_work()  # and how much of it torch.compile took, inside graphs and decoding

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 2)

    env = setup(verifier=c.verifier, draft=c.draft, device=c.device, dtype=c.dtype, seed=c.seed,
                trust_remote_code=c.trust_remote_code, chat_template=c.chat_template)  # fmt: skip
    seconds = {"load": lap()}
    dev, tokenizer, d = env["device"], env["tokenizer"], env["draft"]
    # the longest conversation any turn may reach: --max-seq-len within the verifier's positions; the caches and
    # graphs are sized by the prompts only when they all fit below it (a long prompt must not size the run)
    positions = getattr(env["model"].config, "max_position_embeddings", None) or c.max_seq_len  # as regenerate
    max_len = min(c.max_seq_len, positions)
    if max_len <= c.max_new_tokens + max(Ks) + 2:
        raise EyasError(f"--max-new-tokens {c.max_new_tokens} leaves no room for a prompt in the verifier's "
                        f"{positions} positions; lower --max-new-tokens")  # fmt: skip
    bound = min(conversation_bound(plist, tokenizer, max_new_tokens=c.max_new_tokens, draft_tokens=max(Ks)),
                max_len)  # fmt: skip
    runners = Runners.build(env["model"], d, draft_tokens=Ks, max_len=bound, cuda_graphs=c.cuda_graphs,
                            compile=c.compile, fused_rounds=c.fused_rounds,
                            freeze=None if c.freeze else False)  # fmt: skip
    graphs = runners.base.graphs.enabled
    seconds["build"] = lap()  # the caches and the graphs of every loop, compiling included
    m = measure(plist, tokenizer, runners, max_new_tokens=c.max_new_tokens, eos_ids=env["eos_ids"],
                temperature=c.temperature, seed=c.seed, baseline=c.baseline)  # fmt: skip
    if not m.turns:
        raise EyasError(f"every prompt of {source} is longer than --max-seq-len {max_len} allows with "
                        f"--max-new-tokens {c.max_new_tokens}: nothing was decoded; raise --max-seq-len"
                        + (f" (the verifier has {positions} positions)" if positions < c.max_seq_len else ""))  # fmt: skip
    seconds["decode"] = lap()
    # of which the decoding loops' own clocks (the rest: prompts' prefills, templates, graphs of new shapes)
    seconds["decode_plain"] = round(m.base_seconds, 2)
    seconds["decode_speculative"] = round(sum(x.seconds for x in m.spec.values()), 2)
    if c.temperature == 0 and (c.recheck_fp32 or (env["model"].dtype != torch.float32
                                                   and fp32_copy_fits(env["model"]))):  # fmt: skip
        # a difference the logit gap calls real is decoded again in fp32 by default (where an fp32 copy of the
        # verifier is cheap): rare, and the lossless verdict must not blame the loop for the dtype's rounding
        recheck_fp32_turns(env, m, max_new_tokens=c.max_new_tokens, bound=bound, only_real=not c.recheck_fp32)
        seconds["recheck_fp32"] = lap()
    by_k = {K: summarize(m, draft_tokens=K, temperature=c.temperature, baseline=c.baseline) for K in Ks}
    template_sha = chat_template_hash(tokenizer)
    compiled = compile_work()
    K = Ks[0]
    report: dict[str, Any] = {
        **by_k[K],
        "num_prompts": len(plist),
        "temperature": c.temperature,
        "max_new_tokens": c.max_new_tokens,
        "prompts": source,
        # rows of the source left out (not prompts) or cut short (a turn of an unknown role, an empty turn: the
        # turns before it kept), one line per reason with the first rows (from 0)
        "prompts_dropped_or_cut": dropped,
        "verifier": env["info"].path,
        "draft": str(c.draft),
        "draft_is_random": str(c.draft) == "random",
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,  # the figures depend on the card
        "dtype": str(env["dtype"]).removeprefix("torch."),
        "cuda_graphs": graphs,
        "compile": graphs and runners.base.graphs.compile_model is not None,
        # the verifier's layers compiled with their weights as constants (gate/up one matmul; q/k/v one without GQA)
        "frozen": graphs and runners.base.graphs.compile_model is not None and runners.base.graphs.freeze,
        "fused_rounds": graphs and c.fused_rounds and c.temperature == 0,
        "draft_attention": env["draft"].attn_implementation,  # the draft cache's (decode_attn_implementation)
        "batch_size": 1,
        "chat_template_sha256": template_sha,
        "chat_template": c.chat_template,  # --chat-template, or None: the tokenizer's own
        "end_of_turn_ids": sorted(env["eos_ids"]),
        "seed": c.seed,
        "versions": versions(),
        "measured_sha256": measured,
        "seconds": {
            **seconds,
            "total": round(time.perf_counter() - clock[0], 2),
            "compile": round(compiled[1] - compiled_before[1], 2),
        },
        "compiles": compiled[0] - compiled_before[0],
        "max_seq_len": max_len,
        # turns whose prompt with --max-new-tokens would pass max_seq_len, not decoded (nor their prompt's later turns)
        "skipped_turns": m.skipped,
    }
    if len(Ks) > 1:
        report["by_draft_tokens"] = {str(k): v for k, v in by_k.items()}
    trained_template = (env["draft_manifest"].get("inputs") or {}).get("chat_template_sha256")
    if trained_template and template_sha and trained_template != template_sha:
        report["warning"] = ("the draft was trained on data rendered with another chat template (give eval the one "
                             "prepare used: --chat-template)")  # fmt: skip
    if c.offline:
        rows, kind, why = offline_rows_from
        report["offline"] = offline_accuracy(d, env["info"], c.offline, ttt_steps=K, rows=rows, max_rows=c.offline_rows,
                                             device=dev, max_new_tokens=c.max_new_tokens)  # fmt: skip
        report["offline"].update(rows_from=kind, rows_note=why)
        report["predicted_tau"] = report["offline"]["predicted_tau"]
        report["predicted_tau_walk"] = report["offline"]["predicted_tau_walk"]
    if c.out:
        json_path, png_path = report_paths(c.out)
        check_report_out(c.out)  # again: a file may have appeared there while eval ran
        name = "random draft" if report["draft_is_random"] else Path(str(c.draft)).name
        plot_histogram(png_path, report["accepted_length_histogram"], tau=report["tau"],
                       title=f"{name} on {Path(env['info'].path).name}, K={K}, T={c.temperature:g}")  # fmt: skip
        report["histogram_png"] = str(png_path)
        write_json(json_path, report)
        report["report_json"] = str(json_path)
    _print_report(report)
    return report


evaluate = stage_function(EvalConfig, run, "evaluate")


# --------------------------------------------------------------------------- the report


def _existing_report(out: str | Path, measured: str) -> dict[str, Any] | None:
    """The report at ``out`` when it measured exactly ``measured`` (see :func:`run`), else None."""
    from eyas.core.manifest import report_paths

    path = report_paths(out)[0]
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and report.get("measured_sha256") == measured else None


def plot_histogram(path: Path, hist: list[int], *, tau: float, title: str) -> None:
    """A bar chart of accepted draft tokens per round, written atomically as a PNG (matplotlib's Agg canvas,
    without pyplot's global state)."""
    from matplotlib.figure import Figure

    from eyas.core.files import atomic_path

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


def _print_report(r: dict[str, Any]) -> None:
    fmt = lambda xs: "  ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    rows = [
        ("prompts", f"{r['num_prompts']} ({r['num_turns']} turns, {r['generated_tokens']} tokens) from {r['prompts']}"),
        ("draft", r["draft"] + ("  (random: untrained)" if r["draft_is_random"] else "")),
        ("setting", f"K={r['draft_tokens']}  T={r['temperature']:g}  {r['device']} {r['dtype']}  "
                    f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}{'  compiled' if r['compile'] else ''}  batch 1"),
        ("tau (tokens per verifier forward)", f"{r['tau']:.3f}  over {r['rounds']} rounds"),
    ]  # fmt: skip
    if "predicted_tau" in r:
        rows.append(
            (
                "tau predicted offline",
                f"{r['predicted_tau']:.3f} pooled over positions, "
                f"{r['predicted_tau_walk']:.3f} walking the turns as decoding does  "
                f"(measured {r['tau']:.3f})",
            )
        )
        off = r["offline"]
        rows.append(("offline rows", f"{off['rows']} rows of {off['features']}: {off['rows_note']}"))
    rows += [
        ("acceptance per position", fmt(r["acceptance_per_position"]) + "  (unconditional)"),
        ("conditional acceptance", fmt(r["conditional_acceptance_per_position"]) + "  (given the previous accepted)"),
        ("accepted-length histogram", " ".join(map(str, r["accepted_length_histogram"])) + "  (0..K drafts accepted)"),
    ]
    groups = lambda g: ",  ".join(f"{k}: {v['tau']:.2f}" for k, v in g.items())  # noqa: E731
    if len(r.get("tau_by_turn") or {}) > 1:
        rows.append(("tau by turn", groups(r["tau_by_turn"]) + "  (a later turn follows the verifier's answer)"))
    if r.get("tau_by_category"):
        rows.append(("tau by category", groups(r["tau_by_category"])))
    if r.get("prompts_dropped_or_cut"):
        rows.append(("rows dropped or cut", "; ".join(r["prompts_dropped_or_cut"]) + "  (rows from 0)"))
    if r.get("skipped_turns"):
        sk = r["skipped_turns"]
        named = ", ".join(f"{x['prompt']} turn {x['turn']} ({x['prompt_tokens']} tokens)" for x in sk[:5])
        rows.append(("skipped (too long)", f"{len(sk)} turn(s) past --max-seq-len {r['max_seq_len']} with their "
                     f"prompts' later turns: {named}" + (" ..." if len(sk) > 5 else "")))  # fmt: skip
    if r["lossless"] is not None:
        rows.append(("lossless (== plain greedy)", _lossless_line(r["mismatches"], r["dtype"])))
    speed = f"{r['tokens_per_s']:.1f} tokens/s"
    if r["baseline_tokens_per_s"]:
        speed += f"  vs plain {r['baseline_tokens_per_s']:.1f}: speedup {r['speedup']:.2f}x"
    rows.append(("speed", speed))
    if r.get("seconds"):
        t = r["seconds"]
        rows.append(("time", f"{t['total']:.1f} s: load {t['load']:.1f}, graphs {t['build']:.1f}, decoding "
                              f"{t['decode']:.1f} (plain loop {t['decode_plain']:.1f}, speculative "
                              f"{t['decode_speculative']:.1f})"
                              + (f"; {r['compiles']} compiles took {t['compile']:.1f} s of it" if r.get("compiles")
                                 else "")))  # fmt: skip
    for k, x in (r.get("by_draft_tokens") or {}).items():
        line = f"tau {x['tau']:.3f}"
        if x["speedup"]:
            line += f"  speedup {x['speedup']:.2f}x"
        if x["lossless"] is not None:
            line += f"  lossless {_lossless_line(x['mismatches'], r['dtype'])}"
        rows.append((f"K={k}", line))
    if r.get("warning"):
        rows.append(("warning", r["warning"]))
    if r.get("report_json"):
        rows.append(("report", f"{r['report_json']}  (histogram {r['histogram_png']})"))
    width = max(len(k) for k, _ in rows)
    print("\neyas eval")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _lossless_line(mismatches: list[dict[str, Any]], dtype: str) -> str:
    if not mismatches:
        return "yes"
    ties = sum(x.get("kind") == "near-tie" for x in mismatches)
    real = len(mismatches) - ties
    rechecked = sum("fp32" in x for x in mismatches)
    how = (" (rechecked in fp32)" if rechecked == len(mismatches) else
           f" (by the logit gap in {dtype}; {rechecked} of them rechecked in fp32)" if rechecked else
           f" (by the logit gap in {dtype})")  # fmt: skip
    return f"NO: {len(mismatches)} turn(s) differ: {ties} near-tie(s), {real} real{how}"
