"""A TCP proxy on loopback that cuts connections: what a flaky network does to an upload.

Each client connection is forwarded to ``target``; once ``cut_after`` bytes went from
the client to the server on one connection (keep-alive requests add up), that connection
is reset (SO_LINGER 0: the peer sees ECONNRESET mid-request). ``cuts`` says how many
connections to cut that way (-1: every one that crosses the mark).

``lose_response_of`` (byte strings all found in a request, e.g. its method and path) lets
such a request
reach the server and resets the connection as the response comes back: the server did
the work, the client never hears of it (``losses`` times)."""

from __future__ import annotations

import socket
import struct
import threading


class CuttingProxy:
    def __init__(self, target: tuple[str, int], *, cut_after: int = 1 << 62, cuts: int = 1,
                 lose_response_of: tuple[bytes, ...] = (), losses: int = 1) -> None:
        self.target = target
        self.lose_response_of = lose_response_of
        self.losses_left = losses
        self.lost = 0
        self.cut_after = cut_after
        self.cuts_left = cuts
        self.cut = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            state = {"lose": False}
            for args in ((client, server, True, state), (server, client, False, state)):
                threading.Thread(target=self._pipe, args=args, daemon=True).start()

    def _should_cut(self, sent: int) -> bool:
        with self._lock:
            if sent >= self.cut_after and self.cuts_left != 0:
                self.cuts_left -= 1
                self.cut += 1
                return True
        return False

    @staticmethod
    def _reset(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # shutdown wakes the other direction's thread blocked in recv on it (a
                # bare close would wait for that recv before the peer hears anything).
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass

    def _marks(self, data: bytes) -> bool:
        if not self.lose_response_of or not all(m in data for m in self.lose_response_of):
            return False
        with self._lock:
            if self.losses_left == 0:
                return False
            self.losses_left -= 1
            self.lost += 1
        return True

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool,
              state: dict) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                sent += len(data)
                if upstream and self._should_cut(sent):
                    self._reset(src, dst)
                    return
                if upstream and self._marks(data):
                    state["lose"] = True
                if not upstream and state["lose"]:
                    self._reset(src, dst)  # the server answered; the client never hears
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
