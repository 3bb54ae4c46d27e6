"""What the backends' subsystems stand on: artifact files, bounded readers, metric samples, error counts."""
