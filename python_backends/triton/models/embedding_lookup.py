"""Triton model ``embedding_lookup``: raw features to the dense network's inputs in one Python hop.

The feature transform (recserve.backends.features.transform) and the tiered store's lookup
(recserve.backends.store.tiered) run here together; see recserve.backends.steps.lookup.FeaturesToEmbeddings,
and recserve.backends.triton.lookup_requests for how a dynamic batch is handled.
"""

from recserve.backends.base.heap import freeze_startup_heap
from recserve.backends.request_log.step_log import feature_log
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.steps.stateful_lookup import StatefulFeaturesToEmbeddings
from recserve.backends.steps.user_history import UserHistories
from recserve.backends.store.served import ServedStore
from recserve.backends.triton.adapter import ModelContext, instance_device
from recserve.backends.triton.degrade_requests import DegradeGate
from recserve.backends.triton.lookup_requests import LookupRequests
from recserve.backends.triton.publisher import MetricsPublisher
from recserve.core.names import L1_DEVICE_PARAMETER
from recserve.core.user_state_wire import serves_user_state


class TritonPythonModel:
    """Transforms and looks up a whole dynamic batch at once; online updates are applied in the background."""

    def initialize(self, args: dict) -> None:
        """Map and verify the shards, apply published updates, warm the hot cache up.

        The hot cache is on the device when the config sets ``l1_device``.
        """
        context = ModelContext.from_args(args)
        self.served = ServedStore.open(context.spec, context.version_dir)
        lookup = EmbeddingLookup.for_instance(
            context.spec,
            self.served,
            context.parameters.get(L1_DEVICE_PARAMETER, ""),
            instance_device(args),
        )
        self.step = FeaturesToEmbeddings(context.spec, lookup)
        self.stateful: StatefulFeaturesToEmbeddings | None = None
        if serves_user_state(context.spec):  # [user_state]: states from under the repository's folder
            histories = UserHistories.open(context.spec, context.version_dir.parent.parent)
            self.step = self.stateful = StatefulFeaturesToEmbeddings(context.spec, lookup, histories)
        self.log = feature_log(context.spec)  # None unless [logging] or serve --log-dir turn it on
        self.requests = LookupRequests(self.step, self.stateful, self.log)
        self.degrade: DegradeGate | None = None  # [degrade]: each request's level chosen at this door
        if context.spec.degrade.enabled:
            names = (*self.step.input_names, *self.step.candidate_input_names)
            # the capacity it learns is kept in the model's folder for the next run
            self.degrade = DegradeGate(
                context.spec, self.requests.execute, names, keep_in=context.version_dir.parent
            )
            self.degrade.start()
        self.metrics = MetricsPublisher()
        # every declared series exists (at 0) before the first request
        self.metrics.publish_now(self.samples)
        # from now on once a second, off the request path: a newly applied version shows on the
        # metrics endpoint within a second, without waiting for a request
        self.metrics.start(self.samples)
        freeze_startup_heap()  # last: what the instance holds from now on is never walked again

    def execute(self, requests: list) -> list:
        """One response per request (a bad request fails alone with INVALID_ARG); see LookupRequests."""
        if self.degrade is not None:
            return self.degrade.execute(requests)
        return self.requests.execute(requests)

    def samples(self) -> list:
        """The store's samples, the user states' with ``[user_state]``, the host-device bytes on a device."""
        return [
            *self.served.samples(),
            *(self.stateful.samples() if self.stateful else ()),
            *(self.step.copies.samples() if self.step.lookup.device_l1 is not None else ()),
            *(self.log.writer.samples() if self.log is not None else ()),
            *(self.degrade.samples() if self.degrade is not None else ()),
        ]

    def is_ready(self) -> bool:
        """Readiness (Python backends that support it): the local tiers are mapped."""
        return self.served.store.healthy()

    def finalize(self) -> None:
        """Stop the upkeep and metrics threads; publish the last counts."""
        self.metrics.stop()
        if self.degrade is not None:
            self.degrade.stop()
        self.served.close()
        if self.stateful is not None:
            self.stateful.users.close()
        if self.log is not None:
            self.log.writer.close()  # what is queued is written
        self.metrics.publish_now(self.samples)
