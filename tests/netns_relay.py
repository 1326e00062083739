"""A TCP forwarder that delays what it forwards: the link delay of tests/netns.py's hosts.

Used in place of socat when the kernel has no ``sch_netem`` (no ``tc ... netem delay``):
every chunk read from one side is written to the other ``delay`` seconds later, in order,
so each request and each response arrives that much later, as over a slow link. Packet
loss is done in the kernel (see ``NetnsHost``); this only delays. Standard library only,
run by path:

    python tests/netns_relay.py LISTEN_HOST LISTEN_PORT TARGET TO_SERVER_DELAY TO_CLIENT_DELAY

TARGET is ``tcp:HOST:PORT`` or ``unix:PATH`` (the embedded server's socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time

CHUNK = 65536

# The connections' tasks: the event loop keeps only weak references to tasks, and a
# connection whose transport is gone must still be seen through to its end.
_LIVE: set[asyncio.Task[None]] = set()


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, reader_name: str
) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read.

    Returns after passing the EOF on; raises when either side breaks.
    """
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

    async def feed() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                pending.put_nowait((loop.time() + delay, data))
                if not data:
                    return
        except OSError as exc:
            _log(f"{reader_name} broke: {exc!r}")
            pending.put_nowait((loop.time(), None))  # broken: no delay for that

    feeding = asyncio.ensure_future(feed())
    try:
        while True:
            due, data = await pending.get()
            if data is None:
                raise ConnectionResetError("the other side broke the connection")
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    finally:
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


async def _relay(
    client_reader: asyncio.StreamReader,
    client: asyncio.StreamWriter,
    target: str,
    to_server: float,
    to_client: float,
) -> None:
    # A client that went away in a cut is noticed in about a minute (longer than any cut),
    # so its server session does not linger for the rest of the test.
    sock = client.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    try:
        if target.startswith("unix:"):
            server_reader, server = await asyncio.open_unix_connection(target[5:])
        else:
            _, host, port = target.split(":", 2)
            server_reader, server = await asyncio.open_connection(host, int(port))
    except OSError as exc:
        _log(f"cannot reach the server: {exc!r}")
        client.transport.abort()
        return
    pumps = {
        asyncio.ensure_future(_pump(client_reader, server, to_server, "the client")),
        asyncio.ensure_future(_pump(server_reader, client, to_client, "the server")),
    }
    try:
        # Both ways end on their EOF; a break on either side ends the connection, as
        # socat does.
        done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        for pump in done:
            if pump.exception() is not None:
                _log(f"a connection ended: {pump.exception()!r}")
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for writer in (client, server):
            writer.transport.abort()


async def _serve(
    listen_host: str, listen_port: int, target: str, to_server: float, to_client: float
) -> asyncio.Server:
    async def handle(client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        _LIVE.add(task)
        try:
            await _relay(client_reader, client, target, to_server, to_client)
        finally:
            _LIVE.discard(task)

    return await asyncio.start_server(handle, listen_host, listen_port, reuse_address=True)


async def _main(argv: list[str]) -> None:
    listen_host, listen_port, target, to_server, to_client = argv
    server = await _serve(listen_host, int(listen_port), target, float(to_server), float(to_client))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1:6]))
