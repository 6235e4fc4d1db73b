"""A replica's direct channel, both ends: one TCP connection per router carries that router's submits
and aborts in, and its deltas (with the KV events of the same steps) out, as length-prefixed pickles.
The replica listens (ChannelListener); a router connects (ChannelConnection, on its event loop).

Through Ray, every submit would be an actor task and every step's deltas the answer to a long poll:
two hops of Ray's task machinery on the path of a request's first token (milliseconds each on a busy
host, and work for the replica's process every step). Over the channel a submit is one write, and a
step's deltas one send from a thread that waits on the replica's outbox for that router.

A connection proves itself first with the replica's token (random, handed out only through a Ray call,
so only processes of the cluster hold it); nothing is unpickled before that. When a router's connection
closes, the replica aborts the requests sent over it at once: nobody can receive them any more. A peer
whose host vanished closes nothing; keepalive probes and a bound on unacknowledged sends end such a
connection within about ten seconds on Linux, and a router counts ten seconds of silence as a loss."""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cluster.messages import AddRequest, ReplicaOutput

log = logging.getLogger(__name__)

FRAME = struct.Struct("!I")  # a frame's payload length
HELLO = struct.Struct("!32sIB")  # token, subscriber, whether it takes KV events
POLL_S = 1.0  # an idle connection still gets a (heartbeat) frame this often
SILENCE_S = 10 * POLL_S  # a connection silent this long is lost (its peer's host is gone)
SUBMIT, ABORT = 0, 1


@dataclass(frozen=True)
class ChannelAddress:
    """Where a replica's channel listens, and the token a connection must present."""

    host: str
    port: int
    token: bytes


class ChannelEnd(Protocol):
    """What the channel needs of its replica (cluster.replica.actor.SchedulerActor)."""

    def submit(self, requests: list[AddRequest], subscriber: int = 0) -> None: ...
    def abort(self, uids: list[int]) -> None: ...
    def poll(
        self,
        timeout_s: float = 1.0,
        subscriber: int = 0,
        kv_events: bool = True,
        receives: Callable[[], bool] | None = None,
    ) -> ReplicaOutput: ...
    def release_subscriber(self, subscriber: int) -> int: ...


def detect_dead_peer(sock: socket.socket) -> None:
    """TCP keepalive probes after a few idle seconds, and a bound on unacknowledged sends: a peer whose
    host vanished (power, network) sends no FIN, and without these its connection would look open for
    many minutes (Linux's options; elsewhere keepalive alone)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", 5),
        ("TCP_KEEPINTVL", 2),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", int(SILENCE_S * 1000)),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(FRAME.pack(len(payload)) + payload)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes from sock; raises ConnectionError when it closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the channel closed")
        buf += chunk
    return bytes(buf)


class ChannelConnection:
    """A router's end: one connection to a replica's channel, on the router's event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(
        cls, address: ChannelAddress, subscriber: int, kv_events: bool, timeout_s: float = 10.0
    ) -> ChannelConnection:
        """Connects as router `subscriber` (taking the replica's KV events or not) and presents the token."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout_s)
        detect_dead_peer(writer.get_extra_info("socket"))
        writer.write(HELLO.pack(address.token, subscriber, kv_events))
        return cls(reader, writer)

    def send(self, submits: list[AddRequest], aborts: list[int]) -> None:
        """The router's submits and aborts, in one write (submits first: an abort may name one of them)."""
        out = b""
        for kind, items in ((SUBMIT, submits), (ABORT, aborts)):
            if items:
                payload = pickle.dumps((kind, items), protocol=pickle.HIGHEST_PROTOCOL)
                out += FRAME.pack(len(payload)) + payload
        if out:
            self._writer.write(out)

    async def receive(self) -> ReplicaOutput:
        """The replica's next message. The replica sends at least every POLL_S: a connection silent for
        SILENCE_S raises TimeoutError (its host is gone), a closed one IncompleteReadError."""
        header = await asyncio.wait_for(self._reader.readexactly(FRAME.size), SILENCE_S)
        (n,) = FRAME.unpack(header)
        return pickle.loads(await self._reader.readexactly(n))

    def close(self) -> None:
        self._writer.close()

    def abort(self) -> None:
        """Drops the connection at once, sending nothing more, as a network fault drops it."""
        self._writer.transport.abort()


class ChannelListener:
    """The replica's side: accepts routers' connections, each served by two threads (one reads its
    submits and aborts, one sends its deltas)."""

    def __init__(self, replica: ChannelEnd, host: str) -> None:
        self.replica = replica
        self._sock = socket.create_server((host, 0))
        self.address = ChannelAddress(host, self._sock.getsockname()[1], secrets.token_bytes(32))
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._current: dict[int, socket.socket] = {}  # subscriber -> its newest connection
        threading.Thread(target=self._accept_loop, name="channel-accept", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        with self._lock:
            conns = list(self._current.values())
        for conn in conns:
            _shutdown(conn)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="channel-in", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        detect_dead_peer(conn)
        try:
            conn.settimeout(10.0)  # a peer that connects and says nothing is not held on to
            token, subscriber, kv_events = HELLO.unpack(recv_exactly(conn, HELLO.size))
            if not hmac.compare_digest(token, self.address.token):
                log.warning("a channel connection presented a wrong token: closed")
                conn.close()
                return
            conn.settimeout(None)
        except (OSError, ConnectionError, struct.error):
            conn.close()
            return
        with self._lock:
            self._current[subscriber] = conn
        sent = _Sent()
        threading.Thread(
            target=self._send_loop, args=(conn, subscriber, bool(kv_events), sent), name="channel-out", daemon=True
        ).start()
        try:
            while True:
                (n,) = FRAME.unpack(recv_exactly(conn, FRAME.size))
                kind, body = pickle.loads(recv_exactly(conn, n))
                if kind == SUBMIT:
                    sent.add(r.uid for r in body)
                    self.replica.submit(body, subscriber)
                elif kind == ABORT:
                    sent.discard(body)
                    self.replica.abort(body)
        except (OSError, ConnectionError):
            pass  # the router is gone (or the replica is closing)
        except Exception:  # noqa: BLE001 - a frame this side cannot read: the connection is unusable
            log.exception("channel of router %d: a bad frame; closing it", subscriber)
        finally:
            _shutdown(conn)
            self._drop(conn, subscriber, sent)

    def _send_loop(self, conn: socket.socket, subscriber: int, kv_events: bool, sent: _Sent) -> None:
        def receives() -> bool:  # asked under the replica's lock, before its outbox is taken
            return self._current.get(subscriber) is conn

        try:
            while not self._closed.is_set():
                out = self.replica.poll(POLL_S, subscriber, kv_events, receives)
                sent.discard(d.uid for d in out if d.finished)
                send_frame(conn, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))  # taken while it received
                if not receives():
                    return  # a newer connection of the subscriber receives from now on
        except OSError:
            pass  # the router is gone (or the replica is closing)
        except Exception:  # noqa: BLE001 - the router must see the connection end, not wait on it
            log.exception("channel of router %d: sending failed; closing it", subscriber)
        finally:
            _shutdown(conn)

    def _drop(self, conn: socket.socket, subscriber: int, sent: _Sent) -> None:
        """The connection closed: the requests sent over it have no receiver and end here (whether or
        not the router has connected again since), and unless it has, what waits for it is dropped."""
        conn.close()
        if uids := sent.take():
            if not self._closed.is_set():
                self.replica.abort(uids)
                log.warning("router %d's channel closed: %d request(s) aborted", subscriber, len(uids))
        with self._lock:  # decided and released at once: a connection registering meanwhile keeps its own
            if self._current.get(subscriber) is conn:
                del self._current[subscriber]
                if not self._closed.is_set():
                    self.replica.release_subscriber(subscriber)


class _Sent:
    """The requests a connection sent that have not ended (its reader and its sender both change it)."""

    def __init__(self) -> None:
        self._uids: set[int] = set()
        self._lock = threading.Lock()

    def add(self, uids) -> None:
        with self._lock:
            self._uids.update(uids)

    def discard(self, uids) -> None:
        with self._lock:
            self._uids.difference_update(uids)

    def take(self) -> list[int]:
        with self._lock:
            uids, self._uids = sorted(self._uids), set()
        return uids


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
