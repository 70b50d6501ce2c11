"""Every device program of the paged paths, declared once: name -> (function, jit options).

The engine makes a fresh set per depth (`programs()`; what a set compiled is freed with it), the
`Model` path (`generate`, the batch calls, `Conversation`) runs the module's one set, `SHARED`:
both drivers run the same step body (`step.py`) by the same programs. Static arguments are
shapes, depths and a loop's kind only (a speculative round's lookahead; its draft depth is
traced), so warmup can enumerate them (`serving.plan`).
"""

from __future__ import annotations

import functools

import jax

from ..model import page_pool
from . import step as St

POOL, STATE = ("pool",), ("pool", "state")

JIT_OPTIONS = dict(
    # a pool and its pages
    empty_pool=(page_pool.empty, dict(static_argnums=(0, 1, 2, 3, 4, 5, 6))),
    collapse_pages=(page_pool.collapse_pages, dict(static_argnames=("loops",), donate_argnames=POOL)),
    load_segment=(page_pool.load_segment, dict(static_argnames=("cfg",), donate_argnames=POOL)),
    copy_pages=(page_pool.copy_pages, dict(donate_argnames=POOL)),
    grow=(page_pool.grow, dict(static_argnames=("n_pages",))),
    to_segment=(page_pool.to_segment, dict(static_argnames=("capacity", "rings", "ring_capacity"))),
    # request rows (made on the host: `step.requests_of`)
    admit=(St.admit, dict(donate_argnames=("state",))),
    start_rows=(St.start_rows, dict(donate_argnames=("state",))),
    # the step body and its loop
    step=(St.step, dict(static_argnames=("cfg", "loops", "window", "in_prefill", "keep_depths", "top"),
                     donate_argnames=STATE)),
    decode_forward=(St.decode_forward, dict(static_argnames=("cfg", "loops", "window"), donate_argnames=POOL)),
    decode_choose=(St.decode_choose, dict(donate_argnames=("state",))),
    decode_steps=(St.decode_steps, dict(static_argnames=("cfg", "loops", "n_max", "window", "adaptive", "lookahead"),
                                        donate_argnames=STATE)),
)


class Programs(dict):
    """name -> jitted program, also as attributes (`SHARED.step`)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def programs() -> Programs:
    """A new set of the jitted programs over new function objects: JAX keeps a program's trace,
    lowering and executable in caches keyed (weakly) by the function, so what one set compiled
    is freed with it (a depth's programs hold megabytes)."""
    out = Programs()
    for name, (fn, opts) in JIT_OPTIONS.items():
        @functools.wraps(fn)
        def fresh(*args, fn=fn, **kwargs):
            return fn(*args, **kwargs)
        out[name] = jax.jit(fresh, **opts)
    return out


SHARED = programs()  # the `Model` path's
