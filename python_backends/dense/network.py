"""The dense network in PyTorch: DLRM-style MLPs and dot interaction plus target attention.

``forward`` takes the flat tensors exactly as the ``dense`` step receives them, so the same module
is exported to ONNX and used as the in-process reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recserve.core.contract import attention_inputs, dense_net_inputs, sparse_inputs
from recserve.core.names import (
    DENSE_NORMALIZED,
    HISTORY_EMBEDDINGS,
    HISTORY_LOG_WEIGHTS,
    HISTORY_USER,
    SPARSE_EMBEDDINGS,
)
from recserve.core.spec.model import ModelSpec


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
    with an empty history attends to nothing (zero context). Target and history rows ``width`` wide
    (a concatenated group's) are projected to ``dim``, the width the interaction takes.
    """

    def __init__(self, dim: int, heads: int, width: int | None = None) -> None:
        super().__init__()
        width = width or dim
        self.heads = heads
        self.head_dim = dim // heads
        self.query = nn.Linear(width, dim)
        self.key = nn.Linear(width, dim)
        self.value = nn.Linear(width, dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        # the target as the interaction and the residual take it (no module at width == dim: the
        # weights of a summed group's network stay as they were)
        self.project_target: nn.Module = nn.Identity() if width == dim else nn.Linear(width, dim)

    def forward(
        self,
        target: torch.Tensor,
        history: torch.Tensor,
        mask: torch.Tensor,
        users: torch.Tensor | None = None,
        log_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``target`` [B, W], ``history`` [B, L, W], ``mask`` [B, L] (1 real, 0 padding) to [B, D].

        With ``users`` [B] (int64), ``history`` and ``mask`` hold one row per user, ``[U, L, ...]``,
        and row ``b`` attends over row ``users[b]``: each user's keys and values are projected once,
        whatever the number of rows (a candidate list). The result equals the expanded history's.
        ``log_weights`` ([B, L], or [U, L] with ``users``) is added to each position's logit before
        the mask: a token standing for ``c`` identical items carries ``ln c``. None or zeros: today's.
        """
        length, dim = history.shape[1], self.heads * self.head_dim
        owners, batch = history.shape[0], target.shape[0]
        k = self.key(history).view(owners, length, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(history).view(owners, length, self.heads, self.head_dim).transpose(1, 2)
        if users is None:
            q = self.query(target).view(batch, self.heads, 1, self.head_dim)
            scores = (q @ k.transpose(-1, -2)).squeeze(2) / math.sqrt(self.head_dim)  # [B, H, L]
            if log_weights is not None:
                scores = scores + log_weights[:, None, :]
            gate = mask[:, None, :]
            scores = scores + (gate - 1.0) * 1e9
            weights = torch.softmax(scores, dim=-1) * gate
            context = (weights.unsqueeze(-1) * v).sum(dim=2).reshape(batch, dim)
        else:  # every row against every user's keys [B, U, H, L]; only its own user's weights stay
            q = self.query(target).view(batch, self.heads, self.head_dim)
            own = (users[:, None] == torch.arange(owners, device=users.device)[None, :]).to(history.dtype)
            scores = torch.einsum("bhd,uhld->buhl", q, k) / math.sqrt(self.head_dim)
            if log_weights is not None:
                scores = scores + log_weights[None, :, None, :]
            gate = own[:, :, None, None] * mask[None, :, None, :]
            scores = scores + (gate - 1.0) * 1e9
            weights = torch.softmax(scores, dim=-1) * gate
            context = torch.einsum("buhl,uhld->bhd", weights, v).reshape(batch, dim)
        return self.norm(self.out(context) + self.project_target(target))


class CTRNet(nn.Module):
    """Bottom MLP over dense features, dot interaction of all embeddings, top MLP to a probability.

    Parts the spec lacks are left out: without numeric features there is no bottom MLP (the top
    MLP sees the interactions only); without a sequence there is no target attention. Each
    attention group (a sequence with its own positions) has its own attention, whose target and
    context join the interaction. With ``[dense_net] first_order``, the 1-wide tables' values are
    summed into the logit (FM-style first-order terms) and stay out of the interaction.
    ``forward`` takes the inputs named by :attr:`input_names` (the dense contract), in that order.
    """

    pair_index: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dim = spec.model.embedding_dim
        self.input_names = dense_net_inputs(spec)
        self.has_dense = bool(spec.normalized_columns)
        self.has_attention = spec.sequence is not None
        self.groups = attention_inputs(spec)
        if self.has_dense:
            self.bottom = _mlp(
                [len(spec.normalized_columns), *spec.dense_net.bottom_mlp], final_activation=True
            )
        if self.has_attention:
            self.attention = TargetAttention(dim, spec.dense_net.attention_heads, self.groups[0].width)
        # bottom output, sparse (every width), then per attention group its target and context
        # with first_order, the 1-wide tables' values go to the logit, not into the interaction
        self.first_order = tuple(
            n for n, w, _ in sparse_inputs(spec) if w == 1 and spec.dense_net.first_order
        )
        self.widths = tuple(w for w in sparse_inputs(spec)[1:] if w[0] not in self.first_order)
        narrow = sum(len(slots) for _, _, slots in self.widths)
        vectors = int(self.has_dense) + spec.num_sparse + narrow + 2 * len(self.groups)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pair_index", rows * vectors + cols, persistent=False)
        self.top = _mlp(
            [dim * int(self.has_dense) + len(rows), *spec.dense_net.top_mlp, 1], final_activation=False
        )
        # the further groups' attentions (made last: a one-group network starts from the same weights)
        self.further = nn.ModuleList(
            TargetAttention(dim, spec.dense_net.attention_heads, group.width) for group in self.groups[1:]
        )
        # per other table width: each of its features projected to embedding_dim for the interaction
        self.projections = nn.ParameterList(
            nn.Parameter(torch.randn(len(slots), width, dim) / math.sqrt(width))
            for _, width, slots in self.widths
        )

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Click probability [B, 1] from the tensors of :attr:`input_names`."""
        return self.score(dict(zip(self.input_names, inputs, strict=True)))

    def score(self, named: dict[str, torch.Tensor], users: torch.Tensor | None = None) -> torch.Tensor:
        """Click probability [B, 1] from the named inputs (``users``: see :class:`TargetAttention`)."""
        parts = [named[SPARSE_EMBEDDINGS]]
        for (name, _, _), projection in zip(self.widths, self.projections, strict=True):
            parts.append(torch.einsum("bfw,fwd->bfd", named[name], projection))
        head = []
        if self.has_dense:
            bottom = self.bottom(named[DENSE_NORMALIZED])
            parts.insert(0, bottom[:, None, :])
            head.append(bottom)
        attentions = [self.attention, *self.further] if self.has_attention else []
        for group, attention in zip(self.groups, attentions, strict=True):
            target = named[group.target]
            weights = named.get(group.history.replace(HISTORY_EMBEDDINGS, HISTORY_LOG_WEIGHTS, 1))
            context = attention(target, named[group.history], named[group.mask], users, weights)
            parts += [attention.project_target(target)[:, None, :], context[:, None, :]]
        stacked = torch.cat(parts, dim=1)
        pairs = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)[:, self.pair_index]
        logit = self.top(torch.cat([*head, pairs], dim=1))
        for name in self.first_order:  # FM-style first-order terms: each 1-wide slot's value
            logit = logit + named[name].sum(dim=(1, 2))[:, None]
        return torch.sigmoid(logit)


class CandidateNet(nn.Module):
    """The same network over candidate lists: one history row per user, ``history_user`` per row.

    ``forward`` takes :attr:`input_names`: the dense contract's inputs, whose history and mask hold
    a row per user, then :data:`~recserve.core.names.HISTORY_USER`. Exported as a second ONNX graph.
    """

    def __init__(self, net: CTRNet) -> None:
        super().__init__()
        if not net.has_attention:
            raise ValueError("a network without a sequence has no candidate-list layout")
        self.net = net
        self.input_names = (*net.input_names, HISTORY_USER)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Click probability [B, 1]."""
        named = dict(zip(self.input_names, inputs, strict=True))
        return self.net.score(named, named.pop(HISTORY_USER))
