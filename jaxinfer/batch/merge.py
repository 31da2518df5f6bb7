"""`--merge DIR`: checks a job's shards and joins them into DIR/output.jsonl in input order,
with DIR/summary.json over all of them.

Refused, with the reason: no shards; shards of different splits (--num_shards); a shard
directory holding another shard's output (a copy or a rename: a duplicated shard); a missing or
unfinished shard; shards run with other settings or over other lines; an input line answered
twice; a part that changed after its commit.
"""

from __future__ import annotations

import heapq
import json
import os
from typing import Iterator

from jaxinfer.batch.store import (JOB_FILE, MANIFEST, SHARD_DIR, SUMMARY, Totals,
                                  check_same_settings, fsync_dir, manifest_entries, part_lines,
                                  read_json, shard_dir_name, write_atomic)

OUTPUT = "output.jsonl"


def _shard_dirs(output_dir: str) -> list[tuple[int, int, str]]:
    """(index, count, directory) of every shard directory, by name."""
    if not os.path.isdir(output_dir):
        raise ValueError(f"--merge: {output_dir} is not a directory")
    found = []
    for name in sorted(os.listdir(output_dir)):
        m = SHARD_DIR.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m[1]), int(m[2]), os.path.join(output_dir, name)))
    if not found:
        raise ValueError(f"{output_dir} holds no shard directories (shard-NNNNN-of-NNNNN): "
                         "is it a batch job's --output?")
    return found


def check_shards(output_dir: str) -> list[tuple[str, dict]]:
    """(directory, summary) of shards 0..n-1, after every check in the module docstring."""
    shards = _shard_dirs(output_dir)
    splits = sorted({n for _, n, _ in shards})
    if len(splits) > 1:
        names = ", ".join(os.path.basename(d) for _, _, d in shards)
        raise ValueError(f"{output_dir} holds shards of different splits ({names}): shards of "
                         f"--num_shards {' and '.join(map(str, splits))} answer the same lines "
                         "twice; remove the directories of the split you do not want")
    n = splits[0]
    reference, out = None, {}
    for index, _, path in shards:
        if not os.path.exists(os.path.join(path, JOB_FILE)):
            raise ValueError(f"{path} has no {JOB_FILE}: not the output of a batch job")
        job = read_json(os.path.join(path, JOB_FILE))
        if (job["shard_index"], job["num_shards"]) != (index, n):
            raise ValueError(
                f"duplicated shard: {os.path.basename(path)} holds the output of "
                f"{shard_dir_name(job['shard_index'], job['num_shards'])} (its {JOB_FILE}), "
                "a copied or renamed directory; remove it and rerun the missing shard")
        if reference is None:
            reference = job["fingerprint"]
        else:
            check_same_settings(reference, job["fingerprint"], path)
        out[index] = path
    missing = sorted(set(range(n)) - set(out))
    if missing:
        raise ValueError(f"missing shard{'s' * (len(missing) > 1)} "
                         f"{', '.join(map(str, missing))} of {n} in {output_dir}: run the job "
                         f"with --num_shards={n} --shard_index=I for each, then merge")
    result = []
    for index in range(n):
        path = out[index]
        if not os.path.exists(os.path.join(path, SUMMARY)):
            raise ValueError(f"shard {index} of {n} is not finished ({path} has no {SUMMARY}): "
                             "rerun its command, which resumes it")
        result.append((path, read_json(os.path.join(path, SUMMARY))))
    spans = {(s["lines"], s["max_lines"]) for _, s in result}
    if len(spans) > 1:
        raise ValueError(f"the shards of {output_dir} read different parts of the input "
                         f"(lines, --max_lines): {sorted(spans, key=str)}; rerun them with the "
                         "same --max_lines")
    return result


def _records(shard_dir: str) -> Iterator[tuple[int, str]]:
    """(input line, output line) of one shard, in input order."""
    for entry in manifest_entries(os.path.join(shard_dir, MANIFEST)):
        yield from zip(entry["lines"], part_lines(shard_dir, entry))


def merge(output_dir: str) -> dict:
    """Writes DIR/output.jsonl (every shard's output lines in input order) and DIR/summary.json;
    returns the summary."""
    shards = check_shards(output_dir)
    path = os.path.join(output_dir, OUTPUT)
    tmp = f"{path}.{os.getpid()}.tmp"
    last, last_shard = -1, None
    streams = [((line, i, rec) for line, rec in _records(d)) for i, (d, _) in enumerate(shards)]
    with open(tmp, "wb") as f:
        for line, shard, record in heapq.merge(*streams):
            if line <= last:  # each shard's lines ascend, so this is the same line twice
                os.remove(tmp)
                raise ValueError(f"input line {line + 1} is answered twice (by shards "
                                 f"{last_shard} and {shard}): a duplicated shard")
            last, last_shard = line, shard
            f.write(record.encode("utf-8") + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(output_dir)

    totals = Totals()
    for _, s in shards:
        totals.add_summary(s)
    runs = max(s["runs"] for _, s in shards)
    first = read_json(os.path.join(shards[0][0], JOB_FILE))
    summary = {"input": first["input"], "output": os.path.abspath(path),
               "lines": shards[0][1]["lines"], "shards": len(shards), **totals.summary(),
               "max_rss_mb": max(s["max_rss_mb"] for _, s in shards)}
    summary["runs"] = runs  # the most runs any shard needed (1: never interrupted)
    write_atomic(os.path.join(output_dir, SUMMARY), json.dumps(summary, indent=1).encode())
    return summary


def summary_line(summary: dict) -> str:
    """The one-line account printed at the end of a job or a merge."""
    errors = ", ".join(f"{n} {kind}" for kind, n in summary["errors_by_kind"].items())
    failed = f"{summary['failed']} failed ({errors})" if summary["failed"] else "0 failed"
    where = f" -> {summary['output']}" if "output" in summary else ""
    return (f"batch: {summary['requests']} requests, {summary['succeeded']} ok, {failed}; "
            f"{summary['completion_tokens']} output tokens in {summary['elapsed_s']:.1f} s "
            f"({summary['output_tokens_per_s']:.1f} tok/s){where}")
