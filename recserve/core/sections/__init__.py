"""The spec's TOML tables parsed into typed sections, one module per part of the document.

:mod:`.base` parses a table into its dataclass and defines :class:`~recserve.core.sections.base.SpecError`;
:mod:`.features` the ``[[features]]`` kinds and the top-level keys; :mod:`.serving` ``[model]``,
``[serving]``, ``[store]``, ``[access]`` and the rest of serving; :mod:`.user_state` ``[user_state]``;
:mod:`.logging` ``[logging]``.
"""
