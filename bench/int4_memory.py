"""Memory of an int4 compressed-tensors verifier as eyas loads it (packed, decompressed per matmul) against the
same checkpoint dequantized while loading (transformers' ``dequantize=True`` route, eyas' behaviour before),
on a random Kimi-like checkpoint built on the fly: a DeepseekV3 text model under a multimodal wrapper, every
routed expert int4 (group 32, bf16 scales, per-expert tensors as in Kimi-K2.5's int4 release), the rest bf16.

    # one GPU (about 40 s; the default dims give about 2.2B weights, 4.3 GB in bf16):
    PYTHONPATH=src python3 bench/int4_memory.py
    # anywhere, to check that the script works:
    PYTHONPATH=src python3 bench/int4_memory.py --smoke

Prints JSON lines: the checkpoint built; for each load (``packed``, ``dequantized``) the bytes its parameters
and buffers really hold (every storage once), what the GPU allocated for it and at its peak while loading,
and the backbone's forward over ``--batch x --seq`` tokens (what extraction and online training run); then
the ratio of the two, the largest difference between their hidden states, and what ``eyas plan`` predicts
for the same config. Needs torch, transformers, safetensors and compressed-tensors (no gguf, no datasets).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "src", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import tiny  # noqa: E402
from eyas.verifier.packed import resident_bytes  # noqa: E402
from eyas.verifier.load import build_text_model, forward_hidden_states, resolve  # noqa: E402

DIMS = dict(hidden_size=2048, num_hidden_layers=6, n_routed_experts=128, moe_intermediate_size=512,
            intermediate_size=5632, vocab_size=16384, num_attention_heads=16, num_key_value_heads=16,
            num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=512, kv_lora_rank=256,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_group=1, topk_group=1)  # fmt: skip
SMOKE = dict(DIMS, hidden_size=64, num_hidden_layers=4, n_routed_experts=8, moe_intermediate_size=32,
             intermediate_size=128, vocab_size=512, num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip


def build(path: Path, dims: dict, device: torch.device) -> dict:
    """Write the random int4 Kimi-like checkpoint to ``path``; the experts are drawn, quantized and packed on
    ``device``, one layer at a time."""
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
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    for layer in range(dims["first_k_dense_replace"], dims["num_hidden_layers"]):
        experts = {f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight":
                   0.02 * torch.randn(shape, generator=g, device=device)
                   for e in range(dims["n_routed_experts"]) for proj, shape in shapes.items()}  # fmt: skip
        packed, _ = tiny.int4_pack(experts)
        del experts
        for k, v in packed.items():  # Kimi-K2.5's release keeps its scales in bf16
            weights[k] = (v.to(torch.bfloat16) if k.endswith("weight_scale") else v).cpu()
    text_cfg = json.loads(cfg.to_json_string(use_diff=False)) | {"quantization_config": tiny.KIMI_INT4_QUANTIZATION}
    tiny.write_kimi_wrapper(path, weights, text_cfg, shards=dims["num_hidden_layers"])
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"what": "checkpoint", "path": str(path), "dims": dims, "safetensors_bytes": on_disk,
            "tensors": len(weights)}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(info, *, packed: bool, device: torch.device, ids: torch.Tensor, repeats: int) -> tuple[dict, tuple]:
    """Load the verifier (packed or dequantized) onto ``device``, run the backbone, free it."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    t0 = time.perf_counter()
    where = {"device_map": {"": device.index or 0}} if cuda else {"device": device}
    model = build_text_model(info, dtype=torch.bfloat16, packed=packed, **where)
    _sync(device)
    out = {"what": "packed" if packed else "dequantized", "load_s": round(time.perf_counter() - t0, 2),
           "resident_bytes": resident_bytes(model)}  # fmt: skip
    if cuda:
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device) - base
        out["cuda_peak_load_bytes"] = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
    states = forward_hidden_states(model, ids, layer_ids=info.aux_layer_ids)  # warm-up (and the states compared)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        forward_hidden_states(model, ids, layer_ids=info.aux_layer_ids)
    _sync(device)
    seconds = (time.perf_counter() - t0) / repeats
    out.update(forward_ms=round(1000 * seconds, 1), forward_tokens_per_s=round(ids.numel() / seconds))
    if cuda:
        out["cuda_peak_forward_bytes"] = torch.cuda.max_memory_allocated(device) - base
    del model
    return out, tuple(s.float().cpu() for s in states)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/eyas-int4-memory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny dims, for a check on any machine")
    a = ap.parse_args()
    dims = SMOKE if a.smoke else DIMS
    device = torch.device(a.device)
    import compressed_tensors
    import transformers

    print(json.dumps({"what": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
                      "compressed_tensors": compressed_tensors.__version__,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}), flush=True)
    path = Path(a.workdir) / ("smoke" if a.smoke else "kimi_int4")
    t0 = time.perf_counter()
    made = build(path, dims, device)
    print(json.dumps(made | {"build_s": round(time.perf_counter() - t0, 1)}), flush=True)
    info = resolve(path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, dims["vocab_size"], (a.batch, a.seq), generator=g).to(device)
    packed, (pa, pl) = measure(info, packed=True, device=device, ids=ids, repeats=a.repeats)
    print(json.dumps(packed), flush=True)
    dense, (da, dl) = measure(info, packed=False, device=device, ids=ids, repeats=a.repeats)
    print(json.dumps(dense), flush=True)
    key = str(device) if device.type == "cpu" else f"cuda:{device.index or 0}"
    rel = lambda x, y: float((x - y).norm() / y.norm())  # noqa: E731
    from eyas.stages.plan import verifier_memory

    predicted = verifier_memory(path)
    print(json.dumps({
        "what": "compare",
        "resident_ratio": round(packed["resident_bytes"][key] / dense["resident_bytes"][key], 4),
        "aux_rel_diff": rel(pa, da), "last_rel_diff": rel(pl, dl),
        "forward_time_ratio": round(packed["forward_ms"] / dense["forward_ms"], 3),
        "plan_packed_bytes": predicted["packed_bytes"], "plan_bf16_bytes": predicted["bf16_bytes"],
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
