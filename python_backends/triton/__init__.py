"""The layer between Triton's Python backend and the plain-Python steps.

Batching, errors, metrics and the model adapters.
"""
