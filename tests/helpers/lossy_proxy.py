"""A real TCP proxy in front of a real Prefect server that loses one answer on the way back: the
server's answer to the first request ``lose(request_line, body)`` picks. The request reaches the
server and is carried out; the client's connection is closed before any answer, as when a busy
server answers after the client's read timeout. Prefect's client then sends the request again
(it retries a dropped connection), the way it did in CI when a loaded server took over a minute.

Everything else passes through byte for byte, websockets (Prefect's events) included."""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import urlsplit

Lose = Callable[[str, bytes], bool]


class _Connection:
    def __init__(self, client: socket.socket, upstream: socket.socket, proxy: "_Proxy"):
        self.client, self.upstream, self.proxy = client, upstream, proxy
        self.doomed = False  # the answer to the request just sent is to be lost
        self.raw = False  # after a protocol upgrade (a websocket): bytes only

    def requests_to_server(self) -> None:
        buffer = b""
        try:
            while chunk := self.client.recv(65536):
                if self.raw:
                    self.upstream.sendall(chunk)
                    continue
                buffer += chunk
                buffer = self._send_complete_requests(buffer)
        except OSError:
            pass
        finally:
            self.close()

    def _send_complete_requests(self, buffer: bytes) -> bytes:
        while not self.raw and b"\r\n\r\n" in buffer:
            head, rest = buffer.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
            length = int(headers.get("content-length", 0))
            if len(rest) < length:
                break
            body, buffer = rest[:length], rest[length:]
            if self.proxy.should_lose(lines[0], body):
                self.doomed = True
            self.raw = headers.get("upgrade", "").lower() == "websocket"
            self.upstream.sendall(head + b"\r\n\r\n" + body)
        if self.raw and buffer:
            self.upstream.sendall(buffer)
            buffer = b""
        return buffer

    def answers_to_client(self) -> None:
        try:
            while chunk := self.upstream.recv(65536):
                if self.doomed:  # the server did it; its answer never arrives
                    break
                self.client.sendall(chunk)
        except OSError:
            pass
        finally:
            self.close()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class _Proxy:
    def __init__(self, upstream: tuple[str, int], lose: Lose):
        self.upstream, self.lose = upstream, lose
        self.lost: list[str] = []  # the request lines whose answers were lost
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))

    def should_lose(self, request_line: str, body: bytes) -> bool:
        with self.lock:
            if self.lost or not self.lose(request_line, body):
                return False
            self.lost.append(request_line)
            return True

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            connection = _Connection(client, socket.create_connection(self.upstream), self)
            threading.Thread(target=connection.requests_to_server, daemon=True).start()
            threading.Thread(target=connection.answers_to_client, daemon=True).start()


@contextmanager
def lossy_proxy(api_url: str, lose: Lose) -> Iterator[tuple[str, list[str]]]:
    """(the proxy's API URL, the request lines whose answers it lost) for the block."""
    parts = urlsplit(api_url)
    proxy = _Proxy((parts.hostname, parts.port), lose)
    threading.Thread(target=proxy.serve, daemon=True).start()
    try:
        yield f"{parts.scheme}://127.0.0.1:{proxy.listener.getsockname()[1]}{parts.path}", proxy.lost
    finally:
        proxy.listener.close()
