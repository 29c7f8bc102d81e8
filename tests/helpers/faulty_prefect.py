"""A real HTTP server standing in for a faulty Prefect server: it answers Prefect's version check
(and says CSRF protection is off) like a working one, and 500 to everything else, the way a server
whose database fails answers a flow's registration."""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager
from typing import Iterator


class _Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append(f"{self.command} {self.path.split('?')[0]}")
        if self.path.endswith("/admin/version"):
            import prefect

            self._send(200, prefect.__version__)
        elif "/csrf-token" in self.path:
            self._send(422, {"detail": "CSRF protection is disabled."})
        else:
            self._send(500, {"exception_message": "Internal Server Error"})

    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


@contextmanager
def faulty_prefect_server() -> Iterator[tuple[str, list[str]]]:
    """(its API URL, the requests it answered: "METHOD /path") for the block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api", server.requests
    finally:
        server.shutdown()
        server.server_close()
