"""Runs notebooks/quickstart.ipynb top to bottom from a working directory outside the repository."""

import json
import os
import sys

import pytest

import ipykernel  # noqa: F401  (the test extras: a broken install fails, never skips)
import matplotlib  # noqa: F401
import nbclient
import nbformat

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "notebooks", "quickstart.ipynb")


def _kernel_name(tmp_path, monkeypatch) -> str:
    """"python3" when it resolves to this interpreter (jupyter_client runs a spec whose argv[0] is
    python / python3 / python3.X with sys.executable, and ipykernel supplies a python3 spec when
    none is installed). If another environment's python3 spec shadows it, a private spec for this
    interpreter is put first on JUPYTER_PATH instead."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    names = {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}
    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        argv0 = None
    if argv0 is not None and (argv0 in names
                              or os.path.realpath(argv0) == os.path.realpath(sys.executable)):
        return "python3"
    spec_dir = tmp_path / "jupyter" / "kernels" / "jaxinfer-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxinfer test", "language": "python"}))
    previous = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(tmp_path / "jupyter")] + previous))
    return "jaxinfer-test"


@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)  # the kernel's cwd is set below; the test's own cwd moves too
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=_kernel_name(tmp_path,
                                                                               monkeypatch),
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError on any failing cell

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "'The capital of France is' -> ' Paris" in text  # greedy generation
    assert "The capital of France is Paris" in text  # greedy chat
    assert "tokens; TTFT" in text  # the latency cell's summary
    assert any("image/png" in o.get("data", {}) for o in outputs
               if o.output_type in ("display_data", "execute_result"))
    stats = [o for o in outputs if o.output_type == "execute_result"][-1]
    assert "generated_tokens" in stats.data["text/plain"]


@pytest.mark.slow
def test_grpo_notebook_runs(tmp_path, monkeypatch):
    """notebooks/grpo.ipynb: a short GRPO run through examples/grpo.py plotted, and the stored
    run (benchmarks/results/grpo_curve.json) plotted."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    nb = nbformat.read(os.path.join(os.path.dirname(NOTEBOOK), "grpo.ipynb"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name=_kernel_name(tmp_path,
                                                                               monkeypatch),
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "step   7" in text and "mean reward, first 5 steps" in text
    images = [o for o in outputs if o.output_type in ("display_data", "execute_result")
              and "image/png" in o.get("data", {})]
    assert len(images) == 2  # the short run's curve and the stored run's
