#!/usr/bin/env bash
# The GPU benchmark in one command, run ON the lent GPU machine (its own jax 0.11.2 + CUDA 13 plugin, flax, optax,
# orbax, chex, einops, torch + transformers; no network). The device tool call that decides everything:
#
#   run(command="bash benchmarks/gpu/run.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=600)   # ~8 min, no flags
#   run(command="bash benchmarks/gpu/run.sh --skip hf,moe --steps 20", carry=[".whl"])   # step.py's flags pass through
#
# First, HERE (with network): bash benchmarks/gpu/fetch_wheels.sh   (fills the ignored .whl/ with grain,
# ml-collections, array-record and their missing needs; ~5 MiB of the call's 64 MiB).
# It installs the carried wheels into /tmp/site (never into the image's own environment), then runs
# benchmarks/gpu/step.py with the image's python3: HF transformers first (a subprocess, before JAX takes the GPU's
# memory), then the step, its profile, the HF-equivalent row and the MoE section. result.json and report.md are
# rewritten in $OUT after every section (a timeout still brings back what ran), with trace.json.gz, step_hlo.txt.gz,
# profile_hlo.txt.gz (and trace_default.json.gz + profile_default_hlo.txt.gz where the default executable was
# profiled), hf/ and log.txt; elsewhere runs/gpu_bench. It exits non-zero when a check of the report fails on a GPU
# (an "error: check failed:" line each: e.g. a component row above the measured matmul peak). Without a GPU it
# runs step.py's CPU fallback (tiny preset, fp32) and says so. docs/gpu.md#running-it-on-the-lent-gpu has the details.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

OUT="${OUT:-runs/gpu_bench}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
exec > >(tee "$OUT/log.txt") 2>&1

echo "== run.sh: $(date -u +%FT%TZ) on $(uname -nm), python $("$PY" -V 2>&1 | cut -d' ' -f2) ($(command -v "$PY"))"
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "== gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | paste -sd';')"
else
  echo "== gpu: no nvidia-smi on PATH"
fi

shopt -s nullglob
# A test points these at its own folders (no wheels: the venv running it has the packages).
WHEELS="${GPU_BENCH_WHEELS:-.whl}"
SITE="${GPU_BENCH_SITE:-/tmp/site}"
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
  echo "== installing ${#wheels[@]} carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" || { echo "error: installing $WHEELS/*.whl into $SITE failed (see above)" >&2; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== no $WHEELS/*.whl here: was the call made with carry=[\".whl\"] after benchmarks/gpu/fetch_wheels.sh?"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's glm46_jax, not an installed copy
# More of the GPU for the step than JAX's default 75% pre-allocation (nothing else runs there).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export PYTHONUNBUFFERED=1

# Everything the step imports, checked up front: one clear line instead of a traceback deep in an import.
missing="$("$PY" - <<'PY'
import importlib
names = ["jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "chex", "einops", "jaxtyping", "numpy", "absl",
         "grain", "ml_collections", "array_record", "safetensors", "tokenizers", "jinja2", "tqdm"]
bad = []
for n in names:
    try:
        importlib.import_module(n)
    except Exception as e:  # noqa: BLE001
        bad.append(f"{n} ({type(e).__name__}: {e})")
print("; ".join(bad))
PY
)"
if [ -n "$missing" ]; then
  echo "error: cannot import: $missing. Carry the wheels (bash benchmarks/gpu/fetch_wheels.sh here, then" \
       "carry=[\".whl\"]) or install the package's dependencies." >&2
  exit 2
fi
# Not jax.devices() here: that would start JAX on the GPU in a process of its own before the HF anchor runs.
"$PY" -c 'import jax, flax; print("== jax", jax.__version__, "flax", flax.__version__)'
"$PY" -c 'import torch, transformers; print("== torch", torch.__version__, "transformers", transformers.__version__)' \
  2>/dev/null || echo "== no torch/transformers for $PY: the HF anchor is skipped"

"$PY" benchmarks/gpu/step.py --out "$OUT" "$@"
