"""lm-evaluation-harness as a client: its `local-completions` model (loglikelihoods from
`echo` + `logprobs`, `tokenizer_backend=remote`: our /tokenizer_info, /tokenize, /detokenize)
against the server on SmolLM2-135M-Instruct, on a 30-question multiple-choice task shipped with
the tests (tests/data/mc30.jsonl). Every loglikelihood equals `Model.score` of the same tokens
(<= 1e-4), so the accuracy does too, and transformers' on the same file (<= 1e-3, the golden
file of scripts/make_smollm2_golden.py).

lm-eval pulls torch, transformers and datasets, so it lives in a side venv
(`python scripts/lm_eval_venv.py` makes it once per machine, ~2 min); without it the test is
skipped, saying so.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))

import lm_eval_venv  # noqa: E402

pytest.importorskip("openai", reason="the test extra installs the openai client")
from test_server import Server  # noqa: E402

TASK = """task: tinyloop_mc30
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_lm_eval_local_completions_equals_our_scores(smollm2, tmp_path):
    if not os.path.isfile(lm_eval_venv.executable()):
        pytest.skip(f"lm-evaluation-harness is not installed at {lm_eval_venv.venv_dir()} "
                    "(python scripts/lm_eval_venv.py makes it)")
    model, tok = smollm2
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "mc30.yaml").write_text(TASK.format(data=os.path.join(HERE, "data", "mc30.jsonl")))
    server = Server(model, eos=tok.eos_token_ids, tok=tok, name="smollm2", max_batch=4)
    try:
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("XLA_FLAGS", None)
        run = subprocess.run(
            [lm_eval_venv.executable(), "run", "--model", "local-completions", "--model_args",
             f"model=smollm2,base_url={server.url}/v1/completions,tokenizer_backend=remote,num_concurrent=4,"
             "max_retries=1,tokenized_requests=True",
             "--tasks", "tinyloop_mc30", "--include_path", str(tmp_path / "task"), "--log_samples",
             "--output_path", str(tmp_path / "out"), "--batch_size", "1"],
            capture_output=True, text=True, env=env, timeout=1200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        server.close()
    samples = [json.loads(line) for f in sorted((tmp_path / "out").rglob("samples_*.jsonl")) for line in open(f)]
    results = json.load(open(next((tmp_path / "out").rglob("results_*.json"))))
    assert len(samples) == 30
    golden = json.loads(str(np.load(os.path.join(HERE, "data", "smollm2-golden.npz"))["mc30"]))
    correct = 0
    for s in samples:
        ours = []
        args = [(a["arg_0"], a["arg_1"]) for _, a in sorted(s["arguments"].items(), key=lambda kv: int(kv[0][9:]))]
        resps = [(float(r[0][0]), r[0][1] == "True") for r in s["resps"]]  # (loglikelihood, is_greedy) as text
        for (context, continuation), (ll, greedy) in zip(args, resps):
            whole, ctx = tok.encode(context + continuation, special=False), tok.encode(context, special=False)
            assert whole[:len(ctx)].tolist() == ctx.tolist()
            score = model.score(whole)
            ours.append(float(score.logprobs[len(ctx):].sum()))
            np.testing.assert_allclose(ll, ours[-1], atol=1e-4, rtol=0)
            ids, _, theirs = golden[4 * int(s["doc_id"]) + len(ours) - 1]  # transformers on the same tokens
            assert ids == whole.tolist()
            np.testing.assert_allclose(ll, theirs, atol=1e-3, rtol=0)
        correct += int(np.argmax(ours) == int(s["target"]))
    acc = results["results"]["tinyloop_mc30"]["acc,none"]
    assert acc == pytest.approx(correct / 30)
    print(f"lm-eval local-completions on SmolLM2-135M-Instruct: acc {acc:.3f} on 30 questions")
