"""Tokenizers: the bundled model's bytes (UTF-8 bytes are ids 0..255, then a few special ids),
and a Hugging Face folder's tokenizer.json or a GGUF file's vocabulary through the `tokenizers`
package, with the model's chat template (`load_tokenizer`)."""

from __future__ import annotations

import json
import os

import numpy as np


class ByteTokenizer:
    """>>> tok = ByteTokenizer(); tok.decode(tok.encode("héllo"))
    'héllo'
    """

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 260  # 256 bytes + BOS, EOS, PAD + one spare

    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False) -> np.ndarray:
        """str -> np.ndarray[int32] of byte ids (optionally wrapped in BOS/EOS; `special` is
        accepted for HFTokenizer's interface: the bundled model was trained without BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return np.array(([self.BOS] if bos else []) + ids + ([self.EOS] if eos else []), np.int32)

    def decode(self, ids) -> str:
        """Token ids -> str. Special and out-of-range ids are dropped, invalid UTF-8 is replaced
        (U+FFFD); this never raises on integer input."""
        data = bytes(int(i) for i in np.asarray(ids, np.int64).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def token_text(self, i: int) -> str:
        """One token as text, special tokens by name (a logprobs entry's `token`)."""
        return {self.BOS: "<bos>", self.EOS: "<eos>", self.PAD: "<pad>"}.get(int(i)) or self.decode([i])

    def info(self) -> dict:
        """What the tokenizer is, for `GET /tokenizer_info`: its class, vocabulary size and chat
        template, and the special tokens' ids (they have no text: they decode to nothing)."""
        return dict(tokenizer_class=type(self).__name__, vocab_size=self.vocab_size,
                    chat_template=getattr(self, "chat_template", None),
                    **{f"{k}_token": None for k in ("bos", "eos", "pad", "unk")},
                    bos_token_id=self.BOS, eos_token_id=self.EOS, pad_token_id=self.PAD, unk_token_id=None)


class HFTokenizer:
    """A `tokenizers` tokenizer with its model's metadata: a folder's tokenizer.json (+
    tokenizer_config.json, chat_template.jinja, generation_config.json), or a GGUF file's
    `tokenizer.ggml.*` metadata (`from_gguf`). Same interface as ByteTokenizer: encode(str) ->
    int32 ids, decode(ids) -> str (special tokens dropped); plus `eos_token_ids` (every id that ends
    a turn), `special_tokens`, `apply_chat_template` and `info`."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"{path!r} has no tokenizer.json")
        try:
            tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise ValueError(f"cannot read {file}: {e}") from e
        folder = os.path.dirname(file)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        specials = {k: _token_text(config[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if _token_text(config.get(k)) is not None}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        eos = [tok.token_to_id(specials["eos_token"])] if "eos_token" in specials else []
        for name in ("config.json", "generation_config.json"):
            value = _read_json(os.path.join(folder, name)).get("eos_token_id")
            eos += value if isinstance(value, list) else [value]
        self._setup(tok, specials, template, eos)
        # what tokenizer_config.json says of itself, reported as is by `info`
        self.config = {k: config[k] for k in ("tokenizer_class", "model_max_length") if k in config}

    @classmethod
    def from_gguf(cls, path: str) -> "HFTokenizer":
        """The tokenizer in a GGUF file's metadata, built as `transformers` builds it (see `gguf_vocab`)."""
        from . import gguf_vocab

        meta = gguf_vocab.metadata(path)
        self = cls.__new__(cls)
        self._setup(gguf_vocab.build(meta, path), gguf_vocab.special_tokens(meta), meta.get("chat_template"),
                    gguf_vocab.end_of_turn_ids(meta))
        return self

    def _setup(self, tok, specials: dict, chat_template: str | None, eos_ids: list) -> None:
        self._tok, self.special_tokens, self.chat_template = tok, dict(specials), chat_template
        self.config: dict = {}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = [int(i) for i in dict.fromkeys(eos_ids) if i is not None and 0 <= int(i) < self.vocab_size]

    def encode(self, text: str, special: bool = True) -> np.ndarray:
        """str -> np.ndarray[int32]; special=True adds the tokenizer's own special tokens (BOS).
        Special-token text in `text` ("<|im_start|>") is its id either way, as in transformers."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return np.array(self._tok.encode(text, add_special_tokens=special).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids, np.int64).ravel()], skip_special_tokens=True)

    def token_text(self, i: int) -> str:
        """One token as text, special tokens included ("<|im_end|>"; a logprobs entry's `token`)."""
        return self._tok.decode([int(i)], skip_special_tokens=False)

    def info(self) -> dict:
        """What the tokenizer is, for `GET /tokenizer_info`: its class (tokenizer_config.json's
        tokenizer_class, else this one's), vocabulary size, chat template, the special tokens'
        text and id, and tokenizer_config.json's model_max_length if it states one."""
        out = dict(tokenizer_class=self.config.get("tokenizer_class", type(self).__name__), vocab_size=self.vocab_size,
                   chat_template=self.chat_template)
        for k in ("bos", "eos", "pad", "unk"):
            text = self.special_tokens.get(f"{k}_token")
            out[f"{k}_token"], out[f"{k}_token_id"] = text, None if text is None else self._tok.token_to_id(text)
        if "model_max_length" in self.config:
            out["model_max_length"] = self.config["model_max_length"]
        return out

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs):
        """`messages` ([{"role": "user", "content": "..."}, ...]) rendered by the model's chat
        template, as `transformers`' `apply_chat_template`: a str, or int32 ids (no BOS added)
        with `tokenize=True`. `kwargs` are extra template variables. ValueError if the model
        has no chat template or a message is malformed.

        >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # doctest: +SKIP
        '<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
        """
        from . import chat_template

        if not self.chat_template:
            raise ValueError("this model has no chat template")
        text = chat_template.render(self.chat_template, messages, add_generation_prompt,
                                    **{**self.special_tokens, **kwargs})
        return self.encode(text, special=False) if tokenize else text


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_text(value):
    """A special token as tokenizer_config.json writes it (a str or an AddedToken dict) -> str."""
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(path=None):
    """The tokenizer of a model: a known name ("smollm2"), a GGUF file or a folder holding one, a
    Hugging Face folder (tokenizer.json), or None / a tinyloop checkpoint (the byte tokenizer).

    >>> load_tokenizer("smollm2").decode(load_tokenizer("smollm2").encode("Hello"))   # doctest: +SKIP
    'Hello'
    """
    from . import gguf, hub

    if path is None:
        return ByteTokenizer()
    path = hub.resolve(path)
    file = gguf.find_file(path)
    if file is not None:
        return HFTokenizer.from_gguf(file)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    if os.path.isfile(os.path.join(path, "tinyloop.json")):
        return ByteTokenizer()
    raise ValueError(f"no tokenizer at {path!r}: expected a GGUF file, a folder with tokenizer.json, a tinyloop "
                     f"checkpoint or a known model name ({', '.join(sorted(hub.MODELS))})")


def tokenizer_for(path: str | None):
    """The tokenizer of a model folder: tokenizer.json if it has one, else the byte tokenizer
    (the bundled model and tinyloop checkpoints); GGUF files and known names as `load_tokenizer`."""
    from . import gguf, hub

    if path is not None and (hub.is_name(path) or gguf.find_file(path) is not None):
        return load_tokenizer(path)
    if path is not None and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    return ByteTokenizer()
