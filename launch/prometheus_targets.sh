#!/usr/bin/env bash
# Prometheus file-based service discovery for the Slurm job this runs in: one scrape target per task.
#
#   launch/prometheus_targets.sh FILE PORT     # launch/slurm_pretrain.sbatch calls it before srun
#
# Task i (srun's SLURM_PROCID) serves /metrics on PORT + i (monitor.prometheus_port) on the node that runs it:
# the job's nodes come from `scontrol show hostnames "$SLURM_JOB_NODELIST"` (it reads slurm.conf, no controller
# needed) and its tasks per node from SLURM_TASKS_PER_NODE ("8(x2),4": 8 on each of two nodes, then 4), filled in
# srun's default block distribution (tasks 0..7 on the first node, 8..15 on the second, ...). FILE gets
#
#   [{"targets": ["node1:9400", ...], "labels": {"job": "glm46", "slurm_job_id": "<id>", "slurm_job_name": "<name>"}}]
#
# written to a temporary file next to it and renamed (Prometheus re-reads files as they change, so it never sees
# half of one). Point a `file_sd_configs` entry at FILE's directory (`files: [DIR/*.json]`).
set -euo pipefail

[[ $# == 2 && $2 =~ ^[0-9]+$ ]] || { echo "usage: $0 FILE PORT" >&2; exit 2; }
file=$1 port=$2
: "${SLURM_JOB_ID:?not in a Slurm job}" "${SLURM_JOB_NODELIST:?}" "${SLURM_TASKS_PER_NODE:?}"

mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[[ ${#hosts[@]} -gt 0 ]] || { echo "$0: scontrol found no hosts in '$SLURM_JOB_NODELIST'" >&2; exit 1; }

targets=() node=0
for group in ${SLURM_TASKS_PER_NODE//,/ }; do  # "8(x2)" -> 8 tasks on each of 2 nodes; "4" -> 4 on 1
  tasks=${group%%(*} repeat=1
  if [[ $group == *"(x"* ]]; then repeat=${group#*(x} repeat=${repeat%)}; fi
  for ((r = 0; r < repeat; r++, node++)); do
    (( node < ${#hosts[@]} )) || { echo "$0: SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE names more nodes than" \
                                        "'$SLURM_JOB_NODELIST'" >&2; exit 1; }
    for ((t = 0; t < tasks; t++)); do targets+=("\"${hosts[node]}:$((port + ${#targets[@]}))\""); done
  done
done
if [[ -n ${SLURM_NTASKS:-} ]] && (( SLURM_NTASKS < ${#targets[@]} )); then  # sbatch --ntasks below the nodes' slots
  targets=("${targets[@]:0:SLURM_NTASKS}")
fi

json_string() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; printf '"%s"' "$s"; }
labels="\"job\": \"glm46\", \"slurm_job_id\": $(json_string "$SLURM_JOB_ID")"
labels+=", \"slurm_job_name\": $(json_string "${SLURM_JOB_NAME:-}")"
mkdir -p "$(dirname "$file")"
tmp=$file.tmp.$$  # not *.json: a file_sd glob skips it
trap 'rm -f "$tmp"' EXIT
( IFS=,; printf '[{"targets": [%s], "labels": {%s}}]\n' "${targets[*]}" "$labels" ) >"$tmp"
mv -f "$tmp" "$file"
echo "prometheus targets: ${#targets[@]} tasks, ports $port-$((port + ${#targets[@]} - 1)), in $file"
