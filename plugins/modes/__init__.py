"""Built-in attention modes."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.modes.full import FullAttention
from elasticfw_plugins.modes.streaming import StreamingAttention


@hookimpl
def elasticfw_register_sparse_modes(register):
    register(FullAttention)
    register(StreamingAttention)
