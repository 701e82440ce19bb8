"""launch/slurm_pretrain.sbatch on a real one-node Slurm cluster (launch/local_slurm.sh; .ci/run starts one):
sbatch -> srun -> two tasks that start jax.distributed from the real step's environment and train like one process;
a TERM to the job's steps -> both tasks save the same step -> the script requeues the job -> it resumes and ends
with the uninterrupted job's weights; a stopped (SIGSTOP) task -> the other aborts on the heartbeat timeout and the
job fails long before its time limit; a task that hangs (injected: GLM46_FAULTS) -> the watchdogs end the run as
"hung" -> the script requeues the job once -> it resumes and ends like the uninterrupted job, while a real Prometheus
scrapes both tasks through the job's service-discovery file. Skipped only when no cluster answers `sinfo`, and never
under CI=true."""

import fcntl
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import PLUMBING_MODEL, ROOT, apply_flags, cluster_lock_fd, run_losses, subprocess_env, unavailable
from promserver import prometheus

from glm46_jax.parallel import sharding
from glm46_jax.training import checkpoint

LOCAL_SLURM = os.path.join(ROOT, "launch", "local_slurm.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm_pretrain.sbatch")
STEPS, EVERY, HEARTBEAT_S = 8, 3, 10

pytestmark = pytest.mark.slow


def _run(cmd: list[str], env: dict, **kw) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)
    assert out.returncode == 0, f"{cmd}: {out.stdout}{out.stderr}"
    return out.stdout


def _flags(heartbeat_s: int = 100) -> list[str]:
    # 8 steps of 8 x 64 rows on data=4: 2 tasks x 2 CPU devices (data only: Gloo's collectives between the tasks
    # are what a step waits on here). Every process reads the whole batch (process_split=rows), so the tasks see
    # the batches one process sees.
    return [*PLUMBING_MODEL, "--config.mesh.data=4", "--config.data.process_split=rows",
            "--config.data.phases.general.tokens=4096", "--config.data.phases.general.seq_len=64",
            "--config.data.phases.general.global_batch=8", f"--config.train.steps={STEPS}",
            "--config.train.log_every=1",
            "--config.train.eval_every=100", "--config.train.eval_batches=1", f"--config.checkpoint.every={EVERY}",
            f"--config.optim.decay_steps={STEPS}", "--config.optim.warmup_steps=2",
            f"--config.distributed.heartbeat_timeout_s={heartbeat_s}"]


def _submit(slurm_env: dict, run_dir: str, corpus: str, heartbeat_s: int = 100, env: dict | None = None,
            flags: tuple[str, ...] = ()) -> str:
    """The launcher as a user submits it on a CPU node: 2 tasks on the one node, no GPUs, the tiny preset; only
    environment and sbatch options override the script's GPU defaults. No Prometheus exporter unless `env` sets
    METRICS_PORT (a fixed port could be taken, and the exporter lingers after the run); `env` and `flags` (after
    the script's own, so they win) are a test's extras."""
    env = {**subprocess_env(2), "SLURM_CONF": slurm_env["SLURM_CONF"], "GPUS_PER_TASK": "0",
           "CONFIG": "configs/pretrain.py:tiny", "RUN_DIR": run_dir, "DATA_ROOT": corpus, "PYTHON": sys.executable,
           "REPO": ROOT, "METRICS_PORT": "", **(env or {})}
    os.makedirs(run_dir, exist_ok=True)
    out = _run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                "--time=15", f"--output={run_dir}/slurm-%j.out", SBATCH, *_flags(heartbeat_s), *flags], env, cwd=ROOT)
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
    want, got = run_losses(one), run_losses(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6, atol=0)


def test_term_to_the_steps_saves_requeues_and_resumes_exactly(straight, slurm_env, sample_corpus, tmp_path):
    """`scancel --signal=TERM` (to the job's steps, not the batch shell: what --signal=TERM@120 delivers) ->
    both tasks save one step and exit 0 -> status.json "stopped" -> the script requeues the job -> it resumes
    from that step and ends with the uninterrupted job's weights, bit for bit."""
    run_dir = str(tmp_path / "preempted")
    job = _submit(slurm_env, run_dir, sample_corpus)
    _wait(lambda: max(run_losses(run_dir), default=0) >= 2, "step 2", run_dir, job)
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
    assert run_losses(run_dir) == run_losses(straight[0])
    for a, b in zip(_params(straight[0]), _params(run_dir), strict=True):
        np.testing.assert_array_equal(b, a)


def test_a_stopped_task_fails_the_job_within_the_heartbeat_timeout(slurm_env, sample_corpus, tmp_path):
    """SIGSTOP of task 1 (hung, not dead: srun sees nothing) -> task 0 aborts when its heartbeats go unanswered ->
    --kill-on-bad-exit ends the step -> the job FAILs with the reason in its log, minutes before its time limit."""
    run_dir = str(tmp_path / "hung")
    job = _submit(slurm_env, run_dir, sample_corpus, heartbeat_s=HEARTBEAT_S)
    _wait(lambda: max(run_losses(run_dir), default=0) >= 2, "step 2", run_dir, job)
    pid = _task_pid(job, 1)
    assert pid, "task 1's process not found"
    os.kill(pid, 19)  # SIGSTOP
    stopped_at = time.time()
    state = _final(job, slurm_env, run_dir, timeout=HEARTBEAT_S + 120)
    took = time.time() - stopped_at
    log = _log(run_dir, job)
    assert state["JobState"] == "FAILED", (state, log[-4000:])
    assert took < HEARTBEAT_S + 60, (took, log[-4000:])
    print(f"\ntask 1 stopped at step {max(run_losses(run_dir))}: job {job} FAILED {took:.1f} s later "
          f"(heartbeat timeout {HEARTBEAT_S} s)")
    assert "detected fatal errors" in log and "another task died" in log, log[-4000:]  # JAX's abort, not a time limit
    assert "DUE TO TIME LIMIT" not in log


def _free_port_base(count: int) -> int:
    """A port p with p .. p + count - 1 free here (task i's exporter serves on METRICS_PORT + i); below the ephemeral
    range, where the tasks' own connections take their local ports."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    for _ in range(100):
        base = random.randrange(20000, 30000)
        if all(free(base + i) for i in range(count)):
            return base
    raise AssertionError(f"no {count} consecutive free ports in 20000-30000")


def test_a_hung_task_is_requeued_once_and_the_rerun_completes(straight, slurm_env, sample_corpus, tmp_path):
    """Task 1 blocks before step 4 (GLM46_FAULTS, once) -> its watchdog dumps its stacks (task 1's shows the fault),
    status.json says "hung", the tasks exit -> the script requeues the job once (requeues.log) -> the rerun resumes
    from the step-3 checkpoint and ends with the uninterrupted job's losses and weights. A real Prometheus, pointed at
    the job's file_sd directory only, scrapes both tasks on METRICS_PORT + rank; the file goes when the job ends."""
    run_dir = str(tmp_path / "hung_once")
    sd_dir = os.path.join(run_dir, "prometheus_targets")  # the script's default METRICS_SD_DIR
    os.makedirs(sd_dir)
    port = _free_port_base(2)
    faults = f"hang_at_step=4,hang_process=1,hang_once={run_dir}/hang_marker"
    with prometheus(sd_dir=sd_dir) as prom:
        job = _submit(slurm_env, run_dir, sample_corpus, env={"GLM46_FAULTS": faults, "METRICS_PORT": str(port)},
                      flags=("--config.monitor.watchdog_floor_s=8", "--config.monitor.watchdog_factor=5",
                             "--config.monitor.sinks=jsonl,prometheus", "--config.monitor.prometheus_linger_s=3"))
        state = _final(job, slurm_env, run_dir)
        steps = prom.query(f'max_over_time(training_steps_total{{slurm_job_id="{job}"}}[15m])')
    log = _log(run_dir, job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, log[-4000:])
    # the first run: the watchdogs' report, task 1 stuck in the injected fault
    assert "process 1: hung: no step completed" in log and "fault_injection.py" in log, log[-6000:]
    with open(os.path.join(run_dir, "hang", "process_1.txt")) as f:
        assert "fault_injection.py" in f.read()
    with open(os.path.join(run_dir, "requeues.log")) as f:
        requeues = f.read().splitlines()
    assert len(requeues) == 1 and re.search(rf" job {job} restart 1: hung at step 3$", requeues[0]), requeues
    assert f"requeueing job {job}" in log and "restart count 1" in log
    # the rerun: from the step-3 checkpoint to the end, as if nothing had happened
    assert f"steps 4-{STEPS} of {STEPS}" in log, log[-4000:]
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "complete"
    assert run_losses(run_dir) == run_losses(straight[0])
    for a, b in zip(_params(straight[0]), _params(run_dir), strict=True):
        np.testing.assert_array_equal(b, a)
    # service discovery: one target per task, on its node at METRICS_PORT + rank, with the job's labels
    got = {r["metric"]["process"]: r for r in steps}
    assert sorted(got) == ["0", "1"] and len(steps) == 2, steps
    for process, r in got.items():
        assert r["metric"]["instance"] == f"{state['NodeList']}:{port + int(process)}", r
        assert (r["metric"]["job"], r["metric"]["slurm_job_name"]) == ("glm46", "glm46-pretrain"), r
        assert float(r["value"][1]) == STEPS, r  # the rerun's last step was scraped (the exporter lingers)
    assert os.listdir(sd_dir) == [], os.listdir(sd_dir)  # removed when the job ended, no temporary file left


def test_the_script_requeues_a_hung_run_a_bounded_number_of_times(tmp_path):
    """The script's decisions after srun, under fake `srun` / `scontrol` (no cluster): "stopped" and "hung" requeue
    (one requeues.log line each), a job's hangs only HANG_REQUEUES times, REQUEUE=0 never, and any other failure
    ends the job with srun's status. The targets file exists while srun runs and is gone after every ending."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    # srun: record the targets file it saw, then end as $FAKE_STATE says, with exit status $FAKE_RC
    (bin_dir / "srun").write_text('#!/bin/sh\ncp "$RUN_DIR/prometheus_targets/$SLURM_JOB_ID.json" "$RUN_DIR/seen.json"\n'
                                  '[ -z "$FAKE_STATE" ] || printf \'{"state": "%s", "step": 5}\' "$FAKE_STATE" '
                                  '> "$RUN_DIR/status.json"\nexit "$FAKE_RC"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && exec echo node1\n'
                                      f'echo "$@" >> {tmp_path / "scontrol.log"}\n')
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="9", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node1",
               SLURM_TASKS_PER_NODE="2", SLURM_NTASKS="2", REPO=ROOT, RUN_DIR=str(run_dir), METRICS_PORT="9500")

    def run(restart: int, state: str, rc: int, job: str = "9", **extra: str) -> tuple[int, bool, str]:
        """The script's exit status, whether it requeued the job, its stdout + stderr."""
        (tmp_path / "scontrol.log").unlink(missing_ok=True)
        out = subprocess.run(["bash", SBATCH], env={**env, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restart),
                                                    "FAKE_STATE": state, "FAKE_RC": str(rc), **extra},
                             capture_output=True, text=True, timeout=60, check=False)
        with open(run_dir / "seen.json") as f:
            assert json.load(f)[0]["targets"] == ["node1:9500", "node1:9501"], out
        assert os.listdir(run_dir / "prometheus_targets") == [], out
        requeued = (tmp_path / "scontrol.log").exists()
        assert not requeued or (tmp_path / "scontrol.log").read_text() == f"requeue {job}\n", out
        return out.returncode, requeued, out.stdout + out.stderr

    assert run(0, "stopped", 0)[:2] == (0, True)
    assert run(1, "hung", 3)[:2] == (0, True)
    assert run(2, "hung", 3)[:2] == (0, True)
    rc, requeued, out = run(3, "hung", 3)  # a third hang with the default HANG_REQUEUES=2: the job fails
    assert (rc, requeued) == (3, False) and "not requeueing job 9, already requeued 2 time(s)" in out, out
    with open(run_dir / "requeues.log") as f:
        lines = f.read().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["job 9 restart 1: stopped at step 5",
                                                         "job 9 restart 2: hung at step 5",
                                                         "job 9 restart 3: hung at step 5"], lines
    assert run(0, "hung", 3, job="10")[:2] == (0, True)  # a new job in the same run dir: a bound of its own
    assert run(0, "hung", 3, REQUEUE="0")[:2] == (3, False)
    assert run(0, "", 137)[:2] == (137, False)  # killed, no status: srun's status, no requeue
    assert run(0, "complete", 0)[:2] == (0, False)


def test_the_targets_file_lists_every_task_on_its_node(slurm_env, tmp_path):
    """launch/prometheus_targets.sh on a made-up allocation: SLURM_TASKS_PER_NODE "3(x2),1" over three nodes ->
    seven targets, ranks filling the nodes in order (srun's block distribution), port = base + rank."""
    path = tmp_path / "sd" / "123.json"
    env = {**slurm_env, "SLURM_JOB_ID": "123", "SLURM_JOB_NAME": 'pre"train', "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
           "SLURM_TASKS_PER_NODE": "3(x2),1"}
    out = _run(["bash", os.path.join(ROOT, "launch", "prometheus_targets.sh"), str(path), "9400"], env)
    assert "7 tasks, ports 9400-9406" in out, out
    with open(path) as f:
        assert json.load(f) == [{"targets": ["gpu07:9400", "gpu07:9401", "gpu07:9402", "gpu08:9403", "gpu08:9404",
                                             "gpu08:9405", "cpu1:9406"],
                                 "labels": {"job": "glm46", "slurm_job_id": "123", "slurm_job_name": 'pre"train'}}]
    assert os.listdir(path.parent) == ["123.json"]  # written through a temporary file, renamed
    env["SLURM_TASKS_PER_NODE"] = "3(x2),1,1"  # more nodes than the node list: an error, not a wrong file
    bad = subprocess.run(["bash", os.path.join(ROOT, "launch", "prometheus_targets.sh"), str(path), "9400"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "names more nodes" in bad.stderr, bad.stderr


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
        unavailable("launch/local_slurm.sh start/stop need root or passwordless sudo")
    env = {**os.environ, "SLURM_LOCAL_DIR": os.path.dirname(slurm_env["SLURM_CONF"])}
    cluster = ("slurmctld", "slurmd", "munged")  # slurmstepd comes and goes with jobs (an earlier test's may be ending)
    fcntl.lockf(cluster_lock_fd(), fcntl.LOCK_EX)  # waits until no other worker's test has jobs on the cluster
    try:
        before = daemons()
        assert all(before[name] for name in cluster), before
        out = _run(["bash", LOCAL_SLURM, "start"], env)
        after = daemons()
        assert "already running" in out and {n: after[n] for n in cluster} == {n: before[n] for n in cluster}
        try:
            _run(["bash", LOCAL_SLURM, "stop"], env)
            assert not any(daemons().values()), daemons()
            assert subprocess.run(["bash", LOCAL_SLURM, "status"], env=env, capture_output=True).returncode == 1
        finally:
            _run(["bash", LOCAL_SLURM, "start"], env)
    finally:
        fcntl.lockf(cluster_lock_fd(), fcntl.LOCK_SH)  # back to the module's shared lock
    assert subprocess.run(["sinfo", "-h"], env=slurm_env, capture_output=True).returncode == 0
