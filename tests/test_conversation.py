"""`Conversation` on pages, with tiny random models and a character-level chat template:

- every turn's answer equals greedy `generate` of the whole rendered conversation (a from-scratch
  recompute), while the pool is kept across turns (each later turn computes only what it adds,
  the previous answer's last token included) and grows when a turn needs more positions;
- `prefix`, the kept pages as a dense `PrefixCache`, holds the conversation's K/V: its logits equal a
  from-scratch `build_prefix_cache` of the same tokens, in plain, quantized and h KV modes;
- a turn abandoned midway leaves the conversation as it was: the next turn answers as if it had
  never started.
"""

import numpy as np
import pytest

import tinyloop_jax as tl
from conftest import tiny_config, tiny_model

EOS, BOS, USER, ASSISTANT = 2, 1, 3, 4


class CharChat:
    """A chat template over characters: token i is the character chr(0x100 + i) (every id, so an
    answer's text renders back to the ids emitted), a message is [BOS, role, *content, EOS]."""

    chat_template = "chars"
    eos_token_ids = [EOS]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [BOS, USER if m["role"] == "user" else ASSISTANT] + [ord(ch) - 0x100 for ch in m["content"]] + [EOS]
        return np.array(ids + ([BOS, ASSISTANT] if add_generation_prompt else []), np.int32)

    def decode(self, ids):
        return "".join(chr(0x100 + i) for i in ids if i != EOS)


def text(ids) -> str:
    return "".join(chr(0x100 + int(i)) for i in ids)


def question(n: int, seed: int) -> str:
    return text(np.random.default_rng(seed).integers(5, 120, n))


def greedy(model, ids, max_tokens):
    """The reference: `generate` of the whole rendering, up to an end-of-turn token."""
    return model.generate(ids, max_tokens=max_tokens, stop_sequences=[[EOS]])[len(ids):]


def check_turns(model, conv, questions, max_tokens):
    tok, messages, kept = conv.tokenizer, [], None
    for i, q in enumerate(questions):
        messages.append(dict(role="user", content=q))
        ids = tok.apply_chat_template(messages).tolist()
        answer = "".join(conv.send(q))
        want = greedy(model, ids, max_tokens)
        turn = conv.turns[-1]
        assert list(turn.answer) == want, f"turn {i}"
        assert answer == tok.decode(want)
        # the kept tokens (all but the last answer token in the pages) were read, not computed
        reused = 0 if kept is None else len(kept) - 1
        assert (turn.reused_tokens, turn.prefill_tokens) == (reused, len(ids) - reused)
        kept = ids + want
        assert conv.kept.tokens.tolist() == kept
        messages.append(dict(role="assistant", content=answer))
    return kept


def test_turns_equal_generate_and_the_pool_grows():
    """Three turns on a model of 512 positions: the pool starts at 256 and grows in turn 3."""
    model = tl.Model.random(tiny_config(max_seq_len=512), seed=1)
    conv = tl.Conversation(model, CharChat(), max_tokens=24)
    kept = check_turns(model, conv, [question(150, 0), question(40, 1), question(60, 2)], 24)
    assert conv.turns[1].reused_tokens > 150 and conv.kept.pool.n_pages * 16 == 512
    want = model.build_prefix_cache(kept).logits
    np.testing.assert_allclose(np.asarray(conv.prefix.logits), np.asarray(want), atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("kv_mode", ["int8", "fp16-h"])
def test_prefix_of_the_pages_equals_a_recompute(kv_mode):
    """Two turns in a quantized and an h mode: the answers equal generate's; the dense prefix
    made from the pages (the h mode's: prefilled again) equals a from-scratch prefix, its
    depth states too; reading it equals reading the recompute; a third turn after it reads the
    kept pages."""
    model = tiny_model(kv_mode)
    conv = tl.Conversation(model, CharChat(), max_tokens=10)
    kept = check_turns(model, conv, [question(30, 3), question(12, 4)], 10)
    got, want = conv.prefix, model.build_prefix_cache(kept)
    assert got.prompt.tolist() == kept and got.kv_mode == kv_mode
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-3, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(got.depth_states), np.asarray(want.depth_states), atol=1e-3, rtol=1e-2)
    assert model.generate_from_prefix_cache(got, max_tokens=6) == model.generate_from_prefix_cache(want, max_tokens=6)
    # the prefix was made from a copy: the kept pages serve the next turn as they were
    q = question(9, 5)
    ids = conv.tokenizer.apply_chat_template(list(conv.messages) + [dict(role="user", content=q)]).tolist()
    assert "".join(conv.send(q)) == conv.tokenizer.decode(greedy(model, ids, 10))
    assert conv.turns[-1].reused_tokens == len(kept) - 1


def test_an_abandoned_turn_leaves_the_conversation_as_it_was():
    model = tiny_model("fp32")
    tok, q1, q2 = CharChat(), question(20, 5), question(8, 6)
    conv = tl.Conversation(model, tok, max_tokens=30)
    a1 = "".join(conv.send(q1))
    kept, messages = conv.kept.tokens.tolist(), list(conv.messages)
    it = conv.send(q2)
    next(it)  # the first burst's text: the turn has prefilled and decoded into the kept pool
    it.close()
    assert conv.kept.tokens.tolist() == kept and conv.messages == messages and len(conv.turns) == 1
    a2 = "".join(conv.send(q2))
    ids = tok.apply_chat_template([dict(role="user", content=q1), dict(role="assistant", content=a1),
                                   dict(role="user", content=q2)]).tolist()
    assert list(conv.turns[-1].answer) == greedy(model, ids, 30)
    assert conv.turns[-1].reused_tokens == len(kept) - 1
    assert a2 == tok.decode(conv.turns[-1].answer)
