"""Throughput of `eyas prepare` on the full ShareGPT release with SmolLM2's tokenizer and template.

Runs the real stage twice, with one worker process and with every core, and prints conversations/s and
tokens/s of the tokenize-and-mask phase (from the stage's manifest: parsing the 125 MB file and loading
the tokenizer are outside it), plus the wall and CPU seconds of the whole call and the load average (on a
shared machine, other processes take cores).

    .venv/bin/python bench/prepare_sharegpt.py [--out runs/bench-prepare] [--procs 1,2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import time

from eyas.stages.prepare import prepare


def _cpu_s() -> float:
    """CPU seconds of this process and its finished workers: on a shared machine the honest cost."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench-prepare")
    ap.add_argument("--procs", default=f"1,{len(os.sched_getaffinity(0))}")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    args = ap.parse_args()
    results = []
    for n in sorted({int(x) for x in args.procs.split(",")}):
        out = f"{args.out}/procs{n}"
        t0 = time.perf_counter()
        cpu0 = _cpu_s()
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON result
            m = prepare(verifier="smollm2", data="sharegpt", out=out, max_seq_len=args.max_seq_len, num_proc=n)
        wall = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        t = m["timing"]
        results.append({
            "num_proc": n, "conversations": m["outputs"]["rows_sampled"], "rows": m["outputs"]["rows"],
            "tokens": m["outputs"]["tokens"], "tokenize_s": t["tokenize_s"],
            "conversations_per_s": t["conversations_per_s"],
            "tokens_per_s": round(m["outputs"]["tokens"] / t["tokenize_s"]), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "conversations_per_cpu_s": round(m["outputs"]["rows_sampled"] / cpu, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        })  # fmt: skip
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores", "results": results}, indent=2))


if __name__ == "__main__":
    main()
