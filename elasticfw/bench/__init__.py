"""Benchmarks (``python -m elasticfw.bench.<name>``); each writes one JSON file with its environment."""
