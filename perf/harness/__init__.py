"""Load and measurement helpers shared by the benchmarks, the lab commands and the tests.

Traffic senders and scratch repositories (``traffic``), a real Redis Cluster on loopback
(``redis_cluster``), Triton's per-model statistics (``stats``), the closed-loop HTTP load generator
(``loadgen``) and the in-process rate (``inprocess``). The commands use them too, so they stay in the
installed package rather than under ``tests/``.
"""
