"""The GPU bench of ``make gpu-check``: the in-process bound and the served paths, side by side.

:mod:`.spec` makes the bench's spec; :mod:`.bound` measures the in-process bound; :mod:`.served` the
served id and BYTES paths through a real tritonserver; :mod:`.steps` the steps' own times from
Triton's statistics; :mod:`.report` the table and ``summary.json``.
"""
