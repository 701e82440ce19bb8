"""`python -m data_prep pipeline` on datatrove's other executors and on an object store, each compared byte for byte
with the same command on the local executor (one worker): the Slurm executor on the one-node cluster of
launch/local_slurm.sh (array jobs, sbatch -> srun -> launch_pickled_pipeline in this venv), the Ray executor on a Ray
cluster this file starts (`ray start --head`, found through RAY_ADDRESS), and `--out s3://...` (intermediates there
too) on moto's S3 server. The dataset is metadata.json, tokenizer.json and the shards: everything but `_work/`.

A missing cluster, ray or moto skips outside CI and fails in CI (CI=true), where they are part of the run."""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import ROOT, unavailable
from test_data_prep import _vocab, all_files, prose

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)  # this venv's console scripts (ray, launch_pickled_pipeline)
# A 300-token BPE and ~10 KB shards: 10 train shards from the 120 documents. 16 MinHash permutations (5 LSH bands,
# so 5 bucket tasks instead of 15) keep the Slurm and Ray runs short: their time is mostly one process per task.
FLAGS = ["--vocab-size", "300", "--shard-size-mb", "0.01", "--num-perm", "16"]
# Only a guard against a hung run, never a speed check: the Slurm run is 12 jobs, each a fresh Python importing
# datatrove, and beside the RLHF round's -O2 process on a busy 2-core CI host it took over 300 s (35 s alone).
TIMEOUT_S = 1200


def _require(*modules: str):
    if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
        unavailable(f"{', '.join(missing)} not installed: pip install -e .[dev,data,ray]")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace_s: float = 60):
    """TERM to the process this file started, then KILL to its process group (start_new_session) if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --- the corpus and the reference run -------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """3 JSONL files x 40 documents, with one exact and one near duplicate planted across files."""
    rng = np.random.default_rng(0)
    vocab = _vocab(rng)
    docs = [prose(rng, vocab, int(rng.integers(80, 200))) for _ in range(120)]
    docs[50] = docs[3]  # exact, file 1 of file 0's
    docs[90] = docs[10] + " And one more."  # near, file 2 of file 0's
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (root / f"part{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[40 * i:40 * i + 40]))
    return str(root)


def _pipeline(corpus: str, out: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, from the checkout (the tasks import data_prep from it: PYTHONPATH)."""
    cmd = [sys.executable, "-m", "data_prep", "pipeline", "--input", f"prose={corpus}", "--out", out, *FLAGS, *flags]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, bytes]:
    out = str(tmp_path_factory.mktemp("reference") / "ds")
    _pipeline(corpus, out, "--executor", "local", "--workers", "1")
    files = all_files(out)
    meta = json.loads(files["metadata.json"])
    prose = meta["domains"]["prose"]
    assert len(prose["train"]["shards"]) >= 5 and prose["heldout"]["documents"] > 0
    assert prose["dedup"]["exact_duplicates"] == 1 and prose["dedup"]["near_duplicates"] == 1
    assert meta["stale_shards"] == []
    assert set(files) == {"metadata.json", "tokenizer.json", *prose["train"]["shards"], *prose["heldout"]["shards"]}
    return files


def assert_same_dataset(got: dict[str, bytes], want: dict[str, bytes]):
    assert sorted(got) == sorted(want)
    assert [name for name in sorted(want) if got[name] != want[name]] == []


# --- Slurm -------------------------------------------------------------------------------------------

def _default_partition(env: dict[str, str]) -> str:
    names = subprocess.run(["sinfo", "-h", "-o", "%P"], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    return next((n.rstrip("*") for n in names if n.endswith("*")), names[0])


def test_slurm_executor_writes_the_local_dataset(slurm_env, corpus, reference, tmp_path):
    """One array job per stage (afterok on the one before) through sbatch -> srun -> launch_pickled_pipeline in
    this venv; --wait returns when the last ended. --mem-per-cpu-gb 0.5: a fraction sbatch only takes in MiB.
    The same command again submits only the finalize job (the rest is complete) and writes the same bytes."""
    out = str(tmp_path / "ds")
    flags = ["--executor", "slurm", "--wait", "--partition", _default_partition(slurm_env), "--time", "00:10:00",
             "--cpus-per-task", "1", "--mem-per-cpu-gb", "0.5"]
    _pipeline(corpus, out, *flags, env={"SLURM_CONF": slurm_env["SLURM_CONF"]})
    assert_same_dataset(all_files(out), reference)
    (work,) = os.listdir(os.path.join(out, "_work"))
    for stage in ("prepare", "buckets", "dedup", "tokenize", "write", "finalize"):  # each ran as a Slurm job
        logs = os.path.join(out, "_work", work, "slurm_logs", stage)
        assert os.path.isdir(logs) and os.listdir(logs), f"no Slurm log of stage {stage} in {logs}"
        # <job id>_<task>.out: the stage's array job, then datatrove's stats-merging job; by number, not by text
        # (on a new cluster the ids cross 9 -> 10 mid-run, and "10_0.out" < "9_0.out")
        first = min(os.listdir(logs), key=lambda n: [int(x) for x in n.removesuffix(".out").split("_")])
        with open(os.path.join(logs, first)) as f:
            assert "launch_pickled_pipeline" in f.read()

    again = _pipeline(corpus, out, *flags, env={"SLURM_CONF": slurm_env["SLURM_CONF"]})
    assert "skipped: prepare 3, buckets 5, dedup 1, tokenize 3, write 3;" in again.stdout, again.stdout
    assert_same_dataset(all_files(out), reference)


# --- Ray ---------------------------------------------------------------------------------------------

@pytest.fixture
def ray_address():
    """A one-node Ray cluster (4 logical CPUs, 100 MB object store): `ray start --head --block` in
    its own session, stopped by TERM (it then ends every Ray process it started; no draining wait) and, should it
    hang, KILL to its process group. Not `ray stop`: that stops every Ray cluster on the machine."""
    _require("ray")
    ray_cli = os.path.join(BIN, "ray")
    if not os.path.exists(ray_cli):
        unavailable(f"no ray command next to {sys.executable}")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray_")  # short: Ray's socket paths under it must fit in 107 characters
    log_path = os.path.join(temp, "start.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", "--port", str(port), "--num-cpus", "4",
             "--object-store-memory", "100000000", "--include-dashboard=false", "--disable-usage-stats",
             "--temp-dir", temp], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": ROOT, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        t0 = time.time()
        while "Ray runtime started" not in (started := _read(log_path)):
            assert proc.poll() is None and time.time() - t0 < 120, f"ray start:\n{started[-4000:]}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_executor_writes_the_local_dataset(ray_address, corpus, reference, tmp_path):
    out = str(tmp_path / "ds")
    proc = _pipeline(corpus, out, "--executor", "ray", "--workers", "4", env={"RAY_ADDRESS": ray_address})
    assert "Connecting to existing Ray cluster" in proc.stderr  # this file's cluster, not one the CLI started
    assert_same_dataset(all_files(out), reference)


# --- S3 (moto) ----------------------------------------------------------------------------------------

@pytest.fixture
def s3_env():
    """moto's S3 server on 127.0.0.1 and the environment that points boto3 and s3fs at it: botocore (under s3fs's
    aiobotocore too) reads the endpoint from AWS_ENDPOINT_URL."""
    _require("moto", "boto3", "s3fs")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.time()
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.time() - t0 < 60, "moto's server did not start"
            time.sleep(0.1)
        yield {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    finally:
        _stop(proc, grace_s=10)


def test_s3_input_and_output_give_the_local_dataset(s3_env, corpus, reference, tmp_path):
    """--input s3://bucket/corpus (a directory of objects) and --out s3://bucket/ds with the intermediates under it
    (the default --work): the objects are the local files (metadata.json too, but for the input spec it records),
    and the repo's loader reads the downloaded shards."""
    import boto3

    from glm46_jax.data.loader import LoaderConfig, domain_documents

    s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="bucket")
    for name in sorted(os.listdir(corpus)):
        s3.upload_file(os.path.join(corpus, name), "bucket", f"corpus/{name}")
    s3.put_object(Bucket="bucket", Key="corpus/.hidden.jsonl", Body=b"not read: hidden")
    remote = dict(reference)
    meta = json.loads(remote["metadata.json"])
    meta["config"]["ingest"]["inputs"] = [["prose", "s3://bucket/corpus"]]
    remote["metadata.json"] = (json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()

    _pipeline("s3://bucket/corpus", "s3://bucket/ds", "--executor", "local", "--workers", "1", env=s3_env)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bucket", Prefix="ds/")
            for o in page.get("Contents", [])]
    assert any(k.startswith("ds/_work/") and "/logs/finalize/" in k for k in keys)  # intermediates in the bucket
    assert not os.path.exists(os.path.join(ROOT, "s3:"))  # nor in a local folder named after the URL
    got = {k.removeprefix("ds/"): s3.get_object(Bucket="bucket", Key=k)["Body"].read()
           for k in keys if not k.startswith("ds/_work/")}
    assert_same_dataset(got, remote)

    root = tmp_path / "downloaded"
    for name, data in got.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    meta = json.loads(got["metadata.json"])
    for split in ("train", "heldout"):
        cfg = LoaderConfig(str(root), split=split, num_epochs=1, process_index=0, process_count=1)
        docs = list(domain_documents(cfg, "prose"))  # decodes every record: int32 ids < vocab, ending in eos
        want = meta["domains"]["prose"][split]
        assert (len(docs), sum(len(d["tokens"]) for d in docs)) == (want["documents"], want["tokens"])
