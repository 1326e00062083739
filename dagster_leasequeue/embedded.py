"""An embedded PostgreSQL server (pgserver), for machines that have no server configured.

The server lives in a data directory and listens on a Unix socket inside it, never on a
TCP port. Every process that uses the same directory attaches to the same server.

Two lifetimes:

- By default a process starts the server, or attaches to it, with a handle: pgserver
  counts the processes using it, and the last one to exit stops it.
- ``leasequeue embedded start`` (:func:`start_server`) starts it to keep running and leaves
  a marker in the data directory; processes then attach without a handle, so none of them
  stops it, until :func:`stop_server` removes the marker and stops it.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DatabaseUnavailable

logger = logging.getLogger(__name__)

# Left in the data directory by start_server: the server outlives the processes using it.
KEEP_RUNNING_MARKER = ".leasequeue-keep-running"

_lock = threading.Lock()
_servers: dict[Path, Any] = {}


@dataclass(frozen=True)
class ServerStatus:
    """What the data directory's server is doing."""

    data_dir: Path
    pid: int | None
    state: str  # "stopped", "starting", "ready", ... (PostgreSQL's postmaster status)
    uri: str | None  # a Unix-socket URI without a password, when ready
    kept_running: bool  # started by start_server, to outlive its users

    @property
    def running(self) -> bool:
        return self.pid is not None


def embedded_dsn(data_dir: Path | str, *, database: str = "postgres") -> str:
    """Start (or attach to) the embedded server under ``data_dir`` and return its DSN."""
    path = _resolve(data_dir)
    with _lock:
        server = _servers.get(path)
        if server is None:
            status = server_status(path)
            if status.kept_running and status.uri:
                return status.uri
            server = _get_server(path, cleanup_mode="stop")
            _servers[path] = server
            # Runs before pgserver's own exit hook (hooks run last-registered first), so the
            # last clean user stops the server even if another user was killed, and nobody
            # stops one that `leasequeue embedded start` asked to keep running.
            atexit.register(_before_exit, server, path)
    return str(server.get_uri(database))


def start_server(data_dir: Path | str) -> ServerStatus:
    """Start the server (or find it running) and keep it running after this process exits."""
    path = _resolve(data_dir)
    _get_server(path, cleanup_mode=None)
    (path / KEEP_RUNNING_MARKER).touch()
    return server_status(path)


def stop_server(data_dir: Path | str) -> bool:
    """Stop the server (sessions end, committed work is kept); False if it was not running."""
    path = _resolve(data_dir)
    (path / KEEP_RUNNING_MARKER).unlink(missing_ok=True)
    if not server_status(path).running:
        return False
    pgserver = _import_pgserver()
    pg_ctl = Path(pgserver._commands.POSTGRES_BIN_PATH) / "pg_ctl"
    # PostgreSQL refuses to run as root; pgserver then runs it as the data directory's
    # owner (its user "pgserver"), and so must we.
    user = path.stat().st_uid if os.geteuid() == 0 else None
    try:
        subprocess.run(
            [str(pg_ctl), "-D", str(path), "-m", "fast", "-w", "stop"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
            user=user,
        )
    except subprocess.CalledProcessError as exc:
        raise DatabaseUnavailable(
            f"pg_ctl could not stop the embedded PostgreSQL in {path}: "
            f"{' '.join((exc.stderr or '').split())}"
        ) from None
    return True


def server_status(data_dir: Path | str) -> ServerStatus:
    """Whether the server runs, read from its ``postmaster.pid``; never starts it."""
    path = _resolve(data_dir)
    kept = (path / KEEP_RUNNING_MARKER).exists()
    info = _postmaster(path)
    if info is None:
        return ServerStatus(path, None, "stopped", None, kept)
    uri = str(info.get_uri(database="postgres")) if info.status == "ready" else None
    return ServerStatus(path, int(info.pid), str(info.status), uri, kept)


def _postmaster(path: Path) -> Any:
    if not (path / "postmaster.pid").exists():
        return None
    pgserver = _import_pgserver()
    try:
        info = pgserver.utils.PostmasterInfo.read_from_pgdata(path)
    except (AssertionError, ValueError, OSError):
        return None  # a pid file being written (start-up) or removed (shutdown)
    return info if info is not None and info.is_running() else None


def _before_exit(server: Any, path: Path) -> None:
    try:
        _forget_dead_users(_import_pgserver(), path)
        if (path / KEEP_RUNNING_MARKER).exists():
            server.cleanup_mode = None
    except Exception as exc:  # an exit hook must not fail the interpreter's exit
        logger.warning("embedded server clean-up: %s", exc)


def _forget_dead_users(pgserver: Any, path: Path) -> None:
    """Drop the processes that died without saying so (SIGKILL, OOM) from the server's users.

    pgserver counts the processes using a server and stops it when the last one exits;
    a killed process never leaves that list, and would keep the server running for good.
    """
    import psutil  # a dependency of pgserver

    handles = pgserver.utils.DiskList(path / ".handle_pids.json")
    with pgserver.PostgresServer._lock:
        users = handles.get()
        alive = [pid for pid in users if psutil.pid_exists(pid)]
        if alive != users:
            handles.put(alive)


def _get_server(path: Path, *, cleanup_mode: str | None) -> Any:
    pgserver = _import_pgserver()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _forget_dead_users(pgserver, path)
        logger.info("starting or attaching to the embedded PostgreSQL in %s", path)
        return pgserver.get_server(path, cleanup_mode=cleanup_mode)
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {path} ({type(exc).__name__}: {exc}); "
            f"its log is {path / 'log'}. Set LEASEQUEUE_DATA_DIR to another directory, or "
            "LEASEQUEUE_DSN to use a server of your own"
        ) from None


def _import_pgserver() -> Any:
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime directory; the fallback it warns
            # about (a folder under /tmp) is fine for its lock file.
            warnings.simplefilter("ignore")
            import pgserver
            import pgserver._commands
            import pgserver.utils
    except ImportError:  # pragma: no cover - pgserver is a dependency
        raise DatabaseUnavailable(
            "no PostgreSQL DSN is configured (LEASEQUEUE_DSN) and the embedded server is not "
            "available: pip install pgserver, or set LEASEQUEUE_DSN"
        ) from None
    return pgserver


def _resolve(data_dir: Path | str) -> Path:
    return Path(data_dir).expanduser().resolve()
