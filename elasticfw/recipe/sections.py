"""What a recipe's plugin sections are, and how two recipes' sections merge: the rule that both
reading (:mod:`elasticfw.recipe.loader`: ``base:`` files, overrides) and validation
(:mod:`elasticfw.recipe.schema`: ``compare`` variants) follow.

A plugin section (a key of :data:`PLUGIN_FIELDS`) that names a different plugin replaces the base
section whole, so that parameters of one plugin never leak into another's.
"""

from __future__ import annotations

from typing import Any

#: recipe field name → plugin kind, for error messages
PLUGIN_FIELDS = {
    "retrieval_mode": "sparse_mode",
    "sparse_mode": "sparse_mode",
    "router": "router",
    "executor": "executor",
    "task": "task",
}

#: recipe fields that hold a list of plugin sections → their plugin kind, for error messages
LIST_PLUGIN_FIELDS = {"modes": "sparse_mode"}

#: the fields of a two-mode ``elastic`` section that an ``elastic.modes`` list replaces: a section (or
#: override) that gives ``modes`` drops them from the section it is merged onto
TWO_MODE_FIELDS = ("retrieval_mode", "sparse_mode")


def merge_sections(base: Any, override: Any, key: str | None = None) -> Any:
    """Deep merge where a plugin section (``key`` in :data:`PLUGIN_FIELDS`) naming a different
    plugin replaces the base section. Other sections with a ``name`` (``model:``) merge."""
    if isinstance(base, dict) and isinstance(override, dict):
        if key in PLUGIN_FIELDS and "name" in override and "name" in base and override["name"] != base["name"]:
            return dict(override)
        merged = dict(base)
        if override.get("modes") is not None:  # a mode list replaces the two-mode fields it generalises
            for k in TWO_MODE_FIELDS:
                merged.pop(k, None)
        for k, value in override.items():
            merged[k] = merge_sections(base[k], value, k) if k in base else value
        return merged
    return override
