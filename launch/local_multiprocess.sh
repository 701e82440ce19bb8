#!/usr/bin/env bash
# N JAX processes on this machine, CPU only: the multi-host code path (jax.distributed, process-local
# data, collective checkpoints) without a cluster.
#
#   launch/local_multiprocess.sh N [ARGS...]
#   launch/local_multiprocess.sh 2 --config=configs/pretrain.py:tiny --config.mesh.data=2 \
#       --config.mesh.tensor=2 --config.mesh.expert=2 --config.run_dir=runs/tiny_2proc
#
# Each process gets DEVICES_PER_PROCESS virtual CPU devices (default 4) and runs
# `python -m $MODULE ARGS --config.distributed.{coordinator,num_processes,process_id}=...`
# (MODULE defaults to glm46_jax.train). Environment: PYTHON (default .venv/bin/python, else python3),
# PORT (default: a free port), LOG_DIR (if set, process i writes LOG_DIR/process_i.log instead of this
# terminal, and LOG_DIR/pids lists the process ids), GRACE_S (default 180: how long survivors get to stop on their own after one fails).
#
# Exit status: 0 when every process exits 0, else the first failure's status. When one process fails, the
# others detect it (JAX's heartbeat, config.distributed.heartbeat_timeout_s) and abort by themselves; any
# still running GRACE_S seconds later are killed. SIGTERM / SIGINT to this script are forwarded to every
# process (each saves a checkpoint and exits 0, as under Slurm preemption).
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N [ARGS...]  (N >= 1 processes; ARGS go to python -m \$MODULE)" >&2
  exit 2
fi
n=$1
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
module=${MODULE:-glm46_jax.train}
devices=${DEVICES_PER_PROCESS:-4}
grace=${GRACE_S:-180}
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
if [[ -n "${LOG_DIR:-}" ]]; then mkdir -p "$LOG_DIR"; : > "$LOG_DIR/pids"; fi

pids=()
for ((i = 0; i < n; i++)); do
  cmd=("$python" -u -m "$module" "$@" "--config.distributed.coordinator=127.0.0.1:$port"
       "--config.distributed.num_processes=$n" "--config.distributed.process_id=$i")
  if [[ -n "${LOG_DIR:-}" ]]; then
    JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
      PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" > "$LOG_DIR/process_$i.log" 2>&1 &
  else
    JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
      PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" &
  fi
  pids+=($!)
  if [[ -n "${LOG_DIR:-}" ]]; then echo $! >> "$LOG_DIR/pids"; fi
  echo "local_multiprocess: process $i of $n: pid $! (coordinator 127.0.0.1:$port, $devices CPU devices)" >&2
done

forward() {
  echo "local_multiprocess: $1: forwarding to all processes" >&2
  kill -s "$1" "${pids[@]}" 2> /dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT

# Reap processes as they end; remember the first failure.
status=0
failed_at=0
declare -A done_pids=()
while ((${#done_pids[@]} < n)); do
  for ((i = 0; i < n; i++)); do
    pid=${pids[$i]}
    [[ -n "${done_pids[$pid]:-}" ]] && continue
    if ! kill -0 "$pid" 2> /dev/null; then
      set +e
      wait "$pid"
      rc=$?
      set -e
      done_pids[$pid]=1
      if ((rc != 0)); then
        echo "local_multiprocess: process $i (pid $pid) exited with status $rc" >&2
        if ((status == 0)); then status=$rc; failed_at=$SECONDS; fi
      fi
    fi
  done
  if ((status != 0 && SECONDS - failed_at > grace)); then
    echo "local_multiprocess: processes still running ${grace} s after a failure; killing them" >&2
    for pid in "${pids[@]}"; do [[ -z "${done_pids[$pid]:-}" ]] && kill -9 "$pid" 2> /dev/null || true; done
    grace=$((1 << 30))
  fi
  sleep 0.2
done
exit "$status"
