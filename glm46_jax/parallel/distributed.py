"""Multi-process start-up: `jax.distributed` under Slurm, from explicit settings, or not at all.

    cluster = distributed.initialize(run_cfg.distributed)   # first thing: before any device is touched

Who the processes are is decided here, once, in this order:
  1. explicit settings (`coordinator`, `num_processes`, `process_id`; `launch/local_multiprocess.sh`
     passes them), all three or none;
  2. Slurm: inside `srun` (SLURM_PROCID and a node list), coordinator = the first host of the
     step's node list (falling back to the job's, for launchers that set only SLURM_JOB_NODELIST /
     SLURM_NODELIST), port = job id % 4096 + 61440 as JAX's own Slurm detection picks it;
  3. otherwise a single process (no `jax.distributed`).
We resolve the Slurm settings ourselves instead of letting JAX detect them because JAX then always
restricts each process to the GPU numbered SLURM_LOCALID, which leaves 7 of 8 GPUs idle when a
job runs one task per node; here one device per task is used only with several tasks on a node.

Failure behaviour comes from JAX's coordination service: a process that stops sending heartbeats
for `heartbeat_timeout_s` (a crash, a kill, a lost node) makes every other process abort with
"the JAX distributed service detected fatal errors ... another task died" (non-zero exit); a dead
coordinator (process 0) is noticed at once. The batch script restarts the job, and the run resumes
from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Mapping

import jax
from absl import logging

from glm46_jax.errors import InputError, check_at_least, check_choice, check_field


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    mode: str = "auto"  # auto: explicit settings, else Slurm's srun environment, else one process | off
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    local_device_ids: str = ""  # "0,1": this process's devices (default: all visible)
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    shutdown_timeout_s: int = 60

    def __post_init__(self):
        check_choice("distributed", self, "mode", ("auto", "off"),
                     "auto: explicit settings, else Slurm, else one process; off: always one process")
        check_at_least("distributed", self, 0, "num_processes")
        check_at_least("distributed", self, 1, "initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s")
        given = {"coordinator": bool(self.coordinator), "num_processes": self.num_processes > 0,
                 "process_id": self.process_id >= 0}
        if any(given.values()) and not all(given.values()):
            raise InputError(f"distributed: {[k for k, v in given.items() if not v]} must be set together with "
                             f"{[k for k, v in given.items() if v]} (or none of them, for Slurm auto-detection)")
        ids = [v.strip() for v in self.local_device_ids.split(",") if v.strip()]
        check_field("distributed", "local_device_ids", self.local_device_ids, all(v.isdigit() for v in ids),
                    "expected comma-separated device numbers, e.g. 0,1", "set --config.distributed.local_device_ids")
        if all(given.values()):
            check_field("distributed", "process_id", self.process_id, self.process_id < self.num_processes,
                        f"must be in [0, num_processes={self.num_processes})", "set --config.distributed.process_id")

    @property
    def explicit(self) -> bool:
        return self.num_processes > 0

    @property
    def device_ids(self) -> tuple[int, ...] | None:
        """`local_device_ids` as numbers; None = every device this host sees."""
        return tuple(int(v) for v in self.local_device_ids.split(",") if v.strip()) or None



@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands: what `jax.distributed.initialize` is called with."""
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every device this host sees
    source: str  # "explicit" or "slurm (<the variables read>)"


# --- Slurm ------------------------------------------------------------------------------------

def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'node[007-009,012],gpu2' -> 'node007'.

    Handles several bracketed ranges in one name ('rack[1-2]-n[01-04]' -> 'rack1-n01'); zero padding
    is kept as written, as Slurm does.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first name
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    name = nodelist[:end].strip()
    if not name or depth < 0 or name.count("[") != name.count("]"):
        raise ValueError(f"cannot parse the Slurm node list {nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], name)


def _tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed per-node task counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse the Slurm tasks-per-node value {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_cluster(env: Mapping[str, str]) -> Cluster | None:
    """The cluster Slurm describes in `env`, or None when this is not a multi-task Slurm step."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    used = ["SLURM_JOB_ID", "SLURM_PROCID"]

    def first(*names: str) -> str | None:
        name = next((n for n in names if env.get(n)), None)
        if name:
            used.append(name)
        return env[name] if name else None

    ntasks = first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if ntasks is None or int(ntasks) <= 1:
        return None
    nodelist = first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is None:
        raise ValueError("Slurm: SLURM_PROCID and SLURM_NTASKS are set but no node list (SLURM_STEP_NODELIST, "
                         "SLURM_JOB_NODELIST or SLURM_NODELIST); set --config.distributed.coordinator=HOST:PORT")
    port = int(env.get("JAX_COORDINATOR_PORT") or int(env["SLURM_JOB_ID"]) % 4096 + 61440)
    # Several tasks on this node share its GPUs: one each (by local rank), unless Slurm already bound one
    # GPU per task (CUDA_VISIBLE_DEVICES lists a single device, which each task then sees as device 0).
    local_ids = None
    per_node = first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    node_id = int(env.get("SLURM_NODEID", "0"))
    counts = _tasks_per_node(per_node) if per_node else []
    tasks_here = counts[node_id] if node_id < len(counts) else int(env.get("SLURM_NTASKS_PER_NODE", "1"))
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if tasks_here > 1 and len(visible) != 1 and "SLURM_LOCALID" in env:
        local_ids = (int(env["SLURM_LOCALID"]),)
    return Cluster(coordinator=f"{first_host(nodelist)}:{port}", num_processes=int(ntasks),
                   process_id=int(env["SLURM_PROCID"]), local_device_ids=local_ids,
                   source=f"slurm ({', '.join(used)})")


# --- resolution and start-up ------------------------------------------------------------------

def resolve(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster from `config.distributed` (explicit wins) or the Slurm environment; None = one process.
    The config has checked that explicit settings come all together (`DistributedConfig`)."""
    env = os.environ if env is None else env
    if cfg.explicit:
        if cfg.num_processes == 1:
            return None
        return Cluster(cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.device_ids, "explicit")
    cluster = slurm_cluster(env)
    if cluster is not None and cfg.device_ids is not None:
        cluster = dataclasses.replace(cluster, local_device_ids=cfg.device_ids)
    return cluster


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> Cluster | None:
    """Start `jax.distributed` if this is one of several processes; call before any device is used."""
    if cfg.mode == "off":
        return None
    cluster = resolve(cfg, env)
    if cluster is None:
        return None
    init_s = cfg.initialization_timeout_s
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
            process_id=cluster.process_id, local_device_ids=cluster.local_device_ids,
            cluster_detection_method="deactivate", initialization_timeout=init_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s, shutdown_timeout_seconds=cfg.shutdown_timeout_s)
    except Exception as e:  # noqa: BLE001 - JAX raises its runtime error type; say what to check, keep the cause
        raise RuntimeError(
            f"process {cluster.process_id} of {cluster.num_processes} could not join the job at {cluster.coordinator} "
            f"(from {cluster.source}) within {init_s} s: are all {cluster.num_processes} processes started (under "
            f"Slurm, with srun, not plain python in the batch script), and can this host reach that port?") from e
    if jax.default_backend() == "cpu":
        _cache_on_every_process()
    logging.info("process %d of %d (%s), coordinator %s; %d local of %d devices", cluster.process_id,
                 cluster.num_processes, cluster.source, cluster.coordinator, jax.local_device_count(),
                 jax.device_count())
    return cluster


def _cache_on_every_process() -> None:
    """On CPU, every process writes its programs to JAX's persistent compilation cache, not only process 0.

    JAX keys a CPU program by the topology of the process's own devices, so the processes of a job never share
    entries, and it writes process 0's only: the others compiled every program again at every launch (a resumed or
    requeued job; on the tiny model ~15 s before the first step). Now each reads back its own. On GPU the key is the
    same in every process and process 0's entries serve them all (unchanged). Private API: none exists for this
    (docs/performance.md#a-relaunch-of-a-multi-process-cpu-job)."""
    from jax._src import compilation_cache, compiler, config
    from jax._src import distributed as jax_distributed

    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "every_process", False):
        return

    def write_every_process(cache_key, compile_time_secs, module_name, backend, executable):
        if jax_distributed.global_state.process_id == 0:
            return write(cache_key, compile_time_secs, module_name, backend, executable)
        if compile_time_secs >= config.persistent_cache_min_compile_time_secs.value:  # JAX's own threshold
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))

    write_every_process.every_process = True
    compiler._cache_write = write_every_process


# --- lining processes up ----------------------------------------------------------------------

_barriers = itertools.count()
BARRIER_TIMEOUT_S = 3600  # how far one process may trail another after a compile (another read the cache)


def barrier(name: str, timeout_s: int = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process gets here (the coordination service's barrier; nothing with one process).
    Call it between compiling a program and its first run: on CPU a program's first collective opens a Gloo
    communicator, which waits only 30 s for the other processes, and a process that reads the program from JAX's
    persistent compilation cache can arrive minutes before one that compiles it. Every process must make the same
    calls in the same order (the counter keeps the ids unique)."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the client jax.distributed.initialize made; no public API

    jax_distributed.global_state.client.wait_at_barrier(f"glm46_jax/{name}/{next(_barriers)}", timeout_s * 1000)
