"""A shard's output directory (job.json, part-NNNNNN.jsonl, manifest.jsonl, summary.json, lock)
and its exactly-once commits: a part is written atomically, then its manifest line appended and
fsynced, which is the commit, so a rerun after a kill resumes after the last one. A run holds the
shard's lock throughout. docs/batch.md ("Exactly once") has the details.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import resource
import threading
from typing import Iterator, Optional

from jaxinfer.batch.inputs import IdSet, line_digest
from jaxinfer.batch.records import Blank, Result

JOB_FILE, MANIFEST, SUMMARY, LOCK_FILE = "job.json", "manifest.jsonl", "summary.json", "lock"
SHARD_DIR = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def shard_dir_name(shard_index: int, num_shards: int) -> str:
    return f"shard-{shard_index:05d}-of-{num_shards:05d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Temporary file, fsync, rename over `path`, fsync of the directory: after a crash the file
    is either absent (or its previous version) or whole."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def make_dirs(path: str) -> None:
    """os.makedirs, each created directory's entry fsynced into its parent."""
    missing, p = [], os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    for d in reversed(missing):
        fsync_dir(os.path.dirname(d))


class DirectoryInUse(ValueError):
    """Another process holds the directory's lock."""


_held: dict[str, list] = {}  # realpath -> [lock file descriptor, depth]: this process's locks
_held_guard = threading.Lock()


@contextlib.contextmanager
def dir_lock(path: str):
    """Holds an exclusive flock on `path`/lock for the block, or raises DirectoryInUse naming
    the holder's pid. Reentrant within a process (a one-shard run merges while it holds its
    shard); a killed run's lock goes with its process."""
    key = os.path.realpath(path)
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
        else:
            _held[key] = [_acquire(key), 1]
    try:
        yield
    finally:
        with _held_guard:
            _held[key][1] -= 1
            if _held[key][1] == 0:
                os.close(_held.pop(key)[0])


def _acquire(directory: str) -> int:
    path = os.path.join(directory, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise DirectoryInUse(f"{directory} is in use by another run (pid {holder}): two runs "
                             "in one shard directory would answer its lines twice; wait for "
                             "that run to end (or stop it), then rerun") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def shard_lock(output_dir: str, shard_index: int, num_shards: int):
    """dir_lock of the shard's directory, created (durably) if missing."""
    path = os.path.join(output_dir, shard_dir_name(shard_index, num_shards))
    make_dirs(path)
    with dir_lock(path):
        yield


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def max_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclasses.dataclass
class Totals:
    """Counts over committed parts (a shard's, or all shards' after a merge)."""

    records: int = 0
    succeeded: int = 0
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    blank_lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0     # generation time of the committed parts, summed over runs
    runs: set = dataclasses.field(default_factory=set)

    def add_entry(self, entry: dict) -> None:
        """Adds a manifest entry (one committed part)."""
        self._add(entry["records"], entry["succeeded"], entry["errors"], entry["blank_lines"],
                  entry["prompt_tokens"], entry["completion_tokens"], entry["seconds"])
        self.runs.add(entry["run"])

    def add_summary(self, s: dict) -> None:
        """Adds a shard's summary.json counts (summary() of that shard's Totals)."""
        self._add(s["requests"], s["succeeded"], s["errors_by_kind"], s["blank_lines"],
                  s["prompt_tokens"], s["completion_tokens"], s["elapsed_s"])

    def _add(self, records, succeeded, errors, blank_lines, prompt_tokens, completion_tokens,
             seconds) -> None:
        self.records += records
        self.succeeded += succeeded
        self.errors.update(errors)
        self.blank_lines += blank_lines
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.seconds += seconds

    def summary(self) -> dict:
        """summary.json's counts: requests are input lines that got an output line."""
        s = self.seconds
        return {"requests": self.records, "succeeded": self.succeeded,
                "failed": self.records - self.succeeded,
                "errors_by_kind": dict(sorted(self.errors.items())),
                "blank_lines": self.blank_lines, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "elapsed_s": round(s, 3),
                "output_tokens_per_s": round(self.completion_tokens / s, 2) if s else 0.0,
                "requests_per_s": round(self.records / s, 3) if s else 0.0,
                "runs": len(self.runs)}


def manifest_entries(path: str, repair: bool = False) -> Iterator[dict]:
    """The committed parts, in order. A last line without its newline was torn by a kill while
    it was appended: it is not a commit (and with repair, it is cut off the file)."""
    if not os.path.exists(path):
        return
    with open(path, "rb+" if repair else "rb") as f:
        while True:
            start = f.tell()
            raw = f.readline()
            if not raw:
                return
            if not raw.endswith(b"\n"):
                if repair:
                    f.truncate(start)
                    f.flush()
                    os.fsync(f.fileno())
                return
            yield json.loads(raw)


def part_lines(shard_dir: str, entry: dict) -> list[str]:
    """A committed part's output lines, checked against its manifest entry."""
    with open(os.path.join(shard_dir, entry["file"]), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != entry["sha256"] \
            or data.count(b"\n") != len(entry["lines"]):
        raise ValueError(f"{shard_dir}/{entry['file']} does not match its manifest entry "
                         "(changed or damaged after it was committed)")
    return data.decode("utf-8").splitlines()


class ShardStore:
    """One shard's directory: checks the job's settings, resumes, commits parts. Only the
    writer touches files; other processes keep the same counters, so all decide alike."""

    def __init__(self, output_dir: str, shard_index: int, num_shards: int, fingerprint: dict,
                 input_path: str, writer: bool = True):
        self.dir = os.path.join(output_dir, shard_dir_name(shard_index, num_shards))
        self.shard_index, self.num_shards = shard_index, num_shards
        self.writer = writer
        self.totals = Totals()
        self.next_part, self.start_line, self.run = 0, 0, 1
        job = {"version": 2, "shard_index": shard_index, "num_shards": num_shards,
               "fingerprint": fingerprint, "input": os.path.abspath(input_path)}
        job_path = os.path.join(self.dir, JOB_FILE)
        if os.path.exists(job_path):
            check_same_settings(read_json(job_path)["fingerprint"], fingerprint, self.dir)
        elif writer:
            make_dirs(self.dir)
            write_atomic(job_path, json.dumps(job, indent=1).encode())  # fsyncs self.dir
        if writer:
            for name in os.listdir(self.dir):
                if name.endswith(".tmp"):  # a kill during write_atomic
                    os.remove(os.path.join(self.dir, name))

    def completed(self, max_lines: Optional[int]) -> Optional[dict]:
        """The shard's summary when an earlier run finished it with the same --max_lines."""
        path = os.path.join(self.dir, SUMMARY)
        if not os.path.exists(path):
            return None
        summary = read_json(path)
        if summary["max_lines"] == max_lines:
            return summary
        if self.writer:  # asked for more (or fewer) lines: go on from where it stopped
            os.remove(path)
        return None

    def resume(self, lines: Iterator[tuple[int, bytes]], seen: Optional[IdSet]) -> None:
        """Reads the manifest (totals, next part, custom_ids into `seen`), consuming `lines` up
        to the line to go on from; checks each part and the input lines it answered."""
        for entry in manifest_entries(os.path.join(self.dir, MANIFEST), repair=self.writer):
            part_lines(self.dir, entry)
            own, digest = set(entry["lines"]), hashlib.sha256()
            while self.start_line < entry["end_line"]:
                try:
                    no, raw = next(lines)
                except StopIteration:
                    raise ValueError(f"the input has {self.start_line} lines, but {self.dir} "
                                     f"holds answers up to line {entry['end_line']}: it is not "
                                     "the input this job started with") from None
                if no in own:
                    digest.update(line_digest(raw))
                self.start_line = no + 1
            if digest.hexdigest() != entry["input_digest"]:
                raise ValueError(f"input lines {entry['first_line'] + 1}-{entry['end_line']} "
                                 f"differ from those {self.dir}/{entry['file']} answered: the "
                                 "input changed since; use a new --output")
            if seen is not None:
                for cid in entry["custom_ids"]:
                    if cid is not None:
                        seen.add(cid)
            self.totals.add_entry(entry)
            self.next_part = entry["part"] + 1
            self.run = max(self.run, entry["run"] + 1)

    def commit(self, entries: list[tuple[int, bytes, object]], end_line: int,
               seconds: float) -> dict:
        """Commits the results of input lines [start_line, end_line): `entries` are this shard's
        (line, digest, Result or Blank) among them, in line order."""
        results = [(line, digest, r) for line, digest, r in entries if isinstance(r, Result)]
        errors = collections.Counter(r.error_kind for _, _, r in results if r.error_kind)
        input_digest = hashlib.sha256(b"".join(d for _, d, _ in results)).hexdigest()
        data = "".join(r.record + "\n" for _, _, r in results).encode("utf-8")
        name = f"part-{self.next_part:06d}.jsonl"
        entry = {"part": self.next_part, "file": name, "first_line": self.start_line,
                 "end_line": end_line, "lines": [line for line, _, _ in results],
                 "custom_ids": [r.custom_id for _, _, r in results],
                 "sha256": hashlib.sha256(data).hexdigest(), "input_digest": input_digest,
                 "records": len(results), "succeeded": len(results) - sum(errors.values()),
                 "errors": dict(errors),
                 "blank_lines": sum(isinstance(r, Blank) for _, _, r in entries),
                 "prompt_tokens": sum(r.prompt_tokens for _, _, r in results),
                 "completion_tokens": sum(r.completion_tokens for _, _, r in results),
                 "seconds": round(seconds, 4), "run": self.run}
        if self.writer:
            write_atomic(os.path.join(self.dir, name), data)
            manifest = os.path.join(self.dir, MANIFEST)
            created = not os.path.exists(manifest)
            with open(manifest, "ab") as f:
                f.write(json.dumps(entry).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            if created:  # the file's own fsync does not make its name durable
                fsync_dir(self.dir)
        self.totals.add_entry(entry)
        self.next_part += 1
        self.start_line = end_line
        return entry

    def finish(self, max_lines: Optional[int]) -> dict:
        """Marks the shard complete: its summary.json."""
        summary = {"shard_index": self.shard_index, "num_shards": self.num_shards,
                   "lines": self.start_line, "max_lines": max_lines, **self.totals.summary(),
                   "parts": self.next_part, "max_rss_mb": round(max_rss_mb(), 1)}
        if self.writer:
            write_atomic(os.path.join(self.dir, SUMMARY),
                         json.dumps(summary, indent=1).encode())
        return summary


def _compared(fingerprint: dict) -> dict:
    """What must match between runs: the model by its content digest, not by its name (a copy
    at another path, or the alias of the same file, is the same model)."""
    model = fingerprint.get("model")
    if isinstance(model, dict):
        return {**fingerprint, "model": {"sha256": model.get("sha256")}}
    return fingerprint


def check_same_settings(recorded: dict, current: dict, where: str) -> None:
    """ValueError naming each setting that differs from the one `where` was produced with."""
    a, b = _compared(recorded), _compared(current)
    if a == b:
        return
    diffs = [f"{k} was {recorded.get(k)!r}, now {current.get(k)!r}"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    raise ValueError(f"{where} holds output of a job with other settings ({'; '.join(diffs)}): "
                     "rerun with the same flags, or use a new --output")
