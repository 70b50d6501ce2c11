"""Serving: continuous batching over the prefix store (`Engine`) and its HTTP app (`app`)."""

from .engine import Engine
from .handles import Cancelled, Handle, QueueFull, RequestTimeout

__all__ = ["Cancelled", "Engine", "Handle", "QueueFull", "RequestTimeout"]
