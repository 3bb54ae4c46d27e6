"""The steps composed from the subsystems: features to embeddings, the in-process pipeline, explain."""
