"""A primary and a streaming standby of the tests' own (never the shared server).

The failover tests (tests/integration/test_failover.py) kill the primary with SIGKILL, as
the loss of its machine would, and promote the standby, as a failover manager would. The
servers use the PostgreSQL binaries found on the machine: pgserver's bundled ones, else
Debian's. As root they run as the OS user ``pgserver`` (PostgreSQL refuses to run as root).

The standby is made with ``pg_basebackup -R`` (which writes ``primary_conninfo`` and
``standby.signal``), so it inherits the primary's configuration, ``synchronous_standby_names``
included: once promoted with no standby of its own, its commits would wait forever. As a
failover manager does, the tests clear it right after the promotion
(:meth:`ReplicatedPair.clear_synchronous_standby_names`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

DEBIAN_BINARIES = Path("/usr/lib/postgresql/15/bin")
_PROGRAMS = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
STANDBY_NAME = "failover_standby"


def find_binaries() -> tuple[Path | None, str]:
    """The folder holding initdb, pg_ctl, pg_basebackup and postgres, or None and why not."""
    candidates: list[Path] = []
    try:
        from pgserver._commands import POSTGRES_BIN_PATH

        candidates.append(Path(POSTGRES_BIN_PATH))
    except Exception:  # pgserver missing or broken: try the system's binaries
        pass
    candidates.append(DEBIAN_BINARIES)
    for folder in candidates:
        if all((folder / program).is_file() for program in _PROGRAMS):
            return folder, ""
    looked = ", ".join(str(folder) for folder in candidates)
    return None, f"no PostgreSQL binaries with {', '.join(_PROGRAMS)} found (looked in {looked})"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _os_user() -> str | None:
    """The OS user the servers run as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        from pgserver.utils import ensure_user_exists

        ensure_user_exists("pgserver")
        return "pgserver"
    except Exception:
        import pwd

        for name in ("pgserver", "postgres"):
            with contextlib.suppress(KeyError):
                pwd.getpwnam(name)
                return name
        raise


def _make_traversable(path: Path) -> None:
    """Let another OS user reach ``path``: g+rx, o+rx on every folder above it."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        wanted = mode | 0o055
        if wanted != mode:
            parent.chmod(wanted)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, left unreaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _processes_in(folder: Path) -> list[int]:
    """The processes whose working directory is ``folder``: a server's postmaster and every
    process it started (they all work in the data directory)."""
    target = str(folder.resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{entry}/cwd") == target and _alive(int(entry)):
                found.append(int(entry))
    return found


class Server:
    """One PostgreSQL server: a data directory, a port, a log."""

    def __init__(self, pair: ReplicatedPair, name: str) -> None:
        self.pair = pair
        self.name = name
        self.data = pair.root / name
        self.log = pair.root / f"{name}.log"
        self.port = free_port()

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} dbname=postgres user=postgres"

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)

    def start(self) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.data}"
        self.pair.run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60",
            "start",
        )  # fmt: skip

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        return None

    def kill(self) -> None:
        """SIGKILL the postmaster (the pid in postmaster.pid), then every process it had
        started: all of the server dies at once, as on the loss of its machine; no
        orphaned backend lingers to answer a client or stream WAL."""
        pid = self.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            left = _processes_in(self.data)
            if not left and (pid is None or not _alive(pid)):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} server's processes {left} outlived SIGKILL")
            for child in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop at once if running; whatever is left of it is killed."""
        if self.data.exists():
            with contextlib.suppress(Exception):
                self.pair.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            with contextlib.suppress(Exception):
                self.kill()

    def setting(self, name: str) -> str:
        with self.connect() as conn:
            row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
        assert row is not None
        return str(row[0])


class ReplicatedPair:
    """A primary and a standby streaming from it, each on a free port of 127.0.0.1.

    ``synchronous``: the primary's ``synchronous_standby_names`` is ``'*'``, so a commit is
    acknowledged only once the standby has flushed it; else replication is asynchronous.
    Call :meth:`start_primary`, prepare the database (tables made now are in the base
    backup), then :meth:`start_standby`; later :meth:`kill_primary`, :meth:`promote` and
    :meth:`clear_synchronous_standby_names`.
    """

    def __init__(self, root: Path, *, synchronous: bool, binaries: Path) -> None:
        self.root = root / "servers"
        self.synchronous = synchronous
        self.binaries = binaries
        self.user = _os_user()
        self.root.mkdir(parents=True)
        if self.user:
            _make_traversable(self.root)
            shutil.chown(self.root, self.user, self.user)
        self.primary = Server(self, "primary")
        self.standby = Server(self, "standby")

    @property
    def dsn(self) -> str:
        """Both servers, the one that accepts writes chosen at each connection."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            "dbname=postgres user=postgres target_session_attrs=read-write"
        )

    def run(self, program: str, *args: str) -> None:
        completed = subprocess.run(
            [str(self.binaries / program), *args],
            user=self.user,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.root,
        )
        if completed.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} failed ({completed.returncode}):\n"
                f"{completed.stdout}\n{completed.stderr}"
            )

    def start_primary(self) -> None:
        self.run("initdb", "-D", str(self.primary.data), "--auth=trust", "-U", "postgres", "-N")
        with open(self.primary.data / "postgresql.conf", "a") as conf:
            conf.write(
                "\n# tests/standby.py\n"
                "wal_level = replica\n"
                "max_wal_senders = 4\n"
                "hot_standby = on\n"
                "wal_keep_size = '256MB'\n"
                "max_connections = 80\n"
                "synchronous_commit = on\n"
            )
        with open(self.primary.data / "pg_hba.conf", "a") as hba:
            hba.write("\nhost replication all 127.0.0.1/32 trust\n")
        self.primary.start()

    def start_standby(self, timeout: float = 30) -> None:
        """Make the standby from a base backup of the primary, start it and wait until it
        streams (synchronously, if the pair is synchronous)."""
        if self.synchronous:
            # Set before the base backup, so the standby inherits it, as a standby made
            # with pg_basebackup from a synchronous primary does.
            with self.primary.connect() as conn:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                conn.execute("SELECT pg_reload_conf()")
        self.run(
            "pg_basebackup",
            "-d", f"host=127.0.0.1 port={self.primary.port} user=postgres "
            f"application_name={STANDBY_NAME}",
            "-D", str(self.standby.data),
            "-R", "-X", "stream", "-c", "fast",
        )  # fmt: skip
        self.standby.start()
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        with self.primary.connect() as conn:
            while True:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY_NAME,),
                ).fetchone()
                if row is not None and row[0] == "streaming" and row[1] == wanted:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby is not streaming ({wanted}): {row}")
                time.sleep(0.05)

    def kill_primary(self) -> None:
        self.primary.kill()

    def promote(self) -> None:
        """Promote the standby (``pg_ctl promote -w``: returns once it accepts writes)."""
        self.run("pg_ctl", "-D", str(self.standby.data), "-w", "-t", "60", "promote")

    def clear_synchronous_standby_names(self) -> str:
        """Clear the synchronous_standby_names the promoted standby inherited, as a failover
        manager does: with no standby of its own, its commits would wait forever.

        Returns the value it had inherited (``'*'`` for a synchronous pair).
        """
        with self.standby.connect() as conn:
            row = conn.execute("SELECT current_setting('synchronous_standby_names')").fetchone()
            # SET to '', not RESET: the value may come from postgresql.conf too.
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
            conn.execute("SELECT pg_reload_conf()")
        assert row is not None
        return str(row[0])

    def close(self) -> None:
        """Stop both servers and remove their data directories."""
        for server in (self.standby, self.primary):
            server.stop()
        shutil.rmtree(self.root, ignore_errors=True)
