"""`tinyloop demo`: one document shared by several questions, answered three ways, timed.

    NO_CACHE   each question prefills document + question (`Model.generate`), one at a time
    SHARED     the document prefilled once (`build_prefix_cache`), each question decoded from it
               (`generate_from_prefix_cache`), one at a time
    SERVED     every question submitted to an `Engine` at once: the document's pages written by
               the first request and read by the others, their decode steps batched

With a chat model (SmolLM2) the document is a few hundred tokens of text and the questions go
through its chat template; with the bundled byte model (a 256-byte context) it is a pydoc
section and the questions are section titles. Every arm compiles its programs first (the
engine's warmup, then passes over two other documents), so the timings are of serving, not
compiling. Greedy by default: SHARED's and SERVED's answers then equal NO_CACHE's token for
token, which `Result.same` checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

# The bundled model has a 256-byte context: prompt + question + answer must fit in it.
BYTE_DOCUMENT = (
    "The \"pass\" statement\n**********************\n\n"
    "\"pass\" is a null operation -- when it is executed, nothing happens.\n\n"
)
# pydoc-style section titles; the asterisk underline is added so the model starts on the body
TITLES = ["The \"while\" statement", "The \"import\" statement", "The \"return\" statement",
          "The \"del\" statement", "The \"for\" statement", "The \"global\" statement",
          "Boolean operations", "Comparisons"]
BYTE_QUESTIONS = [f"{t}\n{'*' * len(t)}\n\n" for t in TITLES]

# A chat model reads a document of a few hundred tokens and answers questions about it.
DOCUMENT = """\
The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is \
named after the engineer Gustave Eiffel, whose company designed and built the tower between \
1887 and 1889 as the centrepiece of the 1889 World's Fair, held for the centenary of the French \
Revolution. The design was drawn by two senior engineers of the company, Maurice Koechlin and \
Emile Nouguier, and the architect Stephen Sauvestre worked on its appearance. Some of France's \
leading artists and intellectuals protested against it at first, calling it useless and \
monstrous, but it has since become a global cultural icon of France and one of the most \
recognisable structures in the world.

The tower is 330 metres tall, about the height of an 81-storey building, and was the tallest \
man-made structure in the world for 41 years, until the Chrysler Building in New York was \
finished in 1930. It has three levels for visitors, with restaurants on the first and second \
levels. The top level's upper platform is 276 metres above the ground, the highest observation \
deck accessible to the public in the European Union. Tickets can be bought to climb the stairs \
to the first and second levels, 674 steps in all, or to take the lifts; the top level is \
reached by lift only.

The structure weighs about 10,100 tonnes, of which 7,300 tonnes are iron, and it is held \
together by 2.5 million rivets. It is repainted every seven years to protect it from rust, \
which takes about 60 tonnes of paint. The tower was almost torn down in 1909, when the permit \
of twenty years ran out, but it was saved because its antenna proved useful for radio \
telegraphy. Today it receives about seven million visitors a year, which makes it the most \
visited monument that charges for entry.

The tower has also been a place of science and of stunts. Gustave Eiffel kept a small apartment \
at the top, where he received guests such as Thomas Edison, and used the tower for experiments \
on aerodynamics and weather. In 1910 the physicist Theodor Wulf measured radiation at its top \
and found more than at the ground, one of the first hints of cosmic rays. Its lights were first \
switched on for the 1900 World's Fair; since 1985 it has been lit from within by sodium lamps, \
and since the year 2000 it sparkles for five minutes every hour after dark, thanks to 20,000 \
light bulbs."""
QUESTIONS = ["How tall is the Eiffel Tower?", "Who is the tower named after?",
             "Why was the tower almost torn down in 1909?", "How often is the tower repainted?",
             "Which building overtook it as the tallest structure?", "Who did Eiffel receive at the top?",
             "How many visitors does the tower receive each year?", "When does the tower sparkle?"]
ASK = ("Answer the user's questions about the following document in one or two sentences, using only what "
       "it says.\n\n")
# The warm-up passes' documents: the same text, its paragraphs in other orders (the same
# programs compile, the second pass finding the first's pages as the timed one does; no
# document page of theirs is the timed document's).
_PARAGRAPHS = DOCUMENT.split("\n\n")
WARM = ["\n\n".join(_PARAGRAPHS[::-1]), "\n\n".join(_PARAGRAPHS[1:] + _PARAGRAPHS[:1])]


@dataclass
class Result:
    document: str  # what was shared, as text
    document_tokens: int
    questions: list  # as text
    answers: dict  # arm -> [emitted token ids per question]
    seconds: dict  # arm -> wall seconds for all the questions
    prefix_mib: float  # SHARED's prefix cache

    def same(self, arm: str) -> bool:
        """`arm`'s answers equal NO_CACHE's token for token."""
        return self.answers[arm] == self.answers["NO_CACHE"]


def prompts(tok, n: int, warm: int | None = None):
    """(shared ids, the shared text, [(question ids, question text)] for n questions). A chat
    model's questions are their rendering through its chat template after the shared system
    message; the bundled byte model's are pydoc section titles. warm: the i-th warm-up document."""
    if not getattr(tok, "chat_template", None):
        text = BYTE_DOCUMENT if warm is None else BYTE_DOCUMENT[warm + 1:] + BYTE_DOCUMENT[:warm + 1]  # other bytes
        return (tok.encode(text), text.rstrip(), [(tok.encode(q, special=False), q) for q in (BYTE_QUESTIONS * 4)[:n]])
    document = DOCUMENT if warm is None else WARM[warm]
    system = [dict(role="system", content=ASK + document)]
    head = np.asarray(tok.apply_chat_template(system, add_generation_prompt=False, tokenize=True), np.int32)
    out = []
    for q in (QUESTIONS * 4)[:n]:
        ids = np.asarray(tok.apply_chat_template(system + [dict(role="user", content=q)], add_generation_prompt=True,
                                                 tokenize=True), np.int32)
        if not np.array_equal(ids[:len(head)], head):
            raise RuntimeError("the chat template does not render the system message as a prefix of the chat")
        out.append((ids[len(head):], q))
    return head, document, out


def _arms(model, engine, doc: np.ndarray, questions: list, kw: dict) -> tuple[dict, dict, float]:
    """Each arm's answers and seconds over one document."""
    answers, seconds = {}, {}
    t = time.perf_counter()
    answers["NO_CACHE"] = [model.generate(np.concatenate([doc, q]), **kw)[len(doc) + len(q):] for q in questions]
    seconds["NO_CACHE"] = time.perf_counter() - t
    t = time.perf_counter()
    prefix = model.build_prefix_cache(doc, loops=kw.get("loops"))
    answers["SHARED"] = [model.generate_from_prefix_cache(prefix, suffix=q, **kw)[len(doc) + len(q):]
                         for q in questions]
    seconds["SHARED"] = time.perf_counter() - t
    t = time.perf_counter()
    handles = [engine.submit(np.concatenate([doc, q]), **kw) for q in questions]
    answers["SERVED"] = [h.result()[len(doc) + len(q):] for h, q in zip(handles, questions)]
    seconds["SERVED"] = time.perf_counter() - t
    return answers, seconds, prefix.nbytes / 2**20


def run(model, tok, n_questions: int = 6, warm: bool = True, **kw) -> Result:
    """The demo: `n_questions` questions about one document, each arm timed after its programs
    are compiled (warm=False: not; the timings then include compiling). kw: `generate`'s
    sampling keywords (max_tokens, temperature, seed, loops, ...); a chat model's answers stop
    at its end-of-turn tokens."""
    from .serving.engine import Engine

    doc, text, qs = prompts(tok, n_questions)
    questions = [q for q, _ in qs]
    if getattr(tok, "chat_template", None):
        kw = dict(kw, stop_sequences=[[i] for i in tok.eos_token_ids])
    engine = Engine(model, max_batch=max(4, len(questions)))  # (4: the programs of other small engines)
    try:
        if warm:
            engine.warmup()  # every step program (which ones a pass needs depends on timing)
            for i in range(len(WARM)):  # the Model path's programs
                _arms(model, engine, prompts(tok, 1, warm=i)[0], questions, kw)
        answers, seconds, mib = _arms(model, engine, doc, questions, kw)
    finally:
        engine.close()
    return Result(text, len(doc), [t for _, t in qs], answers, seconds, mib)


def report(res: Result, tok, loops: int) -> str:
    chat = getattr(tok, "chat_template", None)
    unit = "tokens" if chat else "bytes"
    shown = res.document if len(res.document) <= 300 else res.document[:240].rsplit(" ", 1)[0] + " [...]"
    lines = [f"shared document ({res.document_tokens} {unit}, loops={loops}, prefix cache {res.prefix_mib:.2f} MiB):",
             "", shown]
    for q, a in zip(res.questions, res.answers["SHARED"]):
        lines += ["", "-" * 60]
        answer = tok.decode(a)
        lines.append(f"user: {q}\nassistant: {answer.strip()}" if chat else q + answer)
    n = len(res.questions)
    base = res.seconds["NO_CACHE"]
    lines += ["", "-" * 60, f"{'arm':<10}{'requests':>10}{'total ms':>12}{'ms/request':>12}{'speedup':>10}"]
    for arm, s in res.seconds.items():
        lines.append(f"{arm:<10}{n:>10}{s * 1e3:>12.0f}{s * 1e3 / n:>12.0f}{base / s:>9.2f}x")
    same = ", ".join(f"{arm} {'yes' if res.same(arm) else 'NO'}" for arm in ("SHARED", "SERVED"))
    lines.append(f"answers equal NO_CACHE's token for token: {same}")
    return "\n".join(lines)
