"""A loopback HTTP server that answers JSON: the base of the tests' stand-ins for Google's APIs."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Callable

# (method, path with query, request headers, body) -> (status, JSON answer)
Answer = Callable[[str, str, Any, bytes], "tuple[int, Any]"]


class LoopbackApi:
    """Serves ``answer`` on 127.0.0.1 from a thread; an answer that raises becomes a 500 the client can show."""

    def __init__(self, answer: Answer) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    status, payload = answer(self.command, self.path, self.headers, body)
                except Exception as exc:
                    status, payload = 500, {"error": {"code": 500, "message": f"stand-in: {exc!r}"}}
                raw = isinstance(payload, bytes)  # an object's own bytes (a download), sent as they are
                data = payload if raw else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = handle_one

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
