"""A TCP forwarder between a worker and the shared Redis that can break the network on cue.

Real sockets, real failures, no mocks, and no need to restart the (shared) Redis:

    with TcpProxy("127.0.0.1", 6379) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        proxy.drop_at(b"EXEC", after=False)  # next MULTI/EXEC never reaches Redis: connection reset
        proxy.drop_at(b"EXEC", after=True)   # next EXEC runs on Redis, but its reply is lost
        proxy.drop_at(b"EXEC", after=True, late=True)  # ...and only when the client sends EXEC again, just before
        proxy.drop_at(b"XLEN", after=False, outage=True)  # next XLEN: an outage begins (cut) until restore()
        proxy.cut(); ...; proxy.restore()    # outage: every connection reset, new ones refused
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._triggers: list[tuple[bytes, bool, bytes | None, int, bool]] = []  # (pattern, after, late's release,
        # skip, outage)
        self._held: tuple[bytes, socket.socket, bytes, int] | None = None  # a late command: (release, server, data,
        # releasing commands still to let through first)
        self.triggered = threading.Event()  # every armed trigger fired
        self.released = threading.Event()  # a held late command was sent on
        self._muted: dict[socket.socket, threading.Event] = {}  # server -> set when its reply came (and was dropped)
        self.connections = 0

    # ---------------------------------------------------------------- control
    def start(self) -> TcpProxy:
        self._listen()
        return self

    def drop_at(
        self,
        command: bytes,
        *,
        after: bool,
        first_arg: bytes | None = None,
        late: bool | bytes = False,
        late_skip: int = 0,
        outage: bool = False,
    ) -> None:
        """One shot: when a client sends ``command`` (e.g. b"EXEC"; with ``first_arg``, only that call of it, e.g.
        one script's EVALSHA), reset that client's connection, forwarding the command to Redis first if ``after``
        (so it runs but the reply is lost). ``late`` (with ``after``): it reaches Redis, on its own connection, only
        when a client sends ``command`` again (or the command ``late`` names), just before that: a try stuck in the
        network, landing under the retry that followed its lost reply; ``late_skip``: that many of those pass first.
        ``outage`` (without ``after``): the command is not sent and every connection is cut, new ones refused, until
        ``restore()``: Redis gone at that very point of a client's work. Armed together, several fire in turn.
        Matched within one read of a client's data: the tests' transactions are small (redis-py sends one past ~6 KB
        in several writes, and its EXEC might not be in the read that fires)."""
        self.triggered.clear()
        self.released.clear()
        release = _pattern(late if isinstance(late, bytes) else command) if late else None
        with self._lock:
            self._triggers.append((_pattern(command, first_arg), after, release, late_skip, outage))

    def cut(self) -> None:
        """Reset every connection and refuse new ones until ``restore()``."""
        with self._lock:
            listener, self._listener = self._listener, None
            pairs, self._pairs = self._pairs, []
        if listener is not None:
            _close(listener)
        for a, b in pairs:
            _close(a)
            _close(b)

    def restore(self) -> None:
        self._listen()

    def close(self) -> None:
        self.cut()

    # --------------------------------------------------------------- plumbing
    def _listen(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.port = s.getsockname()[1]
        with self._lock:
            self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:
                    _close(client)
                    _close(server)
                    return
                self._pairs.append((client, server))
                self.connections += 1
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            held = self._take_held(data) if from_client else None
            if held is not None:
                self._send_held(held[1], held[2])
            if not from_client and src in self._muted:  # the reply to a command run "after": never delivered
                self._muted.pop(src).set()
                break
            trigger = self._fired(data) if from_client else None
            if trigger is not None:
                _, after, release, skip, outage = trigger
                if outage:
                    self.cut()
                    self._fire_done()
                    break
                if after and release is not None:
                    with self._lock:  # before the reset: the client's retry may come at once
                        self._held = (release, dst, data, skip)
                    _close(src)  # the client sees a reset
                    self._fire_done()
                    return  # its server connection stays open (and its WATCHes with it) until it is sent
                if after:  # it runs, and its reply is dropped, before the client sees a reset: in that order
                    self._run_muted(dst, data)
                _close(src)
                self._fire_done()
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        _close(src)
        _close(dst)

    def _take_held(self, data: bytes) -> tuple[bytes, socket.socket, bytes, int] | None:
        """The held command, if ``data`` is the client command that releases it (taken once, under the lock)."""
        with self._lock:
            held = self._held
            if held is None or held[0] not in data.upper():
                return None
            if held[3] > 0:
                self._held = (*held[:3], held[3] - 1)
                return None
            self._held = None
            return held

    def _fired(self, data: bytes) -> tuple[bytes, bool, bytes | None, int, bool] | None:
        upper = data.upper()
        with self._lock:
            for trigger in self._triggers:
                if trigger[0] in upper:
                    self._triggers.remove(trigger)
                    return trigger
        return None

    def _fire_done(self) -> None:
        with self._lock:
            if not self._triggers:
                self.triggered.set()

    def _run_muted(self, server: socket.socket, data: bytes) -> None:
        """Send ``data`` to Redis on ``server`` and wait for its reply, which the server's pump drops: it has run."""
        replied = self._muted.setdefault(server, threading.Event())
        try:
            server.sendall(data)
        except OSError:
            pass
        replied.wait(5)

    def _send_held(self, server: socket.socket, data: bytes) -> None:
        """The held command, run on its own connection before the command that released it is forwarded."""
        self._run_muted(server, data)
        _close(server)
        self.released.set()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _pattern(command: bytes, first_arg: bytes | None = None) -> bytes:
    """How ``command`` (and its first argument) look on the wire, matched case-blind."""
    pattern = b"$%d\r\n%s\r\n" % (len(command), command.upper())
    if first_arg is not None:
        pattern += b"$%d\r\n%s\r\n" % (len(first_arg), first_arg.upper())
    return pattern


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
