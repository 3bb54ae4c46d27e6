"""The model spec, the single source of truth: its value objects, its parsing and ``ModelSpec``.

:mod:`.types` holds the spec's value objects (tables, features, groups, wire tensors); :mod:`.model`
``ModelSpec``, what every part of recserve derives its names, shapes and limits from; :mod:`.parse`
reads a spec document (``load_spec``), with :mod:`.features` for its ``[[features]]`` and
:mod:`.defaults` for the defaults an import's spec may leave out. The TOML tables' typed sections
are in :mod:`recserve.core.sections`.
"""
