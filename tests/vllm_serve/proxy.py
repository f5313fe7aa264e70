"""A TCP proxy between refit's trainer and a worker that can hold the trainer's
stream mid-update: the worker sees a trainer that stopped sending (or, once the
trainer is killed, one that went away) at a chosen byte of the update."""

from __future__ import annotations

import socket
import threading


class HoldingProxy:
    """Listens on a free port and forwards each connection to ``target``. Bytes
    from the target (the trainer) to the client (the worker) stop after
    ``hold_after`` of them, until :meth:`release`; the other direction always
    flows. When either side closes, the other is closed too."""

    def __init__(self, target: tuple[str, int], hold_after: int | None = None) -> None:
        self.target = target
        self.hold_after = hold_after
        self.forwarded = 0
        self.held = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        """Closes every connection now, as the kernel does for a killed process. A
        socket another thread is blocked in recv on would send its FIN only once
        that recv returned: shut each down first (that wakes the recv)."""
        self._closed = True
        self._release.set()
        for s in [self._listener, *self._sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if downstream and self.hold_after is not None:
                    with self._lock:
                        room = self.hold_after - self.forwarded
                    if room <= len(data) and not self._release.is_set():
                        if room > 0:
                            dst.sendall(data[:room])
                            data = data[room:]
                        with self._lock:
                            self.forwarded += max(room, 0)
                        self.held.set()
                        self._release.wait()
                        if self._closed:
                            break
                with self._lock:
                    self.forwarded += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
