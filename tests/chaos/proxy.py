"""A TCP proxy between one worker and its store that can stop forwarding without closing.

The proxy runs an asyncio loop in a daemon thread. :meth:`Proxy.pause` makes every pump
stop reading and writing while the sockets stay open: the worker sees a store that
accepts bytes and never answers (a partition, not a refused connection). :meth:`resume`
lets the bytes buffered meanwhile flow again. When the store closes a connection (a
restart), the proxy closes the worker's side too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import warnings
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Proxy", "proxy_in_front", "with_port"]


def with_port(url: str, port: int) -> str:
    """``url`` with its port replaced by ``port`` (to connect through a proxy)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit(":", 1)[0] + f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@contextlib.contextmanager
def proxy_in_front(url: str) -> Iterator[Proxy]:
    """A started :class:`Proxy` in front of the server of ``url``; at the end resumed and
    closed, and the connections opened through it collected (collected later, their
    streams would warn "loop is closed" in another test)."""
    port = urlsplit(url).port
    assert port is not None, url
    proxy = Proxy(port)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.resume()
        proxy.close()
        del proxy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


class Proxy:
    """Forward 127.0.0.1:``port`` to ``upstream_port``, pausable."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._gate = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"proxy-{upstream_port}")

    def start(self) -> int:
        """Start listening; return the port the worker should connect to."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.port

    async def _start(self) -> None:
        self._gate.set()
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def paused(self) -> bool:
        """True while the proxy forwards nothing."""
        return not self._gate.is_set()

    def pause(self) -> None:
        """Stop forwarding in both directions; keep every socket open."""
        self._loop.call_soon_threadsafe(self._gate.clear)

    def resume(self) -> None:
        """Forward again, starting with what was buffered meanwhile."""
        self._loop.call_soon_threadsafe(self._gate.set)

    def close(self) -> None:
        """Close every connection and stop the thread."""
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            # Cancel what is left (pumps of closed connections), then close the loop.
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._gate.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._gate.wait()
                data = await reader.read(65536)
                if not data:
                    break
                # Bytes read just before a pause are held back until the resume.
                await self._gate.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # One side closed: close both, so the other pump ends too.
            writer.close()
