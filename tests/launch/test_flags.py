"""The launch scripts' flags: a script with a library function imports beside the others.

absl registers flags in one global table and refuses a name defined twice, so a script whose
library function (`launch.convert.convert`, `launch.evaluate.evaluate`) is imported beside a
script built on launch.common must not define its own --model on import. It once did, and a
test process that had imported launch.generate failed on importing launch.convert.
"""

import subprocess
import sys

import pytest

from jaxinfer.launch import convert as convert_script
from jaxinfer.launch import evaluate as evaluate_script



@pytest.mark.parametrize("script", ["generate", "batch", "serve"])
@pytest.mark.parametrize("first", [True, False])
def test_library_scripts_import_beside_a_common_flag_script(script, first):
    order = [script, "convert", "evaluate"] if first else ["convert", "evaluate", script]
    code = "\n".join(f"import jaxinfer.launch.{m}" for m in order) + "\nprint('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("script", [convert_script, evaluate_script])
def test_a_script_defines_its_flags_when_it_runs(script):
    """Its --helpshort lists its own flags, registered by define_flags() under __main__ (absl
    exits 1 after printing help)."""
    name = script.__name__
    proc = subprocess.run([sys.executable, "-m", name, "--helpshort"], capture_output=True,
                          text=True, timeout=120)
    assert "--model" in proc.stdout and "--quantization" in proc.stdout, proc.stderr[-2000:]
