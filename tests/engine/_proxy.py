"""A TCP proxy on loopback that cuts connections: what a flaky network does to an upload.

Each client connection is forwarded to ``target``; once ``cut_after`` bytes went from
the client to the server on one connection (keep-alive requests add up), that connection
is reset (SO_LINGER 0: the peer sees ECONNRESET mid-request). ``cuts`` says how many
connections to cut that way (-1: every one that crosses the mark)."""

from __future__ import annotations

import socket
import struct
import threading


class CuttingProxy:
    def __init__(self, target: tuple[str, int], *, cut_after: int, cuts: int = 1) -> None:
        self.target = target
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
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

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
                s.close()
            except OSError:
                pass

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
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
