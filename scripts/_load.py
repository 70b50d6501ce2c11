"""A load of streaming OpenAI clients against any OpenAI-compatible server (ours, llama.cpp's) and
its report: the one load client of the serving benchmarks (`bench_serve_load.py`,
`bench_vs_llamaserver.py`, `bench_serve.py`), run in the suite against the bundled model on a
tiny load (tests/test_bench_load.py).

    load(url, Workload(...), clients=16)  -> Load: one Result per request, the wall time
    drain(url, Workload(...), prompts, clients=16) -> Load: the clients share a queue of given prompts
    summary(load, rss) -> Row: tokens/s, TTFT / inter-token / latency percentiles, peak RSS
    table(rows) -> markdown lines

Each client sends `per_client` requests back to back: one of the workload's shared system
prompts (Zipf: prompt i with weight 1 / (i + 1)) plus a question of its own, `max_tokens` tokens
out (`ignore_eos`, which both servers take), greedy (temperature 0) unless the workload's
`sampling` says otherwise, streamed. Tokens are counted from the
usage the server reports with the last chunk (`stream_options.include_usage`), else as content
chunks. A completion's chunk counts when it carries text or token ids (our server's `token_ids`,
kept in Result.ids).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

TOPICS = ["a public library", "a city bicycle-sharing scheme", "a mountain hut", "a community swimming pool"]
RULES = ["Opening hours are nine to seven on weekdays and ten to five on Saturdays; it is closed on Sundays.",
         "Members pay twelve euros a year; residents of the town pay nothing.",
         "Bookings are made online at least two days ahead, and cancelled free of charge up to a day before.",
         "Children under twelve must be accompanied by an adult at all times.",
         "Lost cards are replaced for two euros at the front desk.",
         "Late returns cost twenty cents a day per item, capped at five euros.",
         "Groups of more than ten people must call ahead and are given a guide.",
         "Pets are not allowed inside, except assistance dogs.",
         "The wireless network is open to everyone and needs no password.",
         "Lockers cost one euro, returned when the key is handed back."]


def system_prompt(i: int) -> str:
    """One of the shared system prompts: about 330 tokens of house rules (SmolLM2's tokenizer)."""
    rules = " ".join(RULES[(i + j) % len(RULES)] for j in range(len(RULES)))
    return (f"You are the assistant of {TOPICS[i]}. You answer questions from visitors about its rules, prices "
            f"and services, briefly and politely, in one or two sentences. These are the rules. {rules} "
            f"If you do not know an answer, say so and suggest asking at the front desk. {rules}")


def question(client: int, j: int) -> str:
    return f"Question {client}-{j}: may I come at {7 + j} with {client % 5 + 1} friends?"


@dataclass(frozen=True)
class Workload:
    """What every client sends. chat=False: text completions of system + question (a model
    without a chat template, e.g. the bundled one)."""

    model: str = "smollm2"
    systems: tuple = tuple(system_prompt(i) for i in range(len(TOPICS)))
    max_tokens: int = 64
    per_client: int = 2
    chat: bool = True
    question: object = question  # (client, j) -> str
    # the request's sampling knobs: temperature and top_p as OpenAI's fields, others (top_k) as
    # extras both servers take; a request seeded by its client and turn (reproducible draws)
    sampling: tuple = (("temperature", 0.0),)
    # structured output: OpenAI's response_format on every request (None: free text); the answer
    # then ends where the format does (no ignore_eos: a grammar that is done allows only the end)
    response_format: object = None


@dataclass
class Result:
    ttft: float  # seconds to the first content chunk
    itl: list  # seconds between content chunks (a chunk may carry several tokens)
    latency: float  # seconds for the whole request
    tokens: int  # completion tokens
    chunks: int  # content chunks
    ids: list = field(default_factory=list)  # the emitted token ids, where the server sends them


@dataclass
class Load:
    clients: int
    results: list = field(default_factory=list)
    wall: float = 0.0


@dataclass(frozen=True)
class Row:
    clients: int
    tps: float  # completion tokens / wall
    ttft50: float
    ttft99: float
    itl50: float  # ms between content chunks
    itl99: float
    lat50: float
    rss: float  # GiB, the server's peak (VmHWM); nan if unknown
    per_chunk: float  # tokens per content chunk (mean)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


def peak_rss(pid: int) -> int:
    """A process's peak resident set, bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def client(url: str):
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)


def request(cl, work: Workload, system: str, q: str, max_tokens: int | None = None, seed: int = 0) -> Result:
    """One streamed request of a system prompt and a question; its times and tokens."""
    if work.chat:
        return send(cl, work, dict(messages=[dict(role="system", content=system), dict(role="user", content=q)]),
                    max_tokens, seed)
    return send(cl, work, dict(prompt=f"{system}\n{q}\n"), max_tokens, seed)


def send(cl, work: Workload, body: dict, max_tokens: int | None = None, seed: int = 0) -> Result:
    """One streamed request of `body`: `messages` (a chat completion) or `prompt` (a completion:
    text or token ids); its times and tokens."""
    n = work.max_tokens if max_tokens is None else max_tokens
    knobs = dict(work.sampling)
    common = dict(model=work.model, max_tokens=n, stream=True, stream_options={"include_usage": True},
                  seed=seed, **{k: knobs.pop(k) for k in ("temperature", "top_p") if k in knobs},
                  extra_body={"ignore_eos": work.response_format is None, **knobs})
    if work.response_format is not None:
        common["response_format"] = work.response_format
    chat = "messages" in body
    t0 = time.perf_counter()
    times, usage, ids = [], None, []
    stream = (cl.chat.completions if chat else cl.completions).create(**body, **common)
    for chunk in stream:
        usage = getattr(chunk, "usage", None) or usage
        if chunk.choices:
            c = chunk.choices[0]
            new = getattr(c, "token_ids", None) or []
            ids += new
            if c.delta.content if chat else (c.text or new):
                times.append(time.perf_counter())
    tokens = usage.completion_tokens if usage is not None else len(times)
    return Result(ttft=times[0] - t0 if times else float("nan"), itl=list(np.diff(times)),
                  latency=time.perf_counter() - t0, tokens=tokens, chunks=len(times), ids=ids)


def warm(url: str, work: Workload) -> None:
    """The warm-up pass: each system prompt served once (a short answer)."""
    cl = client(url)
    for s in work.systems:
        request(cl, work, s, "Hello?", max_tokens=4)


def run_clients(url: str, clients: int, body) -> float:
    """`clients` threads, each calling body(its index, an OpenAI client of its own); the wall
    seconds. The first error of any thread is raised here."""
    errors = []

    def run(c):
        try:
            body(c, client(url))
        except Exception as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall


def load(url: str, work: Workload, clients: int, seed: int = 0) -> Load:
    """`clients` threads, each sending work.per_client requests back to back."""
    rng = np.random.default_rng(seed)
    w = 1 / np.arange(1, len(work.systems) + 1)
    picks = rng.choice(len(work.systems), size=(clients, work.per_client), p=w / w.sum())
    out, lock = Load(clients), threading.Lock()

    def body(c, cl):
        for j in range(work.per_client):
            r = request(cl, work, work.systems[int(picks[c, j])], work.question(c, j), seed=c * 1000 + j)
            with lock:
                out.results.append(r)

    out.wall = run_clients(url, clients, body)
    return out


def drain(url: str, work: Workload, prompts: list, clients: int) -> Load:
    """`clients` threads, each taking the next of `prompts` (completions: text or token ids; the
    workload's max_tokens and sampling) until none is left; the results in the prompts' order."""
    out, nxt, lock = Load(clients, [None] * len(prompts)), [0], threading.Lock()

    def body(c, cl):
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts):
                return
            out.results[i] = send(cl, work, dict(prompt=prompts[i]), seed=i)

    out.wall = run_clients(url, clients, body)
    return out


def summary(ld: Load, rss_bytes: float = float("nan")) -> Row:
    res = ld.results
    itl = [x for r in res for x in r.itl]
    return Row(clients=ld.clients, tps=sum(r.tokens for r in res) / ld.wall, ttft50=pct([r.ttft for r in res], 50),
               ttft99=pct([r.ttft for r in res], 99), itl50=pct(itl, 50) * 1e3, itl99=pct(itl, 99) * 1e3,
               lat50=pct([r.latency for r in res], 50), rss=rss_bytes / 2**30,
               per_chunk=sum(r.tokens for r in res) / max(1, sum(r.chunks for r in res)))


def metric_lines(label: str, r: Row) -> str:
    """A row as `bench.py`'s metric lines ("name: value unit"), so `bench.py ab` tabulates it."""
    name = f"{label} {r.clients} clients"
    return (f"{name} tok/s: {r.tps:.1f} tok/s\n{name} TTFT p50: {r.ttft50:.3f} s\n{name} TTFT p99: {r.ttft99:.3f} s\n"
            f"{name} peak RSS: {r.rss:.3f} GiB")


def line(r: Row) -> str:
    return (f"{r.clients} clients: {r.tps:.1f} tok/s, TTFT p50 {r.ttft50:.2f} p99 {r.ttft99:.2f} s, between chunks "
            f"p50 {r.itl50:.0f} p99 {r.itl99:.0f} ms ({r.per_chunk:.1f} tokens a chunk), latency p50 {r.lat50:.2f} s, "
            f"peak RSS {r.rss:.2f} GiB")


HEADER = ["| server | clients | tok/s | TTFT p50 / p99 (s) | between chunks p50 / p99 (ms) | tokens a chunk "
          "| latency p50 (s) | server peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|"]


def table(rows: list[tuple[str, Row]]) -> list[str]:
    """Markdown lines: one row per (server name, Row)."""
    return HEADER + [f"| {name} | {r.clients} | {r.tps:.1f} | {r.ttft50:.2f} / {r.ttft99:.2f} | "
                     f"{r.itl50:.0f} / {r.itl99:.0f} | {r.per_chunk:.1f} | {r.lat50:.2f} | {r.rss:.2f} |"
                     for name, r in rows]


def wait_healthy(url: str, proc, timeout: float = 600, ready=lambda body: True) -> float:
    """Seconds until GET url/health answers (200, or 503 while warming) with a body `ready`
    accepts (the process alive)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            body = get(f"{url}/health")
        except urllib.error.HTTPError as e:  # (503: warming, up)
            body = e.read().decode() if e.code == 503 else None
        except OSError:
            body = None
        if body is not None and ready(body):
            return time.perf_counter() - t0
        time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy after {timeout} s")
