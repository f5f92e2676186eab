"""Built-in backbone adapters."""

from elasticfw.hookspecs import hookimpl
from elasticfw_plugins.backbones.gemma3 import Gemma3Adapter
from elasticfw_plugins.backbones.llama import LlamaAdapter
from elasticfw_plugins.backbones.mistral import MistralAdapter
from elasticfw_plugins.backbones.qwen2 import Qwen2Adapter
from elasticfw_plugins.backbones.qwen3 import Qwen3Adapter


@hookimpl
def elasticfw_register_backbones(register):
    for adapter in (LlamaAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter, Gemma3Adapter):
        register(adapter)
