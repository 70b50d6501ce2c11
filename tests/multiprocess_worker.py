"""One process of tests/test_mesh.py's two-process run: `python multiprocess_worker.py PROCESS_ID
N_PROCESSES PORT`. Every process builds the same model on a global ('data', 'model') mesh and
makes the same calls in the same order; the outputs (gathered from all processes) are printed
as one JSON line."""

import json
import os
import sys

pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["JAX_NUM_CPU_DEVICES"] = "2"  # per process
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (the suite's XLA flags and compilation cache)

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=n, process_id=pid,
                           initialization_timeout=120)

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.model import sharding  # noqa: E402
from mesh_checks import GPT2, PROMPT, SUFFIXES  # noqa: E402

model = tl.Model.random(GPT2, seed=0, mesh=sharding.make_mesh(2, 2))
prompt = sharding.share(PROMPT)  # process 0's request, broadcast to every process
prefix = model.build_prefix_cache(prompt[:12])
out = dict(devices=jax.device_count(), generate=model.generate(prompt, max_tokens=8),
           batch=model.generate_batch_from_prefix_cache(prefix, SUFFIXES, max_tokens=6))
print("RESULT " + json.dumps(out), flush=True)
