import numpy as np
from hypothesis import given, settings, strategies as st

import tinyloop_jax as tl

tok = tl.ByteTokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trips_any_unicode(text):
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ((ids >= 0) & (ids < 256)).all()
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-1000, max_value=1000)))
def test_decode_never_raises(ids):
    assert isinstance(tok.decode(ids), str)


def test_invalid_utf8_is_replaced():
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    assert tok.vocab_size > tok.PAD > tok.EOS > tok.BOS >= 256


# ---- tokenizer.json of Hugging Face folders, and the CLI on them ----------------------------

DATA = __import__("os").path.join(__import__("os").path.dirname(__file__), "data")
TEXT = ["the while statement repeats while a condition holds", "the for statement iterates over a sequence",
        "pass is a null operation", "return leaves the current function call"] * 5


def train_tokenizer(vocab_size: int):
    """A small BPE tokenizer.json (Metaspace keeps the spaces, <s> as BOS), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.BPE(unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    t.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "<s>"]))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    return t


def hf_folder(tmp_path, name: str):
    import shutil
    d = tmp_path / name
    shutil.copytree(__import__("os").path.join(DATA, name), d)
    train_tokenizer(90).save(str(d / "tokenizer.json"))
    return str(d)


def test_hf_tokenizer_round_trip(tmp_path):
    from tinyloop_jax.formats.tokenizer import tokenizer_for
    tok = tokenizer_for(hf_folder(tmp_path, "llama-tiny"))
    assert isinstance(tok, tl.HFTokenizer) and tok.vocab_size <= 90
    ids = tok.encode("the for statement repeats")
    assert ids.dtype == np.int32 and ids[0] == 1 and tok.encode("the", special=False)[0] != 1  # <s> = id 1
    assert tok.decode(ids) == "the for statement repeats"
    assert isinstance(tokenizer_for(None), tl.ByteTokenizer)


def test_cli_on_hugging_face_folders(tmp_path, capsys):
    from test_bundled_and_cli import tinyloop
    for name in ("gpt2-tiny", "llama-tiny", "ouro-tiny"):
        d = hf_folder(tmp_path, name)
        r = tinyloop(capsys, "generate", "--model", d, "--max-tokens", "6", "the while statement")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("the while statement") and len(r.stdout) > len("the while statement")
    r = tinyloop(capsys, "demo", "--model", d, "--questions", "1", "--max-tokens", "4")
    assert r.returncode == 0 and "speedup" in r.stdout, r.stderr
