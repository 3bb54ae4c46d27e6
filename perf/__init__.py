"""Performance measurement with perf_analyzer."""
