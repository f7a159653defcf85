"""A small GPT over bytes for the example: embeddings, causal transformer layers, a next-byte head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GPT(nn.Module):
    """``forward(idx, targets)`` gives ``(logits, loss)``; the loss is None without targets."""

    def __init__(self, block_size: int, vocab_size: int = 256, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(block_size, width)
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=0.1, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab_size)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position (only earlier positions are seen), and the cross-entropy loss."""
        time = idx.shape[1]
        positions = torch.arange(time, device=idx.device)
        causal = nn.Transformer.generate_square_subsequent_mask(time, device=idx.device)
        hidden = self.blocks(self.token(idx) + self.position(positions), mask=causal, is_causal=True)
        logits: torch.Tensor = self.head(hidden)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
