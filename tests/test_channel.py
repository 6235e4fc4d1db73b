"""The replica's direct channel (cluster/channel.py): a connection must prove itself with the
replica's token before anything it sends is read; submits and aborts reach the replica, its
deltas come back per poll, and a router's closed connection aborts that router's requests. Served end
to end over the channel, outputs equal the offline engine's."""

from __future__ import annotations

import pickle
import socket
import threading
import time

import pytest
from fixtures import PROMPT_TEXTS
from helpers import concurrent_completions, greedy, serving

from cluster import LLM, AddRequest, SamplingParams, TokenDelta
from cluster.channel import ABORT, FRAME, HELLO, SUBMIT, ChannelConnection, ChannelListener, recv_exactly
from cluster.messages import ReplicaOutput


class FakeReplica:
    """Records what the channel hands it; its outbox is filled by the test."""

    def __init__(self) -> None:
        self.submitted: list[tuple[list[AddRequest], int]] = []
        self.aborted: list[int] = []
        self.released: list[int] = []
        self.outbox: list[TokenDelta] = []
        self.changed = threading.Condition()

    def submit(self, requests, subscriber=0):
        with self.changed:
            self.submitted.append((requests, subscriber))
            self.changed.notify_all()

    def abort(self, uids):
        with self.changed:
            self.aborted.extend(uids)
            self.changed.notify_all()

    def poll(self, timeout_s=1.0, subscriber=0, kv_events=True, receives=None):
        with self.changed:
            self.changed.wait_for(lambda: self.outbox, timeout_s)
            if receives is not None and not receives():
                return ReplicaOutput([], None, 0)
            out, self.outbox = self.outbox, []
            return ReplicaOutput(out, None, len(out))

    def release_subscriber(self, subscriber):
        with self.changed:
            self.released.append(subscriber)
            self.changed.notify_all()
        return 0

    def wait(self, predicate) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, 10.0)


class Unpickled:
    """A payload whose unpickling leaves a mark: proof that the listener read a frame."""

    marks: list[str] = []

    def __reduce__(self):
        return (Unpickled.marks.append, ("unpickled",))


@pytest.fixture
def listener():
    replica = FakeReplica()
    chan = ChannelListener(replica, "127.0.0.1")
    yield chan, replica
    chan.close()


def connect(chan, token: bytes, subscriber: int = 1) -> socket.socket:
    sock = socket.create_connection((chan.address.host, chan.address.port), timeout=10)
    sock.sendall(HELLO.pack(token, subscriber, 1))
    return sock


def send(sock, kind: int, body) -> None:
    payload = pickle.dumps((kind, body))
    sock.sendall(FRAME.pack(len(payload)) + payload)


def receive(sock) -> ReplicaOutput:
    (n,) = FRAME.unpack(recv_exactly(sock, FRAME.size))
    return pickle.loads(recv_exactly(sock, n))


def receive_deltas(sock, within_s: float = 5.0) -> ReplicaOutput:
    """The next message with deltas, past the heartbeats (empty messages); empty if none comes in time."""
    deadline = time.monotonic() + within_s
    out = receive(sock)
    while not out and time.monotonic() < deadline:
        out = receive(sock)
    return out


def test_a_wrong_token_is_refused_before_anything_is_unpickled(listener):
    chan, replica = listener
    Unpickled.marks.clear()
    sock = connect(chan, b"x" * 32)
    payload = pickle.dumps(Unpickled())
    try:
        sock.sendall(FRAME.pack(len(payload)) + payload)
    except OSError:
        pass  # closed already
    try:
        assert sock.recv(1) == b""  # the listener closed the connection
    except ConnectionResetError:
        pass  # closed with the frame unread
    sock.close()
    assert Unpickled.marks == [] and replica.submitted == [] and replica.released == []


def test_submits_aborts_and_deltas_cross_the_channel(listener):
    chan, replica = listener
    sock = connect(chan, chan.address.token, subscriber=3)
    request = AddRequest(7, [1, 2, 3], SamplingParams(max_tokens=2))
    send(sock, SUBMIT, [request])
    send(sock, ABORT, [7])
    replica.wait(lambda: replica.aborted)
    assert replica.submitted == [([request], 3)] and replica.aborted == [7]
    with replica.changed:
        replica.outbox = [TokenDelta(7, 42), TokenDelta(7, 43, finished=True, finish_reason="length")]
        replica.changed.notify_all()
    out = receive_deltas(sock)
    assert [(d.uid, d.token, d.finished) for d in out] == [(7, 42, False), (7, 43, True)]
    assert out.live == 2
    sock.close()
    # the router is gone: what it sent is released at once
    replica.wait(lambda: replica.released)
    assert replica.released == [3]


def test_a_routers_connection_sends_submits_then_aborts_and_receives_deltas(listener):
    import asyncio

    chan, replica = listener
    request = AddRequest(8, [1, 2], SamplingParams(max_tokens=2))

    async def talk() -> ReplicaOutput:
        conn = await ChannelConnection.open(chan.address, subscriber=5, kv_events=False)
        conn.send([request], [8])  # one write: the submit goes first
        await asyncio.get_running_loop().run_in_executor(None, replica.wait, lambda: replica.aborted)
        with replica.changed:
            replica.outbox = [TokenDelta(8, 3, finished=True, finish_reason="length")]
            replica.changed.notify_all()
        out = await conn.receive()
        while not out:  # past the heartbeats
            out = await conn.receive()
        conn.close()
        return out

    out = asyncio.run(talk())
    assert replica.submitted == [([request], 5)] and replica.aborted == [8]
    assert [(d.uid, d.token, d.finished) for d in out] == [(8, 3, True)]


def test_a_closed_connection_aborts_what_it_sent_and_only_the_newest_releases_its_router(listener):
    chan, replica = listener
    params = SamplingParams(max_tokens=8)
    old = connect(chan, chan.address.token, subscriber=2)
    send(old, SUBMIT, [AddRequest(11, [1], params), AddRequest(12, [1], params)])
    replica.wait(lambda: replica.submitted)
    with replica.changed:  # 12 ends before the connection does
        replica.outbox = [TokenDelta(12, 5, finished=True, finish_reason="length")]
        replica.changed.notify_all()
    assert receive_deltas(old)
    new = connect(chan, chan.address.token, subscriber=2)
    send(new, SUBMIT, [AddRequest(13, [1], params)])
    replica.wait(lambda: len(replica.submitted) == 2)
    old.close()  # a router that connected again: what it sent before is gone with the old connection
    replica.wait(lambda: replica.aborted)
    assert replica.aborted == [11] and replica.released == []
    new.close()
    replica.wait(lambda: replica.released)
    assert replica.aborted == [11, 13] and replica.released == [2]


def test_deltas_go_to_a_routers_newest_connection_only(listener):
    # the older connection's sender may be waiting on the same outbox when the newer one registers
    chan, replica = listener
    old = connect(chan, chan.address.token, subscriber=4)
    send(old, SUBMIT, [])
    replica.wait(lambda: replica.submitted)
    new = connect(chan, chan.address.token, subscriber=4)
    send(new, SUBMIT, [])
    replica.wait(lambda: len(replica.submitted) == 2)
    for uid in range(5):
        with replica.changed:
            replica.outbox = [TokenDelta(uid, 1, finished=True, finish_reason="length")]
            replica.changed.notify_all()
        assert [d.uid for d in receive_deltas(new)] == [uid]
    old.close()
    new.close()


def test_served_outputs_equal_the_offline_engine(ray_cluster, qwen3_path):
    import ray

    prompts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] + f" {i}" for i in range(8)]
    with LLM(str(qwen3_path)) as llm:
        expected = [o.text for o in llm.generate(prompts, greedy(8))]
    with serving(qwen3_path, num_pages=512) as srv:
        clients = srv.state.clients
        assert concurrent_completions(srv.url, prompts, 8) == expected
        assert all(c.channel is not None and c.healthy for c in clients)
        stats = ray.get([r.actor.stats.remote() for r in srv.replicas])
        assert [s.live for s in stats] == [0] * len(stats)
        ray.get([r.actor.check_integrity.remote() for r in srv.replicas])


def test_a_lost_connection_fails_its_requests_and_the_router_connects_again(ray_cluster, qwen3_path):
    import httpx
    import ray

    body = {
        "model": "tiny",
        "prompt": PROMPT_TEXTS[2],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with serving(qwen3_path, num_pages=512) as srv:
        (client,) = srv.state.clients
        deadline = time.monotonic() + 20
        while client.channel is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a bounded wait for an eventual state: the router's first connection is made
        lost = client.channel
        decoded_before = ray.get(srv.replicas[0].actor.stats.remote()).decode_tokens
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", srv.url + "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert any(next(lines).startswith("data: {") for _ in range(3))
                # the router's end of the connection drops, as a network fault would drop it
                client._poller.get_loop().call_soon_threadsafe(lost.abort)
                rest = list(lines)
            assert any('"error"' in line for line in rest), rest[-3:]
            assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
            deadline = time.monotonic() + 20
            while (client.channel is None or client.channel is lost) and time.monotonic() < deadline:
                time.sleep(0.05)  # a bounded wait for an eventual state: the router connects again
            assert client.channel is not None and client.channel is not lost and client.healthy
            r = http.post(srv.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 5}).json()
            assert r["usage"]["completion_tokens"] == 5
        # the replica aborted what the lost connection had sent: nothing runs on for no one
        deadline = time.monotonic() + 20
        while (stats := ray.get(srv.replicas[0].actor.stats.remote())).live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.live == 0
        # far fewer than the 400 tokens asked for were decoded: the abort came with the lost connection
        assert stats.decode_tokens - decoded_before < 200
        ray.get(srv.replicas[0].actor.check_integrity.remote())


def test_every_delta_field_survives_the_columns():
    # a step's deltas pickle as columns (ReplicaOutput.__reduce__): any field it forgot would vanish here
    import dataclasses

    from cluster import ErrorKind, FirstTokenHops, KVEvents

    values = {
        "finished": True,
        "finish_reason": "stop",
        "logprob": -0.5,
        "top_logprobs": [(3, -0.1)],
        "error": "why",
        "error_kind": ErrorKind.ENGINE,
        "error_field": "max_tokens",
        "error_code": "context_length_exceeded",
        "prompt_logprobs": [(-1.0, [(2, -0.2)])],
        "cached_tokens": 8,
        "hops": FirstTokenHops(0.001, 0.002, 0.003),
    }
    fields = [f.name for f in dataclasses.fields(TokenDelta)][2:]
    assert sorted(fields) == sorted(values)  # a new field needs a value here, and a column there
    deltas = [TokenDelta(0, 1)] + [TokenDelta(i + 1, None, **{name: values[name]}) for i, name in enumerate(fields)]
    out = pickle.loads(pickle.dumps(ReplicaOutput(deltas, KVEvents(4, [1], [2]), 7)))
    assert list(out) == deltas and out.kv_events == KVEvents(4, [1], [2]) and out.live == 7
