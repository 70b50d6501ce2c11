"""`tinyloop` command line: generate, chat (a terminal chat), demo (prefix sharing), eval (bits
per byte), serve (HTTP)."""

from __future__ import annotations

import argparse
import os
import sys
import time


from . import cli_args as A
from .model.kv_modes import KV_MODES
from . import settings

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tinyloop-pydoc")

class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _load(path: str | None, kv_mode: str | None, weights: str = "as-stored", activations: str = "float32",
          kv_share: str | None = None):
    """A tinyloop checkpoint (tinyloop.json), a Hugging Face folder (config.json), a GGUF file or
    folder, or a known model name ("smollm2"); `weights`: --weights (`quantize_weights`);
    `activations`: --activations; `kv_share`: --kv-share."""
    import tinyloop_jax as tl

    from .formats import gguf, hub

    path = path or BUNDLED
    q = None if weights == "as-stored" else weights
    if hub.is_name(path) or gguf.find_file(path) is not None:  # "smollm2", a GGUF file or a folder holding one
        return tl.Model.from_pretrained(path, kv_mode=kv_mode, quantize_weights=q, activations=activations,
                                        kv_share=kv_share)
    if not os.path.isdir(path):
        raise UsageError(f"no model at {path}" + ("" if path != BUNDLED else " (the bundled checkpoint is missing)"))
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "tinyloop.json")):
        return tl.Model.from_pretrained(path, kv_mode=kv_mode, quantize_weights=q, activations=activations,
                                        kv_share=kv_share)
    return tl.Model.load(path, kv_mode=kv_mode, quantize_weights=q, activations=activations, kv_share=kv_share)


def _model_and_tokenizer(args, tok=None):
    from .formats.tokenizer import tokenizer_for

    model = _load(args.model, args.kv_mode, args.weights, args.activations, getattr(args, "kv_share", None))
    tok = tok or tokenizer_for(args.model)
    if tok.vocab_size > model.config()["vocab_size"]:
        raise UsageError(f"the tokenizer has {tok.vocab_size} ids but the model only {model.config()['vocab_size']}")
    return model, tok


def model_and_tokenizer_of(model: str | None, kv_mode=None, weights=None, activations=None, kv_share=None):
    """(model, tokenizer) as `tinyloop serve --model ...` loads them (picklable as a partial: each
    Ray Serve replica loads its own)."""
    return _model_and_tokenizer(argparse.Namespace(model=model, kv_mode=kv_mode, weights=weights,
                                                   activations=activations, kv_share=kv_share))


def cmd_generate(args) -> None:
    model, tok = _model_and_tokenizer(args)
    prompt = tok.encode(args.prompt)
    if len(prompt) == 0:
        raise UsageError("the prompt is empty")
    stops = [tok.encode(s.encode().decode("unicode_escape"), special=False).tolist() for s in args.stop]
    t = time.perf_counter()
    out = model.generate(prompt, max_tokens=args.max_tokens, loops=args.loops, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, cache_window=args.cache_window,
                         repetition_penalty=args.repetition_penalty, stop_sequences=stops, seed=args.seed)
    ms = (time.perf_counter() - t) * 1e3
    print(args.prompt + tok.decode(out[len(prompt):]))
    loops = model.config()["default_loops"] if args.loops is None else args.loops
    print(f"\n[{len(out) - len(prompt)} tokens in {ms:.0f} ms, loops={loops}]", file=sys.stderr)


def _demo_model(args):
    """The demo's model: --model, else SmolLM2 when its file is cached or can be fetched, else
    the bundled model (offline)."""
    from .formats import hub

    if args.model is None:
        try:
            hub.model_path("smollm2")
            args.model = "smollm2"
        except (RuntimeError, OSError) as e:
            print(f"tinyloop demo: SmolLM2 could not be fetched ({e}); the bundled model instead", file=sys.stderr)
    return _model_and_tokenizer(args)


def cmd_demo(args) -> None:
    from . import demo

    model, tok = _demo_model(args)
    kw = dict(max_tokens=args.max_tokens, loops=args.loops, temperature=args.temperature, top_k=args.top_k,
              seed=args.seed)
    res = demo.run(model, tok, args.questions, **kw)
    loops = model.config()["default_loops"] if args.loops is None else args.loops
    print(demo.report(res, tok, loops))


def cmd_chat(args) -> None:
    """A chat in the terminal: each line of stdin is a user message, the answer is streamed to
    stdout; /reset starts over, /exit (or the end of stdin) quits. On a terminal it prompts and
    reports each turn on stderr; piped, stdout holds only the answers, one per line."""
    from .api import chat
    from .formats.tokenizer import tokenizer_for

    tok = tokenizer_for(args.model)
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"{args.model or 'the bundled model'} has no chat template; chat needs an "
                         "instruction-tuned model: try --model smollm2")
    model, tok = _model_and_tokenizer(args, tok)
    conv = chat.Conversation(model, tok, system=args.system, loops=args.loops, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    tty = sys.stdin.isatty()
    if tty:
        print(f"chatting with {args.model} (loops={conv.loops}); /reset starts over, /exit quits", file=sys.stderr)
    while True:
        try:
            line = input("you> ") if tty else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not tty and not line:  # the end of piped input
            break
        line = line.strip()
        if line == "/exit":
            break
        if line == "/reset":
            conv.reset()
            if tty:
                print("(a new conversation)", file=sys.stderr)
            continue
        if not line:
            continue
        try:
            for piece in conv.send(line):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # an abandoned turn leaves the conversation as it was
            print("\n(interrupted)", file=sys.stderr)
            continue
        except RuntimeError as e:  # the conversation fills the context: the user may /reset
            print(f"tinyloop: error: {e}", file=sys.stderr)
            continue
        finally:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if tty:
            t = conv.turns[-1]
            print(f"[{len(t.answer)} tokens in {t.seconds:.1f} s; prefilled {t.prefill_tokens} new tokens, "
                  f"{t.reused_tokens} kept]", file=sys.stderr)


def cmd_eval(args) -> None:
    from .api.evaluate import bits_per_byte, bits_per_byte_of_text
    from .data import pydoc_split
    from .formats.tokenizer import ByteTokenizer, tokenizer_for

    _, val = pydoc_split()
    tok = tokenizer_for(args.model)
    if not isinstance(tok, ByteTokenizer):  # a real tokenizer: its tokens of the held-out text
        text = bytes(val[:args.max_bytes] if args.max_bytes else val).decode("utf-8", errors="ignore")
        info = tok.info()
        first = info["bos_token_id"] if info["bos_token_id"] is not None else (tok.eos_token_ids or [0])[0]
        ids, n_bytes = tok.encode(text, special=False), len(text.encode("utf-8"))
    if args.seq_len is not None and args.seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2, got {args.seq_len}")
    rows, model = [], _load(args.model, args.kv_modes[0], args.weights, args.activations)
    # a looped model's depths; a model without loops (one pass of its stack, a Llama import) at its own
    depth = model.config()["default_loops"]
    loop_list = args.loops or ([1, 2, 4, 8, 16] if depth > 1 else [depth])
    grid = [(m, L, w) for m in args.kv_modes for w in args.windows for L in loop_list]
    for j, mode in enumerate(args.kv_modes):
        if j:
            model = _load(args.model, mode, args.weights, args.activations)
        w_ = model.weights
        for window in args.windows:
            for loops in loop_list:
                if loops < 1 or window < 0:
                    raise UsageError(f"loops must be >= 1 and windows >= 0, got loops={loops}, window={window}")
                i = len(rows)
                bar = lambda k, n, i=i: _bar(i, len(grid), k, n)  # noqa: E731
                if isinstance(tok, ByteTokenizer):  # the bundled model's tokens are the bytes
                    bpb = bits_per_byte(w_.params, w_.config, val, loops, window, seq_len=args.seq_len,
                                        max_bytes=args.max_bytes, progress=bar)
                else:
                    bpb = bits_per_byte_of_text(w_.params, w_.config, ids, n_bytes, first, loops, window,
                                                seq_len=args.seq_len or 1024, progress=bar)
                rows.append((mode, window, loops, bpb))
    sys.stderr.write("\n")
    print(f"held-out bits per byte ({args.max_bytes or len(val)} of {len(val)} held-out bytes)")
    print(f"{'kv_mode':<8}{'window':>8}{'loops':>7}{'bits/byte':>11}")
    for mode, window, loops, bpb in rows:
        print(f"{mode:<8}{window:>8}{loops:>7}{bpb:>11.4f}")


def cmd_serve(args) -> None:
    try:
        import uvicorn

        from .serving.app import eos_ids, make_app
    except ImportError as e:
        raise UsageError(f"tinyloop serve needs the serve extra (pip install 'tinyloop-jax[serve]'): {e}") from None
    from .serving.engine import Engine

    edge = edge_options(args)  # (checked before the model loads)
    if args.replicas != 1:
        return _serve_replicas(args, edge)
    model, tok = _model_and_tokenizer(args)
    settings.forget_programs()  # (the load's layout programs: a server never runs them again)
    name = args.name or os.path.basename(os.path.normpath(args.model or BUNDLED))
    engine = Engine(model, max_batch=args.max_batch, max_queue=args.max_queue, timeout=args.timeout,
                    max_loops=args.max_loops, memory_budget=args.memory_budget, max_depths=args.max_depths)
    # programs compile in the background (a real model's take minutes) while requests are served,
    # each compiling what it needs first; /health says `warming` until they are all built
    engine.warmup(background=True, adaptive=args.warmup_adaptive, speculation=args.warmup_speculation,
                  grammar=args.warmup_grammar)
    _say_budget(engine, args)
    print(f"tinyloop serve: {name} (loops={model.config()['default_loops']}, max_batch={args.max_batch}) on "
          f"http://{args.host}:{args.port}/v1; compiling its programs in the background", file=sys.stderr)
    try:
        uvicorn.run(make_app(engine, tok, name, eos_ids(args.model, tok, model.config()["vocab_size"]), **edge),
                    host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()


def _serve_replicas(args, edge: dict) -> None:
    """`tinyloop serve --replicas N`: N engines on Ray Serve behind one ingress (`serving/ray_app.py`;
    --ray-address joins a running cluster, else a local one starts)."""
    import functools

    if args.replicas < 1 or args.cores_per_replica <= 0:
        raise UsageError(f"--replicas must be >= 1 and --cores-per-replica > 0, got {args.replicas}, "
                         f"{args.cores_per_replica}")
    try:
        import ray
        from ray import serve

        from .serving.ray_app import build_app
    except ImportError as e:
        raise UsageError(f"--replicas needs the ray extra (pip install 'tinyloop-jax[ray]'): {e}") from None
    from .formats.tokenizer import tokenizer_for
    from .serving.app import eos_ids

    load = functools.partial(model_and_tokenizer_of, args.model, args.kv_mode, args.weights, args.activations,
                             args.kv_share)
    model, tok = load()  # (checked here, before Ray starts; each replica and the ingress load their own)
    c = model.config()
    name = args.name or os.path.basename(os.path.normpath(args.model or BUNDLED))
    max_loops = args.max_loops or max(64, 16 * c["default_loops"])
    from .serving.engine import Engine

    sized = Engine(model, max_batch=args.max_batch, memory_budget=args.memory_budget, max_loops=max_loops)
    pages = sized.budget.pool_pages(c["default_loops"])  # (what each replica's pool holds: the router's bound)
    _say_budget(sized, args, "each replica's ")  # (auto: as this process measures what is free)
    sized.close()
    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options=dict(host=args.host, port=args.port))
    app = build_app(load, replicas=args.replicas, router=args.router, cores_per_replica=args.cores_per_replica,
                    engine_kwargs=dict(max_batch=args.max_batch, max_queue=args.max_queue, timeout=args.timeout,
                                       memory_budget=args.memory_budget, max_depths=args.max_depths),
                    warmup=dict(adaptive=args.warmup_adaptive, speculation=args.warmup_speculation,
                                grammar=args.warmup_grammar),
                    name=name, eos=eos_ids(args.model, tok, c["vocab_size"]), max_loops=max_loops, app_kwargs=edge,
                    router_kwargs=dict(capacity_pages=max(1, pages)),
                    tokenizer=functools.partial(tokenizer_for, args.model))  # (the ingress loads no weights)
    print(f"tinyloop serve: {name}, {args.replicas} replicas routed by {args.router} on Ray Serve, "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve.run(app, route_prefix="/", blocking=True)


def _say_budget(engine, args, whose: str = "") -> None:
    """What the memory budget holds, printed at start (`Engine.capacity`)."""
    cap = engine.capacity()
    print(f"tinyloop serve: {whose}memory budget {cap['memory_budget'] / 2**20:,.0f} MiB "
          f"({'auto' if args.memory_budget == 'auto' else '--memory-budget'}): {cap['tokens']:,} tokens at "
          f"loops={cap['loops']}, {cap['rows']} requests of {cap['row_tokens']:,} tokens at once "
          "(--memory-budget sets it)" if cap["memory_budget"] is not None else
          "tinyloop serve: no memory budget (--memory-budget none): each depth holds max_batch whole contexts",
          file=sys.stderr)


def edge_options(args) -> dict:
    """`tinyloop serve`'s --api-key, --cors-origins and --max-body as make_app's keywords."""
    if args.max_body < 1:
        raise UsageError(f"--max-body must be a positive number of bytes, got {args.max_body}")
    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    return dict(api_key=args.api_key or None, cors_origins=origins, max_body=args.max_body)


def _bar(i, total, k, n):
    done = (i + k / n) / total
    sys.stderr.write(f"\r[{'#' * int(30 * done):<30}] {100 * done:5.1f}%")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tinyloop", description="Looped-transformer inference with prefix caching.")
    sub = ap.add_subparsers(dest="command", required=True)
    model_arg = argparse.ArgumentParser(add_help=False)
    model_arg.add_argument("--model", help="a tinyloop checkpoint, a Hugging Face GPT-2 / Llama / Ouro / Gemma 3 "
                           "folder, a GGUF file or a known name (smollm2, gemma3-270m) (default: the bundled model)")
    model_arg.add_argument("--weights", default="as-stored", choices=["as-stored", "float", "int8", "int4"],
                           help="weights as stored (a GGUF's quantized blocks packed), all float, or quantized to "
                                "int8 / int4 blocks (default: as-stored)")
    model_arg.add_argument("--activations", default="float32", choices=["float32", "int8"],
                           help="what packed weights multiply: the inputs as computed, or rounded to 8 bits per 32 "
                                "(llama.cpp's arithmetic: faster on a CPU with AVX-512 VNNI, logits within ~1%%) "
                                "(default: float32)")
    common = argparse.ArgumentParser(add_help=False, parents=[model_arg])
    common.add_argument("--kv-mode", default=None, help="KV cache storage mode: " + ", ".join(KV_MODES))
    common.add_argument("--kv-share", default=None, type=A.kv_share,
                        help="what later tokens read of a finished token's loop passes: full (each pass its own, "
                             "the default), last, ring:m, avg, first (experimental); a compact mode keeps a looped "
                             "model's cache at about one pass's size (docs/reference.md)")

    g = sub.add_parser("generate", parents=[common], help="continue a prompt")
    g.add_argument("prompt", help="the text to continue")
    g.add_argument("--loops", type=int, default=None, help="loop passes (default: the model's depth)")
    g.add_argument("--max-tokens", type=int, default=200, help="tokens to add at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default here)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set holding p")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide seen tokens' positive logits by this (1: none)")
    g.add_argument("--stop", action="append", default=[], help="stop text (repeatable; \\n escapes allowed)")
    g.add_argument("--cache-window", type=int, default=0, help="attend to the last N positions only (0: all)")
    g.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", parents=[common], help="one shared document, many questions: NO_CACHE vs SHARED "
                       "vs SERVED (default model: smollm2 when it can be fetched, else the bundled one)")
    d.add_argument("--questions", type=int, default=8, help="questions asked of the shared document")
    d.add_argument("--max-tokens", type=int, default=48, help="tokens per answer at most")
    d.add_argument("--loops", type=int, default=None, help="loop passes (default: the model's depth)")
    d.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default here)")
    d.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    d.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("chat", parents=[common], help="chat in the terminal (a model with a chat template)")
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--loops", type=int, default=None, help="loop passes (default: the model's depth)")
    c.add_argument("--max-tokens", type=int, default=512, help="per answer")
    c.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default here)")
    c.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set holding p")
    c.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    c.set_defaults(func=cmd_chat)

    e = sub.add_parser("eval", parents=[model_arg], help="held-out bits per byte")
    e.add_argument("--loops", type=A.int_list, default=None,
                   help="depths to evaluate (default: 1,2,4,8,16 for a looped model, else its one depth)")
    e.add_argument("--kv-modes", type=A.str_list, default=["fp32"],
                   help="comma-separated, from: " + ", ".join(KV_MODES))
    e.add_argument("--windows", type=A.int_list, default=[0], help="cache windows to evaluate (0: the whole context)")
    e.add_argument("--max-bytes", type=int, default=None, help="evaluate only the first N held-out bytes")
    e.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default: the model's context, at most 1024 for a tokenizer's tokens)")
    e.set_defaults(func=cmd_eval)
    s = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP server (continuous batching)")
    s.add_argument("--host", default="127.0.0.1", help="no TLS: keep 127.0.0.1 unless behind a proxy")
    s.add_argument("--port", type=int, default=8000, help="the port to listen on")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded together per depth")
    s.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond the batch (then 429)")
    s.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds")
    s.add_argument("--max-loops", type=int, default=None,
                   help="the deepest `loops` a request may ask (default 64, or 16 x the model's depth)")
    s.add_argument("--max-depths", "--max-lanes", dest="max_depths", type=int, default=8,
                   help="depths served at once (each holds its compiled programs); a new depth evicts the least "
                        "recently used idle one (default 8)")
    s.add_argument("--memory-budget", "--kv-memory", dest="memory_budget", type=A.byte_count, default="auto",
                   help="bytes for every depth's KV pages and request rows together, e.g. 512M (default auto: 80%% "
                        "of a GPU's free memory once the weights are loaded, a quarter of a CPU's at most 4G, never "
                        "below one 2,048-token request; printed at start; none: each depth's pool holds max-batch "
                        "requests at the whole context); cached pages and idle depths are evicted to make room, and "
                        "a request waits while its pages are not free")
    s.add_argument("--warmup-adaptive", action="store_true",
                   help="also compile the adaptive-depth programs before /health says warm (exit_criterion requests)")
    s.add_argument("--warmup-speculation", type=A.pairs, default=(), metavar="D:K[,D:K]",
                   help="also compile the speculative rounds of these draft_loops:lookahead pairs, e.g. 1:4")
    s.add_argument("--warmup-grammar", action="store_true",
                   help="also compile the masked programs of structured output (response_format, tools)")
    s.add_argument("--replicas", type=int, default=1,
                   help="engines on Ray Serve behind one ingress (needs the ray extra; default 1: this process)")
    s.add_argument("--router", default="prefix", choices=["prefix", "round_robin", "power_of_two", "oracle"],
                   help="how --replicas routes a request (default prefix: where its prompt's pages are cached)")
    s.add_argument("--cores-per-replica", type=float, default=1.0, help="CPUs Ray gives each replica (default 1)")
    s.add_argument("--ray-address", default=None, help="a running Ray cluster to join (default: start a local one)")
    s.add_argument("--name", default=None, help="the model name clients send (default: the folder's name)")
    s.add_argument("--log-level", default="info", help="uvicorn's log level")
    s.add_argument("--api-key", default=settings.get("TINYLOOP_API_KEY") or None,
                   help="require Authorization: Bearer KEY on /v1/* and the tokenizer routes (default: "
                        "$TINYLOOP_API_KEY; none: open)")
    s.add_argument("--cors-origins", default="", help="comma-separated browser origins allowed (default: none)")
    s.add_argument("--max-body", type=int, default=4 << 20, help="largest request body in bytes (default 4 MiB)")
    s.set_defaults(func=cmd_serve)
    return ap


def persistent_compile_cache() -> None:
    """Compiled programs kept across runs in $TINYLOOP_HOME/xla-cache (unless the caller chose a
    cache already): a real model's first call compiles for seconds to minutes, later runs load."""
    import jax

    from .formats.hub import home

    if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(home(), "xla-cache"))


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)  # argparse itself exits 2 on malformed arguments
    try:
        if argv is None and args.func is cmd_serve:  # a server's process, from the command line
            settings.restart_under_jemalloc(sys.argv[1:])
        persistent_compile_cache()
        args.func(args)
    except (UsageError, ValueError, RuntimeError) as e:
        print(f"tinyloop: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
