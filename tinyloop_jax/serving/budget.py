"""The engine's sizes and memory: a page's and a depth's bytes, the pages a depth's pool holds
within the memory budget, a request's pages, the local slots and pass slots beside them
(`Budget`, a value of the engine's sizes; the `Batcher` holds one).
"""

from __future__ import annotations

import jax

from . import step as S
from ..decoding import step as St
from ..api.pages import PageBook
from ..model import page_pool

PASS_SHARE = 4  # a compact kv_share's pages per pass slot (`Budget.prompt_slots`)
# "auto" memory_budget (`auto_budget`): a share of the memory free once the weights are loaded — on a
# GPU 80% (vLLM's gpu_memory_utilization is 0.9 of the whole device; the rest here is the programs' and
# XLA's working memory), on a CPU a quarter, at most 4 GiB (vLLM's CPU backend keeps 4 GiB of KV by
# default: host memory is shared with everything else) — and never below one request of
# `AUTO_REQUEST_TOKENS` at the model's default depth. Where nothing says what is free: 256 MiB.
AUTO_SHARE = {"gpu": 0.8, "cpu": 0.25}
AUTO_CPU_CAP = 4 << 30
AUTO_REQUEST_TOKENS = 2048  # a chat request: up to 1,024 prompt tokens and the server's 1,024 answer tokens
DEFAULT_KV_MEMORY = 256 << 20


class Budget:
    """Sizes of the engine's pools and rows, from the model's config and the engine's sizes:
    max_batch request rows per depth, chunk prompt tokens a step, page_size tokens a page,
    memory_budget bytes for every depth's pool and rows (None: each pool holds max_batch rows at
    the whole context; "auto" is resolved before: `auto_budget`), decode_steps steps a burst."""

    def __init__(self, cfg, max_batch: int, chunk: int, page_size: int, memory_budget: int | None,
                 decode_steps: int = 1):
        self.cfg, self.max_batch, self.chunk, self.page_size = cfg, max_batch, chunk, page_size
        self.memory_budget, self.decode_steps = memory_budget, decode_steps

    def page_nbytes(self, loops: int, layers: int | None = None) -> int:
        """Bytes of a page (of `layers` of its cache layers; default every layer on the pages: a
        compact `kv_share`'s loop layers as it keeps them)."""
        c = self.cfg
        held = loops if c.share.full else c.share.slots(loops)
        layers = c.n_cache_layers(held) - len(self.local) if layers is None else layers
        return page_pool.page_nbytes(c.storage, layers, c.n_kv_heads, self.page_size, c.head_dim, c.d_model)

    def pass_nbytes(self, loops: int) -> int:
        """Bytes of a pass slot (a compact `kv_share`: a prompt page's every loop pass)."""
        return self.page_nbytes(loops, loops * self.cfg.loop_blocks)

    def prompt_slots(self, n_pages: int) -> int | None:
        """Pass slots beside n_pages pages under a compact `kv_share` (None: full, none): a
        quarter as many (`PASS_SHARE`: prompts in flight and cached prefixes keep every pass
        there, the pages hold every row compact), and at least what the longest prompt the
        pages hold needs (its pages and a copied partial page)."""
        if self.cfg.share.full:
            return None
        whole = -(-self.cfg.max_seq_len // self.page_size)
        return max(1, min(n_pages, max(-(-n_pages // PASS_SHARE), whole + 1)))

    @property
    def local(self) -> tuple:
        """The pre layers kept in local slots (`page_pool.local_layers`)."""
        return page_pool.local_layers(self.cfg)

    @property
    def local_window(self) -> int:
        return page_pool.local_window(self.cfg)

    def credits(self, n_pages: int, lookahead: int = 0, chunk: int | None = None) -> int:
        """Local slots a row of n_pages pages holds at most: the pages of its last window and of
        the most positions one step writes."""
        P, W = self.page_size, self.local_window
        T = max(self.chunk if chunk is None else chunk, self.decode_steps, lookahead + 1)
        return min(n_pages, -(-(W - 1) // P) + -(-T // P) + 3)  # (+1: a speculative round rolled back)

    def local_slots(self, n_pages: int) -> int:
        """Local slots beside n_pages pages: half as many, and at least every row's window."""
        return min(n_pages, max(n_pages // 2, self.max_batch * self.credits(n_pages)))

    def empty_rows(self) -> S.Requests:
        """A depth's request rows (`step.empty_rows`)."""
        c = self.cfg
        return St.empty_rows(self.max_batch, c.vocab_size, c.d_model, c.compute_dtype)

    def rows_nbytes(self) -> int:
        """Bytes of a depth's request rows (`step.Requests`)."""
        if not hasattr(self, "_rows_nbytes"):
            shapes = jax.eval_shape(self.empty_rows)
            self._rows_nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
        return self._rows_nbytes

    def max_pages(self) -> int:
        """Pages that hold every request row at the whole context: more is never needed."""
        return self.max_batch * -(-self.cfg.max_seq_len // self.page_size)

    def need_pages(self, n_prompt: int, max_tokens: int) -> int:
        return -(-(n_prompt + max_tokens) // self.page_size)

    def pool_pages(self, loops: int) -> int:
        """Pages of a depth's pool: what the budget holds beside the request rows (and the local
        and pass slots that go with them), up to `max_pages` (the same for every engine of this
        model and budget, so warmup's programs are the ones serving runs)."""
        if self.memory_budget is None:
            return self.max_pages()
        room = self.memory_budget - self.rows_nbytes()
        g, l = self.page_nbytes(loops), self.page_nbytes(loops, len(self.local)) if self.local else 0  # noqa: E741
        f = 0 if self.cfg.share.full else self.pass_nbytes(loops)
        n = min(self.max_pages(), room // (g + l // 2 + f // PASS_SHARE))
        while n > 0 and self.pages_nbytes(loops, n) > room:  # (the rows' windows take more than half)
            n -= max(1, n // 64)
        return max(0, n)

    def pages_nbytes(self, loops: int, n: int) -> int:
        """Bytes of n pages with their local and pass slots."""
        local = self.local_slots(n) * self.page_nbytes(loops, len(self.local)) if self.local and n else 0
        return n * self.page_nbytes(loops) + local + (self.prompt_slots(n) or 0) * self.pass_nbytes(loops)

    def depth_nbytes(self, loops: int) -> int:
        return self.pages_nbytes(loops, self.pool_pages(loops)) + self.rows_nbytes()

    def empty_pool(self, loops: int, n_pages: int, make=page_pool.empty) -> page_pool.PagedKV:
        """A depth's pool (its local layers in `local_slots` slots, a compact kv_share's prompts
        in `prompt_slots`), by `make` (a depth's program, or the function for shapes)."""
        return make(self.cfg, loops, n_pages, self.page_size, None, self.local_slots(n_pages) if self.local else None,
                    self.prompt_slots(n_pages))

    def book(self, n_pages: int) -> PageBook:
        """The `PageBook` of a depth's pool of n_pages pages, with its local and pass slots."""
        return PageBook(n_pages, self.page_size, self.local_slots(n_pages) if self.local else None, self.local_window,
                        self.prompt_slots(n_pages))

    def memory_bytes(self, depths) -> int:
        """Bytes the depths (`Depth`s) hold: their pools and rows."""
        return sum(d.pool.nbytes + self.rows_nbytes() for d in depths)


def auto_budget(free: int | None, backend: str, floor: int) -> int:
    """The "auto" memory budget: `AUTO_SHARE` of the `free` bytes on `backend` (a CPU's at most
    `AUTO_CPU_CAP`), never below `floor` (one request at the default depth); `DEFAULT_KV_MEMORY`
    where nothing says what is free."""
    if free is None:
        return max(floor, DEFAULT_KV_MEMORY)
    share = int(free * AUTO_SHARE.get(backend, AUTO_SHARE["gpu"]))
    return max(floor, min(share, AUTO_CPU_CAP) if backend == "cpu" else share)
