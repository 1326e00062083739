"""An embedded PostgreSQL server (pgserver), for machines that have no server configured.

The server lives in a data directory and listens on a Unix socket inside it, never on a
TCP port. Every process that uses the same directory attaches to the same server: pgserver
serialises start-up with a file lock and counts the processes using it, and the last one
to exit stops it.
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path

from .errors import DatabaseUnavailable

logger = logging.getLogger("dagster_leasequeue")

_lock = threading.Lock()
_servers: dict[Path, object] = {}


def embedded_dsn(data_dir: Path | str, *, database: str = "postgres") -> str:
    """Start (or attach to) the embedded server under ``data_dir`` and return its DSN."""
    path = Path(data_dir).expanduser().resolve()
    with _lock:
        server = _servers.get(path)
        if server is None:
            server = _start(path)
            _servers[path] = server
    return str(server.get_uri(database))  # type: ignore[attr-defined]


def _start(path: Path) -> object:
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime directory; the fallback it warns
            # about (a folder under /tmp) is fine for its lock file.
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError:  # pragma: no cover - pgserver is a dependency
        raise DatabaseUnavailable(
            "no PostgreSQL DSN is configured (LEASEQUEUE_DSN) and the embedded server is not "
            "available: pip install pgserver, or set LEASEQUEUE_DSN"
        ) from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting or attaching to the embedded PostgreSQL in %s", path)
        return pgserver.get_server(path, cleanup_mode="stop")  # type: ignore[attr-defined]
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {path} ({type(exc).__name__}: {exc}); "
            f"its log is {path / 'log'}. Set LEASEQUEUE_DATA_DIR to another directory, or "
            "LEASEQUEUE_DSN to use a server of your own"
        ) from None
