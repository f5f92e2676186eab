"""elasticfw: test-time adaptive sparse attention (Elastic Attention, arXiv 2601.17367) as a
plugin framework. See README.md and docs/."""

from elasticfw.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]
