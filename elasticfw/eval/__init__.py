"""Evaluation: tasks, batched generation, comparison reports."""
