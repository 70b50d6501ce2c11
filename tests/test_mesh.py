"""Many devices and many processes. JAX fixes its device count when it starts, so the mesh checks
run in a subprocess with 8 fake CPU devices (tests/mesh_checks.py: meshes 2x4, 8x1,
both families, every call against one device, shard shapes, collectives, warm calls tracing
nothing), and the multi-process check as two processes over gloo on localhost
(tests/multiprocess_worker.py)."""

import json
import os
import socket
import subprocess
import sys

import pytest

import tinyloop_jax as tl
from mesh_checks import GPT2, PROMPT, SUFFIXES

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, env=None, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=HERE, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# each part's subprocess, with lines it must print (a part is one process: the suite's workers share them)
MESH_PARTS = {"gpt2": ("ok gpt2 8x1 own K shard", "ok gpt2 2x4 warm calls trace nothing", "ok gpt2 2x4 int4-h engine"),
              "modes": ("ok gpt2 2x4 int4-h", "ok gpt2 2x4 kv_share avg", "ok gpt2 2x4 kv_share avg engine",
                        "ok int4 weights 2x4"),
              "ouro": ("ok ouro 2x4 collectives", "ok indivisible heads", "ok ouro 2x4 engine",
                       "ok prefix saved on the mesh, loaded on one device")}


@pytest.mark.parametrize("part", list(MESH_PARTS))
def test_mesh_checks_on_8_fake_devices(part):
    r = run(["mesh_checks.py", part], env={"JAX_NUM_CPU_DEVICES": "8"})
    print(r.stdout[-4000:])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    lines = r.stdout.split("\n")
    for want in MESH_PARTS[part]:
        assert any(ln.startswith(want) for ln in lines), want


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_single_process_tokens():
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "multiprocess_worker.py", str(i), "2", port], cwd=HERE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    except subprocess.TimeoutExpired:
        pytest.fail("the two-process run did not finish in 300 s")
    finally:
        for p in procs:
            p.kill()
    single = tl.Model.random(GPT2, seed=0)
    prefix = single.build_prefix_cache(PROMPT[:12])
    want = dict(devices=4, generate=single.generate(PROMPT, max_tokens=8),
                batch=single.generate_batch_from_prefix_cache(prefix, [list(s) for s in SUFFIXES], max_tokens=6))
    assert outs[0] == outs[1] == want
