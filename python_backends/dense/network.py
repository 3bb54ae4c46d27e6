"""The dense network in PyTorch: DLRM-style MLPs and dot interaction plus target attention.

``forward`` takes the flat tensors exactly as the ``dense`` step receives them, so the same module
is exported to ONNX and used as the in-process reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recserve import wire
from recserve.spec import ModelSpec


def _mlp(widths: list[int], final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(fan_in, fan_out))
        if final_activation or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TargetAttention(nn.Module):
    """Multi-head attention of the target item over the behaviour sequence.

    Masked positions get exactly zero weight, so padding never changes a row's result, and a row
    with an empty history attends to nothing (zero context).
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, target: torch.Tensor, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``target`` [B, D], ``history`` [B, L, D], ``mask`` [B, L] (1 real, 0 padding) to [B, D]."""
        batch, length, dim = history.shape
        q = self.query(target).view(batch, self.heads, 1, self.head_dim)
        k = self.key(history).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(history).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)).squeeze(2) / math.sqrt(self.head_dim)  # [B, H, L]
        gate = mask[:, None, :]
        scores = scores + (gate - 1.0) * 1e9
        weights = torch.softmax(scores, dim=-1) * gate
        context = (weights.unsqueeze(-1) * v).sum(dim=2).reshape(batch, dim)
        return self.norm(self.out(context) + target)


class CTRNet(nn.Module):
    """Bottom MLP over dense features, dot interaction of all embeddings, top MLP to a probability.

    Parts the spec lacks are left out: without numeric features there is no bottom MLP (the top
    MLP sees the interactions only); without a sequence there is no target attention.
    ``forward`` takes the inputs named by :attr:`input_names` (the dense contract), in that order.
    """

    pair_index: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dim = spec.embedding_dim
        self.input_names = wire.dense_net_inputs(spec)
        self.has_dense = bool(spec.normalized_columns)
        self.has_attention = spec.sequence is not None
        if self.has_dense:
            self.bottom = _mlp([len(spec.normalized_columns), *spec.bottom_mlp], final_activation=True)
        if self.has_attention:
            self.attention = TargetAttention(dim, spec.attention_heads)
        # bottom output, sparse, target, attention context
        vectors = int(self.has_dense) + spec.num_sparse + 2 * int(self.has_attention)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_index", rows * vectors + cols, persistent=False)
        self.top = _mlp([dim * int(self.has_dense) + len(rows), *spec.top_mlp, 1], final_activation=False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Click probability [B, 1] from the tensors of :attr:`input_names`."""
        named = dict(zip(self.input_names, inputs, strict=True))
        parts = [named[wire.SPARSE_EMBEDDINGS]]
        head = []
        if self.has_dense:
            bottom = self.bottom(named[wire.DENSE_NORMALIZED])
            parts.insert(0, bottom[:, None, :])
            head.append(bottom)
        if self.has_attention:
            target = named[wire.TARGET_EMBEDDING]
            context = self.attention(target, named[wire.HISTORY_EMBEDDINGS], named[wire.HISTORY_MASK])
            parts += [target[:, None, :], context[:, None, :]]
        stacked = torch.cat(parts, dim=1)
        pairs = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)[:, self.pair_index]
        return torch.sigmoid(self.top(torch.cat([*head, pairs], dim=1)))
