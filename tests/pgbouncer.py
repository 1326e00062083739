"""A real PgBouncer in transaction mode, in front of the test server, for
tests/integration/test_pgbouncer.py.

PgBouncer refuses to run as root, so as root it is started with ``-u``: as the owner of the
server's socket directory when the server listens on a Unix socket (the embedded pgserver
keeps its socket in its private data directory), else as ``postgres`` (or ``nobody``).
Its ini, auth file, pid file and log live in a temporary folder owned by that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

# The pooled databases: DATABASE shares DEFAULT_POOL_SIZE server connections between all
# its clients, SINGLE_DATABASE has one server connection only.
DATABASE = "lq"
SINGLE_DATABASE = "lq1"
DEFAULT_POOL_SIZE = 3


def binary() -> str | None:
    """Path of the pgbouncer program, or None."""
    return shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(path).exists()),
        None,
    )


def version(program: str) -> str:
    """PgBouncer's version, e.g. ``1.18.0``."""
    output = subprocess.run(
        [program, "--version"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return output.split()[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_as(host: str) -> str:
    """The OS user PgBouncer runs as: one that can reach the server."""
    if host.startswith("/"):
        owner = pwd.getpwuid(Path(host).stat().st_uid).pw_name
        if owner != "root":
            return owner
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("no unprivileged OS user to run PgBouncer as")


def _quote(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


class PgBouncer:
    """One PgBouncer process in transaction mode in front of ``server_dsn``."""

    def __init__(self, program: str, server_dsn: str) -> None:
        params = conninfo_to_dict(server_dsn)
        host = str(params.get("host") or "/var/run/postgresql").split(",")[0]
        port = str(params.get("port") or "5432").split(",")[0]
        self.user = str(params.get("user") or pwd.getpwuid(os.geteuid()).pw_name)
        password = str(params.get("password") or "")
        dbname = str(params.get("dbname") or self.user)
        self.port = _free_port()
        self.os_user = _run_as(host)
        self.version = version(program)
        self.folder = Path(tempfile.mkdtemp(prefix="leasequeue-pgbouncer-"))
        self.log = self.folder / "pgbouncer.log"
        target = f"host={host} port={port} dbname={dbname}"
        (self.folder / "userlist.txt").write_text(f"{_quote(self.user)} {_quote(password)}\n")
        (self.folder / "pgbouncer.ini").write_text(
            f"""[databases]
{DATABASE} = {target}
{SINGLE_DATABASE} = {target} pool_size=1

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.folder / "userlist.txt"}
admin_users = {self.user}
pidfile = {self.folder / "pgbouncer.pid"}
logfile = {self.log}
pool_mode = transaction
default_pool_size = {DEFAULT_POOL_SIZE}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
ignore_startup_parameters = extra_float_digits,options
query_wait_timeout = 60
"""
        )
        for path in (self.folder, *self.folder.iterdir()):
            shutil.chown(path, self.os_user)
        self._process = subprocess.Popen(
            [program, "-u", self.os_user, str(self.folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def dsn(self, database: str = DATABASE) -> str:
        """A DSN that reaches the server through PgBouncer."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def admin(self, command: str) -> list[dict[str, object]]:
        """Rows of an admin console command (SHOW SERVERS, ...), as dictionaries."""
        # The admin console only speaks the simple query protocol.
        with psycopg.connect(self.dsn("pgbouncer"), autocommit=True) as conn:
            cursor = psycopg.ClientCursor(conn)
            cursor.execute(command, prepare=False)
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {self._process.returncode}:\n{self.log_text()}"
                )
            try:
                with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
