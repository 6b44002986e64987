"""eyas plan: from a config alone, every figure checked against arithmetic written out by hand, on a config
carrying Kimi-K2.5's real values (tests/kimi_k25_config: a multimodal wrapper around a DeepseekV3 text config,
int4 group-32 compressed-tensors on the routed experts; no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiny
from eyas.cli import main as cli_main
from eyas.stages.plan import MEASURED, USABLE_FRACTION, _matches, draft_tokens_per_s, plan, verifier_memory

KIMI = Path(__file__).parents[1] / "kimi_k25_config"

# ---- Kimi-K2.5 by hand (text_config of tests/kimi_k25_config/config.json)
H, L, V = 7168, 61, 163_840
E, TOP_K, I_MOE, I_DENSE = 384, 8, 2048, 18_432
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 64, 1536, 512, 128, 64, 128
MOE_LAYERS = L - 1  # first_k_dense_replace = 1

ATTN = (H * Q_LORA + Q_LORA  # q_a_proj, q_a_layernorm
        + Q_LORA * HEADS * (NOPE + ROPE)  # q_b_proj
        + H * (KV_LORA + ROPE) + KV_LORA  # kv_a_proj_with_mqa, kv_a_layernorm
        + KV_LORA * HEADS * (NOPE + V_HEAD)  # kv_b_proj
        + HEADS * V_HEAD * H)  # o_proj  # fmt: skip
assert ATTN == 101_124_096
NORMS = 2 * H  # input_layernorm, post_attention_layernorm
DENSE_MLP = 3 * H * I_DENSE  # layer 0: gate, up, down
EXPERT = 3 * H * I_MOE  # one routed expert: gate [I, H], up [I, H], down [H, I]
SHARED = 3 * H * I_MOE  # n_shared_experts = 1
ROUTER = E * H + E  # gate.weight, e_score_correction_bias
EMBED = HEAD = V * H
PARAMS = L * (ATTN + NORMS) + DENSE_MLP + MOE_LAYERS * (E * EXPERT + SHARED + ROUTER) + EMBED + HEAD + H
assert MOE_LAYERS * E * EXPERT == 1_014_686_023_680  # the 1.015T routed-expert parameters

# int4, group 32, bf16 scales: a [out, in] weight packs out*in/2 bytes, out*in/32 scales of 2 bytes, and its
# weight_shape (two int64)
packed = lambda out, inp: out * inp // 2 + out * (inp // 32) * 2 + 16  # noqa: E731
EXPERT_PACKED = 2 * packed(I_MOE, H) + packed(H, I_MOE)
assert EXPERT_PACKED == 3 * (7_340_032 + 917_504 + 16)
BF16 = 2 * PARAMS
PACKED = BF16 - 2 * MOE_LAYERS * E * EXPERT + MOE_LAYERS * E * EXPERT_PACKED
ACTIVE = L * (ATTN + NORMS) + DENSE_MLP + MOE_LAYERS * (TOP_K * EXPERT + SHARED + ROUTER) + H  # no embed, no head

# placement over 141 GB GPUs (0.9 of each usable): a MoE layer packed, layer 0 (dense) in bf16
CAP = USABLE_FRACTION * 141e9
MOE_LAYER_PACKED = 2 * (ATTN + NORMS + SHARED + ROUTER) + E * EXPERT_PACKED
LAYER0 = 2 * (ATTN + NORMS + DENSE_MLP)
assert 12 * MOE_LAYER_PACKED <= CAP < 13 * MOE_LAYER_PACKED  # twelve MoE layers a GPU
assert 2 * EMBED + LAYER0 + 12 * MOE_LAYER_PACKED <= CAP  # GPU 0: the embedding, layer 0 and twelve more
MOE_LAYER_BF16 = 2 * (ATTN + NORMS + SHARED + ROUTER + E * EXPERT)
assert 3 * MOE_LAYER_BF16 <= CAP < 4 * MOE_LAYER_BF16  # three a GPU in bf16: sixty MoE layers on twenty GPUs


@pytest.fixture(scope="module")
def kimi() -> dict:
    return plan(str(KIMI), tokens=6_000_000_000, gpus=8, gpu_memory=141, disk=100_000, json_out=True)


def test_kimi_k25_memory_by_hand(kimi):
    """594 GB packed against 2.05 TB dequantized: only the packed verifier fits one 8x H200 node."""
    assert kimi["source"] == "config" and kimi["quantization"] == "compressed-tensors"
    assert kimi["parameters"] == PARAMS
    assert kimi["verifier_bytes_bf16"] == BF16 == 2_052_816_464_896
    assert kimi["verifier_bytes_packed"] == PACKED == 594_206_411_776
    assert kimi["active_backbone_parameters"] == ACTIVE
    assert kimi["feature_bytes_per_token"] == {"bf16": 4 * H * 2, "fp8": 4 * H} == {"bf16": 57_344, "fp8": 28_672}
    assert kimi["feature_bytes"] == {"bf16": 6_000_000_000 * 57_344, "fp8": 6_000_000_000 * 28_672}


def test_kimi_k25_split_over_gpus_by_hand(kimi):
    """Five H200s hold it packed (four hold 507.6 GB < 594.2), twenty in bf16; the split is even by whole layers:
    GPU 0 the embedding, layer 0 and twelve MoE layers, GPUs 1-3 twelve each, GPU 4 the last twelve and the head."""
    assert 4 * CAP < PACKED
    assert kimi["gpus_needed"] == 5 and kimi["gpus_needed_bf16"] == 20 and kimi["verifier_fits"]
    assert kimi["split_bytes"] == [EMBED * 2 + LAYER0 + 12 * MOE_LAYER_PACKED, *[12 * MOE_LAYER_PACKED] * 3,
                                   12 * MOE_LAYER_PACKED + 2 * (H + HEAD)]  # fmt: skip
    assert sum(kimi["split_bytes"]) == PACKED


def test_kimi_k25_mode_and_cost_by_hand(kimi):
    """6B tokens (the public Kimi-K2.5 draft's data) are 172 TB of fp8 features: more than a 100 TB disk, so
    online; the GPU-hours follow from the measured rates."""
    assert kimi["mode"] == "online" and "172.0 TB even in fp8" in kimi["why"] and "docs/SCALING.md" in kimi["why"]
    verifier_tps = MEASURED["verifier_flop_per_s"] / (2 * ACTIVE) / MEASURED["packed_forward_slowdown"]
    draft_tps = MEASURED["draft_tokens_per_s"]  # measured at Kimi-K2.5's draft dims
    assert kimi["verifier_tokens_per_s"] == round(verifier_tps) and kimi["draft_tokens_per_s"] == round(draft_tps)
    verifier_h, draft_h = 6e9 / verifier_tps / 3600, 6e9 / draft_tps / 3600
    assert kimi["wall_hours"] == pytest.approx(verifier_h + draft_h, abs=0.1)
    assert kimi["gpu_hours"]["verifier"] == pytest.approx(5 * verifier_h, abs=0.1)
    assert kimi["gpu_hours"]["draft"] == pytest.approx(5 * draft_h, abs=0.1)


def test_kimi_k25_estimate_beside_the_public_run_with_what_closes_the_difference(kimi, capsys):
    """At the public Kimi-K2.5 draft's 6B tokens the estimate is set against its 1,500 H200-hours; the factors
    that a tensor-parallel engine and an int4 MoE GEMM would remove are the 5 GPUs a device_map holds and the
    measured packed slowdown, and the GPU-hours without them follow by hand."""
    from eyas.stages.plan import PUBLIC_KIMI_RUN, _print_table

    v = kimi["versus_public_kimi_run"]
    hours = kimi["gpu_hours"]
    assert v["gpu_hours"] == pytest.approx(hours["total"], abs=0.1)  # kimi is planned at 6B tokens
    assert v["times"] == pytest.approx(hours["total"] / PUBLIC_KIMI_RUN["gpu_hours"], abs=0.01)
    assert [f["factor"] for f in v["factors"]] == [5.0, round(MEASURED["packed_forward_slowdown"], 2)]
    without = hours["verifier"] / 5 / round(MEASURED["packed_forward_slowdown"], 2) + hours["draft"] / 5
    assert v["gpu_hours_without"] == pytest.approx(without, abs=0.1)
    assert MEASURED["packed_forward_slowdown"] > 1  # measured (docs/BENCHMARKS.md), no longer a placeholder
    _print_table(kimi)
    out = capsys.readouterr().out
    assert "about 1,500 H200-hours for 6B tokens" in out and "Marlin MoE" in out and "device_map" in out


def test_offline_when_the_features_fit_and_a_serving_engine_when_the_verifier_does_not():
    small = plan(str(KIMI), tokens=10_000_000, gpus=8, gpu_memory=141, disk=1000, json_out=True)
    assert small["mode"] == "offline" and small["feature_bytes"]["fp8"] == 10_000_000 * 28_672 <= 1e12
    assert small["feature_dtype"] == "bf16"  # 0.57 TB in bf16 fits the 1 TB disk
    extract_tps = min(
        MEASURED["verifier_flop_per_s"]
        / (2 * ACTIVE)
        / MEASURED["packed_forward_slowdown"]
        * MEASURED["extract_fraction"],
        MEASURED["disk_bytes_per_s"] / 57_344,
    )  # the slower of the two
    train_tps = MEASURED["draft_tokens_per_s"] * 8 * MEASURED["ddp_efficiency"]  # DDP over the eight GPUs
    assert small["gpu_hours"]["verifier"] == pytest.approx(5 * 1e7 / extract_tps / 3600, abs=0.1)
    assert small["gpu_hours"]["draft"] == pytest.approx(8 * 1e7 / train_tps / 3600, abs=0.1)
    four = plan(str(KIMI), tokens=10_000_000, gpus=4, gpu_memory=141, disk=1000, json_out=True)
    assert not four["verifier_fits"] and four["split_bytes"] is None and four["mode"] == "offline"
    assert "needs 5 GPUs" in four["why"] and "vLLM or SGLang" in four["why"]


def test_draft_rate_goes_through_both_measured_sizes():
    assert draft_tokens_per_s(7168) == pytest.approx(MEASURED["draft_tokens_per_s"])
    assert draft_tokens_per_s(4096) == pytest.approx(MEASURED["draft_tokens_per_s_4096"])


def test_matching_agrees_with_compressed_tensors():
    """plan's copy of compressed-tensors' target/ignore rules gives the library's answers on Kimi's patterns."""
    from compressed_tensors.utils.match import is_match

    ignore = json.loads((KIMI / "config.json").read_text())["text_config"]["quantization_config"]["ignore"]
    linear, norm = torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)
    names = ["lm_head", "model.layers.3.self_attn.q_a_proj", "model.layers.3.mlp.shared_experts.up_proj",
             "model.layers.0.mlp.down_proj", "model.layers.3.mlp.experts.7.gate_proj", "model.layers.3.mlp.gate",
             "model.layers.60.mlp.experts.383.down_proj"]  # fmt: skip
    for name in names:
        for module in (linear, norm):
            cls = type(module).__name__
            ours = _matches(name, cls, ["Linear"]) and not _matches(name, cls, ignore)
            assert ours == is_match(name, module, ["Linear"], ignore), name


def test_safetensors_headers_give_what_the_config_gives(tmp_path):
    """With weights present the packed size comes from the shard headers; on a bf16 int4 Kimi-like checkpoint
    it equals the count from the config, and the wrapper's vision tower is left out."""
    t = tiny.kimi_like(tmp_path / "fp32", int4=True)
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(t.path.glob("*.safetensors")):
        weights.update(load_file(f))
    text = {k.removeprefix("language_model."): v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in weights.items() if k.startswith("language_model.")}  # fmt: skip
    cfg = json.loads((t.path / "config.json").read_text())["text_config"]
    tiny.write_kimi_wrapper(tmp_path / "bf16", text, cfg)
    from_headers = verifier_memory(tmp_path / "bf16")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    from_config = verifier_memory(tmp_path / "config_only")
    assert from_headers["source"] == "safetensors headers" and from_config["source"] == "config"
    assert from_headers["packed_bytes"] == from_config["packed_bytes"]
    dense = sum(p.numel() for p in t.reference().parameters()) + 7 * 4  # + e_score_correction_bias, a stored buffer
    assert from_headers["bf16_bytes"] == from_config["bf16_bytes"] == 2 * dense


def test_cli_json_is_one_object_and_bad_input_one_error_line(capsys):
    assert cli_main(["plan", str(KIMI), "--tokens", "1000000", "--gpus", "8", "--gpu-memory", "141", "--disk", "100",
                     "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    for key in ("verifier_bytes_packed", "verifier_bytes_bf16", "feature_bytes_per_token", "gpus_needed", "mode"):
        assert key in out
    assert out["mode"] == "offline"
    assert cli_main(["plan", str(KIMI), "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err
