"""Built-in model sources (short names usable in recipes)."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.models.smollm2 import SmolLM2Source


@hookimpl
def elasticfw_register_models(register):
    register(SmolLM2Source)
