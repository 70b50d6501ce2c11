"""Serving: continuous batching over the prefix store (`Engine`) and its HTTP app (`app`)."""

from .engine import Engine
from .handles import Cancelled, Handle, MemoryBudgetError, QueueFull, RequestTimeout

__all__ = ["Cancelled", "Engine", "Handle", "MemoryBudgetError", "QueueFull", "RequestTimeout"]
