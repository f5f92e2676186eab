"""Built-in tasks."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.tasks.passkey import PasskeyTask


@hookimpl
def elasticfw_register_tasks(register):
    register(PasskeyTask)
