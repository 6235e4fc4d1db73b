"""vLLM's allowed_token_ids: a request that may sample only the tokens of a set. It rides the grammars'
path (a matcher per request whose next-token bitmask masks the logits on the device, in decode, verify
and every other step) with a matcher whose mask never changes, so nothing is compiled and every token
it allows may follow any other."""

from __future__ import annotations

import numpy as np
import torch


class TokenSetMatcher:
    """The part of xgrammar's GrammarMatcher the scheduler calls, over a fixed set of tokens."""

    def __init__(self, token_ids: list[int], vocab_size: int) -> None:
        bits = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint8)
        bits[np.asarray(token_ids, dtype=np.int64)] = 1
        # xgrammar's layout: int32 words, token t at bit t % 32 of word t // 32
        self._row = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
        self._allowed = frozenset(token_ids)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].copy_(self._row)

    def accept_token(self, token_id: int) -> bool:
        return token_id in self._allowed

    def is_terminated(self) -> bool:
        return False  # a set ends nothing: EOS, a stop token or max_tokens does

    def rollback(self, num_tokens: int) -> None:
        pass  # no state to undo
