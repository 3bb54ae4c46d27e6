"""The experiments behind ``recserve lab ...``: measurements that explain a design choice.

Step scheduling and queue policies (``tune``, ``queue_stall``), the adapter's cuts (``microbench``),
the dense step and the store against bare baselines (``dense_bench``, ``store_bench``), the import
rate (``import_bench``), bounded soak and open-loop overload (``soak``, ``overload``), the access
layer's cost and spike (``access_latency``, ``access_overload``) and a Redis Cluster outage
(``redis_outage``).
"""
