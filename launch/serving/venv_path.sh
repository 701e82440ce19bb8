#!/usr/bin/env bash
# The serving venv's directory (`make serving-venv` builds it): outside the clone, named by the hash of
# launch/serving/requirements.txt, so every clone shares it and a changed pin gets a new one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
hash="$(sha256sum "$here/requirements.txt" | cut -c1-12)"
echo "${SERVING_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/glm46_jax/serving-$hash}"
