"""What users run to measure the product: ``recserve perf``, ``recserve bench`` and realistic traffic.

perf_analyzer and its input data (``analyzer``, ``input_data``), the side-by-side benchmark
(``bench``) with its hop floor (``hops``, ``echo_model``) and candidate-list gain (``candidates``),
reports and best-point selection (``report``), and the locust traffic file (``locustfile``).
"""
