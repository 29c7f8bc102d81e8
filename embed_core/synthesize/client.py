"""Requests to an OpenAI-compatible server through the ``openai`` package (``AsyncOpenAI``).

* chat (``/chat/completions``) or plain completion (``/completions``, base models) mode;
* bounded concurrency (a semaphore), a per-request timeout, and retries with exponential backoff
  and full jitter on timeouts, connection errors, 429 and 5xx (other 4xx are not retried: a bad
  request stays bad);
* a run budget (requests, tokens): once spent, further requests fail with reason ``budget`` and
  the stage finishes cleanly with what it has;
* every answer goes through ``RequestCache`` first: a cached answer costs no request and no budget.

The API key is read from the environment variable the config names and handed to the client
object only; it is never logged or returned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import openai

from embed_core.config import LLMServerConfig, SamplingConfig
from embed_core.synthesize.cache import RequestCache, request_key

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


@dataclass
class ClientStats:
    requests: int = 0             # HTTP requests sent (retries included)
    cache_hits: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: Counter = field(default_factory=Counter)   # per attempt, by reason (retried or not)
    budget_exhausted: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "cache_hits": self.cache_hits, "retries": self.retries,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "tokens": self.prompt_tokens + self.completion_tokens, "errors": dict(self.errors),
                "budget_exhausted": self.budget_exhausted}


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


class LLMClient:
    def __init__(self, server: LLMServerConfig, sampling: SamplingConfig, cache: RequestCache, *,
                 base_url: str | None = None, max_requests: int | None = None, max_tokens: int | None = None,
                 before_first_request: Callable[[], Awaitable[str]] | None = None, seed: int = 0):
        self.server = server
        self.sampling = sampling
        self.cache = cache
        self.base_url = base_url or server.base_url
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.stats = ClientStats()
        self._before_first_request = before_first_request
        self._client: openai.AsyncOpenAI | None = None
        self._start_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(server.max_concurrency)
        self._rng = random.Random(seed)

    def _api_key(self) -> str:
        if self.server.launch != "none":
            return "not-needed"  # our own loopback server: a user's hosted-API key has no business there
        if self.server.api_key_env and os.environ.get(self.server.api_key_env):
            return os.environ[self.server.api_key_env]
        return "not-needed"  # local servers (llama.cpp, vLLM, Ollama) accept any key

    async def _connect(self) -> openai.AsyncOpenAI:
        async with self._start_lock:
            if self._client is None:
                if self._before_first_request is not None:  # e.g. launch the local llama.cpp server
                    self.base_url = await self._before_first_request()
                if not self.base_url:
                    raise RequestFailed("config", "synthesize.server.base_url is not set and nothing is launched")
                self._client = openai.AsyncOpenAI(api_key=self._api_key(), base_url=self.base_url,
                                                  timeout=self.server.timeout_s, max_retries=0)
            return self._client

    def sampling_params(self, stop: tuple[str, ...], attempt: int) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                                  "max_tokens": self.sampling.max_tokens}
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
        if self.server.mode == "completion":
            resp = await client.completions.create(model=self.server.model, prompt=prompt, **params)
            text = resp.choices[0].text
        else:
            resp = await client.chat.completions.create(model=self.server.model, messages=prompt, **params)
            text = resp.choices[0].message.content
        if not resp.choices or text is None:
            raise ValueError("the response has no choices or no text")
        usage = getattr(resp, "usage", None)
        return text, int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0)

    async def complete(self, *, prompt_name: str, prompt_version: str, prompt: Any, stop: tuple[str, ...],
                       attempt: int = 0) -> Answer:
        """The answer to ``prompt`` (from the cache when there), or ``RequestFailed``."""
        params = self.sampling_params(stop, attempt)
        key = request_key(model=self.server.model, mode=self.server.mode, prompt=prompt_name,
                          prompt_version=prompt_version, rendered=prompt, sampling=params, attempt=attempt)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            return Answer(hit["text"], True, hit["prompt_tokens"], hit["completion_tokens"])
        async with self._slots:
            client = await self._connect()
            for retry in range(self.server.max_retries + 1):
                if not self._budget_left():
                    self.stats.budget_exhausted = True
                    raise RequestFailed("budget", "run budget (max_requests / max_tokens) spent")
                self.stats.requests += 1
                try:
                    text, p_tok, c_tok = await self._send(client, prompt, params)
                except Exception as exc:  # noqa: BLE001 — sorted into retryable or not below
                    reason = _retryable(exc)
                    if reason is None:
                        status = getattr(exc, "status_code", None)
                        reason = f"http_{status}" if status else type(exc).__name__
                        self.stats.errors[reason] += 1
                        raise RequestFailed(reason, str(exc)[:300]) from None
                    self.stats.errors[reason] += 1
                    if retry == self.server.max_retries:
                        raise RequestFailed(reason, f"gave up after {retry + 1} tries: {str(exc)[:200]}") from None
                    self.stats.retries += 1
                    delay = min(self.server.max_backoff_s, self.server.backoff_s * 2 ** retry)
                    await asyncio.sleep(self._rng.uniform(0, delay))   # full jitter
                    continue
                self.stats.prompt_tokens += p_tok
                self.stats.completion_tokens += c_tok
                self.cache.put(key, text, p_tok, c_tok)
                return Answer(text, False, p_tok, c_tok)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
