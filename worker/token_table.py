"""Per request slot, on the device: the token pool (every token id) and the page table (every token's
KV location). The sampled token is written straight into the token pool, where the next step reads it."""

from __future__ import annotations

import torch


class TokenTable:
    def __init__(self, max_reqs: int, max_seq_len: int, device: torch.device) -> None:
        # one extra column: the token sampled after the last position has a place to go; and one cell
        # past every row (`scratch_cell` of the flat pool), where the padded rows of a decode graph write
        row = max_seq_len + 1
        self.flat_pool = torch.zeros(max_reqs * row + 1, dtype=torch.int32, device=device)
        self.token_pool = self.flat_pool[:-1].view(max_reqs, row)
        self.scratch_cell = max_reqs * row
        self.page_table = torch.zeros(max_reqs, max_seq_len, dtype=torch.int32, device=device)
