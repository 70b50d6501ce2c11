"""Checks on a ('data', 'model') mesh of fake CPU devices, run by tests/test_mesh.py in a
subprocess (JAX fixes the device count when it starts). Every check compares with the same
model on one device; a "donated buffers were not usable" warning is an error. Prints one
"ok <name>" line per check; exits non-zero on the first failure."""

import os
import re
import sys
import warnings
from collections import Counter

if __name__ == "__main__":  # as a script only: test_mesh imports its constants, and its worker's
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # later subprocesses must keep one device
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (the suite's XLA flags and compilation cache)

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import numpy as np  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.decoding.compiled import SHARED  # noqa: E402
from tinyloop_jax.model import sharding  # noqa: E402

warnings.filterwarnings("error", message=".*[Dd]onated.*")

GPT2 = tl.ModelConfig(vocab_size=128, d_model=32, n_heads=4, n_pre_blocks=2, default_loops=3, max_seq_len=128,
                      kv_mode="fp32")
OURO = tl.ModelConfig(vocab_size=128, d_model=32, n_heads=8, n_kv_heads=4, n_pre_blocks=0, loop_blocks=2,
                      default_loops=3, max_seq_len=128, block="llama", norm_placement="sandwich", pass_norm=True,
                      early_exit_gate=True, tie_embeddings=False, intermediate_size=48, kv_mode="int8")
PACKED = tl.ModelConfig(vocab_size=130, d_model=128, n_heads=4, n_kv_heads=4, n_pre_blocks=1, default_loops=2,
                        max_seq_len=128, block="llama", intermediate_size=256, kv_mode="fp32")
PROMPT = (np.arange(20) * 7 % 128).astype(np.int32)
SUFFIXES = [PROMPT[12:], PROMPT[12:15], []]  # 3 requests: not a multiple of 'data' = 2 or 4


def ok(name: str, cond: bool, detail="") -> None:
    if not cond:
        print(f"FAIL {name} {detail}", flush=True)
        sys.exit(1)
    print(f"ok {name}", flush=True)


def same_calls(tag: str, single: tl.Model, m: tl.Model, full: bool) -> None:
    p = PROMPT
    ok(f"{tag} generate", m.generate(p, max_tokens=8) == single.generate(p, max_tokens=8))
    a, b = m.next_token_logits(p), single.next_token_logits(p)
    ok(f"{tag} logits", np.allclose(a, b, atol=1e-5, rtol=1e-5), np.abs(a - b).max())
    pm, ps = m.build_prefix_cache(p[:12]), single.build_prefix_cache(p[:12])
    ok(f"{tag} from prefix", m.generate_from_prefix_cache(pm, suffix=p[12:], max_tokens=8)
       == single.generate_from_prefix_cache(ps, suffix=p[12:], max_tokens=8))
    ok(f"{tag} batch of 3", m.generate_batch_from_prefix_cache(pm, SUFFIXES, max_tokens=6)
       == single.generate_batch_from_prefix_cache(ps, SUFFIXES, max_tokens=6))
    ok(f"{tag} per-device bytes", pm.nbytes_per_device < pm.nbytes or sharding.size(m.weights.config.mesh,
                                                                                      "model") == 1)
    if not full:
        return
    a, b = m.score(p, top_logprobs=2), single.score(p, top_logprobs=2)
    ok(f"{tag} score", np.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5) and (a.top_ids == b.top_ids).all(),
       np.abs(a.logprobs - b.logprobs).max())
    ok(f"{tag} speculative", m.generate(p, max_tokens=8, draft_loops=1, lookahead=2)
       == single.generate(p, max_tokens=8))
    ok(f"{tag} sampled", m.generate(p, max_tokens=8, temperature=0.8, seed=3)
       == single.generate(p, max_tokens=8, temperature=0.8, seed=3))
    store, q = tl.PrefixStore(m), np.concatenate([p, [1, 2, 3]])
    ok(f"{tag} store", store.generate(q, max_tokens=5) == single.generate(q, max_tokens=5)
       and store.generate(q[:-1], max_tokens=5) == single.generate(q[:-1], max_tokens=5))
    deep = m.build_prefix_cache(p, keep_state=True)
    ok(f"{tag} at_depth", m.generate_from_prefix_cache(deep.at_depth(2), max_tokens=5)
       == single.generate(p, loops=2, max_tokens=5))


_traced: list | None = None  # what JAX traces in this process, once warm_calls listens


def _listen(event: str, secs: float, fun_name: str = "", **_) -> None:
    if event.endswith("jaxpr_trace_duration"):
        _traced.append(fun_name)


def warm_calls(tag: str, m: tl.Model) -> None:
    """Calls repeated on the mesh trace nothing (cache arrays allocated in their shards included:
    a fresh jit per array once traced, lowered and compiled again on every call)."""
    global _traced
    if _traced is None:  # (not at import: test_mesh imports this file)
        _traced = []
        jax.monitoring.register_event_duration_secs_listener(_listen)
        jax.jit(lambda: 0)()  # the listener hears a trace (else the check below would be vacuous)
        ok("trace listener hears a trace", bool(_traced), _traced)

    def calls():
        m.generate(PROMPT, max_tokens=8)
        prefix = m.build_prefix_cache(PROMPT[:12])
        m.generate_from_prefix_cache(prefix, suffix=PROMPT[12:], max_tokens=8)
        m.generate_batch_from_prefix_cache(prefix, SUFFIXES, max_tokens=6)
    calls()
    _traced.clear()
    calls()
    ok(f"{tag} warm calls trace nothing", not _traced, _traced[:5])


def shards(tag: str, m: tl.Model) -> None:
    """Per-device shapes are what the layout says."""
    c, mesh = m.weights.config, m.weights.config.mesh
    d, md = sharding.size(mesh, "data"), sharding.size(mesh, "model")
    blk = m.weights.params.loop[0]
    shard = lambda a: a.addressable_shards[0].data.shape  # noqa: E731
    if c.block == "gpt2":
        ok(f"{tag} qkv shard", shard(blk.w_qkv) == (c.d_model, 3, c.n_heads // md, c.head_dim))
        ok(f"{tag} mlp shard", shard(blk.w_fc) == (c.d_model, c.intermediate_size // md))
    else:
        g = c.n_heads // c.n_kv_heads
        ok(f"{tag} qkv shard", shard(blk.w_qkv) == (c.d_model, c.n_kv_heads // md, g + 2, c.head_dim))
    ok(f"{tag} wo shard", shard(blk.w_o) == (c.q_dim // md, c.d_model))
    prefix = m.build_prefix_cache(PROMPT)
    pre_ok = all(shard(e["k"])[0] == c.n_kv_heads // md for e in prefix.cache.pre)
    ok(f"{tag} prefix K shard", shard(prefix.cache.loop["k"])[-3] == c.n_kv_heads // md and pre_ok)
    own = tl.functional.empty_cache(m.weights, 16, batch=8)
    ok(f"{tag} own K shard", shard(own.loop["k"]) == (8 // d, c.default_loops, c.loop_blocks, c.n_kv_heads // md, 16,
                                                       c.head_dim))


def collectives(tag: str, m: tl.Model) -> None:
    """The compiled decode loop: at most 2 all-reduces of activations per block in it (+1: the
    embedding lookup from the vocabulary-split table), the loop's exit test over 'data' (a
    pred[] all-reduce, evaluated before the loop and in it), and no all-gather of a weight
    (activations — the logits, the rows of a batch — may be gathered)."""
    seen = {}
    real = SHARED["decode_steps"]

    def spy(*a, **k):
        seen["call"] = (a, k)
        return real(*a, **k)
    SHARED["decode_steps"] = spy
    try:
        m.generate(PROMPT[:8], max_tokens=3)
    finally:
        SHARED["decode_steps"] = real
    a, k = seen["call"]
    text = real.lower(*a, **k).compile().as_text()
    ops = Counter(re.findall(r"= \S+ (all-reduce|all-gather)(?:-start)?\(", text))
    exit_tests = len(re.findall(r"= pred\[\] all-reduce(?:-start)?\(", text))
    c = m.weights.config
    blocks = c.n_pre_blocks + c.loop_blocks + c.n_post_blocks  # the pass body holds the k loop blocks once
    weight_shapes = {",".join(map(str, a.shape)) for a in jax.tree.leaves(m.weights.params) if a.ndim >= 2}
    gathers = [ln for ln in text.splitlines() if re.search(r"all-gather(-start)?\(", ln)
               and (g := re.search(r"= \(?\w+\[([\d,]*)\]", ln)) and g.group(1) in weight_shapes]
    ok(f"{tag} collectives {dict(ops)}", ops["all-reduce"] - exit_tests <= 2 * blocks + 1 and exit_tests <= 2
       and not gathers, gathers[:2])


def save_load(single: tl.Model, m: tl.Model) -> None:
    """A prefix saved on the mesh loads on one device and the reverse; a model saved from the
    mesh loads anywhere with the same fingerprint."""
    import tempfile
    p = PROMPT
    with tempfile.TemporaryDirectory() as d:
        m.build_prefix_cache(p).save(os.path.join(d, "from_mesh"))
        single.build_prefix_cache(p).save(os.path.join(d, "from_one"))
        a = tl.PrefixCache.load(os.path.join(d, "from_mesh"), single)
        b = tl.PrefixCache.load(os.path.join(d, "from_one"), m)
        want = single.generate(p, max_tokens=6)
        ok("prefix saved on the mesh, loaded on one device", single.generate_from_prefix_cache(a, max_tokens=6) == want)
        ok("prefix saved on one device, loaded on the mesh", m.generate_from_prefix_cache(b, max_tokens=6) == want
           and b.cache.loop["k"].sharding.spec[2] == "model")
        m.save(os.path.join(d, "model"))
        ok("model saved from the mesh", tl.Model.load(os.path.join(d, "model")).fingerprint == single.fingerprint)


def engines(tag: str, single: tl.Model, m: tl.Model, speculative: bool = True, staggered: bool = True) -> None:
    """The serving engine on the mesh (pages split by KV heads over 'model', the step's rows
    over 'data') gives the single-device model's tokens (`generate`, which the engine equals on
    one device: tests/test_random_requests.py): shared-prefix requests in flight together, a
    sampled one and a speculative one among them (not under a compact kv_share: its pass slots
    and compact layers placed alike). staggered: the requests end one by one (each batch
    bucket's programs); else together (one bucket: a storage's placement alone)."""
    work = [(np.concatenate([PROMPT, np.asarray(s, np.int32)]), dict(max_tokens=5 + i * staggered, seed=i))
            for i, s in enumerate(SUFFIXES * 2)]
    work[1][1].update(temperature=0.7)
    if speculative:
        work[3][1].update(draft_loops=1, lookahead=2)
    want = [single.generate(p, **kw) for p, kw in work]
    with tl.Engine(m, max_batch=4, prefill_chunk=16) as eng:
        got = [h.result() for h in [eng.submit(p, **kw) for p, kw in work]]
        pool = eng.batcher.depths[m.weights.config.default_loops].pool
    split = not m.weights.config.storage.splits_heads or "model" in str(next(iter(pool.loop.values())).sharding.spec)
    ok(f"{tag} engine", got == want and split, (got, want, next(iter(pool.loop.values())).sharding))


def gpt2_meshes(shapes: list) -> None:
    gpt2 = tl.Model.random(GPT2, seed=0)
    for d, mm in shapes:
        tag = f"gpt2 {d}x{mm}"
        m = tl.Model.random(GPT2, seed=0, mesh=sharding.make_mesh(d, mm))
        ok(f"{tag} fingerprint", m.fingerprint == gpt2.fingerprint)
        full = (d, mm) == (2, 4)  # (the other meshes: the calls once, their shards and warm calls)
        same_calls(tag, gpt2, m, full=full)
        if full:  # the engine on an h mode's storage (heads' K/V as fp32's and int8's: Ouro's engine
            # below), its rows bucketed, sampled and speculative
            h = GPT2.replace(kv_mode="int4-h")
            h_one, h_many = tl.Model.random(h, seed=0), tl.Model.random(h, seed=0, mesh=sharding.make_mesh(d, mm))
            engines(f"{tag} int4-h", h_one, h_many)
        warm_calls(tag, m)
        shards(tag, m)
        if mm > 1 and d > 1:
            collectives(tag, m)


def kv_modes_and_weights() -> None:
    mesh = sharding.make_mesh(2, 4)
    for mode in ("int4", "fp16-h", "int4-h"):  # fp32 above, int8 with the Ouro layout below; an int and two h
        # modes (fp16 and int8-h take fp32's / int4's and fp16-h's / int4-h's paths)
        one, many = tl.Model.random(GPT2.replace(kv_mode=mode), seed=0), tl.Model.random(GPT2.replace(kv_mode=mode),
                                                                                      seed=0, mesh=mesh)
        a, b = many.build_prefix_cache(PROMPT[:12]), one.build_prefix_cache(PROMPT[:12])
        ok(f"gpt2 2x4 {mode}", many.generate_batch_from_prefix_cache(a, SUFFIXES[:2], max_tokens=5)
           == one.generate_batch_from_prefix_cache(b, SUFFIXES[:2], max_tokens=5))
    for share in ("last", "avg"):  # kv_share: the call's pool collapsed on the mesh, decode steps on the compact store
        one, many = (tl.Model.random(GPT2.replace(kv_share=share), seed=0, mesh=m) for m in (None, mesh))
        a, b = many.build_prefix_cache(PROMPT[:12]), one.build_prefix_cache(PROMPT[:12])
        ok(f"gpt2 2x4 kv_share {share}", many.generate_batch_from_prefix_cache(a, SUFFIXES, max_tokens=5)
           == one.generate_batch_from_prefix_cache(b, SUFFIXES, max_tokens=5))
        if share == "avg":  # the engine: prompts on pass slots beside decode rows on the compact layers
            engines(f"gpt2 2x4 kv_share {share}", one, many, speculative=False, staggered=False)
    # packed int4 weights (qarray): placed by their fields' specs, dequantized whole on the mesh
    q_one = tl.Model.random(PACKED, seed=0, quantize_weights="int4")
    q_many = tl.Model.random(PACKED, seed=0, quantize_weights="int4", mesh=sharding.make_mesh(2, 4))
    pm, ps = q_many.build_prefix_cache(PROMPT[:12]), q_one.build_prefix_cache(PROMPT[:12])
    ok("int4 weights 2x4", q_many.fingerprint == q_one.fingerprint
       and q_many.generate(PROMPT, max_tokens=8) == q_one.generate(PROMPT, max_tokens=8)
       and q_many.generate_batch_from_prefix_cache(pm, SUFFIXES, max_tokens=5)
       == q_one.generate_batch_from_prefix_cache(ps, SUFFIXES, max_tokens=5))


def ouro_layout() -> None:
    ouro = tl.Model.random(OURO, seed=0)
    m = tl.Model.random(OURO, seed=0, mesh=sharding.make_mesh(2, 4))
    same_calls("ouro 2x4", ouro, m, full=True)
    engines("ouro 2x4", ouro, m)
    warm_calls("ouro 2x4", m)
    shards("ouro 2x4", m)
    collectives("ouro 2x4", m)
    save_load(ouro, m)
    # the int4 Pallas kernel (interpreted here) per device under shard_map over heads
    kern = tl.Model.random(OURO.replace(kv_mode="int4", int4_attention="interpret"), seed=0,
                           mesh=sharding.make_mesh(2, 4))
    ref = tl.Model.random(OURO.replace(kv_mode="int4", int4_attention="jnp"), seed=0)
    pk, pr = kern.build_prefix_cache(PROMPT[:12]), ref.build_prefix_cache(PROMPT[:12])
    ok("int4 kernel under shard_map", kern.generate_batch_from_prefix_cache(pk, SUFFIXES, max_tokens=5)
       == ref.generate_batch_from_prefix_cache(pr, SUFFIXES, max_tokens=5))
    try:
        tl.Model.random(OURO.replace(n_heads=6, n_kv_heads=3), mesh=sharding.make_mesh(2, 4))
        ok("indivisible heads", False)
    except ValueError as e:
        ok("indivisible heads", "4 devices" in str(e) and "3 key/value heads" in str(e), e)


PARTS = {"gpt2": gpt2_meshes, "modes": kv_modes_and_weights, "ouro": ouro_layout}


def main() -> None:
    """`python mesh_checks.py [part ...] [DxM ...]`: the parts (default all; the suite runs one a
    process, so its workers share them) and GPT-2's meshes (default 2x4, 8x1; 4x2 is 2x4
    with the axes' sizes swapped; 1x4, the model axis alone, is 2x4's model split)."""
    parts = [a for a in sys.argv[1:] if a in PARTS] or list(PARTS)
    shapes = [tuple(int(x) for x in a.split("x")) for a in sys.argv[1:] if a not in PARTS] or [(2, 4), (8, 1)]
    assert jax.device_count() == 8, jax.devices()
    for part in parts:
        if part == "gpt2":
            gpt2_meshes(shapes)
        else:
            PARTS[part]()


if __name__ == "__main__":
    main()
