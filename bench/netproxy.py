"""A TCP proxy whose connections drop: a link that breaks every so many bytes, for tests and
benchmarks of streams that must survive it (real sockets, the real gRPC transport on both
sides), or whose connections go silent (:meth:`DroppingProxy.blackhole`: a peer gone without a
word, as a node that died or a partition)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from types import TracebackType


class DroppingProxy:
    """Listens on 127.0.0.1 and forwards each connection to ``target`` (host:port). Each of
    the first ``drops`` connections is cut (both directions, as a dropped link) once
    ``drop_after`` bytes went from the target to the client; later ones are not cut.
    ``on_cut``: called (in the proxy's thread) right before each cut. :meth:`blackhole` makes
    the connections open so far silent."""

    def __init__(
        self,
        target: str,
        drop_after: int,
        drops: int,
        on_cut: Callable[[], object] | None = None,
    ) -> None:
        self.on_cut = on_cut
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.drop_after = drop_after
        self.drops_left = drops
        self.cut = 0  # connections cut so far
        self.forwarded = 0  # bytes that went from the target to clients
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        #: connections whose bytes are dropped (kept open, nothing forwarded either way)
        self._silent: set[int] = set()
        self.silenced = 0  # bytes dropped on silent connections
        self.accepted = 0  # connections accepted so far
        self.target_closed = 0  # connections the target ended (EOF or reset from its side)
        self._thread = threading.Thread(target=self._accept, name="proxy", daemon=True)

    def __enter__(self) -> DroppingProxy:
        self._thread.start()
        return self

    def __exit__(
        self,
        t: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            _close(s)
        self._listener.close()

    def blackhole(self) -> int:
        """From now on, drop every byte of the connections open so far, both ways, and keep
        them open: to each end its peer went silent (no FIN, no RST), as a host that died or
        a partition. Connections opened later are forwarded. Returns how many went silent."""
        with self._lock:
            pairs = {id(s) for s in self._socks}
            self._silent |= pairs
            return len(pairs) // 2

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                limit = self.drop_after if self.drops_left > 0 else None
                if limit is not None:
                    self.drops_left -= 1
                self._socks += [client, upstream]
                self.accepted += 1
            pair = (client, upstream)
            for args in (
                (client, upstream, None, pair, False),
                (upstream, client, limit, pair, True),
            ):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        limit: int | None,
        pair: tuple[socket.socket, socket.socket],
        down: bool,
    ) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    if down:
                        with self._lock:
                            self.target_closed += 1
                    break
                if id(src) in self._silent:
                    with self._lock:
                        self.silenced += len(data)
                    continue
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: max(0, limit - sent)])
                    if down:
                        with self._lock:
                            self.forwarded += max(0, limit - sent)
                    if self.on_cut is not None:
                        self.on_cut()
                    with self._lock:
                        self.cut += 1
                    break
                dst.sendall(data)
                sent += len(data)
                if down:
                    with self._lock:
                        self.forwarded += len(data)
        except OSError:
            if down and not self._stop.is_set():
                with self._lock:
                    self.target_closed += 1
        if id(src) in self._silent:  # nothing reaches the other end: it stays silent
            _close(src)
            return
        for s in pair:  # either side ending ends the link
            _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
