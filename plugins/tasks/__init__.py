"""Built-in tasks."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.tasks.code_completion import CodeCompletionTask
from elasticfw_plugins.tasks.dataset import DatasetTask
from elasticfw_plugins.tasks.fewshot import FewshotTask
from elasticfw_plugins.tasks.kv_retrieval import KvRetrievalTask
from elasticfw_plugins.tasks.passkey import PasskeyTask
from elasticfw_plugins.tasks.ruler import (
    NiahMultikeyTask,
    NiahMultiqueryTask,
    NiahMultivalueTask,
    NiahSingleTask,
)
from elasticfw_plugins.tasks.summary import SummaryTask
from elasticfw_plugins.tasks.variable_tracking import VariableTrackingTask


@hookimpl
def elasticfw_register_tasks(register):
    register(PasskeyTask)
    for ruler_task in (NiahSingleTask, NiahMultikeyTask, NiahMultivalueTask, NiahMultiqueryTask,
                       VariableTrackingTask, KvRetrievalTask):
        register(ruler_task)
    register(DatasetTask)
    for robust_task in (CodeCompletionTask, FewshotTask, SummaryTask):
        register(robust_task)
