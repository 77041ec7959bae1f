"""The critic of specs with a value baseline (gae): the policy's transformer body and a scalar head."""
from __future__ import annotations

import copy

from torch import Tensor, nn

from ..models.loading import backbone
from .packing import packed_hidden, packed_layout
from .throughput import TokenCount


class ValueModel(nn.Module):
    """A critic: a copy of the policy's transformer body and a scalar head (zero-initialized).

    ``forward`` returns V [B, Tr]: the value of the state before each response token
    (the hidden state at the previous position, the same alignment as the logprobs).
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.body = copy.deepcopy(backbone(policy))
        hidden = policy.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                num_response: int, *, packing: bool = False, packing_row_tokens: int | None = None,
                group_size: int | None = None, count: TokenCount | None = None) -> Tensor:
        """``packing``: one packed forward (train/packing.py) when exact and supported, each
        group's prompt once per packed row when the rows share prompts by ``group_size``; values
        on padding are then 0. ``count``: adds the real and computed tokens to it."""
        B, L = input_ids.shape
        rows = packed_layout(self.body, input_ids, attention_mask, num_response, packing_row_tokens,
                             group_size) if packing else None
        if rows is not None:
            if count is not None:
                count.add(rows.lengths, rows.computed_tokens, rows.placed)
            v = self.head(packed_hidden(self.body, rows)).squeeze(-1).float()  # [M]
            return rows.scatter(v, B, num_response)  # [B, Tr]
        if count is not None:
            count.add((attention_mask.long().sum(1) - 1).tolist(), input_ids.numel())
        h = self.body(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids).last_hidden_state  # [B, L, H]
        h = h[:, L - num_response - 1:L - 1]  # [B, Tr, H] state before each response token
        return self.head(h).squeeze(-1).float()  # [B, Tr]
