"""The routers a replica sends to, each a subscriber (its index; 0 is the launching process): which
requests each sent, the outbox its deltas and KV events wait in until it polls, and the condition its
poll waits on. A replica that has failed answers every request with its error from here.

One lock guards it all; each subscriber's poll waits on its own condition of that lock, so a step
wakes only the routers it has deltas for (an idle poller woken at every step would take the
interpreter from the scheduler thread for nothing)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from cluster.errors import ErrorKind
from cluster.messages import ReplicaOutput, TokenDelta
from cluster.scheduler.prefix_cache.events import KVEventStream

SUBSCRIBER_TIMEOUT_S = 60.0  # a router silent this long is gone: its requests are aborted
# the longest a step's publisher waits for a first token's sender to take it (publish), and the most
# requests running for it to wait at all: the wait is for time to first token at low load; under load the
# scheduler thread goes straight on to its next step
HANDOVER_S = 0.002
HANDOVER_MAX_LIVE = 8


class Subscribers:
    def __init__(self, kv: KVEventStream | None = None, timeout_s: float = SUBSCRIBER_TIMEOUT_S) -> None:
        """`kv`: the prefix cache's event stream (None: the replica sends no KV events)."""
        self.kv, self.timeout_s = kv, timeout_s
        self.failed: str | None = None  # why the replica cannot serve any more
        self._outboxes: dict[int, list[TokenDelta]] = {}
        self._owner: dict[int, int] = {}  # uid -> the subscriber that submitted it (0 is not kept)
        self._last_poll: dict[int, float] = {}  # subscriber -> when it last polled (monotonic)
        self._live: set[int] = set()  # submitted and not yet finished
        self._lock = threading.Lock()
        self._wakeups: dict[int, threading.Condition] = {}
        self._waiting: dict[int, int] = {}  # subscriber -> its polls waiting for deltas now
        self._taken = threading.Condition(self._lock)  # an outbox was taken
        self._closed = False

    @property
    def num_live(self) -> int:
        """Requests submitted and not ended, every subscriber's."""
        return len(self._live)

    def is_live(self, uid: int) -> bool:
        return uid in self._live

    def polling(self, subscriber: int = 0) -> bool:
        """Whether a poll of subscriber's waits for deltas now."""
        with self._lock:
            return bool(self._waiting.get(subscriber))

    def owner(self, uid: int) -> int | None:
        """The subscriber a live request's deltas go to (None once it has ended)."""
        with self._lock:
            return self._owner.get(uid, 0) if uid in self._live else None

    def submitted(self, uids: list[int], subscriber: int = 0) -> bool:
        """Counts these requests as subscriber's from now on. False when the replica has failed: their
        error deltas then wait in subscriber's outbox, and they must not run."""
        with self._lock:
            if self.failed is not None:
                self._deliver_to(subscriber, _error_deltas(uids, self.failed))
                return False
            self._live.update(uids)
            if subscriber:
                self._owner.update((uid, subscriber) for uid in uids)
        return True

    def aborted(self, uids: list[int]) -> None:
        """These requests end with no delta: they leave the live set here."""
        with self._lock:
            self._live.difference_update(uids)
            for uid in uids:
                self._owner.pop(uid, None)

    def publish(
        self, deltas: list[TokenDelta], stored: Sequence[int] = (), removed: Sequence[int] = ()
    ) -> list[TokenDelta]:
        """One step's deltas into their subscribers' outboxes, with the step's cache changes (a finished
        request's pages among them: in the same message), waking those subscribers' polls. Once the
        replica has failed, only deltas of requests still live go (it ended the others with its error).
        Returns the deltas delivered."""
        with self._lock:
            if self.failed is not None:
                deltas = [d for d in deltas if d.uid in self._live]
            self._live.difference_update(d.uid for d in deltas if d.finished)
            owners, first = set(), set()
            for d in deltas:
                owner = self._owner.pop(d.uid, 0) if d.finished else self._owner.get(d.uid, 0)
                self._outboxes.setdefault(owner, []).append(d)
                owners.add(owner)
                if d.hops is not None and d.hops.sampled_at is not None:
                    first.add(owner)
            self._add_kv_events(stored, removed)
            self._notify(owners)
            # a woken sender needs the interpreter, which this (the scheduler's) thread holds until its
            # Python blocks or the switch interval runs out: waiting here for a first token's take hands
            # the interpreter over at once. Only for a poll already waiting, at low load, and briefly
            hand = [owner for owner in first if self._waiting.get(owner)]
            if hand and len(self._live) <= HANDOVER_MAX_LIVE:
                # until each is taken, or no poll waits for it any more
                self._taken.wait_for(
                    lambda: not any(self._outboxes.get(o) and self._waiting.get(o) for o in hand), HANDOVER_S
                )
        return deltas

    def add_kv_events(self, stored: Sequence[int], removed: Sequence[int]) -> None:
        """Cache changes of a step without deltas: they go with the next ones."""
        if stored or removed:
            with self._lock:
                self._add_kv_events(stored, removed)

    def fail(self, why: str) -> int | None:
        """Ends every live request with why, and answers every later submit with it. Returns how many
        requests it ended; None when the replica had failed already."""
        with self._lock:
            if self.failed is not None:
                return None
            self.failed = why
            live = sorted(self._live)
            for uid in live:
                self._outboxes.setdefault(self._owner.pop(uid, 0), []).append(_error_deltas([uid], why)[0])
            self._live.clear()
            self._notify(self._wakeups)
        return len(live)

    def release(self, subscriber: int) -> list[int]:
        """Forgets subscriber (a router that restarted, or whose connection closed): drops what waits for
        it, and returns the live requests it sent, for the replica to abort."""
        with self._lock:
            return self._release_locked(subscriber)

    def release_silent(self, now: float) -> dict[int, list[int]]:
        """Releases the routers (subscribers 1 and up) that have not polled for timeout_s: a router polls
        at least every second, so one that stopped is gone for good (Ray would have restarted it by
        then), and its requests must not run on for no one. Returns each one's live requests."""
        with self._lock:  # decided and released at once: a poll in between would keep the router
            silent = [sub for sub, seen in self._last_poll.items() if sub and now - seen > self.timeout_s]
            return {sub: self._release_locked(sub) for sub in silent}

    def poll(
        self,
        timeout_s: float = 1.0,
        subscriber: int = 0,
        kv_events: bool = True,
        receives: Callable[[], bool] | None = None,
    ) -> ReplicaOutput:
        """Every delta for subscriber since its last poll, and (`kv_events`) the KV events since then;
        waits up to timeout_s for the first delta (or a snapshot due). Changes to the cache alone wake no
        poll: they go with the next deltas, so a step is one message. A subscriber that polls without
        kv_events is no receiver of them: nothing is kept for it. `receives`: asked (the lock held)
        before anything is taken; when it says no, the poll takes nothing (a channel's connection that
        a newer one of its router has replaced must leave the deltas to that one)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            wakeup = self._wakeups.get(subscriber)
            if wakeup is None:
                wakeup = self._wakeups[subscriber] = threading.Condition(self._lock)
            self._waiting[subscriber] = self._waiting.get(subscriber, 0) + 1
            try:
                while (
                    not self._outboxes.get(subscriber)
                    and not (kv_events and self._snapshot_due(subscriber))
                    and not self._closed
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wakeup.wait(left)
            finally:
                self._waiting[subscriber] -= 1
            if receives is not None and not receives():
                self._taken.notify_all()  # a publisher waiting for this poll's take waits no more
                return ReplicaOutput([], None, len(self._live))
            self._last_poll[subscriber] = time.monotonic()
            out = self._outboxes.pop(subscriber, [])
            _flushed(out, time.perf_counter())
            if out:
                self._taken.notify_all()
            kv = self.kv.take(subscriber) if self.kv is not None and kv_events else None
            return ReplicaOutput(out, kv, len(self._live))

    def resync_kv(self, subscriber: int = 0) -> None:
        """subscriber's next poll carries every block hash the prefix cache holds, and the later ones
        what changed since."""
        with self._lock:
            if self.kv is not None:
                self.kv.resync(subscriber)
            self._notify((subscriber,))

    def kv_receivers(self) -> list[int]:
        """The subscribers the KV events are kept for."""
        with self._lock:
            return [] if self.kv is None else self.kv.receivers

    def close(self) -> None:
        """Every poll returns at once from now on (the replica is stopping)."""
        with self._lock:
            self._closed = True
            self._notify(self._wakeups)

    # -- the lock held -------------------------------------------------------------------------------

    def _release_locked(self, subscriber: int) -> list[int]:
        uids = sorted(uid for uid, owner in self._owner.items() if owner == subscriber and uid in self._live)
        if self._outboxes.pop(subscriber, None):
            self._taken.notify_all()  # its outbox is gone: a publisher waiting for it to be taken goes on
        self._last_poll.pop(subscriber, None)
        if self.kv is not None:
            self.kv.drop(subscriber)
        return uids

    def _deliver_to(self, subscriber: int, deltas: list[TokenDelta]) -> None:
        self._outboxes.setdefault(subscriber, []).extend(deltas)
        self._notify((subscriber,))

    def _add_kv_events(self, stored: Sequence[int], removed: Sequence[int]) -> None:
        if self.kv is not None and (stored or removed):
            self.kv.add(stored, removed)

    def _snapshot_due(self, subscriber: int) -> bool:
        return self.kv is not None and self.kv.snapshot_due(subscriber)

    def _notify(self, subscribers) -> None:
        for sub in subscribers:
            if (cond := self._wakeups.get(sub)) is not None:
                cond.notify_all()


def _flushed(deltas: list[TokenDelta], now: float) -> None:
    """Measures each first token's wait from the host to its sender (on this replica's clock)."""
    for d in deltas:
        if d.hops is not None and d.hops.sampled_at is not None:
            d.hops.flush_s, d.hops.sampled_at = max(0.0, now - d.hops.sampled_at), None


def _error_deltas(uids: list[int], why: str) -> list[TokenDelta]:
    return [TokenDelta.failure(uid, ErrorKind.REPLICA_DOWN, why) for uid in uids]
