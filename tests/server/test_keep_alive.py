"""An idle kept-alive connection outlives the clients' pools (httpx keeps one for 5 s): the server never
closes it under a request the client sends on it, which the client would see as a ReadError."""

import socket
import time

from fastapi import FastAPI

from computron.server.background import KEEP_ALIVE_S, ServerThread


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
    got = b""
    while b"pong" not in got:
        chunk = sock.recv(4096)
        if not chunk:
            return got  # the server closed the connection
        got += chunk
    return got


def test_an_idle_connection_is_still_served_after_the_clients_pool_expiry():
    app = FastAPI()
    app.get("/ping")(lambda: "pong")
    assert KEEP_ALIVE_S > 5
    with ServerThread(app) as server, socket.create_connection((server.host, server.port), timeout=10) as sock:
        assert b"200 OK" in _get(sock)
        time.sleep(5.5)  # past httpx's keepalive_expiry, and past uvicorn's default keep-alive of 5 s
        assert b"200 OK" in _get(sock), "the server closed a connection idle for 5.5 s"
