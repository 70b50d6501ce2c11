"""An independent numpy forward of the looped model: a loop over layers, the whole sequence
at once, no cache. Written from the architecture description, not from tinyloop_jax.model."""

import numpy as np


def _ln(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np(tree):
    return {k: np.asarray(getattr(tree, k), np.float64) for k in tree.__dataclass_fields__}


def forward(params, n_heads, tokens, loops, window=0, kv_dtype=np.float32):
    """Logits [T, V] for every position of `tokens` (float64 math). K/V pass through
    `kv_dtype` (as a cache in that storage mode would hold them)."""
    tokens = np.asarray(tokens)
    T = len(tokens)
    wte, wpe = np.asarray(params.wte, np.float64), np.asarray(params.wpe, np.float64)
    x = wte[tokens] + wpe[np.arange(T)]
    blocks = [_np(b) for b in params.pre] + [_np(b) for b in params.loop] * loops
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = j <= i
    if window:
        mask &= j > i - window
    for b in blocks:
        D = x.shape[1]
        hd = D // n_heads
        h = _ln(x, b["ln1_g"], b["ln1_b"])
        qkv = h @ b["w_qkv"].reshape(D, 3 * D) + b["b_qkv"].reshape(3 * D)  # [D, 3, H, hd]: q | k | v
        q, k, v = (qkv[:, s * D:(s + 1) * D].reshape(T, n_heads, hd).transpose(1, 0, 2) for s in range(3))
        k = k.astype(kv_dtype).astype(np.float64)
        v = v.astype(kv_dtype).astype(np.float64)
        att = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        att = np.where(mask[None], att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        a = (att @ v).transpose(1, 0, 2).reshape(T, D)
        x = x + a @ b["w_o"] + b["b_o"]
        x = x + _gelu(_ln(x, b["ln2_g"], b["ln2_b"]) @ b["w_fc"] + b["b_fc"]) @ b["w_proj"] + b["b_proj"]
    x = _ln(x, np.asarray(params.lnf_g, np.float64), np.asarray(params.lnf_b, np.float64))
    return x @ wte.T
