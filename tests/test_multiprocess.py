"""Several JAX processes on this machine (`launch/local_multiprocess.sh`): two processes x 4 CPU
devices train like one process x 8 devices; a SIGTERM to one of them stops both at the same step
with a checkpoint; a SIGKILL of one makes the other abort with a clear message within the heartbeat
timeout, and a restart resumes from the last checkpoint; Slurm's
environment is read as JAX's own Slurm detection reads it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest

from conftest import PLUMBING_MODEL, run_losses, subprocess_env
from glm46_jax.training import checkpoint
from glm46_jax.parallel import distributed, sharding
from glm46_jax.errors import InputError
from glm46_jax.run_config import DistributedConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
LAUNCHER = os.path.join(ROOT, "launch", "local_multiprocess.sh")
STEPS, EVERY, HEARTBEAT_S = 10, 4, 10
SLOW_S = 0.5


# --- Slurm detection (faked environments) ------------------------------------------------------

def _srun_env(**extra):
    env = {"SLURM_JOB_ID": "12345", "SLURM_STEP_NODELIST": "gpu[003-004,007],gpu010", "SLURM_NTASKS": "32",
           "SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x4)"}
    return {**env, **extra}


def _jax_slurm_coordinator(env, monkeypatch) -> str:
    """JAX's own answer (jax._src.clusters.slurm_cluster) for the same environment: the reference."""
    from jax._src.clusters import slurm_cluster

    for k in [k for k in os.environ if k.startswith("SLURM_") or k == "JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return slurm_cluster.SlurmCluster.get_coordinator_address(None, os.environ.get("JAX_COORDINATOR_PORT"))


def test_slurm_srun_environment_gives_coordinator_count_and_rank(monkeypatch):
    env = _srun_env()
    c = distributed.resolve(DistributedConfig(), env)
    assert c.coordinator == f"gpu003:{12345 % 4096 + 61440}" == _jax_slurm_coordinator(env, monkeypatch)
    assert (c.num_processes, c.process_id) == (32, 13)
    assert c.local_device_ids == (5,)  # 8 tasks on this node: one GPU each, by local rank
    assert c.source.startswith("slurm")


def test_slurm_one_task_per_node_sees_all_its_gpus():
    c = distributed.resolve(DistributedConfig(), _srun_env(SLURM_NTASKS="4", SLURM_PROCID="2", SLURM_LOCALID="0",
                                          SLURM_STEP_TASKS_PER_NODE="1(x4)"))
    assert (c.num_processes, c.process_id, c.local_device_ids) == (4, 2, None)
    # Slurm already bound one GPU per task: that GPU is the task's device 0, so no further restriction.
    c = distributed.resolve(DistributedConfig(), _srun_env(CUDA_VISIBLE_DEVICES="5"))
    assert c.local_device_ids is None


def test_slurm_falls_back_to_the_job_node_list(monkeypatch):
    env = _srun_env(SLURM_JOB_NODELIST="node17,node18", JAX_COORDINATOR_PORT="7777")
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"]
    c = distributed.resolve(DistributedConfig(), env)
    assert c.coordinator == "node17:7777"
    assert "SLURM_JOB_NODELIST" in c.source
    env = {**env, "SLURM_STEP_NODELIST": env.pop("SLURM_JOB_NODELIST")}  # what JAX itself reads
    assert _jax_slurm_coordinator(env, monkeypatch) == "node17:7777"


@pytest.mark.parametrize("nodelist, host", [
    ("node001", "node001"), ("a1,b[1-2]", "a1"), ("x[09,11-12]", "x09"), ("rack[1-2]-n[01-04],z", "rack1-n01")])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert distributed.first_host(nodelist) == host


def test_single_process_and_bad_settings():
    assert distributed.resolve(DistributedConfig(), {}) is None  # no Slurm, nothing explicit: one process
    assert distributed.resolve(DistributedConfig(), _srun_env(SLURM_NTASKS="1")) is None
    explicit = {"coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    c = distributed.resolve(DistributedConfig(**explicit), _srun_env())  # explicit settings win over Slurm
    assert (c.coordinator, c.num_processes, c.process_id, c.source) == ("10.0.0.1:1234", 4, 3, "explicit")
    with pytest.raises(InputError, match=r"\['num_processes', 'process_id'\] must be set together"):
        DistributedConfig(coordinator="h:1")
    with pytest.raises(InputError, match=r"process_id=4: must be in \[0, num_processes=4\)"):
        DistributedConfig(**{**explicit, "process_id": 4})
    with pytest.raises(ValueError, match="cannot parse the Slurm node list"):
        distributed.first_host("node[1-2")
    with pytest.raises(InputError, match="distributed.mode='maybe'"):
        DistributedConfig(mode="maybe")


# --- two processes on this machine ---------------------------------------------------------------

def _flags(run_dir: str, corpus: str) -> list[str]:
    # 10 steps of 8 x 64 rows on a (data 2, tensor 2, expert 2) mesh; every process reads the whole batch
    # (process_split=rows), so one process and two see the same batches.
    return ["--config=configs/pretrain.py:tiny", *PLUMBING_MODEL, f"--config.run_dir={run_dir}",
            f"--config.data.root={corpus}",
            "--config.mesh.data=2", "--config.mesh.tensor=2", "--config.mesh.expert=2",
            "--config.data.process_split=rows", "--config.data.phases.general.tokens=5120",
            "--config.data.phases.general.seq_len=64", "--config.data.phases.general.global_batch=8",
            f"--config.train.steps={STEPS}", "--config.train.log_every=1", "--config.train.eval_every=100",
            "--config.train.eval_batches=1", f"--config.checkpoint.every={EVERY}",
            f"--config.optim.decay_steps={STEPS}", "--config.optim.warmup_steps=2",
            f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}"]


def _launch(n: int, run_dir: str, corpus: str, devices: int, logs: str = "logs", flags: tuple[str, ...] = (),
            **env_extra: str) -> subprocess.Popen:
    env = subprocess_env(None, PYTHON=sys.executable, DEVICES_PER_PROCESS=str(devices),
                         LOG_DIR=os.path.join(run_dir, logs), GRACE_S="120", **env_extra)
    return subprocess.Popen(["bash", LAUNCHER, str(n), *_flags(run_dir, corpus), *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _log(run_dir: str, process: int, logs: str = "logs") -> str:
    with open(os.path.join(run_dir, logs, f"process_{process}.log")) as f:
        return f.read()


def _finish(proc: subprocess.Popen, run_dir: str, n: int, logs: str = "logs") -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out + "".join(_log(run_dir, i, logs)[-3000:] for i in range(n))
    return _log(run_dir, 0, logs)


def _steps(run_dir: str) -> list[int]:
    ckpts = os.path.join(run_dir, "checkpoints")
    return sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) if os.path.isdir(ckpts) else []


def _pid(run_dir: str, process: int, logs: str) -> int:
    with open(os.path.join(run_dir, logs, "pids")) as f:  # written by the launcher, one line per process
        return int(f.read().split()[process])


def _wait_for(proc: subprocess.Popen, run_dir: str, logs: str, predicate, what: str) -> None:
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"exited before {what}: " + proc.communicate()[0] + "".join(
            _log(run_dir, i, logs)[-3000:] for i in range(2))
        assert time.time() - t0 < 600, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_corpus):
    """One process x 8 devices, the reference. Then one run dir through three launches of two
    processes x 4 devices: SIGTERM to process 1 only (both must save the same step and exit 0);
    resume, then SIGKILL process 1 two steps later; restart (from the last checkpoint) and finish."""
    one = str(tmp_path_factory.mktemp("one_process"))
    _finish(_launch(1, one, sample_corpus, devices=8), one, 1)
    two = str(tmp_path_factory.mktemp("two_processes"))
    # The two-process launches' own compilation cache, to see which programs each launch wrote.
    cache = str(tmp_path_factory.mktemp("two_processes_xla_cache"))
    out: dict = {"one": one, "two": two}

    proc = _launch(2, two, sample_corpus, devices=4, logs="logs_preempt", JAX_COMPILATION_CACHE_DIR=cache)
    _wait_for(proc, two, "logs_preempt", lambda: max(run_losses(two), default=0) >= 2, "step 2")
    os.kill(_pid(two, 1, "logs_preempt"), signal.SIGTERM)
    proc.communicate(timeout=300)
    out.update(preempt_rc=proc.returncode, preempt_steps=_steps(two),
               preempt_logs=[_log(two, i, "logs_preempt") for i in range(2)], cached_first=_programs(cache))

    proc = _launch(2, two, sample_corpus, devices=4, logs="logs_kill", JAX_COMPILATION_CACHE_DIR=cache)
    kill_after = max(out["preempt_steps"]) + 2  # both processes are surely training by then
    _wait_for(proc, two, "logs_kill", lambda: max(run_losses(two)) >= kill_after, f"step {kill_after}")
    os.kill(_pid(two, 1, "logs_kill"), signal.SIGKILL)
    killed_at = time.time()
    launcher_out, _ = proc.communicate(timeout=300)
    out.update(killed_rc=proc.returncode, launcher_out=launcher_out, detected_s=time.time() - killed_at,
               survivor_log=_log(two, 0, "logs_kill"), steps_before_restart=_steps(two))
    print(f"\nprocess 1 SIGKILLed after step {max(run_losses(two))}: the launcher exited {proc.returncode} "
          f"{out['detected_s']:.1f} s later (heartbeat timeout {HEARTBEAT_S} s)")

    # The restart also has a straggler: process 1 sleeps SLOW_S before each step (an injected fault; the losses do
    # not change). The processes compare their host time every 2 steps; process 0's exporter is scraped while it
    # lingers after the run.
    proc = _launch(2, two, sample_corpus, devices=4, logs="logs_restart", GLM46_FAULTS=f"slow_process=1,slow_s={SLOW_S}",
                   JAX_COMPILATION_CACHE_DIR=cache,
                   flags=("--config.monitor.straggler_every=2", "--config.monitor.sinks=jsonl,prometheus",
                          "--config.monitor.prometheus_port=0", "--config.monitor.prometheus_linger_s=5"))
    out["straggler_scrape"] = _scrape_at_the_end(proc, two, "logs_restart")
    out["resumed_log"] = _finish(proc, two, 2, "logs_restart")
    out["resumed_log_1"] = _log(two, 1, "logs_restart")
    out["cached_last"] = _programs(cache)
    return out


def _programs(cache: str) -> list[str]:
    """The programs in a JAX compilation cache directory, one entry per key (`jit_step-<hash>`)."""
    return sorted(name.removesuffix("-cache") for name in os.listdir(cache) if name.endswith("-cache"))


def _scrape_at_the_end(proc: subprocess.Popen, run_dir: str, logs: str) -> str:
    """Process 0's /metrics once its run has ended (it says so, then lingers): the port is in its log."""
    path = os.path.join(run_dir, logs, "process_0.log")
    _wait_for(proc, run_dir, logs, lambda: os.path.exists(path) and "serving 5 s more" in open(path).read(),
              "the run's end")
    port = re.search(r"prometheus exporter: http://[^:]+:(\d+)/metrics", open(path).read()).group(1)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_the_same_step(runs):
    assert runs["preempt_rc"] == 0  # every process exited 0
    stopped = max(runs["preempt_steps"])
    assert 2 <= stopped < STEPS, runs["preempt_steps"]
    for log in runs["preempt_logs"]:  # each process says it saved that step, the one they agreed on
        assert f"preemption notice (SIGTERM to one of the processes): saved step {stopped} and stopping" in log


@pytest.mark.slow
def test_a_relaunch_reads_every_process_programs_from_the_cache(runs):
    """On CPU each process's programs have their own cache keys, and JAX writes only process 0's: process 1
    compiled the model's init and train step again at every launch. Both now write theirs at the first launch, and
    the two relaunches compile neither again (each would be a new entry)."""
    for program in ("jit_make", "jit_step"):
        first = [p for p in runs["cached_first"] if p.startswith(program + "-")]
        assert len(first) == 2, (program, runs["cached_first"])  # process 0's and process 1's
        assert [p for p in runs["cached_last"] if p.startswith(program + "-")] == first, runs["cached_last"]


@pytest.mark.slow
def test_killing_one_process_stops_the_other_with_a_clear_error(runs):
    assert runs["killed_rc"] != 0
    assert "process 1 (pid" in runs["launcher_out"] and "exited with status 137" in runs["launcher_out"]
    # The survivor aborts on JAX's heartbeat check (no hang), saying why.
    assert "another task died" in runs["survivor_log"], runs["survivor_log"][-3000:]
    assert "process 0 (pid" in runs["launcher_out"]  # and it exited non-zero by itself
    assert runs["detected_s"] < HEARTBEAT_S + 50


@pytest.mark.slow
def test_a_slow_process_is_named_in_the_log_and_the_metric(runs):
    """Process 1 sleeps SLOW_S per step; process 0 waits for it in the step's collectives. Their host seconds per
    step, exchanged every 2 steps, name process 1, in process 0's log and in its exporter's straggler ratio."""
    named = re.findall(r"step (\d+): the slowest process is (\d), ([\d.]+) host s/step, ([\d.]+)x the median",
                       runs["resumed_log"])
    assert named and all(p == "1" for _, p, _, _ in named), runs["resumed_log"][-3000:]
    assert all(int(s) % 2 == 0 for s, _, _, _ in named)
    # Two processes: the median is their mean, so the ratio is below 2; 1.5 = process 0 spends < SLOW_S / 4 per step.
    assert all(float(host_s) >= SLOW_S and 1.5 < float(ratio) < 2 for _, _, host_s, ratio in named), named
    last = re.search(r'training_straggler_ratio\{process="0",run="[^"]+",slowest_process="1"\} ([\d.]+)',
                     runs["straggler_scrape"])
    assert last and float(last.group(1)) == pytest.approx(float(named[-1][3]), rel=1e-2), runs["straggler_scrape"]
    with open(os.path.join(runs["two"], "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "straggler/process" in r]
    assert records and all(r["straggler/process"] == 1 for r in records)


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_after_the_kill(runs):
    before = runs["steps_before_restart"]
    assert before and max(before) < STEPS
    assert f"steps {max(before) + 1}-{STEPS} of {STEPS}" in runs["resumed_log"]
    # Only process 0 prints the progress bar and the summary (and writes metrics: one record per step below).
    assert "train [" in runs["resumed_log"] and "start loss" in runs["resumed_log"]
    assert "train [" not in runs["resumed_log_1"] and "start loss" not in runs["resumed_log_1"]
    one, two = run_losses(runs["one"]), run_losses(runs["two"])
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    # Same batches, same mesh shape: only the collectives' summation order differs between the runs.
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=0, atol=1e-5)
    print("\n1 process x 8 vs 2 x 4, loss per step:", [(s, one[s], two[s]) for s in sorted(one)])
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, _, p1, _ = checkpoint.load_params(os.path.join(runs["one"], "checkpoints", str(STEPS)), mesh)
    _, _, p2, _ = checkpoint.load_params(os.path.join(runs["two"], "checkpoints", str(STEPS)), mesh)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-4, err_msg=jax.tree_util.keystr(path))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_join_from_faked_slurm_variables(tmp_path):
    """`distributed.initialize` with only srun's variables set (2 tasks on 'localhost'): both processes
    join one job, see 8 devices and sum across each other."""
    port = _free_port()
    script = ("import jax, numpy as np\n"
              "from glm46_jax.parallel import distributed\n"
              "from glm46_jax.run_config import DistributedConfig\n"
              "c = distributed.initialize(DistributedConfig(heartbeat_timeout_s=10))\n"
              "mesh = jax.make_mesh((8,), ('d',))\n"
              "x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P('d')),"
              " np.full(4, jax.process_index() + 1.0, np.float32))\n"
              "print('RESULT', c.coordinator, jax.process_index(), jax.process_count(), jax.device_count(),"
              " float(jax.jit(lambda a: a.sum())(x)), c.source, flush=True)\n")
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "XLA_FLAGS"}
        env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2",
                   CUDA_VISIBLE_DEVICES="0", JAX_COORDINATOR_PORT=str(port), JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out[-3000:]
        result = next(line for line in out.splitlines() if line.startswith("RESULT")).split()
        # 4 devices x 1.0 (process 0) + 4 x 2.0 (process 1) = 12
        assert result[1:7] == [f"localhost:{port}", str(rank), "2", "8", "12.0", "slurm"], result


def test_slurm_batch_script_runs_train_under_srun(tmp_path):
    """launch/slurm_pretrain.sbatch under a fake `srun` that prints what it was asked to run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="gpu[1-2]", SLURM_NTASKS="16", SLURM_SUBMIT_DIR=ROOT,
               RUN_DIR=str(tmp_path / "run"), DATA_ROOT="/data/corpus", CONFIG="configs/pretrain.py:small")
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm_pretrain.sbatch"), "--config.train.steps=5"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    banner, *argv = out.stdout.splitlines()
    assert banner.startswith("job 7: 2 nodes (gpu[1-2]), 16 tasks; config configs/pretrain.py:small")
    assert argv[:3] == ["--kill-on-bad-exit=1", "--gpus-per-task=1", "--cpu-bind=cores"], argv
    i = argv.index("-m")
    assert argv[i - 2:i] == [os.path.join(ROOT, ".venv/bin/python"), "-u"]
    assert argv[i + 1:] == ["glm46_jax.train", "--config=configs/pretrain.py:small",
                            f"--config.run_dir={tmp_path / 'run'}", "--config.data.root=/data/corpus",
                            # the launcher's metrics defaults come before the user's flags, which win
                            "--config.monitor.prometheus_port=9400",
                            "--config.monitor.sinks=jsonl,tensorboard,prometheus", "--config.train.steps=5"]
    assert (tmp_path / "run").is_dir()
    assert not (tmp_path / "scontrol.log").exists()  # the run did not say it stopped early: no requeue
    env["GPUS_PER_TASK"] = "0"  # one task per node: no GPU binding
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm_pretrain.sbatch")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--gpus-per-task=1" not in out.stdout, out.stderr

    # Stopped by the time-limit SIGTERM (status.json says so, as train writes it): the job requeues itself.
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf \'{"state": "stopped", "step": 40}\' > "$RUN_DIR/status.json"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    out = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm_pretrain.sbatch")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "requeueing job 7" in out.stdout, out.stderr
    assert (tmp_path / "scontrol.log").read_text() == "requeue 7\n"
