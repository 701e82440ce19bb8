#!/usr/bin/env bash
# Download, HERE (with network), the wheels the lent GPU image lacks into the repo's ignored .whl/, so that
# benchmarks/gpu/run.sh can install them THERE (no network) into /tmp/site.
#
#   bash benchmarks/gpu/fetch_wheels.sh          # then, on the device: carry [".whl"], bash benchmarks/gpu/run.sh
#
# The image (jax/jaxlib 0.11.2 + jax-cuda13-plugin, flax, optax, orbax-checkpoint, chex, einops, jaxtyping, numpy,
# absl-py, etils, cloudpickle, protobuf, pyyaml, attrs, wrapt, safetensors, tokenizers, jinja2, tqdm) lacks what
# the train step's imports need beyond that: grain (the data pipeline, imported by pretrain), ml-collections (the
# config files), array-record (grain's reader) and what those three need that the image does not have either
# (dm-tree, more-itertools, portpicker). Only cp312 manylinux x86_64 wheels: the device's python3 is CPython 3.12
# on x86-64, whatever this machine is. One version of each: two of a name stop the --no-deps install there.
# Versions are the ones the project's .venv runs (pyproject's bounds); change them together.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

WHEELS=(
  grain==0.2.18
  ml-collections==1.1.0
  array-record==0.8.6
  dm-tree==0.1.10
  more-itertools==11.2.1
  portpicker==1.6.0
)
PY="${PYTHON:-$(command -v python3)}"
DEST=.whl

# .whl/ must stay out of git (it travels to the device only as a carried path); .gitignore has /.whl/.
if ! git check-ignore -q "$DEST/x.whl" 2>/dev/null; then
  echo "/.whl/" >> .git/info/exclude
fi
mkdir -p "$DEST"
# A wheel of another version left from an earlier fetch would make two of one name: start clean.
rm -f "$DEST"/*.whl

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$DEST" "${WHEELS[@]}"

echo "fetched into $DEST ($(du -sh "$DEST" | cut -f1); a device call carries at most 64 MiB with the tree):"
ls -1 "$DEST"
# What the fetched wheels require: each line must be on the image or in .whl (checked by hand when versions move).
for w in "$DEST"/*.whl; do
  reqs="$(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | cut -d' ' -f2- | \
          paste -sd ',' || true)"
  echo "  $(basename "$w"): ${reqs:-no requirements}"
done
