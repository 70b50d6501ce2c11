"""tinyloop-jax: a JAX/XLA inference runtime for looped transformer LMs with prefix caching."""

from .api import functional
from .model.cache import KVCache
from .model.config import ModelConfig
from .model.kv_modes import KV_MODES
from .model.params import Weights
from .api.prefix import PrefixCache, ResumeHandle
from .api.runtime import Model
from .decoding.sampling import Knobs, SamplingParams
from .decoding.grammar import Grammar
from .api.request import Adaptive, DepthPlan, Fixed, Request, Speculative
from .serving.engine import Engine
from .api.store import PrefixStore
from .api.chat import Conversation
from .formats.hub import model_path
from .formats.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from .model.exits import Exit

__all__ = ["Adaptive", "ByteTokenizer", "Conversation", "DepthPlan", "Engine", "Exit", "Fixed", "Grammar",
           "HFTokenizer", "KV_MODES", "KVCache", "Knobs", "Model", "ModelConfig", "PrefixCache", "PrefixStore",
           "Request", "ResumeHandle", "SamplingParams", "Speculative", "Weights", "functional", "load_tokenizer",
           "model_path"]
__version__ = "0.1.0"
