"""The CLI is built from the stage configs' fields; errors are one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

from eyas.cli import main


def test_inspect_json(make_tiny, capsys):
    t = make_tiny("kimi_like")
    assert main(["inspect", str(t.path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text_model_type"] == "deepseek_v3" and out["lm_head_key"] == "language_model.lm_head.weight"
    assert out["runnable"] is True


def test_inspect_and_plan_take_verifier_as_every_stage_does(make_tiny, capsys):
    """`--verifier` as extract, train and regenerate take it; the positional form stays."""
    t = make_tiny("kimi_like")
    assert main(["inspect", "--verifier", str(t.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text_model_type"] == "deepseek_v3"
    assert main(["plan", "--verifier", str(t.path), "--tokens", "1000", "--disk", "1", "--json"]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    assert main(["plan", str(t.path), "--tokens", "1000", "--disk", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verifier_bytes_bf16"] == by_flag["verifier_bytes_bf16"] > 0


def test_inspect_table(make_tiny, capsys):
    assert main(["inspect", str(make_tiny("llama_tied").path)]) == 0
    out = capsys.readouterr().out
    assert "tied to the embedding" in out and "aux layer ids" in out and "runnable           yes" in out


def test_error_is_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eyas inspect: error: verifier not found") and "Traceback" not in err


def test_console_script_smollm2():
    r = subprocess.run([sys.executable, "-m", "eyas.cli", "inspect", "smollm2", "--json"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["num_hidden_layers"], out["hidden_size"], out["vocab_size"]) == (30, 576, 49152)
    assert out["tied_embeddings"] and r.stderr == ""
