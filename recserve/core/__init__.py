"""The ground floor of recserve: what every other part stands on, importing nothing of the project above it.

- :mod:`~recserve.core.names`: the ensemble's steps and the tensors between them, defined once.
- :mod:`~recserve.core.sections_base`, :mod:`~recserve.core.sections_serving`,
  :mod:`~recserve.core.sections_features`: the spec's TOML tables parsed into typed sections.
- :mod:`~recserve.core.spec_types`, :mod:`~recserve.core.spec`: the spec's value objects and
  :class:`~recserve.core.spec.ModelSpec`.
- :mod:`~recserve.core.name_ranges`, :mod:`~recserve.core.spec_features`,
  :mod:`~recserve.core.spec_parse`: reading a spec document (name ranges, features, the whole).
- :mod:`~recserve.core.contract`: the dense contract.
- :mod:`~recserve.core.candidate_lists`: a user's candidate list in list form and as rows.
- :mod:`~recserve.core.values`: the value codec (raw values parsed into numbers and ids).
- :mod:`~recserve.core.rows`: the one row container.

The former modules :mod:`recserve.spec`, :mod:`recserve.sections` and :mod:`recserve.wire` re-export
these names; :mod:`recserve.errors` holds the error hierarchy.
"""
