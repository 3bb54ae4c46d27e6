"""The layer between Triton's Python backend and the plain-Python steps: batching, errors, metrics, adapters."""
