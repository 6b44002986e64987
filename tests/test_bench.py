"""The benchmark scripts still run (CPU smoke mode): they drive eyas' internals directly, so a refactor that
breaks them should fail here, not on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


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
        assert "torch.profiler" in r.stderr
        lines = r.stderr.splitlines()
        host = json.loads(lines[lines.index("=== what the host dispatches") + 1])
        assert host["steps"] == 2 and host["eager_ops_per_step"] > 0 and host["host_ms_per_step"] > 0
