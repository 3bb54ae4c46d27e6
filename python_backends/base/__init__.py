"""What the backends' subsystems stand on: artifacts, bounded readers, metrics, errors, compiled loops."""
