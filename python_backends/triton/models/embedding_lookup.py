"""Triton model ``embedding_lookup``: raw features to the dense network's inputs in one Python hop.

The feature transform (recserve.backends.features.transform) and the tiered store's lookup
(recserve.backends.store.tiered) run here together; see recserve.backends.steps.lookup.FeaturesToEmbeddings.
"""

from recserve.backends.base.heap import freeze_startup_heap
from recserve.backends.request_log.step_log import feature_log
from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
from recserve.backends.steps.stateful_lookup import StatefulFeaturesToEmbeddings
from recserve.backends.steps.user_history import UserHistories
from recserve.backends.store.served import ServedStore
from recserve.backends.triton.adapter import (
    ModelContext,
    execute_alone,
    execute_by_form,
    execute_merged_or_alone,
    instance_device,
)
from recserve.backends.triton.publisher import MetricsPublisher
from recserve.core.names import CANDIDATE_PREFIX, L1_DEVICE_PARAMETER, SPARSE_EMBEDDINGS, USER_ID
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
        self.metrics = MetricsPublisher()
        # every declared series exists (at 0) before the first request
        self.metrics.publish_now(self.samples)
        # from now on once a second, off the request path: a newly applied version shows on the
        # metrics endpoint within a second, without waiting for a request
        self.metrics.start(self.samples)
        freeze_startup_heap()  # last: what the instance holds from now on is never walked again

    def execute(self, requests: list) -> list:
        """One response per request (a bad request fails alone with INVALID_ARG).

        Row-form requests are handled as one merged batch per wire form, and so are candidate lists
        (from the candidates ensemble; each user's sequences looked up once).
        """
        responses = execute_by_form(
            requests,
            self.step.candidate_input_names[0] if self.step.candidate_input_names else "",
            lambda rows: execute_by_form(rows, self.step.ids_marker, self.merged, self.merged),
            lambda lists: execute_by_form(lists, self.step.ids_marker, self.lists, self.lists),
        )
        self.step.copies.executed()
        return responses

    def samples(self) -> list:
        """The store's samples, the user states' with ``[user_state]``, the host-device bytes on a device."""
        return [
            *self.served.samples(),
            *(self.stateful.samples() if self.stateful else ()),
            *(self.step.copies.samples() if self.step.lookup.device_l1 is not None else ()),
            *(self.log.writer.samples() if self.log is not None else ()),
        ]

    def merged(self, requests: list) -> list:
        """Row-form requests of one wire form (ids, or bytes), transformed and looked up together.

        With ``[user_state]`` on, requests carrying a user and those without are merged apart, and
        each gets its history back at the width its own rows were served with.
        """
        if self.stateful is not None:
            stateful = self.stateful
            return execute_by_form(
                requests,
                USER_ID,
                lambda plain: self._merged(plain, stateful.served_width),
                lambda users: self._merged(users, stateful.served_width),
            )
        return self._merged(requests, None)

    def _merged(self, requests: list, output_width) -> list:
        return execute_merged_or_alone(
            requests,
            self.step.input_names,
            self.step,
            ragged_outputs=self.step.histories,
            ragged_width=self.step.history_width,
            left_padded=self.step.left_padded,
            output_width=output_width,
            observe=self.log.rows if self.log is not None else None,
        )

    def lists(self, requests: list) -> list:
        """Candidate lists of one wire form: looked up together, unless one asks for the row form."""
        return execute_alone(
            requests,
            self.step.candidate_input_names,
            self.candidate_list,
            together=self.together,
            observe=self.log.lists if self.log is not None else None,
        )

    def together(self, inputs: list, requested: list) -> list | None:
        """Every list's outputs from one call; None when a list wants the row form (handled alone)."""
        if any(CANDIDATE_PREFIX + SPARSE_EMBEDDINGS not in wanted for wanted in requested):
            return None
        return self.step.candidate_lists(inputs)

    def candidate_list(self, inputs: dict, requested: frozenset) -> dict:
        """One candidate list; as rows when the next step asks for the row form (a TensorRT ``dense``)."""
        expand = CANDIDATE_PREFIX + SPARSE_EMBEDDINGS not in requested
        return self.step.candidates(inputs, expand=expand)

    def is_ready(self) -> bool:
        """Readiness (Python backends that support it): the local tiers are mapped."""
        return self.served.store.healthy()

    def finalize(self) -> None:
        """Stop the upkeep and metrics threads; publish the last counts."""
        self.metrics.stop()
        self.served.close()
        if self.stateful is not None:
            self.stateful.users.close()
        if self.log is not None:
            self.log.writer.close()  # what is queued is written
        self.metrics.publish_now(self.samples)
