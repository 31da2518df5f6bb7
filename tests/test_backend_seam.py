"""The backend seam holds: platform decisions live in jaxinfer/backends alone, and one attention
call reaches the model's layers. Read from the source, so a new branch on the platform anywhere
else fails here."""

import os
import re

import jaxinfer

ROOT = os.path.dirname(jaxinfer.__file__)
# What only the backend package may do: use the native kernels, ask jax for the platform, read
# or write the process's XLA flags. (A link to docs/cpu_kernels.md is not a use.)
FORBIDDEN = re.compile(r"(?<!/)cpu_kernels(?!\.md)|default_backend\(|XLA_FLAGS")


def _sources():
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def test_only_the_backend_package_decides_the_platform():
    offenders = [f"{path}: {m.group()}" for path, src in _sources()
                 if not path.startswith("backends" + os.sep)
                 for m in FORBIDDEN.finditer(src)]
    assert offenders == []


def test_the_models_attend_through_one_call():
    calls = {path: len(re.findall(r"backend\.attend\(", src)) for path, src in _sources()
             if path.startswith("models" + os.sep)}
    assert sum(calls.values()) == 1 and calls[os.path.join("models", "base.py")] == 1
