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
