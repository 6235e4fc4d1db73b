"""The draft-model proposer: a second, smaller engine with the target's tokenizer, on rank 0's device
beside the target's rank 0, with its own paged KV cache, request slots shared with the target's (a
request's slot is its row in both) and its own pages. For each verify step it catches up with the
tokens its requests kept since (one extend step), then decodes k - 1 more. Each proposal is the draft's
own draw with the request's temperature, top-p, top-k and seed at that position: the Gumbel noise the
target's verify step adds there (worker/sampling/sampler.py), so where the two models agree the draft
proposes the very token the target will draw, sampled rows as well as greedy ones (an argmax). The
verify step keeps only the target's own draws, so what the draft proposes changes how many are kept,
never which tokens come out (worker/sampling/verify.py). Penalties, biases, min-p and grammars are the
target's alone: a row using them is proposed for without them, and keeps fewer. Its steps queue behind
the target's on the device; the host waits once, for the last of them. In speculation's pipeline a
request's next row is drafted while its verify row is in flight, on from that row's proposals and one
token more, the draft's guess of the row's last sample (spec_decode.py): that draft KV stands where the
row keeps every proposal and its last sample is the guess, and is trimmed where not."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from cluster.scheduler.page_allocator import PageAllocator
from cluster.scheduler.req import Req
from worker.batch import BatchDesc

# the most tokens of one request a catch-up step runs as decode rows (its verify step's, at most
# num_speculative_tokens + 1); a longer catch-up, a prompt, runs as an extend step
MAX_CATCH_UP_ROWS = 33


@dataclass
class DraftSeq:
    """A request's state in the draft engine."""

    pages: list[int] = field(default_factory=list)
    cached_len: int = 0  # positions whose draft KV is written
    # per verify row not yet handled (two in speculation's pipeline), oldest first: (the length of the
    # tokens it drafted after, the proposals it verifies, the token drafted after them: the guess of the
    # row's last sample that a row launched behind it drafts on from; None where none was drafted)
    rows: deque[tuple[int, int, int | None]] = field(default_factory=deque)


@dataclass
class _Row:
    req: Req
    seq: DraftSeq
    k: int  # tokens to draft
    tokens: list[int]  # what they follow: the request's tokens (and, in the pipeline, its row in flight's)


def weight_bytes(model) -> int:
    """The bytes of a torch module's parameters, each tensor once (tied ones are one)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


class DraftProposer:
    # how many positions the draft's rows run behind the tokens they take (an EAGLE-3 head's: one)
    shift = 0
    # whether a request's next row may be drafted while its verify row is in flight (speculation's
    # pipeline): the draft drafts on from that row's proposals and its guess of the row's last sample
    pipelines = True

    def __init__(self, engine, relative_cost: float = 0.0) -> None:
        """`engine`: the draft's worker Engine (tp 1), started. `relative_cost`: its weights' bytes over
        those the model's rank 0 holds, what one of its forwards reads against one of the model's (a
        decode step reads its weights once): at 1 or more, speculation cannot pay (k of its forwards to
        save at most k of the model's)."""
        self.engine = engine
        self.relative_cost = relative_cost
        self.page_size = engine.page_size
        self.allocator = PageAllocator(engine.num_pages)
        self.seqs: dict[int, DraftSeq] = {}  # by request uid

    def propose(
        self,
        reqs: list[Req],
        caps: list[int],
        after: list[list[int]] | None = None,
        verified: list[int] | None = None,
    ) -> list[list[int]]:
        """Up to caps[i] tokens for reqs[i] (0: none), drawn by the draft as the target draws, after
        after[i] (default: the request's tokens). Of them the first verified[i] (default: all) are the
        row's proposals, the next one a guess of its last sample."""
        after = after or [req.input_ids for req in reqs]
        verified = verified or caps
        rows: list[_Row] = []
        for req, k, tokens in zip(reqs, caps, after):
            if k <= 0:
                continue
            seq = self.seqs.setdefault(req.uid, DraftSeq())
            if self._grow(seq, len(tokens) + k - 1 - self.shift):
                rows.append(_Row(req, seq, k, tokens))
        drafts: dict[int, list[int]] = {req.uid: [] for req in reqs}
        if not rows:
            return [[] for _ in reqs]
        catch_up = self._catch_up(rows)
        outs = [self.engine.forward(catch_up)]
        for j in range(1, max(row.k for row in rows)):
            outs.append(self.engine.forward(self._decode([row for row in rows if row.k > j], j)))
        outs[-1].done.synchronize()  # the draft's steps run in order: the last one done, all are
        for j, out in enumerate(outs):
            tokens = out.next_tokens.tolist()
            if j == 0 and catch_up.spec_lens is not None:  # a sample a token: each row's last is its proposal
                tokens = [tokens[end - 1] for end in np.cumsum(catch_up.extend_lens).tolist()]
            for row, token in zip([row for row in rows if row.k > j], tokens):
                drafts[row.req.uid].append(token)
        proposals = dict(zip([req.uid for req in reqs], verified))
        for row in rows:
            n, drafted = proposals[row.req.uid], drafts[row.req.uid]
            row.seq.rows.append((len(row.tokens), n, drafted[n] if len(drafted) > n else None))
            row.seq.cached_len = len(row.tokens) + row.k - 1 - self.shift
        return [drafts[req.uid] for req in reqs]

    def accept(self, req: Req, num_new: int, last: int | None = None, void: bool = False) -> None:
        """req's oldest verify row not yet handled kept num_new samples, the last of them `last`: the
        draft's KV stands up to the accepted proposals, and past them where the sample after them is the
        guess a row behind it drafted on from (that row's KV then stands until it is handled). `void`:
        the row behind it is void (this one kept fewer than all), its draft KV with it."""
        seq = self.seqs.get(req.uid)
        if seq is None or not seq.rows:
            return
        start, proposals, guess = seq.rows.popleft()
        if void and seq.rows:
            seq.rows.popleft()
        on_track = num_new == proposals + 1 and guess is not None and last == guess
        if on_track and seq.rows:
            return
        self._trim(seq, self._stands(start, num_new, on_track))

    def _stands(self, start: int, num_new: int, on_track: bool) -> int:
        """Up to which position the draft's KV stands once the row drafted after `start` tokens kept
        num_new samples: the accepted proposals' (the last one's KV was never written), and the guess's
        where it was right."""
        return start + num_new - 1 + on_track

    def _trim(self, seq: DraftSeq, stands: int) -> None:
        seq.cached_len = min(seq.cached_len, stands)
        keep = -(-seq.cached_len // self.page_size)
        self.allocator.free(seq.pages[keep:])
        del seq.pages[keep:]

    def release(self, req: Req) -> None:
        """req ended or was preempted (its slot may go to another request): its draft pages go back."""
        seq = self.seqs.pop(req.uid, None)
        if seq is not None:
            self.allocator.free(seq.pages)

    def _grow(self, seq: DraftSeq, upto_len: int) -> bool:
        need = -(-upto_len // self.page_size) - len(seq.pages)
        if need > self.allocator.num_free:
            return False  # no draft KV for it this time: its row verifies nothing
        seq.pages.extend(self.allocator.alloc(max(0, need)))
        return True

    def _locations(self, seq: DraftSeq, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end, dtype=np.int64)
        pages = np.asarray(seq.pages, dtype=np.int64)
        return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).astype(np.int32)

    def _catch_up(self, rows: list[_Row]) -> BatchDesc:
        """One extend step over every row's tokens the draft has not seen (its whole prompt at first);
        it samples the first proposal. Once every row has only the few tokens of its last verify step to
        see, the step samples after each of them, as a verify step does (spec_lens): the engine then runs
        it as decode rows, from a CUDA graph, where an extend step would run eagerly."""
        desc = self._extend(rows)
        if desc.num_tokens <= self.engine.config.max_decode_rows and desc.extend_lens.max() <= MAX_CATCH_UP_ROWS:
            desc.spec_lens = desc.extend_lens - 1
        return desc

    def _extend(self, rows: list[_Row]) -> BatchDesc:
        """The extend step over each row's positions from its cached_len on, sampling after the last."""
        ids = [row.tokens[row.seq.cached_len + self.shift :] for row in rows]
        ends = [len(row.tokens) - self.shift for row in rows]
        return _drawing(
            True,
            [row.req for row in rows],
            ends,
            [len(x) for x in ids],
            np.concatenate([self._locations(row.seq, row.seq.cached_len, end) for row, end in zip(rows, ends)]),
            np.fromiter((t for x in ids for t in x), dtype=np.int32),
        )

    def _decode(self, rows: list[_Row], j: int) -> BatchDesc:
        """The decode step that samples each row's proposal j + 1 from proposal j (read from the
        draft's token pool, where the step before wrote it)."""
        n = [len(row.tokens) + j - self.shift for row in rows]
        return _drawing(
            False,
            [row.req for row in rows],
            n,
            [1] * len(rows),
            np.concatenate([self._locations(row.seq, pos - 1, pos) for row, pos in zip(rows, n)]),
            None,
        )


def _drawing(
    is_prefill: bool,
    reqs: list[Req],
    seq_lens: list[int],
    extend_lens: list[int],
    out_loc: np.ndarray,
    input_ids: np.ndarray | None,
) -> BatchDesc:
    """A draft step over reqs' rows, each sampling as its request does on the target (the same seed, so
    the same noise at each position), without the target's processors and grammars."""
    n = len(reqs)
    params = [r.params for r in reqs]
    return BatchDesc(
        is_prefill,
        slots=np.fromiter((r.slot for r in reqs), dtype=np.int32, count=n),
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        extend_lens=np.asarray(extend_lens, dtype=np.int32),
        out_loc=out_loc,
        input_ids=input_ids,
        temperature=np.fromiter((p.temperature for p in params), dtype=np.float32, count=n),
        top_p=np.fromiter((p.top_p for p in params), dtype=np.float32, count=n),
        top_k=np.fromiter((p.top_k for p in params), dtype=np.int32, count=n),
        seeds=np.fromiter((r.seed for r in reqs), dtype=np.int64, count=n),
    )


class Eagle3Proposer(DraftProposer):
    """An EAGLE-3 head as the draft (worker/models/eagle3.py): its row at position p takes the token at
    p + 1 with the model's hidden state at p, which the model's steps leave in its auxiliary-hidden cache
    at p's KV cell. Each catch-up reruns the positions from the last proposals' first on with the
    model's hidden states (the verify step computed them for the kept tokens): only its own rows' KV
    before those stands. Then k - 1 decode steps go on from the head's own hidden states."""

    shift = 1
    pipelines = False  # a row's catch-up needs the model's hidden states of the row before it

    def __init__(self, engine, target, relative_cost: float = 0.0) -> None:
        """`engine`: the head's Engine, built beside `target`, rank 0's Engine of the model."""
        super().__init__(engine, relative_cost)
        self.target_page_size = target.page_size

    def _stands(self, start: int, num_new: int, on_track: bool) -> int:
        """Whatever the row kept, the head's next catch-up starts at its proposals' first position: the
        positions it drafted on from its own hidden states are rerun with the model's."""
        return start - 1

    def _catch_up(self, rows: list[_Row]) -> BatchDesc:
        desc = self._extend(rows)
        ps = self.target_page_size
        cells = []
        for row in rows:
            pos = np.arange(row.seq.cached_len, len(row.tokens) - 1, dtype=np.int64)
            cells.append(np.asarray(row.req.pages, dtype=np.int64)[pos // ps] * ps + pos % ps)
        desc.hidden_loc = np.concatenate(cells).astype(np.int32)
        desc.sample_shift = 1
        return desc

    def _decode(self, rows: list[_Row], j: int) -> BatchDesc:
        desc = super()._decode(rows, j)
        desc.sample_shift = 1
        return desc
