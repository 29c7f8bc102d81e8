"""Requests to an OpenAI-compatible server through the ``openai`` package (``AsyncOpenAI``).

* chat (``/chat/completions``) or plain completion (``/completions``, base models) mode;
* bounded concurrency (a semaphore), a per-request timeout, and retries (tenacity) on timeouts,
  connection errors, 429 and 5xx: the server's ``Retry-After`` / ``retry-after-ms`` when it sends
  one, else exponential backoff with full jitter (other 4xx are not retried: a bad request stays bad);
* chat mode sends a JSON-schema ``response_format`` built from the answer model (structured
  outputs); a server that rejects it gets plain requests for the rest of the run (``auto``);
* a run budget (requests, tokens): once spent, further requests fail with reason ``budget`` and
  the stage finishes cleanly with what it has;
* every answer goes through ``RequestCache`` first: a cached answer costs no request and no budget;
* ``logprobs=N`` asks for the top N logprobs of the answer's first non-blank token (chat: ``logprobs`` +
  ``top_logprobs``; completion: ``logprobs: N``) and returns them with the text (cached with it).
* several endpoints (``base_urls``, or the launched llama.cpp servers' slots) share the requests:
  the least busy one gets the next, and one that fails rests while the others take its requests.

The API key is read from the environment variable the config names and handed to the client
object only; it is never logged or returned.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import openai
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from embed_core.synthesize.config import LLMServerConfig, SamplingConfig
from embed_core.synthesize.cache import RequestCache, request_key
from embed_core.synthesize.server import resolve_slots

log = logging.getLogger("embedpipe.synthesize")


class RequestFailed(Exception):
    """A request that did not produce an answer; ``reason`` is a short stable label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Answer:
    text: str
    cached: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    top_logprobs: dict[str, float] | None = None   # first non-blank answer token's, when asked for


def first_token_logprobs(choice: Any, chat: bool) -> dict[str, float] | None:
    """token -> logprob of the top candidates for the first answer token that is not blank (a model
    may open with a newline) of a response choice (chat: ``logprobs.content[i].top_logprobs``;
    completion: ``logprobs.top_logprobs[i]``), or None when the server sent none."""
    lp = getattr(choice, "logprobs", None)
    if lp is None:
        return None
    if chat:
        content = getattr(lp, "content", None) or []
        first = next((t for t in content if t.token.strip()), content[0] if content else None)
        if first is None:
            return None
        out = {t.token: float(t.logprob) for t in getattr(first, "top_logprobs", None) or []}
        return out or {first.token: float(first.logprob)}
    tops, tokens = getattr(lp, "top_logprobs", None) or [], getattr(lp, "tokens", None) or []
    at = next((i for i, t in enumerate(tokens) if t.strip() and i < len(tops)), 0)
    if len(tops) > at and isinstance(tops[at], dict) and tops[at]:
        return {str(k): float(v) for k, v in tops[at].items()}
    return None


@dataclass
class ClientStats:
    requests: int = 0             # HTTP requests sent (retries included)
    cache_hits: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: Counter = field(default_factory=Counter)   # per attempt, by reason (retried or not)
    budget_exhausted: bool = False
    endpoints: dict[str, dict[str, int]] = field(default_factory=dict)  # url -> answered / failed attempts

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "cache_hits": self.cache_hits, "retries": self.retries,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "tokens": self.prompt_tokens + self.completion_tokens, "errors": dict(self.errors),
                "budget_exhausted": self.budget_exhausted, "endpoints": self.endpoints}


@dataclass
class Endpoint:
    """One OpenAI-compatible server of the pool, with its health."""

    url: str
    client: openai.AsyncOpenAI
    in_flight: int = 0
    down_until: float = 0.0  # time.monotonic() before which it gets no requests (while another is up)


def _retryable(exc: Exception) -> str | None:
    """Reason label when ``exc`` is worth retrying, else None."""
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.RateLimitError):
        return "http_429"
    if isinstance(exc, openai.APIStatusError) and exc.status_code >= 500:
        return f"http_{exc.status_code}"
    if isinstance(exc, (openai.APIResponseValidationError, ValueError)):
        return "bad_response"      # a 200 whose body is not the JSON the API promises
    return None


def retry_after_seconds(exc: BaseException) -> float | None:
    """The delay a server asked for in its ``retry-after-ms`` or ``Retry-After`` header (seconds or
    an HTTP date), or None."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            pass
    value = headers.get("retry-after")
    parsed = email.utils.parsedate_tz(value) if value else None
    if parsed is not None:
        return max(0.0, email.utils.mktime_tz(parsed) - time.time())
    return None


class _Retryable(Exception):
    """Internal: an attempt failed for a reason worth another try (carries the reason)."""

    def __init__(self, reason: str, exc: Exception):
        super().__init__(str(exc))
        self.reason = reason
        self.exc = exc


def _response_format_rejected(exc: Exception) -> bool:
    """A 400/422 that is about response_format, or a 500 that names it (llama-cpp-python's server
    validates the body inside its handler: ``json_schema`` comes back as a 500 naming
    ``response_format``): the server has no structured outputs of OpenAI's form."""
    if not isinstance(exc, openai.APIStatusError):
        return False
    text = str(exc).lower()
    if exc.status_code in (400, 422):
        return any(w in text for w in ("response_format", "json_schema", "schema"))
    return exc.status_code == 500 and "response_format" in text


class LLMClient:
    def __init__(self, server: LLMServerConfig, sampling: SamplingConfig, cache: RequestCache, *,
                 base_url: str | None = None, max_requests: int | None = None, max_tokens: int | None = None,
                 before_first_request: Callable[[], Awaitable[list[str]]] | None = None, seed: int = 0):
        self.server = server
        self.sampling = sampling
        self.cache = cache
        self.base_url = base_url or server.base_url
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.stats = ClientStats()
        self._before_first_request = before_first_request
        self._endpoints: list[Endpoint] = []
        self._start_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(server.max_concurrency * self._endpoint_count(server))
        self._rng = random.Random(seed)
        self.structured = server.mode == "chat" and server.structured_output != "off"
        self.in_flight = 0  # requests holding a concurrency slot now

    @staticmethod
    def _endpoint_count(server: LLMServerConfig) -> int:
        """Endpoints the requests will be shared among: the base_urls, or the launched servers."""
        if server.base_urls:
            return len(server.base_urls)
        return resolve_slots(server) if server.launch == "llama_cpp" else 1

    def _api_key(self) -> str:
        if self.server.launch != "none":
            return "not-needed"  # our own loopback server: a user's hosted-API key has no business there
        if self.server.api_key_env and os.environ.get(self.server.api_key_env):
            return os.environ[self.server.api_key_env]
        return "not-needed"  # local servers (llama.cpp, vLLM, Ollama) accept any key

    async def _connect(self) -> list[Endpoint]:
        async with self._start_lock:
            if not self._endpoints:
                launched: list[str] = []
                if self._before_first_request is not None:  # e.g. launch the local llama.cpp server(s)
                    launched = await self._before_first_request()
                    self.base_url = launched[0] if launched else self.base_url
                urls = self.server.base_urls or launched or ([self.base_url] if self.base_url else [])
                if not urls:
                    raise RequestFailed("config", "synthesize.server.base_url is not set and nothing is launched")
                self._endpoints = [Endpoint(url, openai.AsyncOpenAI(api_key=self._api_key(), base_url=url,
                                                                    timeout=self.server.timeout_s, max_retries=0))
                                   for url in urls]
                self.stats.endpoints = {url: {"answered": 0, "failed": 0} for url in urls}
            return self._endpoints

    def _pick(self) -> Endpoint:
        """The endpoint for the next attempt: among those up, the one with the fewest requests in
        flight; when all are resting, the one whose rest ends first."""
        now = time.monotonic()
        up = [e for e in self._endpoints if e.down_until <= now]
        if not up:
            up = [min(self._endpoints, key=lambda e: e.down_until)]
        return min(up, key=lambda e: e.in_flight)

    def _endpoint_failed(self, endpoint: Endpoint, reason: str) -> None:
        """A connection failure, timeout or 5xx: with other endpoints, this one rests a while."""
        self.stats.endpoints[endpoint.url]["failed"] += 1
        if len(self._endpoints) > 1 and (reason in ("connection", "timeout") or reason.startswith("http_5")):
            if endpoint.down_until <= time.monotonic():
                log.warning("synthesize: endpoint %s failed (%s); its requests go to the others for %.0f s",
                            endpoint.url, reason, self.server.endpoint_cooldown_s)
            endpoint.down_until = time.monotonic() + self.server.endpoint_cooldown_s

    def sampling_params(self, stop: tuple[str, ...], attempt: int,
                        schema: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                                  "max_tokens": self.sampling.max_tokens}
        if schema is not None and self.structured:
            name, json_schema = schema
            params["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": name, "schema": json_schema, "strict": True}}
        if stop and self.server.mode == "completion":
            params["stop"] = list(stop)
        if self.sampling.seed is not None:
            params["seed"] = self.sampling.seed + attempt
        return params

    def _budget_left(self) -> bool:
        if self.max_requests is not None and self.stats.requests >= self.max_requests:
            return False
        tokens = self.stats.prompt_tokens + self.stats.completion_tokens
        return self.max_tokens is None or tokens < self.max_tokens

    async def _send(self, client: openai.AsyncOpenAI, prompt: Any, params: dict[str, Any]) -> tuple[str, int, int]:
        """One request: (text, prompt tokens, completion tokens); when ``params`` ask for logprobs, the
        text is the JSON of {"text", "top_logprobs"} (what the cache stores)."""
        if self.server.mode == "completion":
            resp = await client.completions.create(model=self.server.model, prompt=prompt, **params)
        else:
            resp = await client.chat.completions.create(model=self.server.model, messages=prompt, **params)
        if not resp.choices:
            raise ValueError("the response has no choices")
        text = resp.choices[0].text if self.server.mode == "completion" else resp.choices[0].message.content
        if text is None:
            raise ValueError("the response has no text")
        if "logprobs" in params:
            text = json.dumps({"text": text, "top_logprobs": first_token_logprobs(
                resp.choices[0], self.server.mode == "chat")}, ensure_ascii=False)
        usage = getattr(resp, "usage", None)
        return text, int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0)

    def _wait(self, state: RetryCallState) -> float:
        """Tenacity's wait: none when another endpoint is up to take the retry; else the server's
        Retry-After if it sent one (within max_retry_after_s), else full jitter over an exponential
        backoff."""
        failure = state.outcome.exception() if state.outcome else None
        if len(self._endpoints) > 1 and any(e.down_until <= time.monotonic() for e in self._endpoints) \
                and isinstance(failure, _Retryable) and failure.reason != "http_429":
            return 0.0
        asked = retry_after_seconds(failure.exc) if isinstance(failure, _Retryable) else None
        if asked is not None and asked <= self.server.max_retry_after_s:
            return asked
        ceiling = min(self.server.max_backoff_s, self.server.backoff_s * 2 ** (state.attempt_number - 1))
        return self._rng.uniform(0, ceiling)

    async def _attempt(self, prompt: Any, params: dict[str, Any]) -> tuple[str, int, int]:
        """One HTTP request to the endpoint ``_pick`` chooses: budget checked first; a failure comes out
        as ``_Retryable`` or ``RequestFailed``."""
        if not self._budget_left():
            self.stats.budget_exhausted = True
            raise RequestFailed("budget", "run budget (max_requests / max_tokens) spent")
        self.stats.requests += 1
        endpoint = self._pick()
        endpoint.in_flight += 1
        try:
            answer = await self._send(endpoint.client, prompt, params)
            self.stats.endpoints[endpoint.url]["answered"] += 1
            return answer
        except Exception as exc:  # noqa: BLE001 — sorted into retryable or not below
            if "response_format" in params and self.server.structured_output == "auto" \
                    and _response_format_rejected(exc):
                self.stats.errors["response_format_unsupported"] += 1
                self.structured = False  # this server has no structured outputs: plain requests from now on
                log.warning("synthesize: the server rejected response_format (%s); sending plain requests",
                            str(exc)[:200])
                params.pop("response_format")
                raise _Retryable("response_format_unsupported", exc) from None
            reason = _retryable(exc)
            if reason is None:
                status = getattr(exc, "status_code", None)
                reason = f"http_{status}" if status else type(exc).__name__
                self.stats.errors[reason] += 1
                raise RequestFailed(reason, str(exc)[:300]) from None
            self.stats.errors[reason] += 1
            self._endpoint_failed(endpoint, reason)
            raise _Retryable(reason, exc) from None
        finally:
            endpoint.in_flight -= 1

    async def complete(self, *, prompt_name: str, prompt_version: str, prompt: Any, stop: tuple[str, ...],
                       attempt: int = 0, schema: tuple[str, dict[str, Any]] | None = None,
                       logprobs: int | None = None, overrides: dict[str, Any] | None = None) -> Answer:
        """The answer to ``prompt`` (from the cache when there), or ``RequestFailed``. ``schema``:
        (name, JSON schema) of the answer, sent as a structured-output response_format in chat mode;
        ``logprobs``: the top logprobs of the first non-blank answer token asked for (``Answer.top_logprobs``);
        ``overrides``: sampling parameters replacing the config's for this request (keyed with it)."""
        params = {**self.sampling_params(stop, attempt, schema), **(overrides or {})}
        if logprobs is not None:
            params.update({"logprobs": True, "top_logprobs": logprobs} if self.server.mode == "chat"
                          else {"logprobs": logprobs})
        # keyed without response_format: the answer to a prompt is the same question with or without
        # structured outputs (and `auto` may switch it off mid-run)
        key = request_key(model=self.server.model, mode=self.server.mode, prompt=prompt_name,
                          prompt_version=prompt_version, rendered=prompt, attempt=attempt,
                          sampling={k: v for k, v in params.items() if k != "response_format"})
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            answer = Answer(hit["text"], True, hit["prompt_tokens"], hit["completion_tokens"])
        else:
            async with self._slots:
                self.in_flight += 1
                try:
                    answer = await self._request(key, prompt, params)
                finally:
                    self.in_flight -= 1
        if "logprobs" in params:
            stored = json.loads(answer.text)
            answer.text, answer.top_logprobs = stored["text"], stored["top_logprobs"]
        return answer

    async def _request(self, key: str, prompt: Any, params: dict[str, Any]) -> Answer:
        """Send one request with retries (tenacity) and cache its answer."""
        await self._connect()
        retrying = AsyncRetrying(stop=stop_after_attempt(self.server.max_retries + 1), wait=self._wait,
                                 retry=retry_if_exception(lambda e: isinstance(e, _Retryable)),
                                 before_sleep=lambda _: self._count_retry(), reraise=True)
        try:
            text, p_tok, c_tok = await retrying(self._attempt, prompt, params)
        except _Retryable as failure:
            raise RequestFailed(failure.reason, f"gave up after {self.server.max_retries + 1} tries: "
                                                f"{str(failure.exc)[:200]}") from None
        self.stats.prompt_tokens += p_tok
        self.stats.completion_tokens += c_tok
        self.cache.put(key, text, p_tok, c_tok)
        return Answer(text, False, p_tok, c_tok)

    def _count_retry(self) -> None:
        self.stats.retries += 1

    async def aclose(self) -> None:
        for endpoint in self._endpoints:
            await endpoint.client.close()
