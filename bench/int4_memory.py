"""An int4 compressed-tensors MoE verifier as eyas loads it (packed, eyas.verifier.packed) against the same model
dequantized to bf16, in one process: memory, the backbone forward (what `eyas extract` and `eyas train --online`
run: eyas.verifier.load.forward_hidden_states), decoding (eyas.engine.generate.SequenceDecoder, with CUDA graphs), and the
int4 matmul kernels on one expert's matrix.

The checkpoint is random and laid out as Kimi-K2.5's int4 release: a DeepseekV3 text model under a multimodal
wrapper, every routed expert int4 (compressed-tensors pack-quantized, group 32, bf16 scales, one tensor set per
expert), the rest bf16. Its default dims are Kimi-K2.5's per layer (hidden 7168, expert width 2048, top-8, MLA
64 heads, dense first layer of width 18432) cut to 4 layers, 128 experts and a 16k vocabulary: about 18.1B
weights, 36 GB in bf16, 12 GB packed. It is written directly (random int4 words and scales, no quantization pass), and
loaded packed through eyas' own loading path (eyas.verifier.load.build_text_model); the bf16 model is transformers'
own class (fused experts, its default grouped GEMM) filled with the packed model's weights dequantized on the
device.

    # one H200 (about 2 min): PYTHONPATH=src python3 bench/int4_memory.py --out $OUT --commit COMMIT
    # anywhere, to check that the script works: PYTHONPATH=src python3 bench/int4_memory.py --smoke

Prints JSON lines, one a stage, and writes ``--out``/int4.json with the summary (``packed_over_bf16_bytes``,
``packed_over_bf16_tokens_per_s``, ``graphs``, ``checkpoint_shape``, ``device``, ``commit``) after every stage,
so a run cut short keeps what it measured. Each stage is guarded: one that fails prints its error and the
next runs. Needs torch, transformers, safetensors, compressed-tensors.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import time
import traceback
from itertools import chain
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "src", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import tiny  # noqa: E402
from eyas.verifier import packed as packed_mod  # noqa: E402
from eyas.verifier.int4_matmul import int4_grouped_mm, supported  # noqa: E402
from eyas.verifier.packed import PackedExperts, dequantize_int4, resident_bytes  # noqa: E402
from eyas.verifier.load import build_text_model, forward_hidden_states, resolve  # noqa: E402

#: Kimi-K2.5's text config per layer (hidden, MLA, expert width, top-8, one shared expert, a dense first layer),
#: cut in depth, experts and vocabulary to fit one H200 twice (packed and bf16).
DIMS = dict(hidden_size=7168, num_hidden_layers=4, n_routed_experts=128, moe_intermediate_size=2048,
            intermediate_size=18432, vocab_size=16384, num_attention_heads=64, num_key_value_heads=64,
            num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1)  # fmt: skip
SMOKE = dict(DIMS, hidden_size=64, num_hidden_layers=4, n_routed_experts=8, moe_intermediate_size=32,
             intermediate_size=128, vocab_size=512, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip
#: Forward shapes (rows x tokens): extraction's batches (long rows, full) and online training's (shorter rows,
#: padded: the last quarter of every other row is masked), at the smoke size too.
SHAPES = {"extract": (8, 2048), "online": (4, 1024)}
SMOKE_SHAPES = {"extract": (2, 32), "online": (2, 16)}
SCALE = 0.02 / 4.6  # int4 values -8..7 have a standard deviation of about 4.6: weights of about 0.02


def build(path: Path, dims: dict, device: torch.device) -> dict:
    """Write the random int4 Kimi-like checkpoint: dense tensors drawn in bf16, each routed expert's int4 words
    drawn as random bytes (every int4 value equally likely) with random bf16 scales, on ``device``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**dims, tie_word_embeddings=False, max_position_embeddings=4096)
    with torch.device("meta"):
        skeleton = DeepseekV3ForCausalLM(cfg)
    g = torch.Generator(device).manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    for name, p in skeleton.state_dict().items():
        if ".mlp.experts." in name:
            continue  # fused in transformers; the checkpoint stores each expert (below)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * torch.randn(p.shape, generator=g, device=device)
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros(p.shape, device=device)
        else:
            t = 0.02 * torch.randn(p.shape, generator=g, device=device)
        weights[name] = t.to(torch.bfloat16).cpu()
    H, I = dims["hidden_size"], dims["moe_intermediate_size"]
    group = tiny.INT4_GROUP
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    experts = 0
    for layer in range(dims["first_k_dense_replace"], dims["num_hidden_layers"]):
        for e in range(dims["n_routed_experts"]):
            for proj, (rows, cols) in shapes.items():
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
                words = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g, device=device)
                scale = SCALE * (0.5 + torch.rand(rows, cols // group, generator=g, device=device))
                weights[base + "weight_packed"] = words.view(torch.int32).cpu()
                weights[base + "weight_scale"] = scale.to(torch.bfloat16).cpu()
                weights[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
                experts += rows * cols
    text_cfg = json.loads(cfg.to_json_string(use_diff=False)) | {"quantization_config": tiny.KIMI_INT4_QUANTIZATION}
    tiny.write_kimi_wrapper(path, weights, text_cfg, shards=dims["num_hidden_layers"] + 1)
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    dense = sum(t.numel() for k, t in weights.items() if "weight_" not in k)
    return {"safetensors_bytes": on_disk, "tensors": len(weights), "expert_weights": experts,
            "other_weights": dense}  # fmt: skip


def dequantized_copy(model, device: torch.device):
    """The same model as transformers builds it unquantized (fused experts ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``) in bf16, every weight taken from the packed ``model``, experts dequantized here."""
    cfg = copy.deepcopy(model.config)
    for name in ("quantization_config",):
        if hasattr(cfg, name):
            delattr(cfg, name)
    with torch.device("meta"):
        dense = type(model)._from_config(cfg, dtype=torch.bfloat16)
    dense = dense.to_empty(device=device).eval()
    source = dict(chain(model.named_parameters(), model.named_buffers()))
    with torch.no_grad():
        for name, t in chain(dense.named_parameters(), dense.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            experts = model.get_submodule(owner) if leaf in ("gate_up_proj", "down_proj") else None
            if isinstance(experts, PackedExperts):
                which = "gate_up" if leaf == "gate_up_proj" else "down"
                for a in range(0, experts.num_experts, 8):
                    part = slice(a, a + 8)
                    t[part].copy_(dequantize_int4(experts._buffers[which + "_packed"][part],
                                                  experts._buffers[which + "_scale"][part], experts.group_size,
                                                  torch.bfloat16))  # fmt: skip
            elif name in source and source[name].shape == t.shape:
                t.copy_(source[name])
            else:
                raise RuntimeError(f"{name}: no weight of this shape in the packed model")
    return dense


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn`` after one warm-up call."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def inputs(shape: tuple[int, int], vocab: int, device: torch.device, *, padded: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, shape, generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[::2, shape[1] * 3 // 4 :] = 0
    return ids.to(device), mask.to(device)


def forward_rate(model, info, shape, vocab, device, repeats, *, padded):
    ids, mask = inputs(shape, vocab, device, padded=padded)
    run = lambda: forward_hidden_states(model, ids, layer_ids=info.aux_layer_ids, attention_mask=mask)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(run, device, repeats)
    out = {"ms": round(1000 * seconds, 2), "tokens_per_s": round(int(mask.sum()) / seconds)}
    if device.type == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def decode_rate(model, info, device, steps: int, *, graphs: bool) -> dict:
    """Batch-1 decoding as eval does: a 32-token prompt, then ``steps`` single-token forwards (greedy)."""
    from eyas.engine.generate import SequenceDecoder

    dec = SequenceDecoder(model, capacity=256, aux_layer_ids=info.aux_layer_ids, cuda_graphs=graphs, compile=False)
    prompt = inputs((1, 32), model.config.vocab_size, device, padded=False)[0][0]
    logits, _ = dec.forward(prompt, 0)
    token, start = logits[-1].argmax(-1, keepdim=True), 32
    for _ in range(3):  # warm-up (and the graph's capture)
        logits, _ = dec.forward(token, start)
        token, start = logits[-1].argmax(-1, keepdim=True), start + 1
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, _ = dec.forward(token, start)
        token, start = logits[-1].argmax(-1, keepdim=True), start + 1
    sync(device)
    seconds = (time.perf_counter() - t0) / steps
    return {"ms_per_token": round(1000 * seconds, 3), "tokens_per_s": round(1 / seconds, 1),
            "graphs": bool(dec.graphs.enabled)}  # fmt: skip


def kernels(experts: PackedExperts, device: torch.device, rows_list, repeats: int) -> dict:
    """One expert's gate projection ``[I, H]`` at each row count: bf16 matmul, eyas' dequantization then matmul
    (compiled and eager), compressed-tensors' decompression then matmul (the per-expert path), and torch's int4
    kernel (tinygemm, ``_weight_int4pack_mm``, what torchao's int4 weight-only layout calls on CUDA), its error
    against the dequantized weight alongside."""
    linear = experts[0].gate_proj
    packed, scale, group = linear.weight_packed, linear.weight_scale, experts.group_size
    dense = dequantize_int4(packed, scale, group, torch.bfloat16)
    N, K = dense.shape
    out: dict = {"matrix": [N, K]}
    tiny_w = tiny_sz = None
    if device.type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        try:  # unsigned nibbles (value + 8), two a byte, high nibble first, as torch's converter reads them
            shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int32)
            q = ((packed[..., None] >> shifts) & 0xF).flatten(-2)  # [N, K] in 0..15
            u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiny_w = torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), 8)
            zeros = torch.zeros_like(scale)  # tinygemm computes (q - 8) * scale + zero
            tiny_sz = torch.stack([scale, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        except Exception as e:  # noqa: BLE001
            out["tinygemm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    for rows in rows_list:
        x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
        ref = x @ dense.t()
        r = {"bf16": timed(lambda: x @ dense.t(), device, repeats)}
        default, packed_mod.COMPILE_DEQUANT = packed_mod.COMPILE_DEQUANT, True
        try:
            r["dequant_compiled"] = timed(lambda: x @ dequantize_int4(packed, scale, group, x.dtype).t(), device,
                                          repeats)  # fmt: skip
        finally:
            packed_mod.COMPILE_DEQUANT = default
        r["dequant_eager"] = timed(lambda: x @ packed_mod._dequantize_int4_eager(packed, scale, group, x.dtype).t(),
                                   device, repeats)  # fmt: skip
        r["compressed_tensors"] = timed(lambda: linear(x), device, repeats)
        if supported(x, K, group):  # eyas' Triton kernel: the packed words read inside the matmul
            offs = torch.full((1,), rows, device=device, dtype=torch.int32)
            got = int4_grouped_mm(x, packed[None], scale[None], offs, group)
            r["int4_kernel_rel_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
            r["int4_kernel"] = timed(lambda: int4_grouped_mm(x, packed[None], scale[None], offs, group), device,
                                     repeats)  # fmt: skip
        if tiny_w is not None:
            try:
                got = torch.ops.aten._weight_int4pack_mm(x, tiny_w, group, tiny_sz)
                r["tinygemm_rel_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
                if r["tinygemm_rel_err"] > 0.05 and "swapped" not in out:  # the other nibble order, once
                    tiny_w = torch.ops.aten._convert_weight_to_int4pack((q[:, 1::2] << 4 | q[:, ::2]).to(torch.uint8)
                                                                        .contiguous(), 8)  # fmt: skip
                    got = torch.ops.aten._weight_int4pack_mm(x, tiny_w, group, tiny_sz)
                    out["swapped"] = float((got.float() - ref.float()).norm() / ref.float().norm())
                r["tinygemm"] = timed(lambda: torch.ops.aten._weight_int4pack_mm(x, tiny_w, group, tiny_sz), device,
                                      repeats)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                r["tinygemm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        out[str(rows)] = {
            k: (
                round(v * 1e6, 1)
                if k in ("bf16", "dequant_compiled", "dequant_eager", "compressed_tensors", "tinygemm", "int4_kernel")
                else v
            )
            for k, v in r.items()
        }  # fmt: skip  (microseconds per call)
    return out


class Run:
    """The stages' results as JSON lines, and the summary written after each stage."""

    def __init__(self, out: Path | None, budget_s: float) -> None:
        self.out, self.budget, self.t0 = out, budget_s, time.perf_counter()
        self.summary: dict = {}
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def stage(self, name: str, fn, *, need_s: float = 0.0):
        if self.left() < need_s:
            self.emit({"what": name, "skipped": f"{self.left():.0f} s of the budget left, {need_s:.0f} s needed"})
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (one failed stage must not lose the others)
            self.emit({"what": name, "error": f"{type(e).__name__}: {str(e)[:400]}",
                       "trace": traceback.format_exc()[-1500:]})  # fmt: skip
            return None
        self.emit({"what": name, "s": round(time.perf_counter() - t0, 1), **(result or {})})
        return result

    def emit(self, row: dict) -> None:
        print(json.dumps(row), flush=True)

    def save(self, **fields) -> None:
        self.summary.update(fields)
        if self.out is not None:
            (self.out / "int4.json").write_text(json.dumps(self.summary, indent=2) + "\n")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/eyas-int4")
    ap.add_argument("--out", default=None, help="folder for int4.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD, where there is one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=170, help="stages that would start later are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, for a check on any machine")
    a = ap.parse_args(argv)
    dims, shapes = (SMOKE, SMOKE_SHAPES) if a.smoke else (DIMS, SHAPES)
    device = torch.device(a.device)
    run = Run(Path(a.out) if a.out else None, a.budget_s)
    import compressed_tensors
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        name += f" ({torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB)"
    run.save(device=name, commit=a.commit or _commit(), smoke=a.smoke,
             checkpoint_shape={k: dims[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                                    "moe_intermediate_size", "num_experts_per_tok", "vocab_size")},
             versions={"torch": torch.__version__, "transformers": transformers.__version__,
                       "compressed_tensors": compressed_tensors.__version__})  # fmt: skip
    run.emit({"what": "start", **run.summary})
    path = Path(a.workdir) / ("smoke" if a.smoke else "kimi_int4")
    made = run.stage("checkpoint", lambda: build(path, dims, device))
    if made is None:
        return run.summary
    run.save(checkpoint_shape=run.summary["checkpoint_shape"] | made)
    info = resolve(path)
    key = str(device) if device.type == "cpu" else f"cuda:{device.index or 0}"
    where = {"device_map": {"": device.index or 0}} if device.type == "cuda" else {"device": device}
    models: dict = {}

    def load_packed():
        t0 = time.perf_counter()
        models["packed"] = build_text_model(info, dtype=torch.bfloat16, **where)
        sync(device)
        stacked = [m.stacked for m in models["packed"].modules() if isinstance(m, PackedExperts)]
        return {"load_s": round(time.perf_counter() - t0, 1), "resident_bytes": resident_bytes(models["packed"]),
                "moe_layers": len(stacked), "stacked": all(stacked) and bool(stacked)}  # fmt: skip

    def load_bf16():
        how = "dequantized on the device"
        try:
            models["bf16"] = dequantized_copy(models["packed"], device)
        except Exception as e:  # noqa: BLE001  (then transformers' own dequantizing load)
            how = f"transformers' dequantizing load ({type(e).__name__}: {str(e)[:200]})"
            models.pop("bf16", None)
            gc.collect()
            models["bf16"] = build_text_model(info, dtype=torch.bfloat16, packed=False, **where)
        sync(device)
        return {
            "resident_bytes": resident_bytes(models["bf16"]),
            "how": how,
            "experts_implementation": getattr(models["bf16"].config, "_experts_implementation", None),
        }

    packed = run.stage("load_packed", load_packed)
    if packed is None:
        return run.summary
    default_compile = packed_mod.COMPILE_DEQUANT
    packed_mod.COMPILE_DEQUANT = False  # until the forward stages, which pay and time any compilation
    dense = run.stage("load_bf16", load_bf16)
    from eyas.stages.plan import verifier_memory

    predicted = verifier_memory(path)
    if dense is not None:
        run.save(packed_over_bf16_bytes=round(packed["resident_bytes"][key] / dense["resident_bytes"][key], 4),
                 packed_bytes=packed["resident_bytes"][key], bf16_bytes=dense["resident_bytes"][key],
                 plan_packed_bytes=predicted["packed_bytes"], plan_bf16_bytes=predicted["bf16_bytes"])  # fmt: skip

        def agree():
            ids, mask = inputs(shapes["online"], dims["vocab_size"], device, padded=True)
            pa, pl = forward_hidden_states(models["packed"], ids, layer_ids=info.aux_layer_ids, attention_mask=mask)
            da, dl = forward_hidden_states(models["bf16"], ids, layer_ids=info.aux_layer_ids, attention_mask=mask)
            rel = lambda x, y: float((x.float() - y.float()).norm() / y.float().norm())  # noqa: E731
            return {"aux_rel_diff": rel(pa, da), "last_rel_diff": rel(pl, dl)}

        same = run.stage("agree", agree)
        if same:
            run.save(**same)
    packed_mod.COMPILE_DEQUANT = default_compile

    rates: dict = {}

    def forward(which: str, shape: str, **settings):
        def go():
            old = {k: getattr(PackedExperts, k) for k in ("kernel",)} | {"compile": packed_mod.COMPILE_DEQUANT}
            PackedExperts.kernel = settings.get("kernel", old["kernel"])
            packed_mod.COMPILE_DEQUANT = settings.get("compile", default_compile)
            try:
                r = forward_rate(models[which], info, shapes[shape], dims["vocab_size"], device,
                                 settings.get("repeats", a.repeats), padded=shape == "online")  # fmt: skip
            finally:
                PackedExperts.kernel, packed_mod.COMPILE_DEQUANT = old["kernel"], old["compile"]
            rates[(which, shape, settings.get("label", ""))] = r["tokens_per_s"]
            return {"model": which, "shape": list(shapes[shape]), **settings, **r}

        return go

    def ratio(shape: str, label: str = "") -> float | None:
        p, d = rates.get(("packed", shape, label)), rates.get(("bf16", shape, ""))
        return round(p / d, 3) if p and d else None

    def save_forward() -> None:
        run.save(packed_over_bf16_tokens_per_s={s: ratio(s) for s in shapes if ratio(s) is not None},
                 **{f"{k}_over_bf16_tokens_per_s": {s: ratio(s, k) for s in shapes if ratio(s, k)}
                    for k in ("dequant", "compiled_dequant") if any(ratio(s, k) for s in shapes)},
                 per_expert_over_bf16_tokens_per_s={s: ratio(s, "per-expert") for s in shapes
                                                    if ratio(s, "per-expert") is not None})  # fmt: skip

    def decode(which: str, graphs: bool):
        def go():
            r = decode_rate(models[which], info, device, a.decode_steps, graphs=graphs)
            return {"model": which, "asked_graphs": graphs, **r}

        return go

    # Most wanted first (a stage that would start past the budget is skipped): the forward at both shapes with
    # the default path, decoding with CUDA graphs, then the alternatives (the other dequantization, per expert).
    for shape in ("extract", "online"):
        if "bf16" in models:
            run.stage(f"forward_bf16_{shape}", forward("bf16", shape), need_s=10)
        run.stage(f"forward_packed_{shape}", forward("packed", shape), need_s=10)
        save_forward()
    dec_p = run.stage("decode_packed_graphs", decode("packed", True), need_s=15)
    dec_d = run.stage("decode_bf16_graphs", decode("bf16", True), need_s=15) if "bf16" in models else None
    if dec_p:
        run.save(graphs=dec_p["graphs"], decode_tokens_per_s={"packed": dec_p["tokens_per_s"]})
        if dec_d:
            run.save(
                decode_tokens_per_s={
                    "packed": dec_p["tokens_per_s"],
                    "bf16": dec_d["tokens_per_s"],
                    "bf16_graphs": dec_d["graphs"],
                    "packed_over_bf16": round(dec_p["tokens_per_s"] / dec_d["tokens_per_s"], 3),
                }
            )
    # the path before the int4 kernel: all experts dequantized (compressed-tensors' unpacking), torch's grouped GEMM
    for shape in ("extract", "online"):
        run.stage(f"forward_packed_{shape}_dequant", forward("packed", shape, kernel="grouped", label="dequant"),
                  need_s=10)  # fmt: skip
        save_forward()
    dec_e = run.stage("decode_packed_eager", decode("packed", False), need_s=15)
    if dec_e and dec_p:
        run.save(decode_graphs_speedup=round(dec_p["tokens_per_s"] / dec_e["tokens_per_s"], 2))
    # eyas' path before the grouped one: one expert at a time, compressed-tensors' decompression
    run.stage("forward_packed_online_per_expert",
              forward("packed", "online", kernel="per-expert", repeats=1, label="per-expert"), need_s=20)  # fmt: skip
    save_forward()
    experts = next(m for m in models["packed"].modules() if isinstance(m, PackedExperts))
    kern = run.stage("kernels", lambda: kernels(experts, device, (1, 16, 128, 1024) if not a.smoke else (1, 4),
                                                 10 if not a.smoke else 1), need_s=10)  # fmt: skip
    if kern:
        run.save(kernels_us=kern)
    del models
    gc.collect()
    return run.summary


if __name__ == "__main__":
    main()
