"""Batch generation jobs: OpenAI batch files (or plain text) in, OpenAI batch output out,
sharded, resumable and exactly-once. The command line is `python -m jaxinfer.launch.batch`;
the contract is docs/batch.md.

    from jaxinfer.batch import JobSpec, run_local
    summary = run_local(llm, JobSpec("requests.jsonl", "out/", {"model": "smollm2-135m"}))
"""

from jaxinfer.batch.job import JobSpec, run_local
from jaxinfer.batch.merge import OUTPUT, merge, summary_line

__all__ = ["JobSpec", "run_local", "merge", "summary_line", "OUTPUT"]
