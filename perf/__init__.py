"""Run and measure the product, in folders by purpose.

``bench`` (what users run: ``recserve perf``, ``recserve bench``, reports), ``peers`` (TorchServe and
the one-model monolith), ``lab`` (the ``recserve lab ...`` experiments), ``harness`` (traffic, a
loopback Redis Cluster, statistics and load generators shared by the commands and the tests) and
``gpu_check`` (the GPU kit).
"""
