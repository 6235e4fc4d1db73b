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
the target's on the device; the host waits once, for the last of them."""

from __future__ import annotations

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
    proposed_from: int = 0  # the request's length when its last proposals were made


def weight_bytes(model) -> int:
    """The bytes of a torch module's parameters, each tensor once (tied ones are one)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


class DraftProposer:
    # how many positions the draft's rows run behind the tokens they take (an EAGLE-3 head's: one)
    shift = 0

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

    def propose(self, reqs: list[Req], caps: list[int]) -> list[list[int]]:
        """Up to caps[i] tokens for reqs[i] (0: none), drawn by the draft as the target draws."""
        rows = []  # (req, its state, k)
        for req, k in zip(reqs, caps):
            if k <= 0:
                continue
            seq = self.seqs.setdefault(req.uid, DraftSeq())
            if self._grow(seq, len(req.input_ids) + k - 1 - self.shift):
                rows.append((req, seq, k))
        drafts = {req.uid: [] for req in reqs}
        if not rows:
            return [[] for _ in reqs]
        catch_up = self._catch_up(rows)
        outs = [self.engine.forward(catch_up)]
        for j in range(1, max(k for _, _, k in rows)):
            outs.append(self.engine.forward(self._decode([(r, s) for r, s, k in rows if k > j], j)))
        outs[-1].done.synchronize()  # the draft's steps run in order: the last one done, all are
        for j, out in enumerate(outs):
            tokens = out.next_tokens.tolist()
            if j == 0 and catch_up.spec_lens is not None:  # a sample a token: each row's last is its proposal
                tokens = [tokens[end - 1] for end in np.cumsum(catch_up.extend_lens).tolist()]
            for (req, _, _), token in zip([row for row in rows if row[2] > j], tokens):
                drafts[req.uid].append(token)
        for req, seq, k in rows:
            seq.proposed_from = len(req.input_ids)
            seq.cached_len = len(req.input_ids) + k - 1 - self.shift
        return [drafts[req.uid] for req in reqs]

    def accept(self, req: Req, num_new: int) -> None:
        """req kept num_new samples of its verify step: the draft's KV holds what it had before the
        proposals, the accepted ones among them (the last proposal's KV was never written)."""
        seq = self.seqs.get(req.uid)
        if seq is None:
            return
        seq.cached_len = min(seq.cached_len, seq.proposed_from + num_new - 1)
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

    def _catch_up(self, rows: list[tuple[Req, DraftSeq, int]]) -> BatchDesc:
        """One extend step over every row's tokens the draft has not seen (its whole prompt at first);
        it samples the first proposal. Once every row has only the few tokens of its last verify step to
        see, the step samples after each of them, as a verify step does (spec_lens): the engine then runs
        it as decode rows, from a CUDA graph, where an extend step would run eagerly."""
        desc = self._extend(rows)
        if desc.num_tokens <= self.engine.config.max_decode_rows and desc.extend_lens.max() <= MAX_CATCH_UP_ROWS:
            desc.spec_lens = desc.extend_lens - 1
        return desc

    def _extend(self, rows: list[tuple[Req, DraftSeq, int]]) -> BatchDesc:
        """The extend step over each row's positions from its cached_len on, sampling after the last."""
        ids = [req.input_ids[seq.cached_len + self.shift :] for req, seq, _ in rows]
        ends = [len(req.input_ids) - self.shift for req, _, _ in rows]
        return _drawing(
            True,
            [req for req, _, _ in rows],
            ends,
            [len(x) for x in ids],
            np.concatenate([self._locations(seq, seq.cached_len, end) for (_, seq, _), end in zip(rows, ends)]),
            np.fromiter((t for x in ids for t in x), dtype=np.int32),
        )

    def _decode(self, rows: list[tuple[Req, DraftSeq]], j: int) -> BatchDesc:
        """The decode step that samples each row's proposal j + 1 from proposal j (read from the
        draft's token pool, where the step before wrote it)."""
        n = [len(req.input_ids) + j - self.shift for req, _ in rows]
        return _drawing(
            False,
            [req for req, _ in rows],
            n,
            [1] * len(rows),
            np.concatenate([self._locations(seq, pos - 1, pos) for (_, seq), pos in zip(rows, n)]),
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

    def __init__(self, engine, target, relative_cost: float = 0.0) -> None:
        """`engine`: the head's Engine; `target`: rank 0's Engine of the model, built with the head as
        its draft_model (so that it keeps the hidden states the head reads)."""
        super().__init__(engine, relative_cost)
        self.target_page_size = target.page_size
        head = engine.model
        head.aux_source = target.aux_hidden
        if head.model.embed_tokens is None:  # the model's token embeddings, whole
            head.share_embeddings(target_embeddings(target))

    def accept(self, req: Req, num_new: int) -> None:
        """Whatever req kept, its next catch-up starts at its last proposals' first position: the
        positions the head drafted on from its own hidden states are rerun with the model's."""
        seq = self.seqs.get(req.uid)
        if seq is None:
            return
        seq.cached_len = min(seq.cached_len, seq.proposed_from - 1)
        keep = -(-seq.cached_len // self.page_size)
        self.allocator.free(seq.pages[keep:])
        del seq.pages[keep:]

    def _catch_up(self, rows: list[tuple[Req, DraftSeq, int]]) -> BatchDesc:
        desc = self._extend(rows)
        ps = self.target_page_size
        cells = []
        for req, seq, _ in rows:
            pos = np.arange(seq.cached_len, len(req.input_ids) - 1, dtype=np.int64)
            cells.append(np.asarray(req.pages, dtype=np.int64)[pos // ps] * ps + pos % ps)
        desc.hidden_loc = np.concatenate(cells).astype(np.int32)
        desc.sample_shift = 1
        return desc

    def _decode(self, rows: list[tuple[Req, DraftSeq]], j: int) -> BatchDesc:
        desc = super()._decode(rows, j)
        desc.sample_shift = 1
        return desc


def target_embeddings(target):
    """Rank 0's token embeddings of the model, whole: its own module at tp 1, else read from its
    checkpoint (each rank holds a shard)."""
    from worker.models.eagle3 import load_embeddings

    embed = target.model.model.embed_tokens
    if target.tp.size == 1:
        return embed
    return load_embeddings(target.config.model_path, target.hf_config, embed.weight.dtype, embed.weight.device)
