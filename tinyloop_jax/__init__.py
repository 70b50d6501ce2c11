"""tinyloop-jax: a JAX/XLA inference runtime for looped transformer LMs with prefix caching."""

from . import functional
from .cache import KVCache
from .config import KV_MODES, ModelConfig
from .params import Weights
from .prefix import PrefixCache
from .runtime import Model, ResumeHandle
from .sampling import Request
from .serving import Engine
from .store import PrefixStore
from .tokenizer import ByteTokenizer, HFTokenizer
from .transformer import Exit

__all__ = ["ByteTokenizer", "Engine", "Exit", "HFTokenizer", "KV_MODES", "KVCache", "Model", "ModelConfig",
           "PrefixCache", "PrefixStore", "Request", "ResumeHandle", "Weights", "functional"]
__version__ = "0.1.0"
