"""Triton model ``dense``: the network behind the bucket policy (see recserve.backends.dense.runner)."""

import functools

import numpy as np

from recserve.backends.base.heap import freeze_startup_heap
from recserve.backends.dense.compatibility import check_dense_fits, onnx_input_dims
from recserve.backends.dense.runner import DenseStep
from recserve.backends.request_log.step_log import score_log
from recserve.backends.triton.adapter import (
    ModelContext,
    execute_alone,
    execute_by_form,
    execute_checked_merged,
    instance_device,
)
from recserve.backends.triton.publisher import MetricsPublisher
from recserve.core.contract import dense_net_inputs, left_padded_inputs
from recserve.core.names import DENSE_DEVICE_PARAMETER, DENSE_VERSION, PROBABILITY


class TritonPythonModel:
    """One bucketed call per dynamic batch; bucket and padding counters on the metrics endpoint."""

    def initialize(self, args: dict) -> None:
        """Verify the artifacts and compile every bucket of the spec's grid (warmed before READY)."""
        context = ModelContext.from_args(args)
        device = instance_device(args)
        check_dense_fits(context.spec, onnx_input_dims(context.version_dir))
        self.step = DenseStep.load(
            context.spec,
            context.version_dir,
            context.instance_count,
            device,
            context.parameters.get(DENSE_DEVICE_PARAMETER, ""),
        )
        self.version = context.version
        self.warmup_left = context.warmup_requests  # Triton's warm-up comes first: not served scores
        self.input_names = dense_net_inputs(context.spec)
        self.left_padded = left_padded_inputs(context.spec)
        self.log = score_log(context.spec)  # None unless [logging] or serve --log-dir turn it on
        self.metrics = MetricsPublisher()
        # every declared series exists (at 0) before the first request
        self.metrics.publish_now(self.samples)
        self.metrics.start(self.samples)  # from now on once a second, off the request path
        freeze_startup_heap()  # last: what the instance holds from now on is never walked again

    def execute(self, requests: list) -> list:
        """Finite probabilities for every valid request."""
        served = self.warmup_left <= 0
        self.warmup_left -= len(requests)
        accept = self.step.accept if served else functools.partial(self.step.accept, count=False)
        observe = self.log if served else None  # Triton's warm-up is not logged
        responses = execute_by_form(
            requests,
            self.step.lists.input_names[0],
            lambda rows: execute_checked_merged(
                rows,
                self.input_names,
                self.step.check,
                self.score,
                accept=accept,
                left_padded=self.left_padded,
                tensors=self.step.tensors,
                observe=observe,
            ),
            lambda lists: execute_alone(
                lists,
                self.step.lists.input_names,
                self.score_list,
                self.step.tensors,
                self.score_lists,
                observe=observe,
            ),
        )
        self.step.copies.executed()
        if not served:  # published after every warm-up batch, so the counts are whole once READY
            self.metrics.publish_now(self.samples)
        return responses

    def samples(self) -> list:
        """Bucket and padding counters, the served-probability histogram, the host-device bytes."""
        return [
            *self.step.runner.counters.samples(),
            *self.step.scores.samples(),
            *self.step.copies.samples(),
            *(self.log.writer.samples() if self.log is not None else ()),
        ]

    def score(self, merged: dict) -> dict:
        """The network's outputs and, per row, the version that computed them."""
        return self.versioned(self.step.compute(merged))

    def score_list(self, inputs: dict, requested: frozenset) -> dict:
        """One candidate list: a row per candidate, user by user; refused whole if any is not finite."""
        outputs = {PROBABILITY: self.step.lists(inputs)}
        self.step.accept(outputs)
        return self.versioned(outputs)

    def score_lists(self, lists: list, requested: list) -> list:
        """A batch's candidate lists scored in one call; if any is not finite, refused (then each alone)."""
        return [self.versioned({PROBABILITY: probability}) for probability in self.step.score_lists(lists)]

    def versioned(self, outputs: dict) -> dict:
        """``outputs`` with, per row, the version that computed them."""
        rows = outputs[PROBABILITY].shape[0]
        return {**outputs, DENSE_VERSION: np.full((rows, 1), self.version, np.int64)}

    def finalize(self) -> None:
        """Stop background compiles; publish the last counts."""
        self.metrics.stop()
        self.step.close()
        if self.log is not None:
            self.log.writer.close()  # what is queued is written
        self.metrics.publish_now(self.samples)
