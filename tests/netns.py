"""A worker host of the tests' own: a network namespace joined to this host by a veth pair.

Processes in the namespace reach the database through a forwarder (socat) listening on
this host's end of the pair. ``cut()`` takes that end down: packets are dropped without a
word, as on a real network that failed; ``heal()`` brings it back.

An ``Impairment`` makes the link a bad one: packets lost at random and delayed. With the
kernel's ``sch_netem`` that is ``tc qdisc add dev <end> root netem loss 20% delay 100ms``.
Kernels built without netem (as on these machines) get the same from what they have: the
loss from a classic-BPF filter that draws a random number per packet (``ld rand``) and
sends the unlucky ones to an HTB class whose queue holds nothing (``pfifo limit 0``), so
they are dropped in the kernel like netem's; the delay from the forwarder, which then is
``tests/netns_relay.py`` and hands each chunk on ``delay`` seconds after it came.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

HOST_PORT = 6543
RELAY = Path(__file__).with_name("netns_relay.py")

# Classic BPF: the offset of the "random number" ancillary load (SKF_AD_OFF + SKF_AD_RANDOM).
_LOAD_RANDOM = 0x100000000 - 0x1000 + 56
# The HTB class (1:2) whose queue holds no packet: what is sent to it is dropped.
_DROP_CLASS = (1 << 16) | 2


@dataclass(frozen=True)
class Impairment:
    """A bad link: ``loss`` (the fraction of packets dropped at random) and ``delay``
    (seconds added), on the packets this host sends into the namespace, and with
    ``both_ways`` on those the namespace sends back too (netem on both ends)."""

    loss: float = 0.0
    delay: float = 0.0
    both_ways: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.loss < 1 and self.delay >= 0


def missing() -> str | None:
    """Why the test bed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for program in ("ip", "socat", "tc"):
        if shutil.which(program) is None:
            return f"{program} is not installed (.ci/run installs iproute2 and socat)"
    return None


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


def _dropped(output: str) -> int:
    """Packets the qdiscs of ``tc -s qdisc show`` dropped."""
    return sum(int(count) for count in re.findall(r"\(dropped (\d+),", output))


class NetnsHost:
    """One namespace, its veth pair and the forwarder to the server of ``server_dsn``."""

    def __init__(
        self,
        index: int,
        server_dsn: str,
        impairment: Impairment | None = None,
        forwarder_log: Path | None = None,
    ) -> None:
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
        self.impairment = impairment
        self._forwarder_log = forwarder_log
        # How the impairment is made: "netem", or "bpf+relay" (see the module's docstring).
        self.impaired_by: str | None = None

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
        relay_delays = self._impair() if self.impairment is not None else None
        host = str(self._server.get("host") or "127.0.0.1")
        port = str(self._server.get("port") or "5432")
        socket_path = Path(host) / f".s.PGSQL.{port}"
        if relay_delays is None:
            target = f"UNIX-CONNECT:{socket_path}" if host.startswith("/") else f"TCP:{host}:{port}"
            listen = f"TCP-LISTEN:{HOST_PORT},bind={self.host_address},fork,reuseaddr"
            command = ["socat", listen, target]
        else:
            target = f"unix:{socket_path}" if host.startswith("/") else f"tcp:{host}:{port}"
            to_server, to_client = relay_delays
            command = [sys.executable, str(RELAY), self.host_address, str(HOST_PORT), target]
            command += [str(to_server), str(to_client)]
        # A process group of its own: socat forks a child per connection, and stop() must
        # end those too (a child whose client was cut off would otherwise live on, holding
        # a session on the server).
        if self._forwarder_log is None:
            self._forwarder = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        else:
            with self._forwarder_log.open("ab") as log:
                self._forwarder = subprocess.Popen(
                    command, stdout=log, stderr=log, start_new_session=True
                )
        self._wait_for_forwarder()

    def _wait_for_forwarder(self) -> None:
        """Until the forwarder listens (asked of the kernel: a probe would reach the server)."""
        deadline = time.monotonic() + 15
        listening = ["ss", "-Hltn", "src", f"{self.host_address}:{HOST_PORT}"]
        while not subprocess.run(listening, capture_output=True, text=True).stdout.strip():
            assert self._forwarder is not None and self._forwarder.poll() is None, "no forwarder"
            assert time.monotonic() < deadline, "the forwarder never listened"
            time.sleep(0.05)

    def _impair(self) -> tuple[float, float] | None:
        """Set up the impairment on the link's ends; the delays the relay must add, if any.

        The host's end shapes what goes into the namespace; the inner end, with
        ``both_ways``, what comes out of it.
        """
        impairment = self.impairment
        assert impairment is not None
        ends: list[tuple[tuple[str, ...], str]] = [((), self._outside)]
        if impairment.both_ways:
            ends.append((("ip", "netns", "exec", self.name), self._inside))
        netem = ["netem"]
        if impairment.loss:
            netem += ["loss", f"{impairment.loss * 100:g}%"]
        if impairment.delay:
            netem += ["delay", f"{impairment.delay * 1000:g}ms"]
        first = subprocess.run(
            ["tc", "qdisc", "add", "dev", self._outside, "root", *netem], capture_output=True
        )
        if first.returncode == 0:
            self.impaired_by = "netem"
            for prefix, device in ends[1:]:
                _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", *netem)
            return None
        self.impaired_by = "bpf+relay"
        if impairment.loss:
            for prefix, device in ends:
                self._drop_at_random(prefix, device, impairment.loss)
        if not impairment.delay:
            return None
        return (impairment.delay if impairment.both_ways else 0.0, impairment.delay)

    @staticmethod
    def _drop_at_random(prefix: tuple[str, ...], device: str, loss: float) -> None:
        """Drop ``loss`` of the IP packets leaving ``device``, each by a draw of its own."""
        threshold = round(loss * (1 << 32))
        # A = random; A >= threshold: no class (sent on as usual); else the dropping class.
        program = f"4,32 0 0 {_LOAD_RANDOM},53 1 0 {threshold},6 0 0 {_DROP_CLASS},6 0 0 0"
        tc = (*prefix, "tc")
        _run(*tc, *f"qdisc add dev {device} root handle 1: htb".split())
        _run(*tc, *f"class add dev {device} parent 1: classid 1:2 htb rate 10gbit".split())
        _run(*tc, *f"qdisc add dev {device} parent 1:2 handle 2: pfifo limit 0".split())
        filter_ = f"filter add dev {device} parent 1: protocol ip prio 1 bpf bytecode"
        _run(*tc, *filter_.split(), program, "classid", "1:2")

    def packets_dropped(self) -> int:
        """Packets the impairment dropped so far, both ends (not those a cut dropped)."""
        outside = subprocess.run(
            ["tc", "-s", "qdisc", "show", "dev", self._outside], capture_output=True, text=True
        ).stdout
        inside = subprocess.run(
            self.command("tc", "-s", "qdisc", "show", "dev", self._inside),
            capture_output=True,
            text=True,
        ).stdout
        return _dropped(outside) + _dropped(inside)

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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._forwarder.pid, signal.SIGKILL)
            self._forwarder.wait()
        subprocess.run(["ip", "link", "del", self._outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
