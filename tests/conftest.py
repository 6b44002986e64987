from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py

import tiny  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here or in CI: a test that reaches for it fails fast
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core: each worker computes on one thread, so two workers
    # share the two cores instead of four threads fighting over them.
    import torch

    torch.set_num_threads(1)


#: speculators 0.9.0 and the few packages it needs, installed by `make setup` beside our torch (never into our
#: site-packages: it pins transformers); tests run it in a subprocess with this dir on PYTHONPATH.
SPECULATORS_DIR = Path(os.environ.get("EYAS_SPECULATORS_DIR") or Path(sys.prefix) / "speculators-0.9.0")


@pytest.fixture
def one_thread():
    """One intra-op thread for a test: tiny models run fastest that way on the shared 2-core machines, and runs
    that are compared bit for bit (extract, train, eval) compute the same in every process. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def speculators_dir() -> Path:
    if not (SPECULATORS_DIR / "speculators").is_dir():
        pytest.skip(f"speculators 0.9.0 is not installed in {SPECULATORS_DIR} (`make setup` installs it there)")
    return SPECULATORS_DIR


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def make_tiny(tiny_dir):
    """``make_tiny(name)`` builds (once per session) the tiny verifier ``name`` from ``tiny.BUILDERS``."""
    cache: dict[str, tiny.Tiny] = {}

    def get(name: str) -> tiny.Tiny:
        if name not in cache:
            cache[name] = tiny.BUILDERS[name](tiny_dir / name)
        return cache[name]

    yield get
    for t in cache.values():  # remote code must never have been imported, by any test
        assert not (t.path / tiny.REMOTE_SENTINEL).exists(), f"checkpoint code in {t.path} was imported"


@pytest.fixture(scope="session")
def made(make_tiny, tmp_path_factory):
    """Every stage's real output on the tiny Llama, each made on first use (``tests/stage_outputs.py``); tests
    damage copies, never these."""
    from stage_outputs import Outputs

    return Outputs(tmp_path_factory.mktemp("made"), make_tiny("llama").path)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from eyas.verifier.locate import demo_verifier_path

    return demo_verifier_path()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """SmolLM2-135M-Instruct dequantized to fp32 by transformers itself (loaded once: ~20 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
