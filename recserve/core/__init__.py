"""The ground floor of recserve: what every other part stands on, importing nothing of the project above it.

- :mod:`~recserve.core.names`: the ensemble's steps and the tensors between them, defined once.
- :mod:`recserve.core.sections`: the spec's TOML tables parsed into typed sections.
- :mod:`recserve.core.spec`: the spec's value objects, its parsing and ``ModelSpec``.
- :mod:`~recserve.core.name_ranges`: name ranges (``C{1..26}``) of the spec's features;
  :mod:`~recserve.core.feature_columns`: features reading another feature's column.
- :mod:`~recserve.core.contract`: the dense contract.
- :mod:`~recserve.core.candidate_lists`: a user's candidate list in list layout and as rows.
- :mod:`~recserve.core.values`: the value codec (raw values parsed into numbers and ids);
  :mod:`~recserve.core.times`: time values and their parts; :mod:`~recserve.core.wire_forms`: the two
  forms of a request's categorical values (ids, text).
- :mod:`~recserve.core.rows`: the one row container.
- :mod:`~recserve.core.gpu_batches`: the GPU profile's batch limits;
  :mod:`~recserve.core.user_state_wire`: what ``[user_state]`` adds to the wire and the contract.

:mod:`recserve.errors` holds the error hierarchy.
"""
