"""Structured output: a request's `response_format` — OpenAI's `json_object` / `json_schema`, or
a `regex`, a `choice` list, a Lark or GBNF `grammar` — compiled by llguidance against the
model's tokenizer into a `Grammar`. Each request row runs a matcher of it (`Grammar.matcher`)
that says before every token which tokens may come next, as a bitmask row
int32[ceil(V/32)] (bit i % 32 of word i // 32 set: token i allowed), filled on the host
(`fill_masks`) and applied on the device after the penalties and the logit bias
(`sampling.allow`): greedy obeys it, and no bias revives a token it forbids.

    >>> g = Grammar.of({"type": "json_object"}, tokenizer, vocab_size)   # doctest: +SKIP
    >>> model.generate(prompt, max_tokens=64, response_format=g)           # doctest: +SKIP

An unsupported JSON-schema keyword or a bad grammar is a ValueError naming it (never relaxed);
JSON whitespace is bounded (`WHITESPACE`: small models otherwise loop on it).
"""

from __future__ import annotations

import functools
import json
import weakref

import numpy as np

# at most this much whitespace between JSON tokens (llguidance's default is unbounded)
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,8}"
KINDS = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency; named if a user removed it
        raise RuntimeError(f"response_format needs the llguidance package: {e}") from None
    return llguidance


def spec(response_format) -> tuple[str, str] | None:
    """response_format (a dict) -> (its canonical key, llguidance's grammar text); None for
    {"type": "text"} (no constraint). ValueError naming what is wrong."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object such as {{\"type\": \"json_object\"}}, "
                         f"got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in KINDS:
        raise ValueError(f"response_format type {kind!r} is not one of {', '.join(KINDS)}")
    M = _llg().LLMatcher
    if kind == "text":
        return None
    if kind == "json_object":
        grammar = M.grammar_from_json_schema({"type": "object"}, overrides=dict(whitespace_pattern=WHITESPACE))
    elif kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ValueError("response_format json_schema must be an object with a \"schema\" object, "
                             "e.g. {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", \"schema\": {...}}}")
        grammar = M.grammar_from_json_schema(js.get("schema", {}), overrides=dict(whitespace_pattern=WHITESPACE))
    elif kind == "regex":
        grammar = M.grammar_from_regex(_text(response_format, "regex"))
    elif kind == "choice":
        choice = response_format.get("choice")
        if not (isinstance(choice, list) and choice and all(isinstance(c, str) and c for c in choice)):
            raise ValueError("response_format choice must be a non-empty list of non-empty strings")
        grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice))
    else:
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (llama.cpp's) or Lark, as written

        try:
            lark = any_to_lark(_text(response_format, "grammar"))
        except Exception as e:  # noqa: BLE001 - the converter's own error types
            raise ValueError(f"response_format grammar: {e}") from None
        grammar = M.grammar_from_lark(lark)
    return json.dumps(response_format, sort_keys=True, separators=(",", ":")), grammar


def _text(response_format: dict, field: str) -> str:
    value = response_format.get(field)
    if not isinstance(value, str) or not value:
        raise ValueError(f"response_format {response_format.get('type')} needs a non-empty string {field!r}")
    return value


class Grammar:
    """A response_format compiled against one tokenizer (hashable by its canonical key, so a
    `SamplingParams` holding it stays a value; not a dataclass, so `dataclasses.asdict` of the
    params keeps it whole). Build with `Grammar.of`."""

    __slots__ = ("key", "grammar", "tokenizer", "vocab_size")

    def __init__(self, key: str, grammar: str, tokenizer, vocab_size: int):
        self.key = key  # the response_format as canonical JSON
        self.grammar = grammar  # llguidance's grammar text
        self.tokenizer = tokenizer  # llguidance.LLTokenizer
        self.vocab_size = vocab_size  # the model's (mask rows cover it; ids past the tokenizer's never allowed)

    def __repr__(self) -> str:
        return f"Grammar({self.key})"

    def __deepcopy__(self, memo) -> "Grammar":  # immutable: `dataclasses.asdict` of params keeps it
        return self

    @staticmethod
    def of(response_format, tokenizer, vocab_size: int) -> "Grammar | None":
        """`response_format` (OpenAI's dict, or a Grammar) for a model of vocab_size ids whose
        tokenizer is `tokenizer` (ours: `load_tokenizer`'s). None for {"type": "text"}.
        ValueError naming an unsupported keyword or a bad grammar."""
        if isinstance(response_format, Grammar):
            if response_format.vocab_size != vocab_size:
                raise ValueError(f"this Grammar was built for {response_format.vocab_size} token ids; the model has "
                                 f"{vocab_size}")
            return response_format
        s = spec(response_format)
        if s is None:
            return None
        return _compiled(s[0], s[1], llg_tokenizer(tokenizer, vocab_size), vocab_size)

    def matcher(self):
        """A fresh llguidance matcher at the start of the output."""
        return _llg().LLMatcher(self.tokenizer, self.grammar, log_level=0)

    def __eq__(self, other) -> bool:
        return isinstance(other, Grammar) and (self.key, self.vocab_size, id(self.tokenizer)) == (
            other.key, other.vocab_size, id(other.tokenizer))

    def __hash__(self) -> int:
        return hash((self.key, self.vocab_size, id(self.tokenizer)))


def rebuilt(key: str, grammar: str, tokenizer, vocab_size: int) -> Grammar:
    """A Grammar from its canonical key and grammar text (what crosses between processes: the
    compiled one holds llguidance objects) for this process's `tokenizer`; cached."""
    return _compiled(key, grammar, llg_tokenizer(tokenizer, vocab_size), vocab_size)


@functools.lru_cache(maxsize=256)
def _compiled(key: str, grammar: str, tokenizer, vocab_size: int) -> Grammar:
    """One Grammar per (spec, tokenizer): checked once (llguidance builds its lexer here)."""
    error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if error:
        raise ValueError(f"response_format {key}: {messages[0] if messages else 'invalid grammar'}")
    m = _llg().LLMatcher(tokenizer, grammar, log_level=0)
    if m.is_error():
        raise ValueError(f"response_format {key}: {m.get_error()}")
    return Grammar(key, grammar, tokenizer, vocab_size)


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def llg_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of one of our tokenizers (made once per tokenizer and vocabulary size,
    ~1 s for a 49 k vocabulary): a tokenizer.json's text (`HFTokenizer`), or the byte
    tokenizer's 256 bytes and specials."""
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab_size not in per:
        llg = _llg()
        inner = getattr(tokenizer, "_tok", None)
        if inner is not None:
            eos = list(getattr(tokenizer, "eos_token_ids", [])) or None
            per[vocab_size] = llg.LLTokenizer(inner.to_str(), n_vocab=vocab_size, eos_token=eos)
        elif hasattr(tokenizer, "BOS") and hasattr(tokenizer, "EOS"):
            per[vocab_size] = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes(tokenizer, vocab_size)))
        else:
            raise ValueError(f"response_format needs a tokenizer of this package (load_tokenizer), got "
                             f"{type(tokenizer).__name__}")
    return per[vocab_size]


class _Bytes:
    """The byte tokenizer as llguidance's `TokenizerWrapper` reads one: ids 0..255 are bytes, the
    rest of the model's vocab_size specials (never text)."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id, self.bos_token_id = tok.EOS, tok.BOS
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def take(matcher, token: int) -> tuple[bool, str | None]:
    """The matcher takes an emitted token -> (the grammar is done, the refusal's message or None).
    A refusal is never expected (the token passed the matcher's own mask); each driver turns
    it into an error rather than a silently wrong answer."""
    if not matcher.consume_token(int(token)):
        return True, f"the grammar refused token {int(token)} its own mask allowed: {matcher.get_error()}"
    return matcher.is_stopped(), None


def consume(matcher, token: int) -> bool:
    """`take` for a driver that fails its call on a refusal (RuntimeError): is the grammar done?"""
    done, error = take(matcher, token)
    if error is not None:
        raise RuntimeError(error)
    return done


def words(vocab_size: int) -> int:
    """int32 words of a bitmask row."""
    return (vocab_size + 31) // 32


def fill_masks(matchers: list, vocab_size: int) -> np.ndarray:
    """int32 [len(matchers), words(V)]: each matcher's allowed next tokens (llguidance's parallel
    fill, by row); a row without one (None) allows everything. A fresh array each call (the
    device may alias a host buffer it is given)."""
    out = np.full((len(matchers), words(vocab_size)), -1, np.int32)
    rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
    if rows:
        from llguidance.numpy import fill_next_token_bitmask_par
        fill_next_token_bitmask_par(_executor(), rows, out)
    return out


@functools.lru_cache(maxsize=1)
def _executor():
    return _llg().LLExecutor()


# ---- the device loop's host side ---------------------------------------------------------------
# `step.decode_steps(grammar=call)` asks the host, each iteration, for the masks of a call's rows
# after their last tokens: the call's matchers live here under `call` while it runs (`register`).

_CALLS: dict[int, dict] = {}
_NEXT = [0]


def register(matchers: list, reads: bool = False) -> int:
    """A call's matchers (one per row, None: free), addressed by the int a loop carries. reads:
    the driver reads the emitted tokens and gives them to the matchers itself (the engine's
    speculative rounds): `commit` then rolls every draft back."""
    _NEXT[0] += 1
    _CALLS[_NEXT[0]] = dict(matchers=matchers, error=None, drafted=[0] * len(matchers), ended=[0] * len(matchers),
                            reads=reads)
    return _NEXT[0]


def release(call: int) -> None:
    """The call is over (its loop finished): RuntimeError if a matcher refused a token its own
    mask allowed (never expected: a wrong answer is not returned silently)."""
    error = _CALLS.pop(call)["error"]
    if error is not None:
        raise RuntimeError(error)


def host_masks(call, tokens, live, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(masks int32 [b, W], done bool [b]) for a call's rows: each live row's matcher takes its
    last token (tokens [b]); a row whose grammar is then complete (or whose matcher refused it)
    is done; the others get the mask of what may follow."""
    entry = _CALLS[int(call)]
    ms, done = entry["matchers"], np.zeros(len(tokens), bool)
    for r, m in enumerate(ms):
        if m is None or not live[r]:
            continue
        done[r], error = take(m, tokens[r])
        entry["error"] = entry["error"] or error
    return fill_masks([m if on and not d else None for m, on, d in zip(ms, live, done)], vocab_size), done


def draft_masks(call, tokens, live, vocab_size: int) -> np.ndarray:
    """A speculative round's draft, as the host sees it: each live row's matcher takes its draft
    token for now (`commit` keeps or rolls back) -> the masks [b, W] of what may follow. A row
    whose grammar the drafts completed takes no more (its later positions: every token; they
    are cut at `commit`)."""
    entry = _CALLS[int(call)]
    ms, out = entry["matchers"], []
    for r, m in enumerate(ms):
        if m is None or not live[r] or entry["ended"][r]:
            out.append(None)
            continue
        done, error = take(m, tokens[r])
        entry["error"] = entry["error"] or error
        entry["drafted"][r] += 1
        entry["ended"][r] = entry["drafted"][r] if done or error else 0
        out.append(None if done or error else m)
    return fill_masks(out, vocab_size)


def commit(call, kept, live) -> np.ndarray:
    """The round verified: each row kept its first kept[r] drafts -> the drafts it keeps [b]:
    fewer where its grammar ended at a kept draft (that draft becomes the round's last token,
    taken again by the next round's first mask, which ends the row). The matchers roll back
    what they took past the kept drafts (a driver that `reads`: every draft)."""
    entry = _CALLS[int(call)]
    out = np.array(kept, np.int32)
    for r, m in enumerate(entry["matchers"]):
        n, end = entry["drafted"][r], entry["ended"][r]
        if m is not None and live[r] and n:
            if end and end <= out[r]:
                out[r] = end - 1
            m.rollback(n if entry["reads"] else n - min(int(out[r]), n))
        entry["drafted"][r] = entry["ended"][r] = 0
    return out


def device_masks(call, tokens, live, vocab_size: int):
    """`host_masks` from inside a jitted loop (an ordered host callback: once an iteration, in order)."""
    import jax
    from jax.experimental import io_callback

    b = tokens.shape[0]
    shapes = (jax.ShapeDtypeStruct((b, words(vocab_size)), np.int32), jax.ShapeDtypeStruct((b,), np.bool_))
    return io_callback(functools.partial(host_masks, vocab_size=vocab_size), shapes, call, tokens, live, ordered=True)


def device_draft_masks(call, tokens, live, vocab_size: int):
    """`draft_masks` from inside a jitted round (an ordered host callback)."""
    import jax
    from jax.experimental import io_callback

    shape = jax.ShapeDtypeStruct((tokens.shape[0], words(vocab_size)), np.int32)
    return io_callback(functools.partial(draft_masks, vocab_size=vocab_size), shape, call, tokens, live, ordered=True)


def device_commit(call, kept, live):
    """`commit` from inside a jitted round (an ordered host callback)."""
    import jax
    from jax.experimental import io_callback

    return io_callback(commit, jax.ShapeDtypeStruct(kept.shape, np.int32), call, kept, live, ordered=True)
