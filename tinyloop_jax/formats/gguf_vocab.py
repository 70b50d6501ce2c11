"""The tokenizer of a GGUF file (`tokenizer.ggml.*` metadata) as a `tokenizers.Tokenizer`.

Built as Hugging Face `transformers` builds it from the same file (so ids equal theirs):
`tokenizer.ggml.model` "gpt2" is a byte-level BPE over `tokens` (ids = positions) and `merges`;
`tokenizer.ggml.pre` picks the split regex: llama.cpp's names for the Llama-3 and Qwen2 regexes
get theirs, every other name (SmolLM2's "smollm", "gpt2", "starcoder", ...) GPT-2's byte-level
regex. Tokens of type CONTROL (3) are special tokens (matched whole in text, dropped by
`decode`), USER_DEFINED (4) plain added tokens. BOS is prepended when `add_bos_token` says so.

`tokenizer.ggml.model` "llama" (SentencePiece) in a Gemma 3 file is a BPE with byte fallback
over the tokens as written (a token of two or more spaces respelled as as many "▁"), spaces
normalized to "▁" (no prefix space), and merges rebuilt from the vocabulary: every split of a
token into two tokens, ordered by the token's position in the file (Gemma's scores do not follow
its merge order), longer left parts first; the decoder maps "▁" back to spaces and byte tokens
(<0x0A>) to bytes. Other SentencePiece files are refused (their prefix-space rules differ).

Note: llama.cpp splits digits one by one for "smollm" (as SmolLM2's own tokenizer.json does);
transformers' GGUF reader does not. The two differ only where a whitespace run meets a digit
("x  1"); we follow transformers.
"""

from __future__ import annotations

import functools

from . import gguf as gguf_format

CONTROL, USER_DEFINED = 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "smaug-bpe": _LLAMA3,
          "dbrx": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
# llama.cpp's end-of-generation markers, besides the eos/eot/eom ids the file names
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
               "<|end_of_text|>", "<|return|>", "<|call|>")


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def metadata(path: str) -> dict:
    """The tokenizer part of a GGUF file's metadata (keys without the 'tokenizer.' prefix)."""
    fields = gguf_format.open_file(path).fields
    meta = {k.removeprefix("tokenizer."): v for k, v in fields.items() if k.startswith("tokenizer.")}
    meta["architecture"] = fields.get("general.architecture")
    return meta


def build(meta: dict, path: str = "GGUF file"):
    """`tokenizers.Tokenizer` from `metadata(path)`; ValueError for a tokenizer it cannot build."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    kind = meta.get("ggml.model")
    if kind == "llama" and meta.get("architecture") == "gemma3":
        return _gemma(meta, path)
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', byte-level BPE, and "
                         f"'llama' (SentencePiece) in Gemma 3 files); architecture {meta.get('architecture')!r}")
    tokens, merges = meta.get("ggml.tokens"), meta.get("ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # a token written in plain text rather than in the byte alphabet is respelled
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, [tuple(m.split(" ")) for m in merges], dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(meta.get("ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("ggml.token_type") or [1] * len(tokens)
    # a CONTROL token outside the byte alphabet is a mislabel that would grow the vocabulary: skipped
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED and t in vocab])
    _add_bos(tok, meta, tokens)
    return tok


def _gemma(meta: dict, path: str):
    """Gemma 3's SentencePiece vocabulary as a `tokenizers` BPE (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tokens = meta.get("ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: tokenizer.ggml.tokens is missing")
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated spelling: its last id
    order = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t, i in order.items():
        for k in range(len(t) - 1, 0, -1):  # longer left parts first
            if t[:k] in vocab and t[k:] in vocab:
                merges.append((i, t[:k], t[k:]))
    merges.sort(key=lambda m: m[0])  # stable: a token's splits keep their order
    unk = meta.get("ggml.unknown_token_id")
    tok = Tokenizer(BPE(vocab, [(a, b) for _, a, b in merges], unk_token=None if unk is None else tokens[int(unk)],
                        fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    types = meta.get("ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED and t in vocab])
    _add_bos(tok, meta, tokens)
    return tok


def _add_bos(tok, meta: dict, tokens: list) -> None:
    """BOS prepended when `add_bos_token` says so."""
    from tokenizers import processors

    bos = meta.get("ggml.bos_token_id")
    if meta.get("ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], int(bos))])


def special_tokens(meta: dict) -> dict[str, str]:
    """{"bos_token": "<|im_start|>", ...}: the named special tokens' text (for chat templates)."""
    tokens, out = meta["ggml.tokens"], {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        i = meta.get(f"ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            out[name] = tokens[int(i)]
    return out


def end_of_turn_ids(meta: dict) -> list[int]:
    """Every id that ends a turn: the file's eos, eot and eom ids, then CONTROL tokens that
    llama.cpp treats as end-of-generation (<|im_end|>, <|endoftext|>, <|eot_id|>, ...)."""
    tokens, types = meta["ggml.tokens"], meta.get("ggml.token_type") or []
    ids = [int(meta[f"ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if meta.get(f"ggml.{k}") is not None]
    ids += [i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL and t in END_OF_TURN]
    return list(dict.fromkeys(i for i in ids if 0 <= i < len(tokens)))
