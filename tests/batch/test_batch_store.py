"""Commits, resume and merge of a batch job's output directory, with stand-in results (no
model): what is committed survives, what is not is redone, merge refuses broken shard sets."""

import json
import os
import shutil

import pytest
from batch_util import line, load_output, strip_ids, write_lines

from jaxinfer.batch import JobSpec, merge, records
from jaxinfer.batch.inputs import IdSet, ShardReader, Work, read_lines
from jaxinfer.batch.job import OrderedCommits
from jaxinfer.batch.store import MANIFEST, ShardStore

FP = {"model": "m", "format": "jsonl"}


class Crash(Exception):
    pass


def stand_in(item):
    """A Work's result without a model: a body naming the request."""
    if not isinstance(item, Work):
        return item
    body = {"id": "cmpl-x", "answer": item.request.prompt,
            "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    return records.success(item.line, item.custom_id, body)


def run_shard(out, path, n=1, i=0, crash_after=None, fp=FP, commit_every=3):
    """Runs a shard with stand-in results; raises Crash after `crash_after` commits."""
    store = ShardStore(out, i, n, fp, path)
    seen, lines = IdSet(), read_lines(path)
    store.resume(lines, seen)
    reader = ShardReader(lines, "jsonl", None, n, i, seen, None, store.start_line)
    commits = []

    def on_commit(entry):
        commits.append(entry)
        if crash_after is not None and len(commits) >= crash_after:
            raise Crash

    order = OrderedCommits(store, JobSpec(path, out, {"model": "m"}, commit_every=commit_every),
                           on_commit=on_commit)
    pending = []
    for no, digest, item in reader:  # results arrive late and in pairs swapped
        pending.append((order.push(no, digest), stand_in(item)))
        if len(pending) == 3:
            for entry, result in (pending.pop(1), pending.pop(0)):
                order.fulfill(entry, result)
        order.maybe_commit(reader.position)
    for entry, result in pending:
        order.fulfill(entry, result)
    order.maybe_commit(reader.position, final=True)
    store.finish(None)
    return store


@pytest.fixture
def input_file(tmp_path):
    lines = [line(f"id{i}", {"prompt": f"p{i}"}) for i in range(40)]
    lines[7], lines[12], lines[20] = "{broken", "", line("id3", {"prompt": "again"})
    return write_lines(tmp_path / "in.jsonl", lines)


def merged(out):
    merge(str(out))
    return [strip_ids(r) for r in load_output(out / "output.jsonl")]


def test_crash_then_resume_equals_an_uninterrupted_run(tmp_path, input_file):
    want_dir, out = tmp_path / "want", tmp_path / "out"
    run_shard(str(want_dir), input_file)
    want = merged(want_dir)
    assert len(want) == 39  # one blank line
    assert [r["custom_id"] for r in want[:3]] == ["id0", "id1", "id2"]
    with pytest.raises(Crash):
        run_shard(str(out), input_file, crash_after=2)
    shard = out / "shard-00000-of-00001"
    committed = [strip_ids(r) for k in (0, 1) for r in load_output(shard / f"part-00000{k}.jsonl")]
    assert len(committed) >= 6 and committed == want[:len(committed)]  # two parts of 3+ lines
    assert len(open(shard / MANIFEST).readlines()) == 2
    run_shard(str(out), input_file)
    assert merged(out) == want
    entries = [json.loads(x) for x in open(shard / MANIFEST)]
    lines = [n for e in entries for n in e["lines"]]
    assert lines == sorted(set(lines)) and {e["run"] for e in entries} == {1, 2}
    summary = json.load(open(out / "summary.json"))
    assert summary["runs"] == 2 and summary["requests"] == 39
    assert summary["errors_by_kind"] == {"duplicate_custom_id": 1, "invalid_json": 1}
    assert summary["blank_lines"] == 1 and summary["completion_tokens"] == 37 * 3


def test_a_torn_manifest_line_an_orphan_part_and_temp_files_are_redone(tmp_path, input_file):
    out = tmp_path / "out"
    with pytest.raises(Crash):
        run_shard(str(out), input_file, crash_after=3)
    shard = out / "shard-00000-of-00001"
    with open(shard / MANIFEST, "ab") as f:
        f.write(b'{"part": 3, "file": "part-0000')  # a kill while appending
    (shard / "part-000003.jsonl").write_text("half a part\n")  # renamed, never committed
    (shard / "part-000004.jsonl.123.tmp").write_text("x")
    run_shard(str(out), input_file)
    assert not list(shard.glob("*.tmp"))
    want_dir = tmp_path / "want"
    run_shard(str(want_dir), input_file)
    assert merged(out) == merged(want_dir)


def test_changed_input_settings_or_parts_are_refused(tmp_path, input_file):
    out = tmp_path / "out"
    with pytest.raises(Crash):
        run_shard(str(out), input_file, crash_after=2)
    with pytest.raises(ValueError, match=r"other settings \(model was 'm', now 'm2'\)"):
        run_shard(str(out), input_file, fp={"model": "m2", "format": "jsonl"})
    text = open(input_file).read().replace('"p1"', '"P1"')
    changed = write_lines(tmp_path / "changed.jsonl", text.splitlines())
    with pytest.raises(ValueError, match=r"input lines 1-\d+ differ from .*part-000000"):
        run_shard(str(out), changed)
    part = out / "shard-00000-of-00001" / "part-000001.jsonl"
    part.write_text(part.read_text().replace("p4", "p5"))
    with pytest.raises(ValueError, match="does not match its manifest"):
        run_shard(str(out), input_file)


def test_merge_joins_shards_in_input_order(tmp_path, input_file):
    run_shard(str(tmp_path / "one"), input_file)
    for i in range(3):
        run_shard(str(tmp_path / "three"), input_file, n=3, i=i)
    assert merged(tmp_path / "three") == merged(tmp_path / "one")
    summary = json.load(open(tmp_path / "three" / "summary.json"))
    assert summary["shards"] == 3 and summary["requests"] == 39


def test_merge_detects_missing_duplicated_and_unfinished_shards(tmp_path, input_file):
    out = tmp_path / "out"
    for i in range(3):
        run_shard(str(out), input_file, n=3, i=i)
    shard = [out / f"shard-0000{i}-of-00003" for i in range(3)]

    shutil.move(shard[2], tmp_path / "aside")
    with pytest.raises(ValueError, match="missing shard 2 of 3"):
        merge(str(out))
    shutil.copytree(shard[0], shard[2])  # a copy under another shard's name
    with pytest.raises(ValueError, match="duplicated shard: shard-00002-of-00003 holds the "
                                         "output of shard-00000-of-00003"):
        merge(str(out))
    job = json.load(open(shard[2] / "job.json"))
    job["shard_index"] = 2  # even relabelled, its lines are shard 0's
    (shard[2] / "job.json").write_text(json.dumps(job))
    with pytest.raises(ValueError, match="is answered twice .*duplicated shard"):
        merge(str(out))
    shutil.rmtree(shard[2])
    shutil.move(tmp_path / "aside", shard[2])
    os.remove(shard[1] / "summary.json")
    with pytest.raises(ValueError, match="shard 1 of 3 is not finished"):
        merge(str(out))
    run_shard(str(out), input_file, n=3, i=1)  # resumes: nothing left but the summary
    run_shard(str(out), input_file, n=1, i=0)
    with pytest.raises(ValueError, match="shards of --num_shards 1 and 3"):
        merge(str(out))
    shutil.rmtree(out / "shard-00000-of-00001")
    assert merge(str(out))["requests"] == 39


def test_merge_from_the_command_line(tmp_path, input_file):
    import subprocess
    import sys

    out = tmp_path / "out"
    run_shard(str(out), input_file, n=2, i=0)
    r = subprocess.run([sys.executable, "-m", "jaxinfer.launch.batch", "--merge", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "error: missing shard 1 of 2" in r.stderr, r.stderr
    run_shard(str(out), input_file, n=2, i=1)
    r = subprocess.run([sys.executable, "-m", "jaxinfer.launch.batch", "--merge", str(out),
                        "--fail_on_error"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "2 line(s) got an error record" in r.stderr, r.stderr
    assert r.stdout.startswith("batch: 39 requests, 37 ok, 2 failed (1 duplicate_custom_id, "
                               "1 invalid_json); 111 output tokens in ") and str(out) in r.stdout


def test_a_second_run_on_a_directory_in_use_is_refused_at_once(tmp_path, input_file):
    import subprocess
    import sys

    from batch_util import MODEL_FLAGS, ROOT

    from jaxinfer.batch.store import DirectoryInUse, dir_lock, shard_lock

    out = tmp_path / "out"
    shard = out / "shard-00000-of-00001"
    command = [sys.executable, "-m", "jaxinfer.launch.batch", "--progress=false"]
    with shard_lock(str(out), 0, 1):  # what a run holds, from start to end
        assert (shard / "lock").read_text() == f"{os.getpid()}\n"
        r = subprocess.run([*command, "--input", input_file, "--output", str(out),
                            *MODEL_FLAGS], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 1, r.stderr
        assert f"error: {shard} is in use by another run (pid {os.getpid()})" in r.stderr
        assert "loaded" not in r.stderr  # refused before the model loads
        r = subprocess.run([*command, "--merge", str(out)], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        assert r.returncode == 1 and f"{shard} is in use by another run" in r.stderr, r.stderr
        with dir_lock(str(shard)):  # reentrant in the process that holds it
            pass
    run_shard(str(out), input_file)
    with shard_lock(str(out), 0, 1):
        merge(str(out))  # a one-shard run merges while it holds its lock
    fd = os.open(shard / "lock", os.O_RDWR)  # another open file: as another process sees it
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: free for the next run
        with pytest.raises(DirectoryInUse, match="in use by another run"):
            merge(str(out))
    finally:
        os.close(fd)


def test_merge_refuses_to_overwrite_files_it_did_not_write(tmp_path, input_file):
    out = tmp_path / "out"
    run_shard(str(out), input_file)
    first = merge(str(out))
    data = (out / "output.jsonl").read_bytes()
    import hashlib

    assert first["output_sha256"] == hashlib.sha256(data).hexdigest()
    assert merge(str(out))["output_sha256"] == first["output_sha256"]  # idempotent
    assert (out / "output.jsonl").read_bytes() == data
    (out / "output.jsonl").write_bytes(data + b"{}\n")  # edited by hand
    with pytest.raises(ValueError, match=f"{out}/output.jsonl exists and was not written by a "
                                         "merge of this job"):
        merge(str(out))
    assert (out / "output.jsonl").read_bytes() == data + b"{}\n"
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    os.remove(out / "output.jsonl")
    merge(str(out))  # its own summary.json, no output: written again
    os.remove(out / "summary.json")  # as after a kill between the two renames
    assert merge(str(out))["requests"] == 39 and (out / "output.jsonl").read_bytes() == data
    (out / "summary.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match=f"{out}/summary.json exists and was not written"):
        merge(str(out))
    os.remove(out / "summary.json")
    (out / "output.jsonl").write_text("my own file\n")
    with pytest.raises(ValueError, match="output.jsonl exists and was not written"):
        merge(str(out))


def test_the_manifest_is_made_durable_when_created(tmp_path, input_file, monkeypatch):
    from jaxinfer.batch import store

    synced = []
    real = store.fsync_dir
    manifest = tmp_path / "out" / "shard-00000-of-00001" / MANIFEST

    def spy(path):
        synced.append((path, manifest.exists()))
        real(path)

    monkeypatch.setattr(store, "fsync_dir", spy)
    shard = ShardStore(str(tmp_path / "out"), 0, 1, FP, input_file)
    assert (shard.dir, False) in synced  # job.json's rename, and the directory's creation
    assert (str(tmp_path / "out"), False) in synced
    synced.clear()
    shard.commit([(0, b"d" * 16, records.line_error(0, "a", "invalid_json", "x"))], 1, 0.1)
    assert synced[-1] == (shard.dir, True)
