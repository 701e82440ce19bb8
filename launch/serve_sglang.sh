#!/usr/bin/env bash
# SGLang's OpenAI-compatible server on an export, with GLM-4.5/4.6's flags: the glm45 tool-call and reasoning
# parsers, the exported MTP layer as the EAGLE draft (SGLang's NextN path), tensor / expert parallelism
# (docs/serving.md#sglang). SGLang has no CPU build to test here: this script is documented, not tested.
#
#   launch/serve_sglang.sh EXPORT_DIR [SGLANG_FLAGS...]
#   TP=8 EP=8 MTP=1 launch/serve_sglang.sh export/glm46
#
# Environment: PORT (8000), HOST (127.0.0.1), NAME (served model name; default the directory's name), TP
# (--tp-size, 1), EP (--ep-size, 1), MTP (1: EAGLE speculation with the MTP layer, 3 steps, top-1, 4 draft tokens
# as GLM's model cards), LORA (space-separated NAME=DIR PEFT adapters, --lora-paths), PYTHON (default python3).
set -euo pipefail
if [[ $# -lt 1 || ! -f "$1/config.json" ]]; then
  echo "usage: $0 EXPORT_DIR [SGLANG_FLAGS...]  (EXPORT_DIR: a directory with config.json, e.g. from convert ckpt-to-hf)" >&2
  exit 2
fi
model="$(cd "$1" && pwd)"
shift
args=(--model-path "$model" --served-model-name "${NAME:-$(basename "$model")}" --host "${HOST:-127.0.0.1}"
      --port "${PORT:-8000}" --tp-size "${TP:-1}" --tool-call-parser glm45 --reasoning-parser glm45)
[[ "${EP:-1}" != 1 ]] && args+=(--ep-size "$EP")
[[ "${MTP:-0}" == 1 ]] && args+=(--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1
                                 --speculative-num-draft-tokens 4)
if [[ -n "${LORA:-}" ]]; then
  read -r -a adapters <<< "$LORA"
  args+=(--lora-paths "${adapters[@]}")
fi
echo "serving $model with ${PYTHON:-python3} -m sglang.launch_server ${args[*]} $*" >&2
exec "${PYTHON:-python3}" -m sglang.launch_server "${args[@]}" "$@"
