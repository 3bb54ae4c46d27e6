"""Triton model ``dense``: the network behind the bucket policy (see recserve.backends.dense.runner)."""

from recserve.backends.base.heap import freeze_startup_heap
from recserve.backends.dense.compatibility import check_dense_fits, onnx_input_dims
from recserve.backends.dense.runner import DenseStep
from recserve.backends.request_log.step_log import score_log
from recserve.backends.triton.adapter import ModelContext, instance_device
from recserve.backends.triton.degrade_requests import answer_lists
from recserve.backends.triton.dense_requests import DenseRequests
from recserve.backends.triton.publisher import MetricsPublisher
from recserve.core.names import DENSE_DEVICE_PARAMETER


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
        self.log = score_log(context.spec)  # None unless [logging] or serve --log-dir turn it on
        # Triton's warm-up comes first: its scores are neither counted nor logged
        self.requests = DenseRequests(
            context.spec, self.step, context.version, context.warmup_requests, self.log
        )
        # [degrade]: a candidate list cut short is answered for every candidate it asked for
        self.fallback = context.spec.degrade.fallback_score if context.spec.degrade.enabled else None
        self.metrics = MetricsPublisher()
        # every declared series exists (at 0) before the first request
        self.metrics.publish_now(self.samples)
        self.metrics.start(self.samples)  # from now on once a second, off the request path
        freeze_startup_heap()  # last: what the instance holds from now on is never walked again

    def execute(self, requests: list) -> list:
        """Finite probabilities for every valid request (see DenseRequests)."""
        responses, served = self.requests.execute(requests)
        if self.fallback is not None:
            responses = answer_lists(requests, responses, self.fallback)
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

    def finalize(self) -> None:
        """Stop background compiles; publish the last counts."""
        self.metrics.stop()
        self.step.close()
        if self.log is not None:
            self.log.writer.close()  # what is queued is written
        self.metrics.publish_now(self.samples)
