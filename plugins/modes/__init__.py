"""Built-in attention modes."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.modes.full import FullAttention
from elasticfw_plugins.modes.moba import MobaAttention
from elasticfw_plugins.modes.nsa import NSAAttention
from elasticfw_plugins.modes.streaming import StreamingAttention
from elasticfw_plugins.modes.xattention import XAttention


@hookimpl
def elasticfw_register_sparse_modes(register):
    register(FullAttention)
    register(MobaAttention)
    register(NSAAttention)
    register(StreamingAttention)
    register(XAttention)
