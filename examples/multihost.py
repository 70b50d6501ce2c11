"""Two processes, one model: `jax.distributed` on localhost (CPU, gloo collectives).

    python examples/multihost.py          # starts 2 processes with 2 CPU devices each

Each process runs the same program: initialize `jax.distributed`, build the same `Model` on a
global ('data', 'model') mesh over all 4 devices, and make the same calls in the same order.
Process 0 admits the requests (`sharding.share` broadcasts them); outputs are gathered from
every process at the host edge, so every process holds the same tokens. On real hosts, replace
the coordinator address and start one process per host.
"""

import os
import socket
import subprocess
import sys


def worker(process_id: int, n: int, port: int) -> None:
    os.environ["JAX_NUM_CPU_DEVICES"] = "2"  # this process's devices (set before JAX starts)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=n, process_id=process_id,
                               initialization_timeout=120)
    import numpy as np

    import tinyloop_jax as tl
    from tinyloop_jax.model import sharding

    mesh = sharding.make_mesh(2, 2)  # 'data' over the processes' devices, 'model' splits the heads
    model = tl.Model.random(tl.ModelConfig(vocab_size=256, d_model=64, n_heads=4, default_loops=4), seed=0,
                            mesh=mesh)
    prompt = sharding.share(np.arange(1, 17) if process_id == 0 else np.zeros(16, np.int64))  # process 0 admits
    prefix = model.build_prefix_cache(prompt)
    outs = model.generate_batch_from_prefix_cache(prefix, [[1, 2], [3], []], max_tokens=8)
    print(f"process {process_id} of {jax.process_count()}, {jax.device_count()} devices: {outs}", flush=True)


def main() -> None:
    if len(sys.argv) == 4:
        return worker(*map(int, sys.argv[1:]))
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, str(i), "2", str(port)]) for i in range(2)]
    sys.exit(max(p.wait(timeout=600) for p in procs))


if __name__ == "__main__":
    main()
