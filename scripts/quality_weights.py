"""SmolLM2-135M-Instruct's bits per byte on a held-out text for each weight form: the GGUF file as
shipped (Q4_1 body + Q8_0 embedding, kept packed), the same dequantized to float32, and
`quantize_weights` int8 / int4 (q8_0 / q4_0, quantized from the dequantized float32 weights), and
the file as shipped multiplying 8-bit activations (`activations="int8"`, llama.cpp's arithmetic).

    python scripts/quality_weights.py        # writes the "weights" section of docs/quality.md

Text: tests/data/heldout.txt (8,000 characters of Python's reference manual, `pydoc_data`),
scored in non-overlapping windows of 512 tokens by `Model.score`; each window's first token is
context only. Bits per byte = the scored tokens' negative log-likelihood in bits / their UTF-8 bytes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
TEXT = os.path.join(HERE, "..", "tests", "data", "heldout.txt")
FORMS = [("file as shipped (packed)", None, None), ("dequantized float32", "float", None),
         ("int8 (q8_0)", "int8", None), ("int4 (q4_0)", "int4", None),
         ("file as shipped, 8-bit activations (`activations=\"int8\"`)", None, "int8")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import jax
    import numpy as np

    import _report
    import tinyloop_jax as tl

    tok = tl.load_tokenizer("smollm2")
    with open(TEXT) as f:
        ids = tok.encode(f.read(), special=False).astype(np.int32)
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    n_bytes = sum(len(tok.decode(w[1:].tolist()).encode()) for w in windows)
    rows, base = [], None
    for label, form, act in FORMS:
        t = time.perf_counter()
        model = tl.Model.from_pretrained("smollm2", kv_mode="fp32", dtype="float32", quantize_weights=form,
                                         activations=act)
        nll = sum(-float(np.sum(np.asarray(model.score(w).logprobs)[1:], dtype=np.float64)) for w in windows)
        n_tok = sum(len(w) - 1 for w in windows)
        bpb, ppl = nll / math.log(2) / n_bytes, math.exp(nll / n_tok)
        base = bpb if base is None else base
        rows.append(f"| {label} | {model.nbytes / 2**20:.1f} | {bpb:.4f} | {bpb - base:+.4f} | {ppl:.3f} |")
        print(rows[-1], f"({time.perf_counter() - t:.0f} s)", flush=True)
        del model
        jax.clear_caches()
    body = "\n".join([
        f"Command: `{_report.command()}`. {len(windows)} windows, {sum(len(w) - 1 for w in windows)} scored tokens, "
        f"{n_bytes} bytes of tests/data/heldout.txt. Machine: {_report.machine()}.", "",
        "| weights | MiB | bits/byte | vs the file | per-token perplexity |", "|---|---|---|---|---|", *rows])
    print(body)
    if not args.no_write:
        print("wrote", _report.write_section(
            "weights", "## SmolLM2-135M-Instruct: weight forms (issue 23)\n\n" + body, path="quality.md"))


if __name__ == "__main__":
    main()
