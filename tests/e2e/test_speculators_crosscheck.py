"""speculators 0.9.0 as the judge: its own classes load eyas checkpoints and compute the same draft logits,
and checkpoints its own code saves load in eyas with the same logits (fp32, CPU, within 1e-4), for the plain
EAGLE-3 layout and every variant speculators has (its layout flags, fc_norm, a Qwen3 layer, two layers).

speculators runs in a subprocess (tests/speculators_worker.py) from the directory `make setup` installs it
into, beside our CPU torch, with the transformers it pins; nothing of it enters this process. The verifier
is a tiny local checkpoint (speculators reads the verifier's config and embedding to load any draft).

Pairing (speculators models/eagle3/data.py shift_batch, core.py forward): its TTT step 0 at index t reads
token x_{t+1} and the aux states of t; step 1 reads x_{t+2} (teacher forcing) and its own step-0 output.
eyas's ``Eagle3Draft.ttt`` takes the unshifted sequence and reads the same tokens at the same index, so
index t < T-1 compares one to one. Position ids differ by a constant: speculators starts at 1, eyas at 0
(as vLLM's proposer does); RoPE only sees differences, and the test checks both that fact and that the
logits do depend on relative positions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from eyas.draft.checkpoint import load_draft
from eyas.core.errors import EyasError
from eyas.stages.export import export
from drafts import LAYOUTS, random_draft, save

from conftest import SPECULATORS_DIR

WORKER = Path(__file__).parents[1] / "speculators_worker.py"
ATOL = 1e-4
T = 24

pytestmark = pytest.mark.skipif(
    not (SPECULATORS_DIR / "speculators").is_dir(),
    reason=f"speculators 0.9.0 is not installed in {SPECULATORS_DIR} (`make setup` installs it there)",
)


def run_speculators(tmp_path: Path, jobs: list[dict]) -> list[dict]:
    """Run jobs in speculators' own process; one result dict per job."""
    f = tmp_path / "jobs.json"
    f.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(SPECULATORS_DIR), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run([sys.executable, str(WORKER), str(f)], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-6000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs), r.stdout
    return results


def write_inputs(path: Path, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny.VOCAB, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * tiny.HIDDEN, generator=g)  # [B, T, 3H]: the three aux states, ascending layers
    save_file({"input_ids": ids, "aux_hidden": aux}, str(path))
    return ids, aux


def eyas_logits(draft, verifier, ids, aux, *, position_ids=None) -> list[torch.Tensor]:
    """eyas's draft logits of TTT steps 0 and 1 at indices t < T-1 (speculators' shifted sequence)."""
    m = load_draft(draft, verifier=verifier, attn_implementation="eager")
    with torch.no_grad():
        return [m.compute_logits(h)[:, :-1] for h in m.ttt(ids, aux, ttt_steps=2, position_ids=position_ids)]


def assert_same_logits(spec_file: Path, ours: list[torch.Tensor]) -> None:
    spec = load_file(str(spec_file))
    assert len(spec) == len(ours) == 2
    for k, mine in enumerate(ours):
        theirs = spec[f"step{k}"]
        assert theirs.shape == mine.shape, (k, theirs.shape, mine.shape)
        diff = (theirs - mine).abs().max().item()
        assert diff <= ATOL, f"TTT step {k}: speculators and eyas logits differ by {diff:.3g}"
        assert theirs.abs().max().item() > 0.1  # not vacuous: real logits, not zeros


@pytest.mark.parametrize(
    ("layout", "include_embeddings"),
    [("eagle3", False), ("speculators_default", True), ("eagle31_qwen3_two_layers", False)],
)
def test_speculators_loads_eyas_checkpoint(make_tiny, tmp_path, layout, include_embeddings):
    v = make_tiny("llama").path
    m = random_draft(v, **LAYOUTS[layout])
    save(m, tmp_path / "trained", v)
    export(draft=str(tmp_path / "trained"), out=str(tmp_path / "vllm"), verifier=str(v),
           include_embeddings=include_embeddings)  # fmt: skip
    ids, aux = write_inputs(tmp_path / "inputs.safetensors")
    (info,) = run_speculators(tmp_path, [{"cmd": "logits", "draft": str(tmp_path / "vllm"), "steps": 2,
                                          "inputs": str(tmp_path / "inputs.safetensors"),
                                          "out": str(tmp_path / "spec_logits.safetensors")}])  # fmt: skip
    assert info["class"] == "Eagle3DraftModel" and info["attn"] == "eager" and info["speculators"] == "0.9.0"
    flags = {k: v for k, v in LAYOUTS[layout].items() if k in info["layout"]}
    assert info["layout"] == {**{k: False for k in info["layout"]}, **flags}
    assert (info["arch"], info["num_layers"]) == (m.config.draft_arch, m.config.num_hidden_layers)
    kind = "Qwen3" if m.config.draft_arch == "qwen3" else "Llama"  # speculators' first layer, then plain ones
    assert info["layer_classes"] == [f"{kind}DecoderEagle3FirstLayer"] + [f"{kind}DecoderLayer"] * (
        info["num_layers"] - 1
    )
    assert info["aux_layer_ids"] == m.config.aux_layer_ids and info["had_embed"] == include_embeddings
    assert (info["draft_vocab_size"], info["vocab_size"]) == (m.config.draft_vocab_size, tiny.VOCAB)
    assert info["speculative_tokens"] == 3 and info["verifier"] == str(v)
    assert_same_logits(tmp_path / "spec_logits.safetensors", eyas_logits(tmp_path / "vllm", v, ids, aux))
    # speculators numbers positions from 1, eyas from 0: RoPE is relative, so a constant shift changes nothing...
    shifted = eyas_logits(tmp_path / "vllm", v, ids, aux, position_ids=torch.arange(1, T + 1)[None])
    assert_same_logits(tmp_path / "spec_logits.safetensors", shifted)
    # ...while relative positions do matter, so the agreement above is not position-blindness
    stretched = eyas_logits(tmp_path / "vllm", v, ids, aux, position_ids=2 * torch.arange(T)[None])
    assert (stretched[0] - shifted[0]).abs().max().item() > 100 * ATOL


def test_eyas_imports_speculators_checkpoints(make_tiny, tmp_path):
    v = make_tiny("llama").path
    ids, aux = write_inputs(tmp_path / "inputs.safetensors", seed=1)
    make = {"cmd": "make", "verifier": str(v), "draft_vocab_size": 80, "seed": 3}
    default = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}  # speculators' CLI
    eagle31 = {"norm_before_residual": False, "fc_norm": True, "norm_output": True}  # its --fc-norm --norm-output
    jobs = [
        {**make, "out": str(tmp_path / "spec"), "layout": default, "sliding_window": None},
        {**make, "out": str(tmp_path / "spec_swa"), "layout": default, "sliding_window": 2048},
        {**make, "out": str(tmp_path / "spec31"), "layout": eagle31, "sliding_window": None, "arch": "qwen3",
         "num_layers": 2},
        {"cmd": "logits", "draft": str(tmp_path / "spec"), "inputs": str(tmp_path / "inputs.safetensors"),
         "out": str(tmp_path / "spec_logits.safetensors"), "steps": 2},
        {"cmd": "logits", "draft": str(tmp_path / "spec31"), "inputs": str(tmp_path / "inputs.safetensors"),
         "out": str(tmp_path / "spec31_logits.safetensors"), "steps": 2},
    ]  # fmt: skip
    *_, info, info31 = run_speculators(tmp_path, jobs)
    assert info["had_embed"] and info["layout"]["norm_before_fc"] and info["sliding_window_layers"] == []
    # speculators' own save, read as is (its embedding included) and after `eyas export --from speculators`
    assert_same_logits(tmp_path / "spec_logits.safetensors", eyas_logits(tmp_path / "spec", None, ids, aux))
    export(draft=str(tmp_path / "spec"), out=str(tmp_path / "ours"), from_format="speculators", verifier=str(v))
    assert_same_logits(tmp_path / "spec_logits.safetensors", eyas_logits(tmp_path / "ours", v, ids, aux))
    conf = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert {k: conf[k] for k in default} == default and conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "ours" / "model.safetensors"))
    # EAGLE-3.1's norms on a two-layer Qwen3 draft, as speculators saves it, and after an export
    assert (info31["arch"], info31["num_layers"], info31["layout"]["fc_norm"]) == ("qwen3", 2, True)
    assert_same_logits(tmp_path / "spec31_logits.safetensors", eyas_logits(tmp_path / "spec31", None, ids, aux))
    export(draft=str(tmp_path / "spec31"), out=str(tmp_path / "ours31"), from_format="speculators", verifier=str(v))
    assert_same_logits(tmp_path / "spec31_logits.safetensors", eyas_logits(tmp_path / "ours31", v, ids, aux))
    # what eyas cannot run is refused, naming the setting
    with pytest.raises(EyasError, match=r"spec_swa/config.json: sliding-window draft layers are not supported"):
        export(draft=str(tmp_path / "spec_swa"), out=str(tmp_path / "x"), from_format="speculators")


def test_speculators_converter_reads_eyas_eagle_export(make_tiny, tmp_path):
    """speculators' own EAGLE-3 converter (convert/eagle/eagle3_converter.py), an independent reader of the
    EAGLE layout, turns our SGLang export into a draft whose logits are ours. (Its legacy model has no
    input_norm and drops that tensor with a warning, so norm_before_fc drafts cannot go through it.)"""
    v = make_tiny("llama").path
    m = random_draft(v, norm_output=True)
    save(m, tmp_path / "trained", v)
    export(draft=str(tmp_path / "trained"), out=str(tmp_path / "sgl"), format="eagle")
    ids, aux = write_inputs(tmp_path / "inputs.safetensors", seed=2)
    jobs = [
        {"cmd": "convert", "eagle": str(tmp_path / "sgl"), "verifier": str(v), "out": str(tmp_path / "conv"),
         "aux_layer_ids": m.config.aux_layer_ids},
        {"cmd": "logits", "draft": str(tmp_path / "conv"), "inputs": str(tmp_path / "inputs.safetensors"),
         "out": str(tmp_path / "spec_logits.safetensors"), "steps": 2},
    ]  # fmt: skip
    _, info = run_speculators(tmp_path, jobs)
    assert info["layout"] == {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                              "norm_output": True}  # fmt: skip
    assert_same_logits(tmp_path / "spec_logits.safetensors", eyas_logits(tmp_path / "trained", v, ids, aux))
