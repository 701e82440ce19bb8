"""launch/slurm_pretrain.sbatch on a real one-node Slurm cluster (launch/local_slurm.sh; .ci/run starts one):
sbatch -> srun -> two tasks that start jax.distributed from the real step's environment and train like one process;
a TERM to the job's steps -> both tasks save the same step -> the script requeues the job -> it resumes and ends
with the uninterrupted job's weights; a stopped (SIGSTOP) task -> the other aborts on the heartbeat timeout and the
job fails long before its time limit. Skipped only when no cluster answers `sinfo`, and never under CI=true."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import ROOT, apply_flags, subprocess_env
from test_multiprocess import _losses

from glm46_jax.parallel import sharding
from glm46_jax.training import checkpoint

LOCAL_SLURM = os.path.join(ROOT, "launch", "local_slurm.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm_pretrain.sbatch")
STEPS, EVERY, HEARTBEAT_S = 8, 3, 10

pytestmark = pytest.mark.slow


def _conf() -> str:
    return os.environ.get("SLURM_CONF") or subprocess.run(["bash", LOCAL_SLURM, "conf"], capture_output=True,
                                                          text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def slurm_env():
    """The environment every Slurm command here gets: the cluster's SLURM_CONF (launch/local_slurm.sh's unless
    set). No cluster: skip, saying how to start one, except in CI, where the cluster is part of the run."""
    env = {**os.environ, "SLURM_CONF": _conf()}
    try:
        answered = shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], env=env, capture_output=True,
                                                            timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        answered = False
    if not answered:
        _unavailable(f"no Slurm cluster answers sinfo (SLURM_CONF={env['SLURM_CONF']}): start one with "
                     "launch/local_slurm.sh start (.ci/run does that before the tests)")
    return env


def _unavailable(why: str):
    """Skip, saying why, outside CI; in CI (.ci/run sets CI=true) the cluster is part of the run, so fail."""
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def _run(cmd: list[str], env: dict, **kw) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)
    assert out.returncode == 0, f"{cmd}: {out.stdout}{out.stderr}"
    return out.stdout


def _flags(heartbeat_s: int = 100) -> list[str]:
    # 8 steps of 8 x 64 rows on data=4: 2 tasks x 2 CPU devices (data only: Gloo's collectives between the tasks
    # are what a step waits on here). Every process reads the whole batch (process_split=rows), so the tasks see
    # the batches one process sees.
    return ["--config.mesh.data=4", "--config.data.process_split=rows",
            "--config.data.phases.general.tokens=4096", "--config.data.phases.general.seq_len=64",
            "--config.data.phases.general.global_batch=8", f"--config.train.steps={STEPS}",
            "--config.train.log_every=1",
            "--config.train.eval_every=100", "--config.train.eval_batches=1", f"--config.checkpoint.every={EVERY}",
            f"--config.optim.decay_steps={STEPS}", "--config.optim.warmup_steps=2",
            f"--config.distributed.heartbeat_timeout_s={heartbeat_s}"]


def _submit(slurm_env: dict, run_dir: str, corpus: str, heartbeat_s: int = 100) -> str:
    """The launcher as a user submits it on a CPU node: 2 tasks on the one node, no GPUs, the tiny preset; only
    environment and sbatch options override the script's GPU defaults."""
    env = {**subprocess_env(2), "SLURM_CONF": slurm_env["SLURM_CONF"], "GPUS_PER_TASK": "0",
           "CONFIG": "configs/pretrain.py:tiny", "RUN_DIR": run_dir, "DATA_ROOT": corpus, "PYTHON": sys.executable,
           "REPO": ROOT}
    os.makedirs(run_dir, exist_ok=True)
    out = _run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                "--time=15", f"--output={run_dir}/slurm-%j.out", SBATCH, *_flags(heartbeat_s)], env, cwd=ROOT)
    return out.strip().split(";")[0]


def _job(job: str, env: dict) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
    text = _run(["scontrol", "show", "job", "-o", job], env)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _log(run_dir: str, job: str) -> str:
    path = os.path.join(run_dir, f"slurm-{job}.out")
    return open(path).read() if os.path.exists(path) else ""


def _wait(predicate, what: str, run_dir: str, job: str, timeout: float = 600):
    t0 = time.time()
    while not predicate():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}:\n{_log(run_dir, job)[-4000:]}"
        time.sleep(0.2)


def _final(job: str, env: dict, run_dir: str, timeout: float = 600) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    _wait(lambda: _job(job, env)["JobState"] in ended, f"job {job} to end", run_dir, job, timeout)
    return _job(job, env)


def _params(run_dir: str) -> list[np.ndarray]:
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, _, params, buffers = checkpoint.load_params(os.path.join(run_dir, "checkpoints", str(STEPS)), mesh)
    return [np.asarray(x) for x in jax.tree.leaves((params, buffers))]


def _task_pid(job: str, rank: int) -> int | None:
    """The pid of the job's task `rank` (srun's SLURM_PROCID in the process's environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"SLURM_PROCID") == str(rank).encode()
                and b"glm46_jax.train" in cmd):
            return int(pid)
    return None


@pytest.fixture(scope="module")
def straight(slurm_env, sample_corpus, tmp_path_factory):
    """The uninterrupted 2-task job, the reference of the preemption test."""
    run_dir = str(tmp_path_factory.mktemp("slurm_straight"))
    job = _submit(slurm_env, run_dir, sample_corpus)
    return run_dir, job, _final(job, slurm_env, run_dir)


def test_two_tasks_train_like_one_process(straight, sample_corpus, tmp_path):
    """srun's two tasks (jax.distributed from the real step's SLURM_* variables) give the one-process losses."""
    run_dir, job, state = straight
    log = _log(run_dir, job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log[-4000:]
    assert f"job {job}: 1 nodes" in log and "2 tasks" in log
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "complete"
    from glm46_jax.run_config import config_file, from_config_dict
    from glm46_jax.train import train

    one = str(tmp_path / "one_process")  # the same flags in this process, on 4 of its CPU devices
    config = config_file(os.path.join(ROOT, "configs", "pretrain.py"), "tiny")
    with config.unlocked():
        config.run_dir, config.data.root = one, sample_corpus
        apply_flags(config, _flags())
    train(from_config_dict(config), jax.devices()[:4])
    want, got = _losses(one), _losses(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6, atol=0)


def test_term_to_the_steps_saves_requeues_and_resumes_exactly(straight, slurm_env, sample_corpus, tmp_path):
    """`scancel --signal=TERM` (to the job's steps, not the batch shell: what --signal=TERM@120 delivers) ->
    both tasks save one step and exit 0 -> status.json "stopped" -> the script requeues the job -> it resumes
    from that step and ends with the uninterrupted job's weights, bit for bit."""
    run_dir = str(tmp_path / "preempted")
    job = _submit(slurm_env, run_dir, sample_corpus)
    _wait(lambda: max(_losses(run_dir), default=0) >= 2, "step 2", run_dir, job)
    _run(["scancel", "--signal=TERM", job], slurm_env)
    state = _final(job, slurm_env, run_dir)
    log = _log(run_dir, job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, log[-4000:])
    stopped = re.search(r"saved step (\d+) and stopping", log)
    assert stopped and 2 <= int(stopped.group(1)) < STEPS, log[-4000:]
    assert f"requeueing job {job}" in log and "restart count 1" in log
    assert f"steps {int(stopped.group(1)) + 1}-{STEPS} of {STEPS}" in log
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "complete"
    assert _losses(run_dir) == _losses(straight[0])
    for a, b in zip(_params(straight[0]), _params(run_dir), strict=True):
        np.testing.assert_array_equal(b, a)


def test_a_stopped_task_fails_the_job_within_the_heartbeat_timeout(slurm_env, sample_corpus, tmp_path):
    """SIGSTOP of task 1 (hung, not dead: srun sees nothing) -> task 0 aborts when its heartbeats go unanswered ->
    --kill-on-bad-exit ends the step -> the job FAILs with the reason in its log, minutes before its time limit."""
    run_dir = str(tmp_path / "hung")
    job = _submit(slurm_env, run_dir, sample_corpus, heartbeat_s=HEARTBEAT_S)
    _wait(lambda: max(_losses(run_dir), default=0) >= 2, "step 2", run_dir, job)
    pid = _task_pid(job, 1)
    assert pid, "task 1's process not found"
    os.kill(pid, 19)  # SIGSTOP
    stopped_at = time.time()
    state = _final(job, slurm_env, run_dir, timeout=HEARTBEAT_S + 120)
    took = time.time() - stopped_at
    log = _log(run_dir, job)
    assert state["JobState"] == "FAILED", (state, log[-4000:])
    assert took < HEARTBEAT_S + 60, (took, log[-4000:])
    print(f"\ntask 1 stopped at step {max(_losses(run_dir))}: job {job} FAILED {took:.1f} s later "
          f"(heartbeat timeout {HEARTBEAT_S} s)")
    assert "detected fatal errors" in log and "another task died" in log, log[-4000:]  # JAX's abort, not a time limit
    assert "DUE TO TIME LIMIT" not in log


def test_the_cluster_script_starts_idempotently_and_stops_without_leftovers(slurm_env):
    """`start` on a running cluster changes nothing; `stop` leaves no daemon; `start` brings it back."""
    def alive(pid: str) -> bool:  # not a zombie (an exited daemon's entry until its parent reaps it)
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def daemons():  # pids per name (pgrep matches at most 15 characters of a name, so one name per call)
        return {name: [p for p in subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout.split()
                       if alive(p)] for name in ("slurmctld", "slurmd", "munged", "slurmstepd")}

    if os.geteuid() != 0 and not (shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"]).returncode == 0):
        _unavailable("launch/local_slurm.sh start/stop need root or passwordless sudo")
    env = {**os.environ, "SLURM_LOCAL_DIR": os.path.dirname(slurm_env["SLURM_CONF"])}
    before = daemons()
    assert all(before[name] for name in ("slurmctld", "slurmd", "munged")), before
    out = _run(["bash", LOCAL_SLURM, "start"], env)
    assert "already running" in out and daemons() == before
    try:
        _run(["bash", LOCAL_SLURM, "stop"], env)
        assert not any(daemons().values()), daemons()
        assert subprocess.run(["bash", LOCAL_SLURM, "status"], env=env, capture_output=True).returncode == 1
    finally:
        _run(["bash", LOCAL_SLURM, "start"], env)
    assert subprocess.run(["sinfo", "-h"], env=slurm_env, capture_output=True).returncode == 0
