"""Write tests/data/smollm2-golden.npz: what Hugging Face `transformers` computes on the SmolLM2
GGUF (`tl.model_path("smollm2")`), so the tests check this runtime against it where transformers
is not installed (CI).

    python scripts/make_smollm2_golden.py            # builds/uses a side venv, then writes the file

transformers and torch are not this project's dependencies, so the script makes a side venv
(default /tmp/tinyloop-golden-venv: torch==2.13.0 CPU, transformers, accelerate, gguf) and reruns itself in
it. What it stores (float32 model, `from_pretrained(dir, gguf_file=...)`):
- `logits_{i}_pos`, `logits_{i}_ids`, `logits_{i}_top`: for each prompt i, the top-32 token ids and
  logits at every position; `prompt_{i}`: the prompt's ids;
- `corpus_ids_{j}` and `corpus_text`: tokenizer ids of each corpus string (code, whitespace runs,
  digits, non-ASCII) and the decoded text (special tokens skipped);
- `chat_{k}`: the rendered chat template of conversations of 1-4 turns, with/without a system
  message, with a generation prompt (`chats` holds the conversations as JSON);
- `mc30`: JSON list, per question of tests/data/mc30.jsonl and choice, [ids, context length,
  loglikelihood]: the continuation " <choice>" after "Question: <q>\nAnswer:", tokenized as
  lm-evaluation-harness does (the whole string, and the context alone, no special tokens), and
  the sum of its tokens' log-softmax — what tests/test_lm_eval.py's harness computes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _side_venv  # noqa: E402

VENV = "/tmp/tinyloop-golden-venv"  # bench_smollm2.py's transformers arm runs in it too
PACKAGES = ["torch==2.13.0", "transformers", "accelerate", "gguf", "numpy", "jinja2"]
OUT = os.path.join(HERE, "..", "tests", "data", "smollm2-golden.npz")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Once upon a time, in a small village by the sea, there lived"]
CORPUS = [
    "Hello, world!", "  leading spaces and trailing   ", "tabs\tand\nnewlines\n\n\nthree",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }", "numbers 12345 3.14159 1,000,000 x  1",
    "Grüße aus München — naïve café, ½ €", "日本語のテキストと中文", "emoji 🙂🚀 and symbols ∑∫√",
    "<|im_start|>user\nhi<|im_end|>", "    indented\n        deeper\n", "",
]
SYSTEM = "You are a concise assistant."
TURNS = [("What is the capital of France?", "Paris."), ("And of Italy?", "Rome."),
         ("Which is larger?", "Rome has more inhabitants."), ("Thanks!", "You're welcome.")]


def conversations() -> list[list[dict]]:
    """1-4 turns (the last user message unanswered), with and without a system message."""
    out = []
    for n in range(1, 5):
        msgs = []
        for q, a in TURNS[:n - 1]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": TURNS[n - 1][0]})
        out += [msgs, [{"role": "system", "content": SYSTEM}] + msgs]
    return out


def write(path: str) -> None:
    import numpy as np
    import torch
    import transformers

    # hub.py needs only the standard library: loaded by path, without the package (and jax)
    spec = importlib.util.spec_from_file_location("tinyloop_hub",
                                                  os.path.join(HERE, "..", "tinyloop_jax", "formats", "hub.py"))
    hub = sys.modules["tinyloop_hub"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    file = hub.model_path("smollm2")
    folder, name = os.path.dirname(file), os.path.basename(file)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = {}
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
        pos = np.arange(len(ids))  # every position
        top = np.argsort(-logits[pos], axis=-1)[:, :32]
        out[f"prompt_{i}"] = np.array(ids, np.int32)
        out[f"logits_{i}_pos"], out[f"logits_{i}_ids"] = pos, top.astype(np.int32)
        out[f"logits_{i}_top"] = np.take_along_axis(logits[pos], top, -1).astype(np.float32)
    for j, text in enumerate(CORPUS):
        out[f"corpus_ids_{j}"] = np.array(tok(text, add_special_tokens=True)["input_ids"], np.int32)
    out["corpus"] = np.array(json.dumps(CORPUS))
    out["corpus_text"] = np.array(json.dumps([tok.decode(out[f"corpus_ids_{j}"], skip_special_tokens=True)
                                              for j in range(len(CORPUS))]))
    chats = conversations()
    out["chats"] = np.array(json.dumps(chats))
    for k, msgs in enumerate(chats):
        out[f"chat_{k}"] = np.array(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    mc = []
    with open(os.path.join(HERE, "..", "tests", "data", "mc30.jsonl")) as f:
        for doc in map(json.loads, f):
            context = f"Question: {doc['question']}\nAnswer:"
            for choice in doc["choices"]:
                whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
                n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1).numpy()
                mc.append([whole, n_ctx, float(sum(logp[i - 1, whole[i]] for i in range(n_ctx, len(whole))))])
    out["mc30"] = np.array(json.dumps(mc))
    out["versions"] = np.array(f"transformers {transformers.__version__}, torch {torch.__version__}")
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({os.path.getsize(path)} bytes) with {out['versions']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=VENV, type=os.path.abspath, help="side venv with torch + transformers")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_venv:
        return write(os.path.abspath(args.out))
    python = _side_venv.python(args.venv, PACKAGES)
    subprocess.run([python, os.path.abspath(__file__), "--in-venv", "--out", args.out], check=True)


if __name__ == "__main__":
    main()
