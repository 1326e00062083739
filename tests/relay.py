"""A relay between the client and the test server that can cut a connection right after a
COMMIT went through: the server has committed, and the client never hears of it."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class CommitCutter:
    """Relays every connection made to ``dsn`` on a local port; once armed, the next
    reply that reports a COMMIT is dropped and its connection closed on both sides."""

    def __init__(self, server_dsn: str) -> None:
        params = conninfo_to_dict(server_dsn)
        host = str(params.get("host") or "/var/run/postgresql").split(",")[0]
        port = int(str(params.get("port") or "5432").split(",")[0])
        self._server: tuple[int, str | tuple[str, int]] = (
            (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}")
            if host.startswith("/")
            else (socket.AF_INET, (host, port))
        )
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.dsn = make_conninfo(server_dsn, host="127.0.0.1", port=self._listener.getsockname()[1])
        self._armed = threading.Event()
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        self._armed.set()

    def __enter__(self) -> CommitCutter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            family, address = self._server
            server = socket.socket(family, socket.SOCK_STREAM)
            server.connect(address)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                if replies and self._armed.is_set() and b"COMMIT\x00" in data:
                    self._armed.clear()
                    self.cut.set()
                    return
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                # shutdown, not close alone: the other direction's thread still reads it.
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
