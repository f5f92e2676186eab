"""Built-in routers."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.routers.fixed import FixedRouter
from elasticfw_plugins.routers.mlp import MLPRouter
from elasticfw_plugins.routers.retrieval_score import RetrievalScoreRouter
from elasticfw_plugins.routers.static import StaticRouter


@hookimpl
def elasticfw_register_routers(register):
    register(MLPRouter)
    register(StaticRouter)
    register(FixedRouter)
    register(RetrievalScoreRouter)
