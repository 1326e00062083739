"""A PostgreSQL server of the test's own (never the shared one), that the test may crash.

It uses the binaries bundled with pgserver; as root they run as the OS user ``pgserver``
(which pgserver creates), since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pgserver  # type: ignore[import-untyped]
from pgserver._commands import POSTGRES_BIN_PATH  # type: ignore[import-untyped]
from pgserver.utils import ensure_prefix_permissions, ensure_user_exists  # type: ignore[import-untyped]

_ = pgserver  # the import sets up the bundled binaries


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class OwnServer:
    def __init__(self, root: Path) -> None:
        self.data = root / "pgdata"
        self.log = root / "server.log"
        self.port = _free_port()
        self.user = "pgserver" if os.geteuid() == 0 else None
        self.data.mkdir(parents=True)
        if self.user:
            ensure_user_exists(self.user)
            ensure_prefix_permissions(self.data)
            import shutil

            shutil.chown(self.data, self.user, self.user)
            self.log.touch()
            shutil.chown(self.log, self.user, self.user)
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres")

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.data}"
        command = ("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w")
        # Right after a crash the port or the shared memory of the old server can take a
        # moment to be let go: try again before giving up, and then show why.
        for _ in range(2):
            try:
                self._run(*command, "start")
                return
            except subprocess.CalledProcessError:
                time.sleep(1)
        try:
            self._run(*command, "start")
        except subprocess.CalledProcessError as exc:
            log = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the test's server did not start:\n{log}") from exc

    def crash(self) -> None:
        """Stop at once, as a power cut would: no checkpoint, recovery from WAL at start."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            [str(POSTGRES_BIN_PATH / program), *args],
            check=True,
            user=self.user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
