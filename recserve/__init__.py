"""recserve: serve sparse CTR models on Triton Inference Server."""

__version__ = "0.1.0"
