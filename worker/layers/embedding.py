"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker import gemv
from worker.checkpoint_error import check_shape
from worker.kernels import Kernels
from worker.parallel import TPGroup
from worker.quant import gemm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)  # the last shard is padded
        self.start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int = 0) -> None:
        check_shape(full, (self.vocab_size, param.shape[1]), "weight")
        piece = full[self.start : min(self.start + self.shard_size, self.vocab_size)]
        param.data[: piece.shape[0]].copy_(piece)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.comm.all_reduce(y)


# logits a row that an e4m3 head (quantize_lm_head) computes again over its unquantized rows: FP8's rounding
# moves a logit by a few percent of the logits' spread, far less than the gap from the largest to the 16th
REFINED_CANDIDATES = 16
# rows up to which an e4m3 head multiplies in e4m3; above, it multiplies its unquantized rows (which it keeps
# for the refinement). Its read halved saves a fixed time a step, its top-k over the vocabulary costs more
# with every row: Qwen3-8B with FP8 linears on an H100 (2026-12-07) took 3.218 ms a batch-1 token against
# 3.357 with the head in bf16, and its (a) at up to 256 rows gave 10,297 output tok/s against 10,388
E4M3_HEAD_MAX_ROWS = 16


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the whole vocabulary (gathered from every rank). One row
    (batch-1 decode, a lone prompt's last token) goes through the Triton GEMV where Kernels.small_linear
    asks for it: bench/small_gemm.py on an H100 (2026-12-05) read Qwen3-8B's 1.2 GB head in 400.9 us
    against cuBLAS's 440.2 and Qwen3-0.6B's in 102.7 against 113.2. Without programmatic dependent launch,
    which made the 8B's head slower (505.0 us)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, kernels: Kernels = Kernels()) -> None:
        super().__init__(vocab_size, hidden, tp)
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        e4m3 = self.weight.dtype == torch.float8_e4m3fn  # quantize_lm_head (worker/quant/prepare.py)
        weight = self.exact_weight if e4m3 else self.weight  # the unquantized rows
        if e4m3 and hidden.numel() <= E4M3_HEAD_MAX_ROWS * hidden.shape[-1]:
            logits = gemm.fp8_linear(
                hidden, self.weight, self.weight_scale, None, None, self.kernels.small_linear, self.kernels
            )
            logits = self._refined(logits, hidden)
        elif (
            self.kernels.small_linear
            and hidden.dim() == 2
            and hidden.shape[0] == 1
            and gemv.small_linear_applies(hidden, weight)
        ):
            logits = gemv.small_linear(hidden, weight)
        else:
            logits = F.linear(hidden, weight)
        if self.tp.size > 1:
            logits = self.tp.comm.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]

    def _refined(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The e4m3 head's logits with its REFINED_CANDIDATES largest a row computed again over the
        unquantized head's rows: the candidates a greedy step, top-k and most of top-p's mass choose among
        come out as the unquantized head gives them (a rank refines its shard's, which hold every global
        candidate of its rows); only the rest keep the e4m3 rounding."""
        rows = logits.reshape(-1, logits.shape[-1])
        # the last shard's padding rows (logit 0) are no candidates: they would push out real rows
        real = rows[:, : max(0, min(self.shard_size, self.vocab_size - self.start))]
        top = real.topk(min(REFINED_CANDIDATES, real.shape[-1]), dim=-1).indices  # [rows, k]
        exact = torch.bmm(self.exact_weight[top], hidden.reshape(-1, hidden.shape[-1], 1)).squeeze(-1)
        return rows.scatter(-1, top, exact.to(rows.dtype)).reshape(logits.shape)
