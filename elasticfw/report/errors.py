"""The one exception type of :mod:`elasticfw.report`."""

from __future__ import annotations

from elasticfw.errors import ElasticError


class ReportError(ElasticError, ValueError):
    """A sweep run folder cannot be read or summarised (a missing or malformed file, a line of
    ``rows.jsonl`` without a required field, no rows yet), or a statistic was asked of no data."""
