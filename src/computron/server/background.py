"""A uvicorn server on a background thread (benchmarks and tests): start, wait until it listens, stop."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


# How long an idle connection stays open. Clients keep pooled connections for a while too (httpx, the
# ``openai`` client's transport: 5 s) and reuse them; a server that closes at the same moment races a
# request sent on the closing connection, which the client sees as a ReadError mid-request (one of
# 174 requests of a hybrid run). Outliving the clients' pools leaves the closing to them.
KEEP_ALIVE_S = 75


def uvicorn_config(app, host: str, port: int, **kw) -> uvicorn.Config:
    """The uvicorn settings every server of this package runs with; ``kw`` adds to them."""
    return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=KEEP_ALIVE_S, **kw)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.host, self.port = host, port or 0  # 0: the OS picks a free port, read back once listening
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level=log_level,
                                                    access_log=False, lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        if not self.port:
            self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
