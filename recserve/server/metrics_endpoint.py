"""A Prometheus text endpoint for recserve's own processes: the canary controller, the joiner, the learner."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from recserve.server.process import LOOPBACK


def serve_metrics(port: int, exposition: Callable[[], str], name: str) -> ThreadingHTTPServer:
    """Serve ``exposition()`` at ``http://127.0.0.1:<port>/metrics`` on a daemon thread called ``name``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's API)
            body = exposition().encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            pass

    server = ThreadingHTTPServer((LOOPBACK, port), Handler)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server
