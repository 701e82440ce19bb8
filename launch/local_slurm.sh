#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to try launch/slurm_pretrain.sbatch without a cluster (and the
# tests in tests/test_slurm.py, which CI runs on it). Needs root and Debian/Ubuntu (apt) for the packages.
#
#   launch/local_slurm.sh start     # install slurm-wlm + munge if missing, write slurm.conf, start the daemons
#   launch/local_slurm.sh status    # sinfo, or exit 1 when no cluster answers
#   launch/local_slurm.sh stop      # stop the daemons (no process is left), keep the state directory
#   export SLURM_CONF=$(launch/local_slurm.sh conf)   # what sbatch / srun / sinfo need to find it
#
# start and stop are idempotent. Everything lives in $SLURM_LOCAL_DIR (default /tmp/glm46_slurm): the generated
# slurm.conf, the controller's state, the daemons' logs (log/slurmctld.log, log/slurmd.log) and pid files. munged
# uses the system's key and socket (/etc/munge/munge.key, /run/munge), as Slurm's munge plugin expects.
# The node is this host (its name, CPUs and memory from `slurmd -C`) in one partition `local`; jobs may share
# its CPUs (OverSubscribe=FORCE:4), the affinity plugin binds tasks (the launcher's --cpu-bind=cores works),
# there is no cgroup plugin (containers often lack cgroup v2 delegation) and no accounting database.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/glm46_slurm}
CONF=$DIR/slurm.conf
DAEMONS=(slurmd slurmctld munged)  # stopped in this order

die() { echo "local_slurm.sh: $*" >&2; exit 2; }

pids_of() {  # the running daemon `$1` that this cluster started (its pid file), if any
  local f=$DIR/run/$1.pid
  [[ -s $f ]] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"
  return 0
}

install_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null && return
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get: install them"
  echo "installing slurm-wlm and munge (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$DIR/log/apt.log" 2>&1 ||
    { apt-get update -q >>"$DIR/log/apt.log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$DIR/log/apt.log" 2>&1; } ||
    die "apt-get install slurm-wlm munge failed: see $DIR/log/apt.log"
}

write_conf() {
  local node host
  host=$(hostname -s)
  # `slurmd -C` prints this host as a NodeName= line: CPUs, sockets, cores, threads, RealMemory.
  node=$(slurmd -C | head -1)
  [[ $node == NodeName=* ]] || die "slurmd -C did not describe this node: $node"
  cat >"$CONF" <<EOF
# Written by launch/local_slurm.sh: a one-node cluster on $host.
ClusterName=glm46local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A job step credential lives 10 s instead of 120 (Slurm's minimum is 5): a requeued job waits that long + 1 s
# before it runs again, until the node has forgotten the old run's revoked credentials.
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Look for startable jobs every 5 s, not every 60 / 30: a requeued job starts soon after its credential expires.
SchedulerParameters=sched_interval=5,bf_interval=5
# 30 s, not 10: a kill that slurmd answers late (a task that outlives KillWait) is not retried against the requeued
# job's new step of the same id.
MessageTimeout=30
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
# Finished jobs stay visible to scontrol for 10 minutes (there is no accounting database for sacct).
MinJobAge=600
KillWait=10
$node State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

answers() { SLURM_CONF=$CONF timeout 10 sinfo -h >/dev/null 2>&1; }

start() {
  [[ $(id -u) == 0 ]] || die "needs root (the daemons run as root here): run it with sudo"
  mkdir -p "$DIR"/{state,spool,log,run}
  install_packages
  if [[ -n $(pids_of slurmctld) && -n $(pids_of slurmd) ]] && answers; then
    echo "the local Slurm cluster is already running (SLURM_CONF=$CONF)"
    return
  fi
  stop >/dev/null
  write_conf
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chmod 400 /etc/munge/munge.key
  fi
  # --force: munged refuses to run as root otherwise. Its own pid file, so stop only ends this one.
  munged --force --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" ||
    die "munged did not start: see $DIR/log/munged.log"
  slurmctld -f "$CONF" || die "slurmctld did not start: see $DIR/log/slurmctld.log"
  slurmd -f "$CONF" || die "slurmd did not start: see $DIR/log/slurmd.log"
  local i
  for i in $(seq 1 60); do
    if answers && SLURM_CONF=$CONF sinfo -h -o %t | grep -qE '^(idle|mix|alloc)'; then
      echo "the local Slurm cluster is up: export SLURM_CONF=$CONF"
      SLURM_CONF=$CONF sinfo
      return
    fi
    sleep 0.5
  done
  die "the cluster did not become ready in 30 s: see $DIR/log/slurmctld.log and $DIR/log/slurmd.log"
}

stop() {
  local d pid i
  for d in "${DAEMONS[@]}"; do
    pid=$(pids_of "$d")
    [[ -n $pid ]] || continue
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  done
  # Job steps outlive slurmd (slurmstepd); end those of this cluster's jobs too.
  pkill -9 -f "slurmstepd: \[" 2>/dev/null || true
  echo "the local Slurm cluster is stopped"
}

# Not root but passwordless sudo (a CI runner's usual user): the same command as root.
if [[ $(id -u) != 0 && ${1:-} =~ ^(start|stop)$ ]] && sudo -n true 2>/dev/null; then
  exec sudo -n env SLURM_LOCAL_DIR="$DIR" bash "$0" "$@"
fi

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) answers || { echo "no local Slurm cluster answers (SLURM_CONF=$CONF)" >&2; exit 1; }
          SLURM_CONF=$CONF sinfo ;;
  conf) echo "$CONF" ;;
  *) die "usage: launch/local_slurm.sh start|stop|status|conf" ;;
esac
