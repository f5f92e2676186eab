"""Built-in attention executors."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.executors.flex import FlexExecutor
from elasticfw_plugins.executors.reference import ReferenceExecutor
from elasticfw_plugins.executors.sdpa import SDPAExecutor
from elasticfw_plugins.executors.split import SplitExecutor


@hookimpl
def elasticfw_register_executors(register):
    register(ReferenceExecutor)
    register(SDPAExecutor)
    register(FlexExecutor)
    register(SplitExecutor)
