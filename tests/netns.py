"""A worker host of the tests' own: a network namespace joined to this host by a veth pair.

Processes in the namespace reach the database through a forwarder (socat) listening on
this host's end of the pair. ``cut()`` takes that end down: packets are dropped without a
word, as on a real network that failed; ``heal()`` brings it back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

HOST_PORT = 6543


def missing() -> str | None:
    """Why the test bed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for program in ("ip", "socat"):
        if shutil.which(program) is None:
            return f"{program} is not installed (.ci/run installs iproute2 and socat)"
    return None


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


class NetnsHost:
    """One namespace, its veth pair and the forwarder to the server of ``server_dsn``."""

    def __init__(self, index: int, server_dsn: str) -> None:
        tag = f"{os.getpid() % 10000}{index}"
        self.name = f"lqns{tag}"
        self._outside = f"lqo{tag}"
        self._inside = f"lqi{tag}"
        octet = 16 + (os.getpid() + index * 7) % 200
        self.host_address = f"10.203.{octet}.1"
        self._inner_address = f"10.203.{octet}.2"
        self._server = conninfo_to_dict(server_dsn)
        self._server_dsn = server_dsn
        self._forwarder: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self._outside, "type", "veth", "peer", "name", self._inside)
        _run("ip", "link", "set", self._inside, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self._outside)
        _run("ip", "link", "set", self._outside, "up")
        inside = ("ip", "netns", "exec", self.name, "ip")
        _run(*inside, "addr", "add", f"{self._inner_address}/30", "dev", self._inside)
        _run(*inside, "link", "set", self._inside, "up")
        _run(*inside, "link", "set", "lo", "up")
        host = str(self._server.get("host") or "127.0.0.1")
        port = str(self._server.get("port") or "5432")
        target = (
            f"UNIX-CONNECT:{Path(host) / f'.s.PGSQL.{port}'}"
            if host.startswith("/")
            else f"TCP:{host}:{port}"
        )
        listen = f"TCP-LISTEN:{HOST_PORT},bind={self.host_address},fork,reuseaddr"
        self._forwarder = subprocess.Popen(
            ["socat", listen, target], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(0.3)

    def dsn(self) -> str:
        """The server's DSN as seen from inside the namespace."""
        return make_conninfo(self._server_dsn, host=self.host_address, port=str(HOST_PORT))

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        _run("ip", "link", "set", self._outside, "down")

    def heal(self) -> None:
        _run("ip", "link", "set", self._outside, "up")
        # The address goes with the link: put it back if the kernel dropped it.
        subprocess.run(
            ["ip", "addr", "add", f"{self.host_address}/30", "dev", self._outside],
            capture_output=True,
        )

    def stop(self) -> None:
        if self._forwarder is not None:
            self._forwarder.kill()
            self._forwarder.wait()
        subprocess.run(["ip", "link", "del", self._outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
