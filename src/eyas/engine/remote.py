"""Answers from an OpenAI-compatible chat-completions server (vLLM, SGLang, ``transformers serve``): the
``--server`` side of ``eyas regenerate``, for a verifier too large to run here.

Built on the ``openai`` package. Its client already does what a long run against a busy server needs, so eyas
uses it as is: each request has a timeout, and a connection error, a timeout, or a 408, 409, 429 or 5xx answer
is retried with exponential backoff (0.5 s doubling up to 8 s, less up to a quarter of jitter, or the server's
``Retry-After``). eyas adds what it does not: a bound on the requests in flight, the key read from the
environment variable the user names, context-too-long answers counted instead of fatal, and the reasoning that
vLLM's and SGLang's reasoning parsers return beside the answer, kept as ``reasoning_content`` so that
``eyas prepare`` renders it where the verifier's chat template puts it (Qwen3's ``<think>`` block).

The key, and the password of a ``http://user:password@host/v1`` URL, go only into the request's
``Authorization`` header: never into a manifest, a message or a log line (an error message is scrubbed of them).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from eyas.data.datasets import REASONING_KEYS
from eyas.core.errors import EyasError

#: Retries of one request before it is given up. The openai client's backoff (0.5, 1, 2, 4, 8, 8 s, less
#: jitter) waits about 20 s in all: enough for a restarting server or a burst of 429s, short enough to say
#: soon that a server is down.
RETRIES = 6

#: Seconds the first request (``/models``, which a serving engine answers at once) may take. A server that
#: accepts connections and never answers is named after ``(RETRIES + 1) * PROBE_TIMEOUT`` (about 2.5 minutes),
#: not after the long timeout an answer of ``max_new_tokens`` may need (``--server-timeout``, 70 minutes in all).
PROBE_TIMEOUT = 20.0

#: Words of a 400 answer that mean "the conversation no longer fits the model's context": vLLM ("This model's
#: maximum context length is ...", "... is too long and exceeds limit of ..."), SGLang ("... exceeds the model's
#: maximum context length ...", "... longer than the model's context length ...") and OpenAI's own wording.
_TOO_LONG = ("context length", "context window", "too long")


@dataclass
class Answer:
    """One generated turn: its text (None when the conversation no longer fits the verifier's context), whether
    the verifier ended it itself (else it was cut at ``max_new_tokens``), how many tokens it took, the
    reasoning a server's reasoning parser split off the text (None when there is none), and the text's token
    ids where the engine that wrote it has them (eyas' own; a server returns text only)."""

    text: str | None
    finished: bool
    tokens: int
    reasoning: str | None = None
    ids: list[int] | None = None


class Server:
    """Answers from an OpenAI-compatible chat-completions endpoint serving the verifier.

    ``concurrency`` requests run at once (one thread each: the openai client is thread-safe, and a server
    batches what is in flight); each waits at most ``timeout`` seconds for its answer and is retried
    ``retries`` times. The API key is read from the environment variable ``api_key_env``; without one, a
    ``user:password@`` in ``url`` is sent as HTTP basic authentication.
    """

    def __init__(self, url: str, model: str | None, *, max_new_tokens: int, temperature: float, seed: int,
                 concurrency: int, api_key_env: str, timeout: float = 600.0,
                 retries: int = RETRIES) -> None:  # fmt: skip
        import base64

        import openai

        self.url = without_credentials(url).rstrip("/")  # what messages may show
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.concurrency, self.timeout, self.retries, self.api_key_env = concurrency, timeout, retries, api_key_env
        key = os.environ.get(api_key_env) or None
        headers = {}
        u = urlsplit(url)
        self._secrets = [s for s in (key, u.password and unquote(u.password)) if s]
        if key is None and u.username:  # the client would send "Bearer <key>"; basic authentication replaces it
            pair = base64.b64encode(f"{unquote(u.username)}:{unquote(u.password or '')}".encode()).decode()
            headers["Authorization"] = f"Basic {pair}"
            self._secrets.append(pair)
        # a server started without a key ignores the header; the client refuses to start without one
        self.client = openai.OpenAI(base_url=self.url, api_key=key or "no-key", timeout=timeout,
                                    max_retries=retries, default_headers=headers)  # fmt: skip
        self.model = self._first_model(model)

    def answer(self, conversations: list[list[dict[str, Any]]]) -> list[Answer]:
        """One answer per conversation, in order, ``concurrency`` requests at a time."""
        if not conversations:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(self.complete, conversations))

    def close(self) -> None:
        self.client.close()

    def _first_model(self, model: str | None) -> str:
        """``model``, or the first model the server lists; either way ``/models`` is asked first, with a short
        timeout (:data:`PROBE_TIMEOUT`), so that a server that never answers is named within minutes."""
        import sys

        import openai

        probe_s = min(PROBE_TIMEOUT, self.timeout)
        print(f"regenerate: asking {self.url}/models (up to {probe_s:g} s a try, {self.retries + 1} tries)",
              file=sys.stderr, flush=True)  # fmt: skip
        try:
            page = self.client.with_options(timeout=probe_s).models.list()
        except openai.APIStatusError as e:
            # the server answered, so it is alive, which is what the probe asks; without /models, or with one that
            # fails (`transformers serve` 5.17 answers 500 with no hub to list), a named model is all it needs
            if model:
                return model
            raise self._error("/models", e) from None
        except openai.APITimeoutError as e:
            raise self._error("/models", e, timeout=probe_s) from None
        except openai.APIError as e:
            raise self._error("/models", e) from None
        except (AttributeError, TypeError, ValueError) as e:  # the client choking on a body that is not JSON
            raise EyasError(self._scrub(f"{self.url}/models answered something that is not an OpenAI model list "
                                        f"(not JSON?): {e}"[:400])) from None  # fmt: skip
        listed = getattr(page, "data", None)
        if not isinstance(listed, list) or not all(isinstance(getattr(m, "id", None), str) for m in listed):
            raise EyasError(self._scrub(f"{self.url}/models answered something that is not an OpenAI model list "
                                        f"(not JSON?): {str(page)[:200]!r}"))  # fmt: skip
        if model:
            return model
        if not listed:
            raise EyasError(f"{self.url}/models lists no model: name the served model with --server-model")
        return listed[0].id

    def complete(self, messages: list[dict[str, Any]]) -> Answer:
        """One chat completion (retried by the client as the module docstring says); a sampled answer is
        seeded on the server (``seed``)."""
        import openai

        seeded = {"seed": self.seed} if self.temperature > 0 else {}
        try:
            got = self.client.chat.completions.create(model=self.model, messages=messages,
                                                      max_tokens=self.max_new_tokens, temperature=self.temperature,
                                                      **seeded)  # fmt: skip
        except openai.BadRequestError as e:
            if any(w in _message(e).lower() for w in _TOO_LONG):
                return Answer(None, False, 0)
            raise self._error("/chat/completions", e) from None
        except openai.APIError as e:
            raise self._error("/chat/completions", e) from None
        except (AttributeError, TypeError, ValueError) as e:  # the client choking on a body that is not JSON
            got = e
        if not isinstance(getattr(got, "choices", None), list):
            raise EyasError(self._scrub(f"{self.url}/chat/completions answered something that is not an OpenAI "
                                        f"chat completion (not JSON?): {str(got)[:200]!r}"))  # fmt: skip
        if not got.choices or got.choices[0].message is None:
            raise EyasError(self._scrub(f"{self.url}/chat/completions answered no choices[0].message: {got}"[:400]))
        choice = got.choices[0]
        if choice.finish_reason not in ("stop", "length"):  # "abort", "content_filter", "tool_calls": not an answer
            raise EyasError(self._scrub(f"{self.url}/chat/completions ended an answer with finish_reason "
                                        f"{choice.finish_reason!r} (not 'stop' or 'length'): {got}"[:400]))  # fmt: skip
        tokens = got.usage.completion_tokens if got.usage is not None else 0
        return Answer((choice.message.content or "").strip(), choice.finish_reason == "stop", tokens,
                      reasoning_of(choice.message))  # fmt: skip

    def _error(self, path: str, e: Exception, *, timeout: float | None = None) -> EyasError:
        """One clear line for a request the client gave up on (after its retries where they apply)."""
        import openai

        where = f"{self.url}{path}"
        if isinstance(e, openai.APITimeoutError) and timeout is not None:
            text = (f"{where} gave no answer within {timeout:g} s in {self.retries + 1} tries: the server accepts "
                    "connections but does not answer; is it still loading the model, or stuck?")  # fmt: skip
        elif isinstance(e, openai.APITimeoutError):
            text = (f"{where} gave no answer within {self.timeout:g} s in {self.retries + 1} tries: raise "
                    "--server-timeout, or lower --concurrency (the requests in flight)")  # fmt: skip
        elif isinstance(e, openai.APIConnectionError):
            text = (f"the server {self.url} did not answer {path} ({e.__cause__ or e}), {self.retries} retries "
                    "later; is it running, and is --server its OpenAI base URL (http://host:port/v1)?")  # fmt: skip
        elif isinstance(e, (openai.AuthenticationError, openai.PermissionDeniedError)):
            state = "set" if os.environ.get(self.api_key_env) else "unset"
            text = (f"{where} refused the request ({e.status_code}: {_message(e)[:200]}); put the server's "
                    f"API key in the environment variable {self.api_key_env} ({state} now; --api-key-env names "
                    "it)")  # fmt: skip
        elif isinstance(e, openai.NotFoundError):
            model = getattr(self, "model", None)  # unset while the first model is being asked for
            text = (f"{where} answered 404 ({_message(e)[:200]}): is --server the OpenAI base URL (ending in "
                    f"/v1), and --server-model ({model or 'not given'}) a model it serves?")  # fmt: skip
        elif isinstance(e, openai.APIStatusError):
            again = f", {self.retries} retries later" if e.status_code >= 500 or e.status_code == 429 else ""
            text = f"{where} answered {e.status_code}{again}: {_message(e)[:300]}"
        else:  # an answer that is not the OpenAI schema
            text = f"{where} answered something that is not an OpenAI chat completion: {e}"[:400]
        return EyasError(self._scrub(text))

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text


def reasoning_of(message: Any) -> str | None:
    """The reasoning a server returned beside an answer's text, or None: vLLM's and SGLang's reasoning parsers
    and ``transformers serve`` put it in ``reasoning_content``, newer vLLM and Ollama in ``reasoning`` (the
    keys a conversation file may use too); none is in the OpenAI schema, so the client keeps them as extra
    fields."""
    extra = getattr(message, "model_extra", None) or {}
    for field in REASONING_KEYS:
        value = extra.get(field, getattr(message, field, None))
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` removed (what a manifest or a message may show)."""
    u = urlsplit(url)
    host = u.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if u.port:
        netloc += f":{u.port}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def _message(e: Any) -> str:
    """The server's own words in an error answer (OpenAI's ``{"error": {"message"}}``, vLLM's and SGLang's
    ``{"message"}`` or ``{"detail"}``), else the client's summary."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            inner = inner.get("message") or inner.get("detail") or inner
        return str(inner)
    return str(body) if body is not None else str(e)
