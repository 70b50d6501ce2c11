"""Random weights for tests, benchmarks and training from scratch: GPT-2's initialisation, and
random GPT-2 / Llama-family models whose every term of the forward pass matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .params import BlockParams, LlamaBlock, Params, cast, from_flat, with_layers


def _random_block(rng: np.random.Generator, d: int, f: int) -> BlockParams:
    # Large matrices (not GPT-2's 0.02): each block moves the residual stream more than the
    # embedding does, so a random model's greedy output is varied, not "repeat the input".
    std, proj_std = 2.0 / np.sqrt(d), 2.0 / np.sqrt(f)
    n = lambda shape, s: rng.normal(0.0, s, shape).astype(np.float32)  # noqa: E731
    # Biases and LayerNorm affine terms are small random values (not GPT-2's zeros) so that
    # tests exercise every term of the forward pass.
    return BlockParams(
        ln1_g=1.0 + n((d,), 0.1), ln1_b=n((d,), 0.02),
        w_qkv=n((d, 3 * d), std), b_qkv=n((3 * d,), 0.02),
        w_o=n((d, d), proj_std), b_o=n((d,), 0.02),
        ln2_g=1.0 + n((d,), 0.1), ln2_b=n((d,), 0.02),
        w_fc=n((d, f), std), b_fc=n((f,), 0.02),
        w_proj=n((f, d), proj_std), b_proj=n((d,), 0.02),
    )


def gpt2_init(config: ModelConfig, seed: int = 0) -> Params:
    """GPT-2's initialisation (std 0.02, scaled residual projections, zero biases): for training."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_model * config.mlp_ratio
    proj = 0.02 / np.sqrt(2 * (config.n_pre_blocks + config.default_loops))
    n = lambda *shape, s=0.02: rng.normal(0.0, s, shape).astype(np.float32)  # noqa: E731
    z, o = (lambda k: np.zeros((k,), np.float32)), (lambda k: np.ones((k,), np.float32))  # noqa: E731

    def blk():
        return BlockParams(ln1_g=o(d), ln1_b=z(d), w_qkv=n(d, 3 * d), b_qkv=z(3 * d), w_o=n(d, d, s=proj), b_o=z(d),
                           ln2_g=o(d), ln2_b=z(d), w_fc=n(d, f), b_fc=z(f), w_proj=n(f, d, s=proj), b_proj=z(d))

    tree = Params(wte=n(config.vocab_size, d), wpe=n(config.max_seq_len, d, s=0.01),
                  pre=tuple(blk() for _ in range(config.n_pre_blocks)),
                  loop=tuple(blk() for _ in range(config.loop_blocks)), lnf_g=o(d), lnf_b=z(d),
                  post=tuple(blk() for _ in range(config.n_post_blocks)),
                  adapter=n(2 * d, d) if config.injection != "none" else None)
    return jax.tree.map(jnp.asarray, from_flat(tree, config))


def _random_llama_block(rng: np.random.Generator, c: ModelConfig) -> LlamaBlock:
    # As _random_block: large matrices and norm weights near 1, so every term moves the output.
    d, f = c.d_model, c.intermediate_size
    n = lambda shape, s: rng.normal(0.0, s, shape).astype(np.float32)  # noqa: E731
    qkv = c.q_dim + 2 * c.kv_dim
    sandwich = c.out_norms
    qk = (lambda: 1.0 + n((c.head_dim,), 0.1)) if c.qk_norm else (lambda: None)
    return LlamaBlock(attn_norm=1.0 + n((d,), 0.1), w_qkv=n((d, qkv), 2.0 / np.sqrt(d)),
                      w_o=n((c.q_dim, d), 2.0 / np.sqrt(c.q_dim)), mlp_norm=1.0 + n((d,), 0.1),
                      w_gate_up=n((d, 2 * f), 2.0 / np.sqrt(d)), w_down=n((f, d), 2.0 / np.sqrt(f)),
                      b_qkv=n((qkv,), 0.02) if c.attention_bias else None,
                      attn_out_norm=1.0 + n((d,), 0.1) if sandwich else None,
                      mlp_out_norm=1.0 + n((d,), 0.1) if sandwich else None, q_norm=qk(), k_norm=qk())


def random_params(config: ModelConfig, seed: int = 0) -> Params:
    """Seeded random weights for tests and benchmarks. The embedding is scaled so logits
    spread over ~unit range, which keeps greedy decoding away from near-ties."""
    rng = np.random.default_rng(seed)
    c, d = config, config.d_model
    llama = c.block == "llama"
    blk = (lambda: _random_llama_block(rng, c)) if llama else (lambda: _random_block(rng, d, c.intermediate_size))
    tree = Params(
        wte=rng.normal(0.0, 1.0 / np.sqrt(d), (c.vocab_size, d)).astype(np.float32),
        wpe=None if llama else rng.normal(0.0, 0.05, (c.max_seq_len, d)).astype(np.float32),
        pre=tuple(blk() for _ in range(c.n_pre_blocks)),
        loop=tuple(blk() for _ in range(c.loop_blocks)),
        lnf_g=(1.0 + rng.normal(0.0, 0.1, (d,))).astype(np.float32) if llama else np.ones((d,), np.float32),
        lnf_b=None if llama else np.zeros((d,), np.float32),
        head=None if c.tie_embeddings else rng.normal(0.0, 1.0 / np.sqrt(d), (c.vocab_size, d)).astype(np.float32),
        gate_w=rng.normal(0.0, 1.0 / np.sqrt(d), (d,)).astype(np.float32) if c.early_exit_gate else None,
        gate_b=np.asarray(rng.normal(0.0, 0.5), np.float32) if c.early_exit_gate else None,
        post=tuple(blk() for _ in range(c.n_post_blocks)),  # drawn late: models without a coda keep their weights
        adapter=(rng.normal(0.0, 1.0 / np.sqrt(2 * d), (2 * d, d)).astype(np.float32)
                 if c.injection != "none" else None),  # drawn last, only for injection models
    )
    return with_layers(cast(jax.tree.map(jnp.asarray, from_flat(tree, config)), config), config)
