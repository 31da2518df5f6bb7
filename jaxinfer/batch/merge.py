"""`--merge DIR`: checks a job's shards and joins them into DIR/output.jsonl in input order, with
DIR/summary.json over all of them. It holds every shard's lock, and replaces only an output its
own merges wrote (summary.json records output.jsonl's sha256). docs/batch.md lists what it
refuses.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
from typing import Iterator, Optional

from jaxinfer.batch.store import (JOB_FILE, MANIFEST, SHARD_DIR, SUMMARY, Totals,
                                  check_same_settings, dir_lock, fsync_dir, manifest_entries,
                                  part_lines, read_json, sha256_file, shard_dir_name,
                                  write_atomic)

OUTPUT = "output.jsonl"
MERGED_SHA256 = "output_sha256"  # summary.json's record of the output.jsonl the merge wrote


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


def check_shards(output_dir: str, shards: Optional[list] = None) -> list[tuple[str, dict]]:
    """(directory, summary) of shards 0..n-1, once they are known to be one finished job.
    `shards`: _shard_dirs(output_dir), when the caller has it."""
    shards = _shard_dirs(output_dir) if shards is None else shards
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
    """Writes DIR/output.jsonl and DIR/summary.json under every shard's lock (DirectoryInUse if
    a run holds one); returns the summary."""
    shard_dirs = _shard_dirs(output_dir)
    with contextlib.ExitStack() as locks:
        for _, _, path in shard_dirs:
            locks.enter_context(dir_lock(path))
        return _merge_locked(output_dir, check_shards(output_dir, shard_dirs))


def _merge_locked(output_dir: str, shards: list[tuple[str, dict]]) -> dict:
    path = os.path.join(output_dir, OUTPUT)
    for name in os.listdir(output_dir):  # left by a merge killed while writing
        if name.startswith((OUTPUT + ".", SUMMARY + ".")) and name.endswith(".tmp"):
            os.remove(os.path.join(output_dir, name))
    tmp = f"{path}.{os.getpid()}.tmp"
    last, last_shard, sha = -1, None, hashlib.sha256()
    streams = [((line, i, rec) for line, rec in _records(d)) for i, (d, _) in enumerate(shards)]
    try:
        with open(tmp, "wb") as f:
            for line, shard, record in heapq.merge(*streams):
                if line <= last:  # each shard's lines ascend, so this is the same line twice
                    raise ValueError(f"input line {line + 1} is answered twice (by shards "
                                     f"{last_shard} and {shard}): a duplicated shard")
                last, last_shard = line, shard
                data = record.encode("utf-8") + b"\n"
                sha.update(data)
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _check_ours(output_dir, sha.hexdigest())
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, path)
    fsync_dir(output_dir)

    totals = Totals()
    for _, s in shards:
        totals.add_summary(s)
    runs = max(s["runs"] for _, s in shards)
    first = read_json(os.path.join(shards[0][0], JOB_FILE))
    summary = {"input": first["input"], "output": os.path.abspath(path),
               "lines": shards[0][1]["lines"], "shards": len(shards), **totals.summary(),
               "max_rss_mb": max(s["max_rss_mb"] for _, s in shards),
               MERGED_SHA256: sha.hexdigest()}
    summary["runs"] = runs  # the most runs any shard needed (1: never interrupted)
    write_atomic(os.path.join(output_dir, SUMMARY), json.dumps(summary, indent=1).encode())
    return summary


def _check_ours(output_dir: str, new_sha256: str) -> None:
    """ValueError unless DIR's output.jsonl and summary.json are absent or a merge's (the output
    the one the summary records, or what this merge writes, after a kill between renames)."""
    output, summary = os.path.join(output_dir, OUTPUT), os.path.join(output_dir, SUMMARY)
    recorded = None
    if os.path.exists(summary):
        try:
            recorded = read_json(summary).get(MERGED_SHA256)
        except (ValueError, AttributeError):  # not JSON, or not an object
            pass
        if recorded is None:
            raise ValueError(f"{summary} exists and was not written by a merge of this job; "
                             "move it away, then merge again")
    if os.path.exists(output) and sha256_file(output) not in (recorded, new_sha256):
        raise ValueError(f"{output} exists and was not written by a merge of this job (or was "
                         "changed since); move it away, then merge again")


def summary_line(summary: dict) -> str:
    """The one-line account printed at the end of a job or a merge."""
    errors = ", ".join(f"{n} {kind}" for kind, n in summary["errors_by_kind"].items())
    failed = f"{summary['failed']} failed ({errors})" if summary["failed"] else "0 failed"
    where = f" -> {summary['output']}" if "output" in summary else ""
    return (f"batch: {summary['requests']} requests, {summary['succeeded']} ok, {failed}; "
            f"{summary['completion_tokens']} output tokens in {summary['elapsed_s']:.1f} s "
            f"({summary['output_tokens_per_s']:.1f} tok/s){where}")
