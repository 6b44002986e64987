"""`eyas regenerate --server`: the openai-based client against a real OpenAI-compatible server on loopback
(`transformers serve` running tiny verifiers), and its retries, timeouts and error answers against a minimal
server started here for fault injection only (a server that is down, answers 500, 429 or 401, or is slow).

The real server decodes with ``generate``; the tiny Llama's head is edited so that ``<|im_end|>`` wins where
one of its greedy tokens did (some answers end themselves, so later turns follow; others are cut), and the
tiny Qwen3 "thinks": with every layer's output projections zeroed, its next token depends on the current one
only, and its head spells ``<think>Rayleigh</think>Blue.<|im_end|>`` after the generation prompt, which
``transformers serve`` splits into ``reasoning_content`` and ``content``.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from eyas.core.errors import EyasError
from eyas.stages.regenerate import CONVERSATIONS, regenerate
from eyas.engine.remote import Server, reasoning_of, without_credentials

pytestmark = pytest.mark.usefixtures("one_thread")

TURNS = [
    ["Hello there", "Tell me more.", "Why is that?"],
    ["Describe a quiet harbour town at dawn, its boats and its gulls", "Now in one line"],
    ["Hey"],
    ["Name three prime numbers and add them up", "Thank you", "Goodbye"],
]
NEW = 10
KEY = "sekret-7f3a"  # an API key that must never be written
PASSWORD = "pw-9c1d"  # a URL's password, the same

REASONING, CONTENT = "Rayleigh", "Blue."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_prompts(path: Path, turns: list[list[str]]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "turns": t}) + "\n" for i, t in enumerate(turns)))
    return path


def _read(out: Path) -> dict[str, list[dict[str, str]]]:
    return {r["id"]: r["messages"] for r in map(json.loads, (out / CONVERSATIONS).read_text().splitlines())}


def _llama_that_ends_turns(base: Path, dest: Path) -> Path:
    """A copy of the tiny Llama whose ``<|im_end|>`` head row is 1.2x that of the fourth token it answers
    "Hello there" with: wherever that token was the greedy choice with a positive logit, the turn now ends."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(base, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                     tokenize=False)  # fmt: skip
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        fourth = int(model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)[0, -1])
    weights = load_file(dest / "model.safetensors")
    head = weights["lm_head.weight"]  # [V, H]
    head[tok.convert_tokens_to_ids("<|im_end|>")] = 1.2 * head[fourth]
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _qwen3_that_thinks(dest: Path) -> Path:
    """A four-layer Qwen3 (the fewest eyas takes) with the real Qwen3 chat template whose greedy answer to any prompt is
    ``<think>Rayleigh</think>Blue.<|im_end|>``. Its attention and MLP outputs are zeroed, so the last hidden
    state is the current token's embedding, normed; the head row of each next token of the chain is (10x) that
    normed embedding, so it wins by far (|x|^2 = 64 against random cross terms)."""
    import chat_templates as C
    import tiny
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = C.qwen3_tokenizer()
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=eot, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False)
    start = tok.encode(prompt, add_special_tokens=False)[-1]  # the generation prompt's last token ("\n")
    chain = [start, tok.convert_tokens_to_ids("<think>"), *tok.encode(REASONING, add_special_tokens=False),
             tok.convert_tokens_to_ids("</think>"), *tok.encode(CONTENT, add_special_tokens=False), eot]  # fmt: skip
    assert len(set(chain)) == len(chain)  # a token met twice would loop
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        normed = model.model.norm(model.model.embed_tokens.weight)  # [V, H]: the last hidden state after each id
        model.lm_head.weight.zero_()
        for cur, nxt in zip(chain, chain[1:]):
            model.lm_head.weight[nxt] = 10 * normed[cur]
    model.generation_config.eos_token_id = eot
    model.generation_config.pad_token_id = 0
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"transformers serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"transformers serve did not come up in time:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(make_tiny, tmp_path_factory):
    """`transformers serve` on loopback, loading each model a request names (a local directory): the tiny Llama
    that ends turns and the tiny Qwen3 that thinks. Yields ``(url, {name: model dir})``."""
    root = tmp_path_factory.mktemp("served")
    models = {"llama": _llama_that_ends_turns(make_tiny("llama").path, root / "llama"),
              "qwen3": _qwen3_that_thinks(root / "qwen3")}  # fmt: skip
    port, log = _free_port(), root / "serve.log"
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, port, log)
        yield f"127.0.0.1:{port}", models
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_answers_through_transformers_serve_equal_local_greedy_decoding(served, tmp_path, monkeypatch, capsys,
                                                                        caplog):  # fmt: skip
    """Regenerated through a real OpenAI-compatible server, turn by turn, the conversations are those local
    greedy decoding of the same checkpoint writes; the API key and the URL's password reach no file, message or
    log line."""
    host, models = served
    path = models["llama"]
    src = _write_prompts(tmp_path / "prompts.jsonl", TURNS)
    local = regenerate(verifier=str(path), data=str(src), out=str(tmp_path / "local"), max_new_tokens=NEW,
                       batch_tokens=4096)  # fmt: skip
    monkeypatch.setenv("EYAS_TEST_KEY", KEY)
    caplog.set_level(logging.DEBUG)  # the openai client's and its HTTP library's own logging too
    capsys.readouterr()
    m = regenerate(verifier=str(path), data=str(src), out=str(tmp_path / "served"), max_new_tokens=NEW,
                   concurrency=3, server=f"http://user:{PASSWORD}@{host}/v1", server_model=str(path),
                   api_key_env="EYAS_TEST_KEY")  # fmt: skip
    got = _read(tmp_path / "served")
    assert got == _read(tmp_path / "local")
    answers = [sum(msg["role"] == "assistant" for msg in c) for c in got.values()]
    assert max(answers) >= 2 and min(answers) == 1  # later turns followed finished answers; cut ones ended
    assert m["outputs"] == local["outputs"] and 0 < m["outputs"]["cut_at_max_new_tokens"] < m["outputs"]["answers"]
    assert m["settings"]["server"] == {"url": f"http://{host}/v1", "model": str(path)}
    said = capsys.readouterr()
    texts = [(tmp_path / "served" / "manifest.json").read_text(), (tmp_path / "served" / CONVERSATIONS).read_text(),
             said.out, said.err, caplog.text]  # fmt: skip
    assert "chat/completions" in caplog.text  # the client's log was captured
    for text in texts:
        assert KEY not in text and PASSWORD not in text


def test_reasoning_lands_where_the_qwen3_template_renders_it(served, tmp_path):
    """The server's reasoning parser returns ``reasoning_content`` beside the answer; regenerate keeps it on the
    assistant message, and prepare renders it through Qwen3's template: dropped from the turn before the last
    user turn (as the template does), inside ``<think>`` in the last one, and trained on there."""
    import numpy as np
    from transformers import AutoTokenizer

    from eyas.stages.prepare import prepare
    from eyas.data.prepared import load_prepared

    host, models = served
    path = models["qwen3"]
    src = _write_prompts(tmp_path / "prompts.jsonl", [["Why is the sky blue?", "And the sea?"]])
    m = regenerate(verifier=str(path), data=str(src), out=str(tmp_path / "served"), max_new_tokens=16,
                   server=f"http://{host}/v1", server_model=str(path))  # fmt: skip
    assert m["outputs"]["answers"] == 2 and m["outputs"]["cut_at_max_new_tokens"] == 0
    (conv,) = _read(tmp_path / "served").values()
    said = [msg for msg in conv if msg["role"] == "assistant"]
    assert said == [{"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}] * 2

    prepare(verifier=str(path), data=str(tmp_path / "served"), out=str(tmp_path / "prep"), num_proc=1)
    (row,) = load_prepared(tmp_path / "prep")[0]
    tok = AutoTokenizer.from_pretrained(path)
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    runs = [tok.decode(ids[a:b].tolist()) for a, b in zip(np.where(edges == 1)[0], np.where(edges == -1)[0])]
    assert runs == [f"{CONTENT}<|im_end|>", f"<think>\n{REASONING}\n</think>\n\n{CONTENT}<|im_end|>"]


# --------------------------------------------------------------------------- fault injection


class FaultServer:
    """A minimal OpenAI-shaped server, for fault injection only (the normal path is tested against
    `transformers serve` above). Each chat request takes the next fault of ``script`` ("500", "429", "401",
    "too_long", "bad_request", "slow"), or answers ``echo: <last user turn>`` when none is left; ``seen``
    records each request's path and Authorization header."""

    def __init__(self, script: list[str] = (), *, port: int = 0, slow_s: float = 2.0) -> None:
        self.script, self.seen, self.slow_s = list(script), [], slow_s
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj: dict, headers: dict[str, str] = {}) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                outer.seen.append((self.path, self.headers.get("Authorization")))
                self._send(200, {"object": "list", "data": [{"id": "fault", "object": "model", "created": 0,
                                                              "owned_by": "test"}]})  # fmt: skip

            def do_POST(self):
                outer.seen.append((self.path, self.headers.get("Authorization")))
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fault = outer.script.pop(0) if outer.script else None
                if fault == "slow":
                    time.sleep(outer.slow_s)
                if fault == "500":
                    return self._send(500, {"error": {"message": "engine hiccup"}})
                if fault == "429":
                    return self._send(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
                if fault == "401":
                    return self._send(401, {"error": {"message": "bad key"}})
                if fault == "too_long":  # vLLM's words
                    words = "This model's maximum context length is 1024 tokens. However, you requested 1210."
                    return self._send(400, {"object": "error", "code": 400, "message": words})
                if fault == "bad_request":
                    return self._send(400, {"error": {"message": "temperature must be at most 2"}})
                last = [m["content"] for m in req["messages"] if m["role"] == "user"][-1]
                self._send(200, {"id": "c", "object": "chat.completion", "created": 0, "model": req["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": f"echo: {last}"}}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})  # fmt: skip

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def chats(self) -> int:
        return sum(path == "/v1/chat/completions" for path, _ in self.seen)


def _client(url: str, **kw) -> Server:
    return Server(url, kw.pop("model", None), max_new_tokens=8, temperature=0.0, seed=0,
                  concurrency=kw.pop("concurrency", 2), api_key_env="EYAS_TEST_KEY", **kw)  # fmt: skip


CONVS = [[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]]


def test_a_server_down_at_first_then_up_and_a_500_are_retried(monkeypatch):
    """The client waits for a server that comes up a second late, and retries a 500 and a 429; the key goes in
    every request's header."""
    monkeypatch.setenv("EYAS_TEST_KEY", KEY)
    port, box = _free_port(), {}
    timer = threading.Timer(1.0, lambda: box.setdefault("srv", FaultServer(["500", "429"], port=port)))
    timer.start()
    try:
        started = time.monotonic()
        client = _client(f"http://127.0.0.1:{port}/v1", concurrency=1)  # asks /models: refused, then retried
        assert client.model == "fault" and time.monotonic() - started > 0.9
        got = client.answer(CONVS)
    finally:
        timer.join()
        box["srv"].stop()
    assert [(a.text, a.finished, a.tokens, a.reasoning) for a in got] == [("echo: one", True, 3, None),
                                                                         ("echo: two", True, 3, None)]  # fmt: skip
    assert box["srv"].chats() == 4 and not box["srv"].script  # 500, 429, then both answered
    assert {auth for _, auth in box["srv"].seen} == {f"Bearer {KEY}"}


def test_a_slow_answer_is_retried_and_a_server_always_too_slow_is_an_error():
    srv = FaultServer(["slow"], slow_s=2.5)
    try:
        assert _client(srv.url, timeout=1.0, retries=1).answer(CONVS[:1])[0].text == "echo: one"
        srv.script = ["slow", "slow"]
        with pytest.raises(EyasError, match=r"/chat/completions gave no answer within 1 s in 2 tries: raise "
                                            r"--server-timeout"):  # fmt: skip
            _client(srv.url, timeout=1.0, retries=1).answer(CONVS[:1])
        assert srv.chats() == 4
    finally:
        srv.stop()


def test_a_server_that_never_answers_is_one_clear_error():
    with pytest.raises(EyasError, match=r"did not answer /models .*, 1 retries later; is it running, and is "
                                        r"--server its OpenAI base URL"):  # fmt: skip
        _client(f"http://127.0.0.1:{_free_port()}/v1", retries=1)


def test_a_body_that_is_not_json_is_one_clear_error():
    """A proxy's HTML page where the API should be: the openai client hands back a str, and eyas used to end in
    AttributeError inside it."""
    import socketserver

    class Html(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _html(self):
            body = b"<html>502 Bad Gateway</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if not box["models_json"]:
                return self._html()
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                           "owned_by": "t"}]}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = _html

    box = {"models_json": False}
    httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        with pytest.raises(EyasError, match=r"/models answered something that is not an OpenAI model list"):
            _client(url, retries=0)
        box["models_json"] = True
        with pytest.raises(EyasError, match=r"/chat/completions answered something that is not an OpenAI chat"):
            _client(url, retries=0).answer(CONVS[:1])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_accepts_and_never_answers_is_named_within_the_probe_timeout(monkeypatch, capsys):
    """It used to hold a run for (6 + 1) x 600 s at the default flags, silent; /models is now asked first with a
    short timeout, and the wait is announced."""
    import socket

    import eyas.engine.remote

    monkeypatch.setattr(eyas.engine.remote, "PROBE_TIMEOUT", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections (the kernel's backlog) and never answers
    try:
        started = time.monotonic()
        with pytest.raises(EyasError, match=r"/models gave no answer within 0.5 s in 2 tries: the server accepts "
                                            r"connections but does not answer"):  # fmt: skip
            _client(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", retries=1, model="m")
        assert time.monotonic() - started < 10
    finally:
        listener.close()
    assert "asking http://127.0.0.1" in capsys.readouterr().err


def test_error_answers_too_long_counted_others_named(monkeypatch):
    """A context-too-long 400 is an answer of None (regenerate counts it); any other 400 and a refused key are
    errors that say what to do, with the key scrubbed from them."""
    srv = FaultServer(["too_long"])
    try:
        assert [a.text for a in _client(srv.url, concurrency=1).answer(CONVS)] == [None, "echo: two"]
        srv.script = ["bad_request"]
        with pytest.raises(EyasError, match="/chat/completions answered 400: temperature must be at most 2"):
            _client(srv.url).answer(CONVS[:1])
        srv.script = ["401"]
        monkeypatch.delenv("EYAS_TEST_KEY", raising=False)
        with pytest.raises(EyasError, match=r"refused the request \(401: bad key\); put the server's API key in the "
                                            r"environment variable EYAS_TEST_KEY \(unset now"):  # fmt: skip
            _client(srv.url).answer(CONVS[:1])
    finally:
        srv.stop()


def test_url_credentials_are_sent_as_basic_auth_and_never_recorded(make_tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EYAS_TEST_KEY", raising=False)
    srv = FaultServer()
    src = _write_prompts(tmp_path / "prompts.jsonl", [["Hi", "Bye"]])
    host = srv.url.removeprefix("http://")
    try:
        m = regenerate(verifier=str(make_tiny("llama").path), data=str(src), out=str(tmp_path / "o"),
                       server=f"http://me:{PASSWORD}@{host}", api_key_env="EYAS_TEST_KEY")  # fmt: skip
    finally:
        srv.stop()
    assert _read(tmp_path / "o") == {"p0": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "echo: Hi"},
                                            {"role": "user", "content": "Bye"},
                                            {"role": "assistant", "content": "echo: Bye"}]}  # fmt: skip
    basic = "Basic " + base64.b64encode(f"me:{PASSWORD}".encode()).decode()
    assert {auth for _, auth in srv.seen} == {basic}
    assert m["settings"]["server"]["url"] == srv.url
    said = capsys.readouterr()
    for text in [(tmp_path / "o" / "manifest.json").read_text(), said.out, said.err]:
        assert PASSWORD not in text and basic.split()[1] not in text


def test_reasoning_is_read_from_either_field_name():
    """vLLM's and SGLang's reasoning parsers (and `transformers serve`) answer ``reasoning_content``; newer vLLM
    ``reasoning``: both come back as extra fields of the openai client's message."""
    from openai.types.chat import ChatCompletionMessage

    def msg(**extra):
        return ChatCompletionMessage.model_validate({"role": "assistant", "content": "A.", **extra})

    assert reasoning_of(msg(reasoning_content="\nBecause.\n")) == "Because."
    assert reasoning_of(msg(reasoning="Since.")) == "Since."
    assert reasoning_of(msg()) is None and reasoning_of(msg(reasoning_content="  ")) is None


def test_credentials_leave_the_url():
    assert without_credentials("http://u:p%40ss@[::1]:8000/v1") == "http://[::1]:8000/v1"
    assert without_credentials("https://user@host.example/v1") == "https://host.example/v1"


def test_bad_server_timeout_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(EyasError, match="--server-timeout must be above 0"):
        regenerate(verifier="no/such/dir", data=str(tmp_path / "x.jsonl"), out=str(tmp_path / "o"),
                   server="http://127.0.0.1:1/v1", server_timeout=0)  # fmt: skip
