"""The engine's end of the workers of other nodes: an authenticated TCP control channel.

A worker of another node (``computron worker --connect HOST:PORT``, one per GPU, usually started
by ``torchrun``) connects to the ``NodeListener`` of the engine's ``WorkerExecutor``. The
connection is authenticated by ``multiprocessing.connection``'s HMAC challenge with a shared key
(``COMPUTRON_WORKER_AUTHKEY``) before a single message is read, so only our own processes get
past it; only then does anything get unpickled (the worker's hello, then the protocol's messages).
The listener hands each new connection and its hello ``("hello", device or None, pid, host)`` to
whoever waits for workers (``take``): the executor, when it starts or restarts its world. The
worker's device, the world's size and the process group's address come back in the answer.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from multiprocessing.connection import AuthenticationError, Listener

log = logging.getLogger("computron.workers")

HELLO_S = 10.0  # a connection that says nothing for this long after authenticating is dropped


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as a (host, port) pair, with a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (e.g. 10.0.0.1:29600), got {text!r}")
    return host, int(port)


def hang_up(conn) -> None:
    """Close a socket connection so that both ends see it closed at once (a thread waiting on it
    here included): shut the socket down, then close it."""
    try:
        with socket.socket(fileno=socket.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass
    try:
        conn.close()
    except OSError:
        pass


class NodeListener:
    """Accepts authenticated connections of workers of other nodes, on a thread of its own."""

    def __init__(self, address: tuple[str, int], authkey: bytes):
        if not authkey:
            raise ValueError("workers of other nodes need a shared key: set COMPUTRON_WORKER_AUTHKEY (the same "
                             "on every node)")
        self._listener = Listener(address, family="AF_INET", authkey=authkey)
        self.address: tuple[str, int] = self._listener.address
        self._arrivals: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="computron-node-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()  # the HMAC challenge both ways; nothing is unpickled before
            except (AuthenticationError, EOFError, OSError) as e:
                if self._closed:
                    return
                log.warning("refused a worker connection to %s:%d: %s", *self.address, e)
                continue
            try:
                if not conn.poll(HELLO_S):
                    raise TimeoutError(f"no hello within {HELLO_S:.0f} s")
                hello = conn.recv()
                if not (isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello"
                        and (hello[1] is None or isinstance(hello[1], int))):
                    raise ValueError(f"not a worker's hello: {hello!r:.100}")
            except Exception as e:  # noqa: BLE001 -- one bad peer must not stop the listener
                log.warning("dropped a worker connection: %s", e)
                hang_up(conn)
                continue
            self._arrivals.put((conn, hello))

    def take(self, timeout: float):
        """The next connected worker, ``(conn, hello)``; ``queue.Empty`` after ``timeout`` seconds."""
        return self._arrivals.get(timeout=max(timeout, 0.0))

    def close(self) -> None:
        self._closed = True
        try:  # wake the accept call
            with socket.create_connection(self.address, timeout=1.0):
                pass
        except OSError:
            pass
        self._listener.close()
        self._thread.join(5.0)
        while True:
            try:
                hang_up(self._arrivals.get_nowait()[0])
            except queue.Empty:
                return
