"""Routing policies on a multi-tenant chat workload over 4 replicas: the prefix-cache hit rate
(prefix_hit_tokens / prompt_tokens_admitted, the replicas' own counts) and the time to first token,
for round_robin, cache_aware (what the router sent where) and cache_exact (the replicas' KV events).

The replicas are real schedulers with their real radix caches and KV events, over the scripted
executor of tests/scripted.py (no model), and the router side is the real policies over real
ReplicaClient views fed by the events; only time is simulated: a step lasts
`--step-ms + --token-us x its tokens` (prompt tokens computed plus one per decoding request), and its
deltas and KV events reach the router when it ends. Why not tiny real replicas: 4 replicas on a
2-core CPU would time-share 2 cores, so their TTFT would measure CPU contention, and a tiny model's
step costs the same for 1 token or 1,000, so a prefix hit would save nothing measurable; the hit
rate, which is what a policy decides, is the same either way.

The workload: `--tenants` system prompts; `--chats` conversations, each of one tenant, of `--turns`
turns whose prompts extend the previous turn's prompt and answer with a new user message; a chat's
next turn follows its last answer after an exponential think time; a cache of `--pages` pages per
replica, far smaller than what the chats hold, so the caches evict.

    python bench/routing_cache.py [--routers 4] [--chats 192 --think-s 1] [--out results.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from scripted import scripted_scheduler  # noqa: E402

from cluster.scheduler.prefix_cache.events import KVEventStream  # noqa: E402
from router.replicas.client import ReplicaClient  # noqa: E402
from router.replicas.routing import create_policy  # noqa: E402


@dataclass
class Chat:
    tenant: int
    prompt: list[int]
    turns_left: int
    rng: random.Random  # its own: every policy sees the same messages, lengths and think times


@dataclass
class Replica:
    """One scheduler, its event stream, and each router's client of it (its load and KV view)."""

    run: object
    stream: KVEventStream
    clients: list[ReplicaClient]
    busy: bool = False
    live: int = 0  # submitted and not finished, as the replica counts them (every router's)
    deltas: list = field(default_factory=list)


def simulate(policy_name: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ps = args.page_size
    systems = [[rng.randrange(1000, 30000) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    replicas = []
    for i in range(args.replicas):
        run = scripted_scheduler(
            num_pages=args.pages,
            page_size=ps,
            max_running_reqs=args.max_running,
            max_seq_len=16384,
            overlap=False,
            eos_ids=set(),
            keep_deltas=False,
        )
        rep = Replica(run, KVEventStream(ps), [ReplicaClient(i, None) for _ in range(args.routers)])
        run.scheduler.on_output = rep.deltas.extend
        snapshot = rep.stream.take()  # what every router starts from
        for client in rep.clients:
            client.apply_kv_events(snapshot)
        replicas.append(rep)
    # each router routes on its own clients: its own load counts, and the same KV events
    routers = [([r.clients[k] for r in replicas], create_policy(policy_name)) for k in range(args.routers)]
    for k, (_, policy) in enumerate(routers):
        if hasattr(policy, "_rng"):
            policy._rng.seed(args.seed + k)

    events: list[tuple[float, int, str, object]] = []  # (time, tie, kind, payload)
    tie = iter(range(10**9))
    chats = [
        Chat(rng.randrange(args.tenants), [], args.turns, random.Random(args.seed * 7919 + c))
        for c in range(args.chats)
    ]
    spread = random.Random(args.seed + 1)  # which router each request reaches
    for c in range(args.chats):
        heapq.heappush(events, (rng.uniform(0, args.ramp_s), next(tie), "turn", c))
    owner: dict[int, tuple[int, float, ReplicaClient]] = {}  # uid -> (chat, arrival, the router's client)
    ttft: list[float] = []
    uid = evicted = 0

    def start_step(i: int, now: float) -> None:
        rep = replicas[i]
        sched = rep.run.scheduler
        if rep.busy or not sched.has_work:
            return
        before = len(rep.run.executor.launched)
        sched.step()
        launched = rep.run.executor.launched[before:]
        rep.run.executor.launched.clear()
        stored, removed = sched.cache.take_kv_events()
        nonlocal evicted
        evicted += len(removed)
        rep.stream.add(stored, removed)
        if not launched and not rep.deltas:
            return  # nothing could run now (waits for pages): tried again at the next event
        tokens = sum(d.num_tokens for d in launched)
        done = now + (args.step_ms * 1e-3 + args.token_us * 1e-6 * tokens if launched else 0.0)
        out, rep.deltas[:] = list(rep.deltas), []
        rep.live -= sum(d.finished for d in out)
        rep.busy = True
        heapq.heappush(events, (done, next(tie), "done", (i, out, rep.stream.take(), rep.live)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "turn":
            chat = chats[payload]
            if not chat.prompt:
                chat.prompt = list(systems[chat.tenant])
            chat.prompt += [chat.rng.randrange(1000, 30000) for _ in range(chat.rng.randint(*args.user_tokens))]
            ids = list(chat.prompt)
            clients, policy = routers[spread.randrange(len(routers))]  # a load balancer spreads requests
            client = policy.pick(clients, ids)
            client.queues[uid] = None  # its load, as that router counts it
            owner[uid] = (payload, now, client)
            replicas[client.replica_id].live += 1
            replicas[client.replica_id].run.submit(
                uid, ids, max_tokens=chat.rng.randint(*args.output_tokens), ignore_eos=True
            )
            uid += 1
            start_step(client.replica_id, now)
            continue
        i, out, kv, live = payload
        rep = replicas[i]
        rep.busy = False
        for client in rep.clients:
            client.apply_kv_events(kv)
            client.replica_live = live
        for d in out:
            c, arrival, client = owner[d.uid]
            if d.token is not None and client.queues[d.uid] is None:
                client.queues[d.uid] = True
                ttft.append(now - arrival)
            if d.token is not None:
                chats[c].prompt.append(d.token)
            if d.finished:
                del client.queues[d.uid]
                chats[c].turns_left -= 1
                if chats[c].turns_left:
                    heapq.heappush(events, (now + chats[c].rng.expovariate(1 / args.think_s), next(tie), "turn", c))
        for j in range(len(replicas)):  # pages freed here may let a waiting request in elsewhere too
            start_step(j, now)
    stats = [r.run.scheduler.snapshot() for r in replicas]
    for r in replicas:
        r.run.check()
    hit = sum(s.prefix_hit_tokens for s in stats) / sum(s.prompt_tokens_admitted for s in stats)
    ttft.sort()
    return {
        "policy": policy_name,
        "routers": args.routers,
        "requests": uid,
        "prefix_hit_rate": hit,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_median_ms": 1e3 * ttft[len(ttft) // 2],
        "ttft_p99_ms": 1e3 * ttft[int(0.99 * (len(ttft) - 1))],
        "prefill_tokens": sum(s.prefill_tokens for s in stats),
        "pages_evicted": evicted,
        "requests_per_replica": [
            sum(1 for _, _, c in owner.values() if c.replica_id == i) for i in range(len(replicas))
        ],
        "duration_s": now,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--chats", type=int, default=96)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-tokens", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--think-s", type=float, default=2.0)
    parser.add_argument("--ramp-s", type=float, default=10.0)
    parser.add_argument("--pages", type=int, default=1024, help="KV pages per replica")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--token-us", type=float, default=12.0)
    parser.add_argument("--routers", type=int, default=1, help="routers, each sent a random share of requests")
    parser.add_argument("--seeds", type=int, default=3, help="runs (workload seeds 0..N-1), averaged")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name in ("round_robin", "cache_aware", "cache_exact"):
        runs = [simulate(name, argparse.Namespace(**{**vars(args), "seed": seed})) for seed in range(args.seeds)]
        rows.append(
            {k: (statistics.fmean(r[k] for r in runs) if isinstance(v, float) else v) for k, v in runs[0].items()}
            | {
                "requests_per_replica": runs[0]["requests_per_replica"],
                "prefill_tokens": round(statistics.fmean(r["prefill_tokens"] for r in runs)),
                "pages_evicted": round(statistics.fmean(r["pages_evicted"] for r in runs)),
            }
        )
    print(f"means over {args.seeds} workloads; requests per replica of the first")
    print(
        f"{'policy':>12} {'requests':>8} {'hit rate':>8} {'TTFT mean':>10} {'median':>8} {'p99':>8} "
        f"{'prefill tok':>11} {'evicted':>8}  requests per replica"
    )
    for r in rows:
        print(
            f"{r['policy']:>12} {r['requests']:>8} {r['prefix_hit_rate']:>8.3f} {r['ttft_mean_ms']:>8.1f}ms "
            f"{r['ttft_median_ms']:>6.1f}ms {r['ttft_p99_ms']:>6.1f}ms {r['prefill_tokens']:>11} {r['pages_evicted']:>8}  "
            f"{r['requests_per_replica']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
