"""Elastic models: backbone adapters, model sources, the transformers bridge, adapters on disk."""
