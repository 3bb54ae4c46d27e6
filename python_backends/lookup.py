"""The import path :mod:`recserve.backends.steps.lookup` had before it moved, kept for built repositories.

A repository built before the move holds an ``embedding_lookup`` adapter (``model.py``, copied into its
version folder by ``recserve build``) that imports ``recserve.backends.lookup``; it keeps loading until
the repository is rebuilt. New code imports :mod:`recserve.backends.steps.lookup`.
"""

from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings

__all__ = ["EmbeddingLookup", "FeaturesToEmbeddings"]
