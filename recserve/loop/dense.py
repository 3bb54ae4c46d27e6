"""The dense side of ``recserve learn``: the served network's weights trained with the rows, hot-swapped.

With ``[loop] dense_learning_rate`` above 0, the learner also trains a copy of the dense network's
weights on each batch (one Adagrad step per batch on its weighted log loss, the rows as the learner
holds them: :meth:`DenseTrainer.train`). The rows go on training through the network **as served**
(:attr:`DenseTrainer.served`), so the rows a delta publishes are always trained for the weights the
servers hold: rows trained through unpublished weights scored worse on the served ones, and their
watch rolled them back. The weights are published on their own, slower interval
(``[loop] dense_publish_seconds``) as a new ``dense`` version, through a callable the command
gives (:data:`PublishDense`: the version folder written whole and checked, then loaded by the
servers). What guards a rows' publish guards this one:

* **the decision**: on the examples since the last dense publish that carry their served score, the
  learner's progressive log loss against the served scores'; worse by more than the margin, nothing
  is published and the weights (and the optimizer's state) go back to the served ones;
* **the watch**: the examples the new version served (their ``dense_version``) are scored by its
  weights and by the weights it replaced, with the same rows (:class:`DenseWatch`); once
  ``watch_examples`` came and its log loss is worse by more than the margin, the replaced weights
  are published again as a newer version (a rollback is a version like any other, so the servers'
  latest-version policy serves it) and the learner's weights go back to them.

Each version published or rolled back is loaded into :attr:`DenseTrainer.served`, which the rows
train through from then on.

A restarted learner starts from the newest served version, with the optimizer's state saved when
it was published (``recserve.loop.learner_state``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from recserve.backends.dense.network import CTRNet
from recserve.loop.watch import judge, positive_share, progressive_auc, progressive_check, watched_auc, worse

#: a network's weights by name
Weights = dict[str, torch.Tensor]
#: writes these weights as the next dense version and puts it live; returns the version
PublishDense = Callable[[Mapping[str, torch.Tensor]], int]


@dataclass
class DenseWatch:
    """A dense version being watched: the weights it replaced, what the examples it served scored."""

    version: int
    weights: Weights  # its own
    replaced: tuple[Weights, dict[str, Any]]  # the weights before it and the optimizer's state then
    positive_share: float  # the positives' weighted share before it (see recserve.loop.watch)
    # label, weight, this version's score, the replaced weights' score: per example it served
    scored: list[np.ndarray] = field(default_factory=list)


def weighted_log_loss(probability: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The batch's log loss, each example weighted (``1 / sample_rate``)."""
    losses = -(labels * probability.log() + (1 - labels) * (1 - probability).log())
    return (weights * losses).sum() / weights.sum()


class DenseTrainer:
    """Trains a copy of ``served`` (dense version ``version``) with Adagrad; publishes and watches versions.

    ``served`` is the learner's network as served: it takes each version's weights as it goes live.
    """

    def __init__(self, served: CTRNet, learning_rate: float, version: int) -> None:
        self.served = served
        self.net = copy.deepcopy(served).eval()  # the forward pass as served (no dropout), trainable
        for parameter in self.net.parameters():
            parameter.requires_grad_(True)
        self.optimizer = torch.optim.Adagrad(self.net.parameters(), lr=learning_rate)
        #: the served dense version (the last published)
        self.version = version
        self.published = (self.weights(), self.optimizer_state())
        self._scored: list[np.ndarray] = []  # per batch since the last publish: as Learner._scored
        self.watching: list[DenseWatch] = []
        self._scratch = copy.deepcopy(self.net).requires_grad_(False)  # scores other weights
        self.versions_published = 0
        self.refused_publishes = 0
        self.rollbacks = 0
        #: the last publish decision's log losses and AUCs (learner, served)
        self.last_check: tuple[float, float] = (0.0, 0.0)
        self.last_auc: tuple[float, float] = (0.0, 0.0)
        #: the last watch judged: the log losses (the version's, the replaced weights')
        self.last_watch: tuple[float, float] = (0.0, 0.0)

    def weights(self) -> Weights:
        """A copy of the network's weights now."""
        return {name: value.detach().clone() for name, value in self.net.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of the optimizer's state now."""
        return copy.deepcopy(self.optimizer.state_dict())

    def _restore(self, state: tuple[Weights, dict[str, Any]]) -> None:
        weights, optimizer = state
        self.net.load_state_dict(weights)
        # load_state_dict may keep the given tensors: a copy, so later steps never write into ``state``
        self.optimizer.load_state_dict(copy.deepcopy(optimizer))

    def train(
        self,
        probability: Callable[[CTRNet], torch.Tensor],
        labels: torch.Tensor,
        weights: torch.Tensor,
        served: np.ndarray,
    ) -> np.ndarray:
        """One Adagrad step on the batch; its probabilities before the step (progressive).

        ``probability`` gives the batch's probabilities through a network; ``served`` holds the
        scores served (NaN: none came), for the publish decision.
        """
        p = probability(self.net)
        weighted_log_loss(p, labels, weights).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        progressive = p.detach().numpy().astype(np.float64)
        self._scored.append(np.stack([progressive, labels.numpy(), weights.numpy(), served], axis=1))
        return progressive

    @property
    def pending(self) -> int:
        """Examples trained on since the last publish."""
        return sum(len(part) for part in self._scored)

    def with_weights(self, weights: Mapping[str, torch.Tensor]) -> CTRNet:
        """A network (not the trained one) holding ``weights``, to score with."""
        self._scratch.load_state_dict(weights)
        return self._scratch

    def observe(
        self, examples: pa.Table, scored: np.ndarray, score: Callable[[pa.Table, CTRNet], np.ndarray]
    ) -> None:
        """Score the examples each watched version served by its weights and by those it replaced.

        ``scored`` is the batch's (progressive p, label, weight, served score); ``score`` scores
        examples through a network with the rows as published, so the two scores differ by the
        weights alone.
        """
        if not self.watching:
            return
        served_by = pc.fill_null(examples["dense_version"], -1).to_numpy()
        for watch in self.watching:
            mine = np.flatnonzero(served_by == watch.version)
            if len(mine):
                taken = examples.take(mine)
                pair = [score(taken, self.with_weights(w)) for w in (watch.weights, watch.replaced[0])]
                watch.scored.append(np.stack([scored[mine, 1], scored[mine, 2], *pair], axis=1))

    def publish(
        self, write: PublishDense, max_loss_increase: float | None = None, max_auc_drop: float | None = None
    ) -> int | None:
        """Publish the weights as a new version (returned), or refuse (None) and go back to the served ones.

        Refused when the progressive log loss since the last dense publish is above the served
        scores' by more than ``max_loss_increase``, or its AUC below theirs by more than
        ``max_auc_drop`` (None: not checked).
        """
        self.last_check = progressive_check(self._scored)
        self.last_auc = progressive_auc(self._scored)
        share = positive_share(self._scored)
        self._scored = []
        if worse(self.last_check, self.last_auc, max_loss_increase, max_auc_drop):
            self.refused_publishes += 1
            self._restore(self.published)
            return None
        replaced, self.published = self.published, (self.weights(), self.optimizer_state())
        self.version = write(self.published[0])
        self.served.load_state_dict(self.published[0])
        self.versions_published += 1
        self.watching.append(DenseWatch(self.version, self.published[0], replaced, share))
        return self.version

    def watch(
        self,
        write: PublishDense,
        watch_examples: int,
        max_loss_increase: float,
        max_auc_drop: float | None = None,
    ) -> int | None:
        """Roll back a watched version that scored worse than the weights it replaced; the revert's version.

        Worse: its log loss above theirs by more than ``max_loss_increase``, or its AUC below theirs by
        more than ``max_auc_drop`` (None: not checked). The versions published after it were trained on
        top of it: their watches go with it.
        """
        for watch in list(self.watching):
            judged = judge(watch.scored, watch.positive_share, watch_examples)
            if judged is None:
                continue
            self.last_watch = judged
            self.watching.remove(watch)
            if not worse(judged, watched_auc(watch.scored), max_loss_increase, max_auc_drop):
                continue
            self.watching.clear()
            self.version = write(watch.replaced[0])
            self.published = watch.replaced
            self._restore(watch.replaced)
            self.served.load_state_dict(watch.replaced[0])
            self.rollbacks += 1
            return self.version
        return None
