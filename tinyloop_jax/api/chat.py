"""Chat: a `Conversation` whose KV cache is kept between turns, and text streamed as it becomes
final (`Detokenizer`, shared with the HTTP server).

A conversation's cache is a page pool (`model.paged`) kept from turn to turn, its positions in
pages 0, 1, 2, ... in order; each turn runs the paged step of every other path
(`decoding.paged_decode`): the tokens the turn adds as one prompt chunk, then the answer under
the on-device loop, `BURST` tokens between two looks of the host (the text is shown as it
comes). Decoding writes each answer token's K/V as it feeds it, so nothing is prefilled twice:
the answer's last token (never fed) starts the next turn's chunk.

    turn 1   [ system, user 1, "assistant\\n" | answer 1, <|im_end|> ]
    turn 2   [ kept: all of turn 1 but <|im_end|> | <|im_end|>, "\\n", user 2, "assistant\\n" | answer 2, <|im_end|> ]
               read from the pages                 one chunk                                   decoded

The chat template re-renders the whole conversation every turn, so the turn's new tokens are
that rendering minus the kept tokens (prompt + answer ids, the end-of-turn token included), which
must be a token prefix of it. `Conversation.prefix` is the kept cache as a dense `PrefixCache`,
made when asked for.

    >>> conv = Conversation(model, tok, system="Be brief.", max_tokens=64)   # doctest: +SKIP
    >>> "".join(conv.send("What is the capital of France?"))                 # doctest: +SKIP
    'The capital of France is Paris.'
    >>> conv.turns[-1].prefill_tokens                                        # doctest: +SKIP
    37
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from . import functional as F
from . import request as R
from .prefix import PrefixCache
from ..decoding import paged_decode, programs
from ..decoding import step as St
from ..decoding.compiled import SHARED
from ..decoding.grammar import consume, fill_masks
from ..decoding.sampling import Knobs, SamplingParams
from ..model import cache as kvc
from ..model import paged
from ..model import page_pool


class Detokenizer:
    """Emitted ids -> text as it becomes final: held back while it ends in a partial character
    (U+FFFD) or could be the start of a stop string; cut before the first stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self, ids) -> str:
        text = self.tok.decode(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return text[:min(hits)]
        return text

    def _delta(self, text: str, final: bool) -> str:
        if not (final or self.stopped):
            text = text.rstrip("\ufffd")
            text = text[:max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def add(self, ids: list[int]) -> str:
        """More ids -> the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self.ids += ids
        return self._delta(self._text(self.ids), final=False)

    def finish(self, drop: int = 0) -> str:
        """The rest of the text once generation ended (the last `drop` ids, a stop token
        sequence, are not text)."""
        if self.stopped:
            return ""
        return self._delta(self._text(self.ids[:len(self.ids) - drop]), final=True)


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one turn did."""

    prompt_tokens: int  # the rendered conversation, up to the assistant's generation prompt
    reused_tokens: int  # of those, read from the kept pages (the previous answer's last token is not: it
    #                     was never fed, so it starts this turn's chunk)
    prefill_tokens: int  # of those, computed this turn (prompt_tokens - reused_tokens)
    answer: tuple[int, ...]  # the emitted ids, an end-of-turn token included
    text: str  # the answer's text (no end-of-turn token)
    finish_reason: str  # "stop" (an end-of-turn token) | "length" (max_tokens, or the context is full)
    first_token_s: float  # from the call to the first token
    seconds: float  # the whole turn, the kept cache's update included


# A conversation's pool grows by doubling from this many positions: a long chat compiles a few
# programs (one per pool size), not one per 128 tokens as prompt buckets would.
MIN_CAPACITY = 256
# A turn's new tokens are prefilled padded to at least this many: most turns add fewer, so a chat
# compiles about one prefill program per pool size (a compile of a 30-block model costs seconds;
# 31 padding tokens, milliseconds).
MIN_CHUNK = 32
MAX_TOKENS = 512  # an answer's default length
BURST = 8  # tokens decoded on the device between two looks of the host (streamed text)


def capacity(n_tokens: int, context: int) -> int:
    """Positions a conversation's pool must hold for `n_tokens`: a power of two >= MIN_CAPACITY,
    at most the model's context (bucketed)."""
    return max(kvc.bucket(n_tokens), min(max(MIN_CAPACITY, 1 << (n_tokens - 1).bit_length()), kvc.bucket(context)))


@dataclasses.dataclass(frozen=True)
class Kept:
    """A conversation's cache between turns: `tokens` (prompts and answers so far) of which the
    first len(tokens) - 1 are in `pool` (position p in page p // P); the last, an answer's last
    token, is fed with the next turn's chunk."""

    pool: page_pool.PagedKV
    tokens: np.ndarray

    @property
    def fed(self) -> int:
        return len(self.tokens) - 1


def _alive(pool) -> bool:
    """The pool's buffers exist (a program that took them as donated and failed leaves none)."""
    return pool is not None and not any(a.is_deleted() for a in jax.tree.leaves(pool))


class Conversation:
    """A chat with `model` through `tokenizer`'s chat template, its cache kept between turns.

    `send(text)` streams the answer's text; afterwards `messages` holds the conversation, `prefix`
    its cache (a `PrefixCache` of prompt + answers, each end-of-turn token included) and
    `turns[-1]` what the turn did. Generation stops at `tokenizer.eos_token_ids` or after
    `max_tokens`. `reset()` starts over (keeping `system`); `turns` is a log of every turn.
    The sampling keywords may come as one `SamplingParams` (params=) and the depth as a
    `DepthPlan` (plan=: loops and an exit pick). response_format: every answer follows it
    (OpenAI's dict, built for this tokenizer, or a `Grammar`; a turn then decodes a token at a
    time). ValueError if the tokenizer has no chat template or an argument is bad.
    """

    def __init__(self, model, tokenizer, system: str | None = None, loops: int | None = None,
                 max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int = 0, params: SamplingParams | None = None,
                 plan: R.DepthPlan | None = None, response_format=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: chat needs an instruction-tuned model "
                             "(e.g. --model smollm2)")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a string or None, got {type(system).__name__}")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        c = model.weights.config
        c.require_full_share("Conversation")
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     repetition_penalty=repetition_penalty)
        if response_format is not None:  # OpenAI's dict (this tokenizer builds it) or a `Grammar`
            from ..decoding.grammar import Grammar

            given["response_format"] = (response_format if isinstance(response_format, Grammar)
                                        else Grammar.of(response_format, tokenizer, c.vocab_size))
        if max_tokens is not None or params is None:  # a chat's answers default to 512 tokens
            given["max_tokens"] = MAX_TOKENS if max_tokens is None else max_tokens
        plan = R.plan_of(plan, dict(loops=loops))
        if type(plan) is not R.Fixed:
            raise ValueError(f"a Conversation runs at a fixed depth (loops and an exit pick); its plan is {plan!r}")
        params = R.params_of(params, given)
        if params.stop_sequences:
            raise ValueError("a Conversation stops at the tokenizer's end-of-turn tokens; its params take no "
                             "stop_sequences")
        self.eos = list(tokenizer.eos_token_ids)
        stops = tuple((i,) for i in self.eos)
        req = R.checked(R.Request(np.zeros((0,), np.int32), dataclasses.replace(params, stop_sequences=stops), plan),
                        c, allow_empty=True)
        self.loops, self.params = req.loops, req.params
        self._exit = model.exit_for(self.loops, *req.exit_pick)
        self.turns: list[Turn] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (its cache too); the system message stays."""
        self.messages: list[dict] = [] if self.system is None else [dict(role="system", content=self.system)]
        self.kept: Kept | None = None
        self._prefix: PrefixCache | None = None

    @property
    def prefix(self) -> PrefixCache | None:
        """The kept cache as a `PrefixCache` (None before the first turn): the pages' positions
        gathered into a dense segment, the last token fed there (its logits and depth states).
        An h mode's pages hold float32 K/V, not h: its prefix is prefilled from the tokens."""
        if self._prefix is None and self.kept is not None:
            self._prefix = self._dense(self.kept)
        return self._prefix

    def send(self, text: str) -> Iterator[str]:
        """The answer to user message `text`, as pieces of text while it is generated (complete
        characters only). The conversation moves on once the iterator is exhausted; a turn
        abandoned midway leaves it as it was. RuntimeError when the conversation fills the
        model's context."""
        if not isinstance(text, str):
            raise ValueError(f"the message must be a string, got {type(text).__name__}")
        t0 = time.perf_counter()
        w, c = self.model.weights, self.model.weights.config
        messages = self.messages + [dict(role="user", content=text)]
        ids = np.asarray(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True),
                         np.int32)
        max_new = min(self.params.max_tokens, c.max_seq_len - len(ids))
        if max_new < 1:
            raise RuntimeError(f"the conversation is {len(ids)} tokens and fills the model's context "
                               f"(max_seq_len={c.max_seq_len}); /reset starts a new one")
        kept = self.kept
        # the kept tokens must start the new rendering; if the template rewrote an earlier turn
        # (or an answer's text tokenizes differently from the ids the model emitted) they do not,
        # and the whole conversation is prefilled again from the start, into a new pool
        reuse = kept is not None and len(kept.tokens) < len(ids) and np.array_equal(ids[:len(kept.tokens)],
                                                                                      kept.tokens)
        k = kept.fed if reuse else 0
        n_pages = capacity(len(ids) + max_new, c.max_seq_len) // page_pool.PAGE_SIZE
        if not reuse:
            pool = paged_decode.empty_pool(c, self.loops, n_pages)
        elif kept.pool.n_pages < n_pages:  # a copy: the kept pool stays whole if the turn is abandoned
            pool = SHARED.grow(kept.pool, n_pages)
        else:
            pool = kept.pool  # donated: the turn writes only positions >= k, so an abandoned turn keeps it
        table = np.arange(pool.n_pages, dtype=np.int32)[None]
        req = Knobs.from_params([dataclasses.replace(self.params, max_tokens=max_new)])
        seen = jnp.asarray(programs.token_mask([ids], c.vocab_size))
        live = [pool]  # the pool as the last program returned it
        finished = False
        g = self.params.response_format
        matcher = None if g is None else g.matcher()  # every answer follows the grammar from its start
        try:
            new = ids[k:]
            state = St.requests_of(seen, req, d_model=c.d_model, dtype=c.compute_dtype)
            chunks = St.Chunks(paged.Rows(table, np.int32([k]), np.int32([len(new)])),
                               F.pad(new, max(MIN_CHUNK, kvc.bucket(len(new))))[None], None, np.ones((1,), bool),
                               None if matcher is None else fill_masks([matcher], c.vocab_size))
            got, _, live[0], state = SHARED.step(w.params, c, pool, state, chunks, None, loops=self.loops,
                                                 exit=self._exit)

            # the answer: the paged step under the on-device loop, in bursts (streamed between them)
            answer: list[int] = []
            text_so_far = Detokenizer(self.tokenizer, [])
            first = None
            stopped = ended = False
            for t, stopped, ended in self._decode(ids, table, live, got, state, max_new, matcher):
                answer.append(t)
                if first is None:
                    first = time.perf_counter()
                if stopped or ended or len(answer) == max_new:
                    break
                delta = text_so_far.add([t])
                if delta:
                    yield delta
            # the last token (unless an end-of-turn token): its text, then what was held back
            rest = (text_so_far.add([answer[-1]]) if not stopped else "") + text_so_far.finish()
            if rest:
                yield rest
            finished = True
        finally:
            if not finished:  # abandoned, or failed: the kept cache as it was (if its buffers live)
                if kept is not None and not _alive(kept.pool):
                    kept = dataclasses.replace(kept, pool=live[0]) if reuse and _alive(live[0]) else None
                self.kept = kept

        tokens = np.concatenate([ids, np.array(answer, np.int32)])
        tokens.setflags(write=False)
        self.kept, self._prefix = Kept(live[0], tokens), None
        self.messages = messages + [dict(role="assistant", content=text_so_far.sent)]
        self.turns.append(Turn(prompt_tokens=len(ids), reused_tokens=k, prefill_tokens=len(ids) - k,
                               answer=tuple(answer), text=text_so_far.sent,
                               finish_reason="stop" if stopped or ended else "length", first_token_s=first - t0,
                               seconds=time.perf_counter() - t0))

    def _decode(self, ids: np.ndarray, table: np.ndarray, live: list, first: St.Emitted, state: St.Requests,
                max_new: int, matcher=None) -> Iterator[tuple[int, bool, bool]]:
        """The answer's tokens, each with whether it ends a stop sequence (an end-of-turn token)
        and whether its grammar is then complete (matcher: the turn's llguidance matcher, None:
        free), a burst of `BURST` at a time: the step body's `decode_steps` over the pool live[0]
        (kept there after each burst), stopping on the device at a stop or at max_new; with a
        grammar a token at a time, its forward dispatched before the mask is filled
        (`step.decode_forward`, `step.decode_choose`). first: the prompt's step's token, state
        its request row."""
        w, c = self.model.weights, self.model.weights.config
        t, stopped, emitted = int(first.tokens[0]), int(first.stops[0]) >= 0, 1
        ended = matcher is not None and consume(matcher, t)
        yield t, stopped, ended
        while not stopped and not ended and emitted < max_new:
            k = min(BURST, max_new - emitted) if matcher is None else 1
            rows = paged.Rows(table, np.int32([len(ids) + emitted - 1]), np.int32([1]))
            decodes = St.Decodes(rows, None, np.int32([emitted]), np.int32([k]))
            if matcher is None:
                got, live[0], state = SHARED.decode_steps(w.params, c, live[0], state, decodes, np.int32(k),
                                                          loops=self.loops, n_max=BURST, exit=self._exit)
                got = got.out
            else:
                logits, live[0] = SHARED.decode_forward(w.params, c, live[0], state, decodes, loops=self.loops,
                                                        exit=self._exit)
                got, state = SHARED.decode_choose(state, decodes.replace(mask=fill_masks([matcher], c.vocab_size)),
                                                  logits, np.ones((1,), bool))
            for t, s in zip(np.asarray(got.tokens).reshape(-1).tolist(), np.asarray(got.stops).reshape(-1).tolist()):
                if t < 0:
                    break
                emitted, stopped = emitted + 1, s >= 0
                ended = matcher is not None and consume(matcher, t)
                yield t, stopped, ended
                if stopped:
                    break

    def _dense(self, kept: Kept) -> PrefixCache:
        """`prefix`: the last token prefilled into a copy of the kept pages (the kept pool stays
        as the next turn expects it) by the step that builds any prefix, then gathered into a
        dense segment (`functional.paged_prefix`)."""
        w, c = self.model.weights, self.model.weights.config
        tokens, n = kept.tokens, len(kept.tokens)
        seed = int(self.params.seed)
        if kept.pool.kv_mode != c.storage:
            return F.build_prefix(w, tokens, self.loops, exit=self._exit, seed=seed)
        pool = SHARED.grow(kept.pool, max(kept.pool.n_pages, -(-n // page_pool.PAGE_SIZE)))  # (a copy)
        own, logits, depths, _ = F.paged_prefix(w, tokens, kept.fed, pool, np.arange(pool.n_pages, dtype=np.int32),
                                             self.loops, 0, self._exit, seed)
        seen = jnp.asarray(programs.token_mask([tokens], c.vocab_size)[0])
        return PrefixCache(cache=own, prompt=tokens, loops=self.loops, cache_window=0, logits=logits, seen=seen,
                           depth_states=depths, weights=w, seed=seed)

