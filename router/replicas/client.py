"""The router's side of one replica: submits and aborts are written at once, the first of an
event-loop tick, and the rest of that tick's in one message at its end; every request's deltas
arrive in one message per scheduler step, both over the replica's direct channel (cluster/channel.py;
Ray calls only start it and check health). It counts the requests it sent that have no token yet:
the replica's queue as the router sees it, for admission. It keeps the block hashes the replica's
prefix cache holds from the KV events that come with the deltas, starting from a snapshot it asks
for when it starts (for cache-exact routing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster import (
    AddRequest,
    ChannelAddress,
    ChannelConnection,
    ErrorKind,
    KVEvents,
    ReplicaOutput,
    SamplingParams,
    ServeConfig,
    TokenDelta,
)

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


class ReplicaClient:
    def __init__(
        self,
        replica_id: int,
        actor: ActorHandle,
        health_timeout_s: float = 30.0,
        subscriber: int = 0,
        kv_events: bool = True,
    ) -> None:
        """`subscriber`: this router's index among the routers sending to the replica (each receives its
        own requests' deltas). `kv_events`: receive the replica's cache contents (a client that routes
        nothing, the launching process's beside router actors, need not: the replica then keeps no
        changes for it)."""
        self.replica_id, self.actor, self.subscriber, self.kv_events = replica_id, actor, subscriber, kv_events
        self.channel: ChannelConnection | None = None  # once connected
        self._connecting = True  # until the channel is up: submits wait in _submits
        self.health_timeout_s = health_timeout_s
        self.queues: dict[int, asyncio.Queue] = {}
        # sent and without a token yet (waiting in the replica's queue, or in its first prefill): prompt tokens
        self.queued: dict[int, int] = {}
        self.queued_tokens = 0
        self._submits: list[AddRequest] = []
        self._aborts: list[int] = []
        self._on_sent: list[Callable[[float], None]] = []  # told when the submits waiting now are written
        self._flush_pending = False
        self._tick_written = False  # a message has been written this event-loop tick
        self.error: str | None = None
        self._poller: asyncio.Task | None = None
        self._error_check: asyncio.Task | None = None
        # the block hashes the replica's prefix cache holds, and the page size they are of; None
        # until its snapshot has arrived
        self.kv_blocks: set[int] | None = None
        self.page_size: int | None = None
        self.replica_live = 0  # requests the replica held at its last message, every router's
        # drained (drain()): routed nothing new; its streams moved to other replicas, or left to end
        self.draining = False
        # waiting requests handed over to another replica's client (hand_over), until their generation
        # takes the notice (it moves them, or leaves one that has had a token or ended meanwhile) or
        # aborts them: an entry outlives the request's end here, so a late notice is known for one
        self.moving: dict[int, ReplicaClient] = {}
        self._idle = asyncio.Event()  # set while no request of this router is on the replica
        self._idle.set()

    @property
    def load(self) -> int:
        return len(self.queues)

    @property
    def routing_load(self) -> int:
        """The load to balance on: the replica's own count when it holds more than this router sent it
        (other routers send to it too); this router's when newer (sent since the replica's message)."""
        return max(len(self.queues), self.replica_live)

    @property
    def healthy(self) -> bool:
        return self.error is None

    def has_room(
        self, num_tokens: int, max_requests: int | None, max_tokens: int | None, num_requests: int = 1
    ) -> bool:
        """Whether num_requests requests of num_tokens each (the choices of one request) would fit the
        replica's queue bounds (its own check, in PrefillManager.check_room, is the same; this count
        also holds requests in their first prefill)."""
        n = len(self.queued)
        if max_requests is not None and n + num_requests > max_requests:
            return False
        return max_tokens is None or not n or self.queued_tokens + num_tokens * num_requests <= max_tokens

    def _dequeue(self, uid: int) -> None:
        if (n := self.queued.pop(uid, None)) is not None:
            self.queued_tokens -= n

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def stop(self) -> None:
        """Stops receiving; the requests still waiting here end (their replica was replaced, or the
        router stops), so that none waits for deltas that will never come."""
        for task in (self._poller, self._error_check):
            if task is not None:
                task.cancel()
        self._close_channel()
        self._fail_requests(f"replica {self.replica_id}'s client stopped")

    def submit(
        self,
        uid: int,
        ids: list[int],
        params: SamplingParams,
        after: int | None = None,
        queue: asyncio.Queue | None = None,
        output_len: int = 0,
        on_sent: Callable[[float], None] | None = None,
    ) -> asyncio.Queue:
        """Sends the request with the next flush and returns the queue its deltas arrive on: `queue`
        when given, so that the choices of one request share one (`after`, `output_len`: see AddRequest).
        `on_sent`: called with the time (time.perf_counter) it was written to the replica's channel."""
        queue = asyncio.Queue() if queue is None else queue
        self.queues[uid] = queue
        self._idle.clear()
        self.queued[uid] = len(ids)
        self.queued_tokens += len(ids)
        self._submits.append(AddRequest(uid, ids, params, after=after, output_len=output_len))
        if on_sent is not None:
            self._on_sent.append(on_sent)
        self._schedule_flush()
        return queue

    def abort(self, uid: int) -> None:
        self._dequeue(uid)
        self.moving.pop(uid, None)
        if self._pop(uid) is not None:
            self._aborts.append(uid)
            self._schedule_flush()

    def _pop(self, uid: int) -> asyncio.Queue | None:
        queue = self.queues.pop(uid, None)
        if not self.queues:
            self._idle.set()
        return queue

    async def drain(self) -> int:
        """Takes the replica out of routing (the replica itself serves on) and empties it of this
        router's requests: each gets a notice, after the tokens that came before it, on which its
        generation moves it to another replica (router/replicas/migration.py) and aborts it here; one
        that may not move runs to its end here. Returns once none is left; how many were noticed."""
        self.draining = True
        noticed = list(self.queues)
        for uid in noticed:  # not finished: only the generation ends it, by a move (an abort) or its end
            why = f"replica {self.replica_id} was drained"
            self.queues[uid].put_nowait(TokenDelta(uid, None, error=why, error_kind=ErrorKind.REPLICA_DOWN))
        await self._idle.wait()
        return len(noticed)

    @property
    def outgoing(self) -> list[ReplicaClient]:
        """The client each handed-over request that still waits here is going to."""
        return [to for uid, to in self.moving.items() if uid in self.queued]

    @property
    def waiting(self) -> list[int]:
        """This router's requests on the replica that have no token yet and are not being handed over,
        the first sent first."""
        return [uid for uid in self.queued if uid not in self.moving]

    def hand_over(self, count: int, to: ReplicaClient) -> int:
        """Moves up to `count` of this router's waiting requests, the last sent first (they would wait
        longest here), to the replica of `to` (router/replicas/rebalance.py): each gets a notice, after
        the tokens that came before it, on which its generation sends it there as it stands and aborts it
        here, or, should `to` have no room by then (or the request have had a token meanwhile), leaves it
        here. Returns how many."""
        uids = self.waiting[::-1][:count]
        for uid in uids:
            self.moving[uid] = to
            why = f"replica {self.replica_id}'s waiting request moves to replica {to.replica_id}"
            self.queues[uid].put_nowait(TokenDelta(uid, None, error=why, error_kind=ErrorKind.REPLICA_DOWN))
        return len(uids)

    def undrain(self) -> None:
        """Routes to the replica again."""
        self.draining = False

    def _schedule_flush(self) -> None:
        if self._flush_pending:
            return
        self._flush_pending = True
        loop = asyncio.get_running_loop()
        if self._tick_written:  # written once this tick: the rest of the tick's messages go in one write after it
            loop.call_soon(self._flush)
            return
        # the first of a tick goes at once: at the tick's end it would wait for the rest of its handler's
        # work (the response's start, the first read of its stream) before the replica could see it
        self._tick_written = True
        loop.call_soon(self._end_tick)
        self._flush()

    def _end_tick(self) -> None:
        self._tick_written = False

    def _flush(self) -> None:
        self._flush_pending = False
        if self._connecting or self.channel is None:
            return  # sent once the channel is up
        self.channel.send(self._submits, self._aborts)
        self._submits, self._aborts = [], []
        if self._on_sent:
            now, told, self._on_sent = time.perf_counter(), self._on_sent, []
            for on_sent in told:
                on_sent(now)

    def apply_kv_events(self, events: KVEvents | None) -> None:
        if events is None:
            return
        if events.full:
            self.kv_blocks, self.page_size = set(events.stored), events.page_size
        elif self.kv_blocks is not None:  # changes before the snapshot are in it
            self.kv_blocks.difference_update(events.removed)
            self.kv_blocks.update(events.stored)

    async def _subscribe_kv(self) -> None:
        try:
            await self.actor.kv_subscribe.remote(self.subscriber)
        except Exception as e:  # noqa: BLE001 - routing goes on without this replica's cache contents
            log.warning(
                "replica %d sends no KV events (%s: %s); cache-exact routing cannot see its cache",
                self.replica_id,
                type(e).__name__,
                e,
            )

    async def _poll_loop(self) -> None:
        while await self._connect() and await self._receive():
            pass

    async def _connect(self) -> bool:
        """Opens the replica's channel and sends what waited for it. A replica whose channel cannot be
        reached is failed, as one whose connection closes for good is: nothing else carries its traffic."""
        try:
            if self.kv_events:  # a snapshot first, with the first message (again after a lost connection)
                await self._subscribe_kv()
            address: ChannelAddress | None = await self.actor.channel_address.remote()
            if address is None:
                raise ConnectionError("the replica has no channel")
            self.channel = await ChannelConnection.open(address, self.subscriber, self.kv_events)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an actor gone, or a channel refused: the replica cannot serve here
            self.mark_failed(f"replica {self.replica_id}'s channel cannot be reached: {type(e).__name__}: {e}")
            log.error("replica %d: %s", self.replica_id, self.error)
            return False
        self._connecting = False
        self._flush()
        return True

    async def _receive(self) -> bool:
        """Takes the channel's messages until it closes. Returns whether to connect again: the replica
        still serves, but this connection was lost (its requests there are aborted, and fail here)."""
        try:
            while True:
                self._take(await self.channel.receive())
        except asyncio.CancelledError:
            self._close_channel()
            raise
        except Exception as e:  # noqa: BLE001 - closed, reset, silent, or a message this side cannot read
            lost = f"{type(e).__name__}: {e}"
        self._close_channel()
        self._connecting = True  # what is submitted from now on waits for the next connection
        unsent = {r.uid for r in self._submits}
        sent = [uid for uid in self.queues if uid not in unsent]  # the replica has aborted these
        if (why := await self.check_health()) is not None:
            self.mark_failed(why)
            log.error("replica %d: channel closed (%s)", self.replica_id, lost)
            return False
        log.warning(
            "replica %d: channel lost (%s) while the replica serves; its requests fail, reconnecting",
            self.replica_id,
            lost,
        )
        self._fail_requests(f"the connection to replica {self.replica_id} was lost", sent)
        return True

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _take(self, deltas: ReplicaOutput) -> None:
        """One message of the replica: its deltas to their requests' queues, its KV events and count."""
        self.apply_kv_events(deltas.kv_events)
        self.replica_live = deltas.live or 0
        now = time.perf_counter()
        for d in deltas:
            if d.hops is not None:
                d.hops.router_received = now
            if self.queued:
                self._dequeue(d.uid)
            queue = self.queues.get(d.uid)
            if queue is not None:
                queue.put_nowait(d)
                if d.finished:
                    self._pop(d.uid)
        if any(d.error is not None for d in deltas) and self._error_check is None:
            # stop routing to a broken replica now, not at the supervisor's next round; in a task,
            # so later deltas are not held up while it waits for an answer
            self._error_check = asyncio.get_running_loop().create_task(self._check_after_error())

    async def _check_after_error(self) -> None:
        try:
            if (why := await self.check_health()) is not None and self.healthy:
                self.mark_failed(why)
        finally:
            self._error_check = None

    async def check_health(self) -> str | None:
        """None when the replica answers that it serves; otherwise why it cannot. A busy replica on a
        loaded host may take seconds to answer, so only a long silence counts as a hang."""
        try:
            why = await asyncio.wait_for(self.actor.health.remote(), self.health_timeout_s)
        except TimeoutError:
            return f"replica {self.replica_id} has not answered a health check in {self.health_timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - the actor is gone
            return f"replica {self.replica_id} failed: {type(e).__name__}"
        return None if why is None else f"replica {self.replica_id} is broken: {why}"

    def mark_failed(self, why: str) -> None:
        self.error = why
        self._fail_requests(why)
        self.kv_blocks = None

    def _fail_requests(self, why: str, uids: list[int] | None = None) -> None:
        """Ends these requests (None: every one) with why."""
        for uid in list(self.queues) if uids is None else uids:
            if (queue := self._pop(uid)) is not None:
                queue.put_nowait(TokenDelta.failure(uid, ErrorKind.REPLICA_DOWN, why))
            self._dequeue(uid)
        if uids is None:
            self.queued.clear()
            self.queued_tokens = 0


def client_for(replica, config: ServeConfig, subscriber: int = 0, kv_events: bool = True) -> ReplicaClient:
    """The router's client of a started replica (a ReplicaHandle, or a router.tier.actor.ReplicaRef; not
    yet receiving: start() it on the event loop); `subscriber`: the router's index; `kv_events`: see
    ReplicaClient."""
    return ReplicaClient(replica.replica_id, replica.actor, config.health_check_timeout_s, subscriber, kv_events)
