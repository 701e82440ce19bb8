"""Streaming memory and throughput of `python -m data_prep pipeline` (datatrove stages) as the corpus grows.

    git worktree add /tmp/old_dp <commit before the rebuild>          # the old in-memory data_prep
    git worktree add --detach /tmp/new_dp HEAD                         # optional: freeze the new one
    .venv/bin/python benchmarks/data_prep.py [--new-checkout /tmp/new_dp] [--old-checkout /tmp/old_dp]
        [--base-files 8] [--docs-per-file 200] [--scales 1 4 16] [--workers 1 2]
        [--cases multi single sample] [--cases big --big-gb 1] [--cases recall]

Each checkout runs with PYTHONPATH=<checkout> and is checked to import its own data_prep. About 8 minutes on an idle
2-core box at the defaults (16x = 77 MB of text in 128 files).

What it measures, each run a fresh subprocess (`python -m data_prep ...`) into a fresh output folder:

* scaling: synthetic English-like prose (2-4 KB documents, ~5% planted near-duplicates with a few words changed,
  ~2% exact copies, drawn from earlier documents of any file) in JSONL files of a fixed size; the 1x corpus is
  `--base-files` files, 4x and 16x are more files of the same size (the first files are shared), so with one task
  per file the task size stays fixed and the task count grows with the corpus. These runs use a fixed tokenizer
  (`--tokenizer`, trained once by a pipeline run on the 1x corpus, which is also reported) so BPE training memory
  does not dominate. Goal: peak RSS flat (<= 1.3x) from 1x to 16x.
* single (issue 51): the same corpus as ONE JSONL file at each scale, run as the issue did (`--heldout-fraction 0
  --tokenizer-sample-mb 2`, a trained BPE, default tasks: one below 256 MB, 1 worker), then the largest with
  `--tasks 4 --workers 2` (wall time, cores busy = CPU s / wall s, and whether the dataset's bytes are the same).
  Goal: every stage's largest task, and the largest process, <= 1.3x from 1x to 16x.
* big: `--big-gb` of fresh synthetic documents as one file, default tasks (one per 256 MB), 2 workers,
  `--tokenizer-sample-mb 64`: throughput per worker and peak RSS per stage.
* recall: 1,500 documents, 400 of them with 4 near copies each (0.3-1.6 % of words replaced), one task: which copies
  dedup removed, by their exact Jaccard (Python sets of the pipeline's shingles) with the original.
* sample: `python -m data_prep sample --workers 1` with this checkout and with the old in-memory implementation
  (`--old-checkout`, a worktree of the commit before the datatrove rebuild). Goal: new throughput per worker
  within 1.5x of the old.
* encoder probe: RSS over 32 rounds of encoding one corpus file (batches of 512, as a tokenize task does) with one
  `tokenizers.Tokenizer` for all rounds vs a new one per round (as each tokenize task builds its own).

Per run: wall time; CPU time of the whole process tree (psutil, summed over every process seen; robust to other
load on a shared box, unlike wall time) and the 1-minute load average before it; documents (metadata.json, sum of
domains.*.ingest.documents) and tokens (train + heldout) per second of wall time per worker; peak memory. Memory is
polled every 50 ms over the whole process tree (psutil: the command, datatrove's multiprocess manager, which exists
even with one worker, forkserver and pool workers; the poll costs ~1 ms of CPU per process): `RSS tree` is the largest sum of RSS over the tree at one instant, `RSS single` the largest one
process reached, `PSS tree` the largest sum of PSS (pages shared by forked processes split between them, so not
counted twice as in the RSS sum). `ru_maxrss` (os.wait4 of the command: the largest single process among it and the
children it reaped; datatrove's forkserver children are not among them) is a cross-check. For the new pipeline the
time and the peaks are also split by stage, a stage ending at its last datatrove completion marker in the work folder
(the first stage starts with the command, so imports and planning count to prepare), and each stage's largest task
peak as the pipeline records it (`task`: the process's high-water mark, reset when the task starts).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("prepare", "buckets", "dedup", "tokenize", "write", "finalize")
POLL_S = 0.05
MIB = 2**20

# --- synthetic corpus ----------------------------------------------------------------------------------

FUNCTION_WORDS = ["the", "of", "and", "to", "a", "in", "that", "is", "was", "he", "for", "it", "with", "as", "his",
    "on", "be", "at", "by", "i", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which",
    "one", "you", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has", "when", "who",
    "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them", "can",
    "only", "other", "new", "some", "could", "time", "these", "two", "may", "then", "do", "first", "any", "my",
    "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also"]
SYLLABLES = ["ka", "ri", "to", "men", "sa", "lo", "ver", "an", "tes", "pro", "di", "nu", "ca", "le", "mi", "or",
    "sen", "tra", "ge", "bo", "fa", "ul", "ex", "re", "con", "ti", "pa", "ro", "lu", "de", "ma", "ne", "vi", "ol",
    "ar", "es", "in", "um", "os", "ta", "co"]
NEAR_DUP, EXACT_DUP = 0.05, 0.02  # fractions of planted documents
POOL = 400  # earlier documents a planted copy is drawn from (spans files, so duplicates cross tasks)


def vocabulary(rng: np.random.Generator, size: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Function words (frequent, as in English; ~45% of the text) and pseudo-words of 1-4 syllables with
    Zipf-like weights; (words, probabilities)."""
    content = sorted({"".join(rng.choice(SYLLABLES, rng.integers(1, 5))) for _ in range(size)} - set(FUNCTION_WORDS))
    rng.shuffle(content)
    function = 1.0 / np.arange(1, len(FUNCTION_WORDS) + 1) ** 0.5
    zipf = 1.0 / np.arange(10, len(content) + 10)  # offset: no pseudo-word dominates a document
    weights = np.concatenate([0.45 * function / function.sum(), 0.55 * zipf / zipf.sum()])
    return np.array(FUNCTION_WORDS + content), weights


def document(rng: np.random.Generator, words: np.ndarray, probs: np.ndarray) -> str:
    """2-4 KB of sentences (6-20 words) in paragraphs of 3-7 sentences."""
    drawn = words[rng.choice(len(words), int(rng.integers(2048, 4096)) // 6, p=probs)].tolist()
    paragraphs, sentences, i = [], [], 0
    while i < len(drawn):
        n = int(rng.integers(6, 21))
        sentences.append(" ".join(drawn[i:i + n]).capitalize() + ".....?!"[int(rng.integers(7))])
        i += n
        if len(sentences) >= rng.integers(3, 8) or i >= len(drawn):
            paragraphs.append(" ".join(sentences))
            sentences = []
    return "\n\n".join(paragraphs)


def near_copy(rng: np.random.Generator, text: str, words: np.ndarray) -> str:
    """`text` with ~1% of its words replaced: Jaccard of 5-word shingles ~0.9, above the 0.85 threshold."""
    tokens = text.split(" ")
    for i in rng.choice(len(tokens), max(1, len(tokens) // 100), replace=False):
        tokens[i] = str(words[rng.integers(len(words))])
    return " ".join(tokens)


def write_files(folder: str, files: int, docs_per_file: int, seed: int = 0) -> list[str]:
    """`files` JSONL files of `docs_per_file` documents; generated in order, so a prefix of the files is the
    same for any `files`."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    words, probs = vocabulary(rng)
    pool: list[str] = []
    paths = []
    for f in range(files):
        path = os.path.join(folder, f"part-{f:05d}.jsonl")
        with open(path + ".tmp", "w", encoding="utf-8") as out:
            for _ in range(docs_per_file):
                r = rng.random()
                if pool and r < EXACT_DUP:
                    text = pool[rng.integers(len(pool))]
                elif pool and r < EXACT_DUP + NEAR_DUP:
                    text = near_copy(rng, pool[rng.integers(len(pool))], words)
                else:
                    text = document(rng, words, probs)
                    pool = (pool + [text])[-POOL:]
                out.write(json.dumps({"text": text}) + "\n")
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def corpora(root: str, base_files: int, docs_per_file: int, scales: list[int]) -> dict[int, str]:
    """{scale: folder of hard links to the first scale * base_files files}; generated once, reused after."""
    all_dir = os.path.join(root, f"files-{docs_per_file}")
    need = max(scales) * base_files
    stamp = os.path.join(all_dir, f"done-{need}")
    if not os.path.exists(stamp):
        shutil.rmtree(all_dir, ignore_errors=True)
        write_files(all_dir, need, docs_per_file)
        open(stamp, "w").close()
    paths = sorted(glob.glob(os.path.join(all_dir, "part-*.jsonl")))
    out = {}
    for scale in scales:
        folder = os.path.join(root, f"x{scale}-{base_files}x{docs_per_file}")
        if not os.path.isdir(folder):
            os.makedirs(folder + ".tmp", exist_ok=True)
            for p in paths[:scale * base_files]:
                os.link(p, os.path.join(folder + ".tmp", os.path.basename(p)))
            os.replace(folder + ".tmp", folder)
        out[scale] = folder
    return out


def folder_mb(folder: str) -> float:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*.jsonl"))) / MIB


# --- one measured run ----------------------------------------------------------------------------------

def sample_tree(proc: psutil.Process, cpu: dict) -> tuple[int, int, int]:
    """(summed RSS, largest RSS, summed PSS) of `proc` and its descendants now; updates `cpu` ({(pid, start):
    user + system seconds so far}). Processes that vanish meanwhile are skipped."""
    rss_sum = rss_max = pss_sum = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0
    for p in procs:
        try:
            with p.oneshot():
                mem, times, started = p.memory_full_info(), p.cpu_times(), p.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rss_sum, rss_max, pss_sum = rss_sum + mem.rss, max(rss_max, mem.rss), pss_sum + mem.pss
        cpu[(p.pid, started)] = times.user + times.system
    return rss_sum, rss_max, pss_sum


def run_measured(cmd: list[str], cwd: str, env: dict[str, str], log: str) -> dict:
    """Runs `cmd`, sampling its process tree every POLL_S; returns wall and CPU time, the memory peaks and the
    samples (time, summed RSS, largest RSS, summed PSS)."""
    load = os.getloadavg()[0]
    with open(log, "w") as out:
        t0 = time.time()
        child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        proc, samples, cpu = psutil.Process(child.pid), [], {}
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            samples.append((time.time(), *sample_tree(proc, cpu)))
            time.sleep(POLL_S)
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        with open(log) as f:
            sys.exit(f"{' '.join(cmd)} failed ({child.returncode}); see {log}:\n" + f.read()[-3000:])
    peak = [max((s[i] for s in samples), default=0) / MIB for i in (1, 2, 3)]
    return {"wall_s": time.time() - t0, "cpu_s": sum(cpu.values()), "load_before": load, "start": t0,
            "samples": samples, "tree_mb": peak[0], "single_mb": peak[1], "pss_mb": peak[2],
            "ru_maxrss_mb": usage.ru_maxrss / 1024}


def dataset_counts(out: str) -> tuple[int, int, int]:
    """(documents read, duplicates removed, tokens written) from metadata.json."""
    with open(os.path.join(out, "metadata.json")) as f:
        meta = json.load(f)
    domains = meta["domains"].values()
    docs = sum(d["ingest"]["documents"] for d in domains)
    tokens = sum(d[split]["tokens"] for d in domains for split in ("train", "heldout"))
    return docs, meta["dedup"]["removed"], tokens


def stage_breakdown(out: str, run: dict) -> dict[str, dict[str, float]]:
    """{stage: {"s": seconds, "tree_mb", "single_mb": peaks}} of the new pipeline: a stage ends at its last completion
    marker (logs/<stage>/completions/*) and starts where the one before ended (the first: at the command's start,
    so planning and imports count to prepare)."""
    (work,) = glob.glob(os.path.join(out, "_work", "*"))
    spans, start = {}, run["start"]
    for stage in STAGES:
        marks = glob.glob(os.path.join(work, "logs", stage, "completions", "*"))  # write: logs/write-<tasks>
        marks += glob.glob(os.path.join(work, "logs", f"{stage}-*", "completions", "*"))
        end = max(map(os.path.getmtime, marks)) if marks else run["start"] + run["wall_s"]
        if stage == STAGES[-1]:
            end = run["start"] + run["wall_s"]
        inside = [s for s in run["samples"] if start <= s[0] <= end]
        spans[stage] = {"s": end - start, "tree_mb": max((s[1] for s in inside), default=0) / MIB,
                        "single_mb": max((s[2] for s in inside), default=0) / MIB}
        start = end
    return spans


# --- the runs ------------------------------------------------------------------------------------------

def python_env(checkout: str) -> dict[str, str]:
    """This interpreter's environment with `checkout` first on the path (the venv has /work/main installed
    editable: without it an old worktree would import the new data_prep)."""
    return {**os.environ, "PYTHONPATH": checkout, "PYTHONUNBUFFERED": "1"}


def commit(checkout: str) -> str:
    """Short commit of `checkout`, with "+uncommitted data_prep" when its data_prep/ differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, check=False).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+uncommitted data_prep" if git("status", "--porcelain", "data_prep")
                                                   else "")


def check_import(checkout: str) -> None:
    got = subprocess.run([sys.executable, "-c", "import data_prep; print(data_prep.__file__)"], cwd=checkout,
                         env=python_env(checkout), capture_output=True, text=True, check=True).stdout.strip()
    if not got.startswith(os.path.realpath(checkout) + os.sep):
        sys.exit(f"{checkout} imports data_prep from {got}")


def pipeline_run(name: str, checkout: str, corpus: str, workers: int, scratch: str, tokenizer: str | None,
                 vocab: int, flags: tuple[str, ...] = ()) -> dict:
    out = os.path.join(scratch, "out", name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "data_prep", "pipeline", "--input", f"web={corpus}", "--out", out,
           "--executor", "local", "--workers", str(workers), "--vocab-size", str(vocab), *flags]
    cmd += ["--tokenizer", tokenizer] if tokenizer else []
    run = run_measured(cmd, checkout, python_env(checkout), os.path.join(scratch, f"{name}.log"))
    run["stages"] = stage_breakdown(out, run)
    run["task_peaks"] = task_peaks(out)
    run["command"] = " ".join(["python", *cmd[1:]])
    return finish(run, name, out, workers)


def task_peaks(out: str) -> dict[str, float]:
    """{stage: largest task's peak RSS in MB} as the pipeline records it (<work>/rss/<stage>/<rank>.json: each task
    resets the process's high-water mark when it starts, so it is the task's own even in a reused process)."""
    (work,) = glob.glob(os.path.join(out, "_work", "*"))
    peaks = {}
    for stage in STAGES:
        values = []
        for path in glob.glob(os.path.join(work, "rss", stage, "*.json")):
            with open(path) as f:
                values.append(json.load(f)["peak_mb"])
        if values:
            peaks[stage] = max(values)
    return peaks


def single_file(corpus_dir: str, scale: int, base_files: int) -> str:
    """The first scale * base_files files of the multi-file corpus as one JSONL file (made once)."""
    path = os.path.join(os.path.dirname(corpus_dir), f"single-x{scale}-{os.path.basename(corpus_dir)}.jsonl")
    if not os.path.exists(path):
        with open(path + ".tmp", "wb") as out:
            for p in sorted(glob.glob(os.path.join(corpus_dir, "part-*.jsonl")))[:scale * base_files]:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out)
        os.replace(path + ".tmp", path)
    return path


def big_file(root: str, gb: float, docs_per_file: int = 2000) -> str:
    """About `gb` GB of the synthetic corpus (fresh documents throughout, seed 1) as one JSONL file (made once)."""
    path = os.path.join(root, f"big-{gb:g}gb.jsonl")
    if not os.path.exists(path):
        parts = os.path.join(root, f"big-{gb:g}gb-parts")
        files = max(1, round(gb * 2**30 / (docs_per_file * 3 * 2**10)))  # ~3 KB per document
        write_files(parts, files, docs_per_file, seed=1)
        with open(path + ".tmp", "wb") as out:
            for p in sorted(glob.glob(os.path.join(parts, "part-*.jsonl"))):
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out)
        os.replace(path + ".tmp", path)
        shutil.rmtree(parts)
    return path


def shingle_set(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """The pipeline's default shingles, exactly: lower-cased `\\w+` word 5-grams."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def recall_corpus(path: str, originals: int, clusters: int, copies: int = 4, seed: int = 2) -> list[float]:
    """`originals` fresh documents, then `copies` near copies of each of the first `clusters` (each its own ~0.3-1.6 %
    of words replaced), as one JSONL file; returns each copy's exact Jaccard with its original, in file order."""
    rng = np.random.default_rng(seed)
    words, probs = vocabulary(rng)
    docs = [document(rng, words, probs) for _ in range(originals)]
    lines, jaccards = list(docs), []
    for i in range(clusters):
        base = shingle_set(docs[i])
        for _ in range(copies):
            tokens = docs[i].split(" ")
            for k in rng.choice(len(tokens), max(1, int(len(tokens) * rng.uniform(0.003, 0.016))), replace=False):
                tokens[k] = str(words[rng.integers(len(words))])
            lines.append(" ".join(tokens))
            other = shingle_set(lines[-1])
            jaccards.append(len(base & other) / len(base | other))
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps({"text": t}) + "\n" for t in lines)
    return jaccards


def recall_run(scratch: str, checkout: str, vocab: int, originals: int = 1500, clusters: int = 400) -> dict:
    """MinHash recall on planted near-duplicate clusters: which copies the pipeline removed, by exact Jaccard."""
    path = os.path.join(scratch, "corpus", f"recall-{originals}-{clusters}.jsonl")
    jaccards = recall_corpus(path, originals, clusters)
    run = pipeline_run("recall", checkout, path, 1, scratch, None, vocab,
                       ("--heldout-fraction", "0", "--tasks", "1", "--tokenizer-sample-mb", "2"))
    (work,) = glob.glob(os.path.join(run["out"], "_work", "*"))
    index = np.load(os.path.join(work, "index", "00000.npy"))
    with open(os.path.join(work, "remove", "000000.remove"), "rb") as f:
        removed = set(index["ord"][np.frombuffer(f.read(), "<u4")].tolist())  # document numbers in the file
    copy_removed = np.array([originals + k in removed for k in range(len(jaccards))])
    j = np.array(jaccards)
    bins = {}
    for lo, hi in ((0.0, 0.85), (0.85, 0.88), (0.88, 0.91), (0.91, 0.94), (0.94, 1.01)):
        inside = (j >= lo) & (j < hi)
        bins[f"[{lo:.2f}, {min(hi, 1):.2f})"] = (int(inside.sum()), int(copy_removed[inside].sum()))
    above = j >= 0.85
    return {"copies": len(j), "jaccard_min": float(j.min()), "jaccard_max": float(j.max()), "bins": bins,
            "recall_at_or_above": float(copy_removed[above].mean()) if above.any() else float("nan"),
            "originals_removed": sum(k in removed for k in range(originals)), "clusters": clusters,
            "command": run["command"]}


def same_dataset(a: str, b: str) -> bool:
    """Every file of two dataset folders, the work folders left out, byte for byte."""
    def files(root: str) -> dict[str, bytes]:
        out = {}
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x != "_work"]
            for n in names:
                with open(os.path.join(d, n), "rb") as f:
                    out[os.path.relpath(os.path.join(d, n), root)] = f.read()
        return out

    return files(a) == files(b)


def sample_run(name: str, checkout: str, workers: int, scratch: str) -> dict:
    out = os.path.join(scratch, "out", name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "data_prep", "sample", "--out", out, "--workers", str(workers)]
    run = run_measured(cmd, checkout, python_env(checkout), os.path.join(scratch, f"{name}.log"))
    if os.path.isdir(os.path.join(out, "_work")):
        run["stages"] = stage_breakdown(out, run)
    return finish(run, name, out, workers)


def finish(run: dict, name: str, out: str, workers: int) -> dict:
    docs, duplicates, tokens = dataset_counts(out)
    run.update(name=name, out=out, workers=workers, docs=docs, duplicates=duplicates, tokens=tokens,
               docs_per_s_worker=docs / run["wall_s"] / workers, tokens_per_s_worker=tokens / run["wall_s"] / workers)
    del run["samples"]
    print(f"  {name}: {run['wall_s']:.1f} s, {docs} docs, {tokens} tokens, tree {run['tree_mb']:.0f} MB, "
          f"single {run['single_mb']:.0f} MB", flush=True)
    return run


# --- the tokenizer probe -------------------------------------------------------------------------------

def encoder_probe(tokenizer: str, jsonl: str, fresh: bool, tasks: int = 32) -> list[float]:
    """RSS (MB) after each of `tasks` rounds of encoding one file's documents in batches of 512 (what a tokenize task
    does), with one Tokenizer for all rounds or a new one per round (fresh: as a tokenize task loads its own)."""
    from tokenizers import Tokenizer

    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok, rss = Tokenizer.from_file(tokenizer), []
    for _ in range(tasks):
        if fresh:
            tok = Tokenizer.from_file(tokenizer)
        for i in range(0, len(texts), 512):
            tok.encode_batch(texts[i:i + 512], add_special_tokens=False)
        rss.append(psutil.Process().memory_info().rss / MIB)
    return rss


def probe_run(tokenizer: str, jsonl: str, fresh: bool) -> list[float]:
    """encoder_probe in a fresh interpreter (this script with --encoder-probe)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--encoder-probe", tokenizer, jsonl] + (["--fresh"] if fresh else [])
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


# --- report --------------------------------------------------------------------------------------------

def table(rows: list[dict], sizes: dict[str, float]) -> str:
    header = ("| run | corpus MB | workers | wall s | CPU s | load | docs | duplicates | docs/s/worker | tokens/s/worker "
              "| peak RSS tree MB | peak RSS single MB | peak PSS tree MB | ru_maxrss MB |")
    lines = [header, "|---" * 14 + "|"]
    for r in rows:
        lines.append(f"| {r['name']} | {sizes.get(r['name'], float('nan')):.1f} | {r['workers']} | {r['wall_s']:.1f} "
                     f"| {r['cpu_s']:.1f} | {r['load_before']:.1f} | {r['docs']:,} | {r['duplicates']:,} | {r['docs_per_s_worker']:,.0f} "
                     f"| {r['tokens_per_s_worker']:,.0f} | {r['tree_mb']:.0f} | {r['single_mb']:.0f} "
                     f"| {r['pss_mb']:.0f} | {r['ru_maxrss_mb']:.0f} |")
    return "\n".join(lines)


def stage_table(rows: list[dict]) -> str:
    """Seconds / peak RSS tree MB / peak RSS single MB per stage."""
    staged = [r for r in rows if "stages" in r]
    lines = ["| run | " + " | ".join(f"{s} s / tree / single / task MB" for s in STAGES) + " |",
             "|---" * (len(STAGES) + 1) + "|"]
    for r in staged:
        peaks = r.get("task_peaks", {})
        cells = [f"{v['s']:.1f} / {v['tree_mb']:.0f} / {v['single_mb']:.0f} / {peaks.get(s, float('nan')):.0f}"
                 for s, v in r["stages"].items()]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def single_goals(rows: dict[str, dict], scales: list[int]) -> list[str]:
    out = []
    first, last = rows.get(f"single x{scales[0]} t1"), rows.get(f"single x{scales[-1]} t1")
    if first and last:
        ratios = {s: last["task_peaks"][s] / first["task_peaks"][s] for s in STAGES}
        worst = max(ratios.values())
        out.append(f"single file, peak RSS x{scales[-1]} / x{scales[0]}: largest process {last['single_mb'] / first['single_mb']:.2f}"
                   f", per stage (largest task) " + ", ".join(f"{s} {r:.2f}" for s, r in ratios.items())
                   + f" -> goal <= 1.3 {'met' if max(worst, last['single_mb'] / first['single_mb']) <= 1.3 else 'NOT met'}")
    one, four = rows.get(f"single x{scales[-1]} t1"), rows.get(f"single x{scales[-1]} t4 w2")
    if one and four:
        out.append(f"single file x{scales[-1]}: --tasks 4 --workers 2 {four['wall_s']:.1f} s wall ({four['cpu_s'] / four['wall_s']:.2f}"
                   f" cores busy on average) vs --tasks 1 {one['wall_s']:.1f} s ({one['cpu_s'] / one['wall_s']:.2f}): "
                   f"{one['wall_s'] / four['wall_s']:.2f}x; same bytes: {four['same_bytes']}")
    return out


def goals(rows: dict[str, dict], scales: list[int], workers: list[int]) -> list[str]:
    out = []
    if f"x{scales[0]} w{workers[0]}" not in rows:
        return out
    for w in workers:
        first, last = rows[f"x{scales[0]} w{w}"], rows[f"x{scales[-1]} w{w}"]
        ratio, single, pss = (last[k] / first[k] for k in ("tree_mb", "single_mb", "pss_mb"))
        out.append(f"workers {w}: peak x{scales[-1]} / x{scales[0]} = {ratio:.2f} (RSS tree), {single:.2f} (RSS single),"
                   f" {pss:.2f} (PSS tree) -> goal <= 1.3 {'met' if ratio <= 1.3 else 'NOT met'} (RSS tree)")
    if "sample old w1" in rows:
        old, new = rows["sample old w1"], rows["sample new w1"]
        ratio = old["docs_per_s_worker"] / new["docs_per_s_worker"]
        out.append(f"sample, 1 worker: old / new docs/s = {ratio:.2f} (wall {old['wall_s']:.1f} s vs "
                   f"{new['wall_s']:.1f} s; CPU {old['cpu_s']:.1f} s vs {new['cpu_s']:.1f} s) -> goal <= 1.5 "
                   f"{'met' if ratio <= 1.5 else 'NOT met'}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scratch", default="/tmp/data_prep_bench", help="corpora, outputs and logs")
    p.add_argument("--base-files", type=int, default=8, help="JSONL files of the 1x corpus")
    p.add_argument("--docs-per-file", type=int, default=200, help="2-4 KB documents per file (200: ~4.8 MB)")
    p.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--cases", nargs="+", choices=("multi", "single", "sample", "big", "recall"),
                   default=["multi", "single", "sample"], help="which runs (big: --big-gb of one file, minutes)")
    p.add_argument("--big-gb", type=float, default=1.0, help="size of the big single-file corpus")
    p.add_argument("--old-checkout", default="/tmp/old_dp",
                   help="worktree of the in-memory implementation (git worktree add /tmp/old_dp <commit>); "
                        "'' skips the sample comparison")
    p.add_argument("--new-checkout", default=REPO,
                   help="checkout of the datatrove pipeline (default: this one; a worktree freezes it while others edit)")
    p.add_argument("--encoder-probe", nargs=2, metavar=("TOKENIZER", "JSONL"), help=argparse.SUPPRESS)
    p.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.encoder_probe:
        return print(json.dumps(encoder_probe(*args.encoder_probe, args.fresh)))
    new = args.new_checkout
    check_import(new)
    if args.old_checkout and "sample" in args.cases:
        check_import(args.old_checkout)
    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; commit {commit(new)}"
          + (f"; old: {commit(args.old_checkout)}" if args.old_checkout and "sample" in args.cases else ""))
    folders = corpora(os.path.join(args.scratch, "corpus"), args.base_files, args.docs_per_file, args.scales)
    sizes, rows = {}, {}
    base = args.scales[0]
    # the trained-tokenizer run: also makes the fixed tokenizer of the scaling runs
    name = f"x{base} w1 trained BPE"
    rows[name] = pipeline_run(name, new, folders[base], 1, args.scratch, None, args.vocab_size)
    sizes[name] = folder_mb(folders[base])
    tokenizer = os.path.join(rows[name]["out"], "tokenizer.json")
    if "multi" in args.cases:
        for scale in args.scales:
            for w in args.workers:
                name = f"x{scale} w{w}"
                rows[name] = pipeline_run(name, new, folders[scale], w, args.scratch, tokenizer, args.vocab_size)
                sizes[name] = folder_mb(folders[scale])
    # the single-file case: a trained BPE on a fixed 2 MB sample, default tasks (one: < 256 MB), 1 worker
    single = ("--heldout-fraction", "0", "--tokenizer-sample-mb", "2")
    if "single" in args.cases:
        for scale in args.scales:
            path = single_file(folders[max(args.scales)], scale, args.base_files)
            name = f"single x{scale} t1"
            rows[name] = pipeline_run(name, new, path, 1, args.scratch, None, args.vocab_size, single)
            sizes[name] = os.path.getsize(path) / MIB
        name, ref = f"single x{max(args.scales)} t4 w2", rows[f"single x{max(args.scales)} t1"]
        rows[name] = pipeline_run(name, new, path, 2, args.scratch, None, args.vocab_size, (*single, "--tasks", "4"))
        rows[name]["same_bytes"] = same_dataset(rows[name]["out"], ref["out"])
        sizes[name] = os.path.getsize(path) / MIB
    if "big" in args.cases:
        path = big_file(os.path.join(args.scratch, "corpus"), args.big_gb)
        name = f"big {args.big_gb:g} GB w2"
        rows[name] = pipeline_run(name, new, path, 2, args.scratch, None, args.vocab_size,
                                  ("--tokenizer-sample-mb", "64"))
        sizes[name] = os.path.getsize(path) / MIB
    recall = recall_run(args.scratch, new, args.vocab_size) if "recall" in args.cases else None
    if args.old_checkout and "sample" in args.cases:
        rows["sample old w1"] = sample_run("sample old w1", args.old_checkout, 1, args.scratch)
        rows["sample new w1"] = sample_run("sample new w1", new, 1, args.scratch)
        for name in ("sample old w1", "sample new w1"):
            sizes[name] = folder_mb(os.path.join(rows[name]["out"], "_source"))
    probe = ({fresh: probe_run(tokenizer, min(glob.glob(os.path.join(folders[base], "*.jsonl"))), fresh)
              for fresh in (False, True)} if "multi" in args.cases else {})
    results = list(rows.values())
    print()
    print(table(results, sizes))
    print()
    print(stage_table(results))
    print()
    print("\n".join(goals(rows, args.scales, args.workers) + single_goals(rows, args.scales)))
    for r in results:
        print(f"{r['name']}: {r['command']}")
    if recall:
        print(f"MinHash recall, {recall['clusters']} clusters of 4 near copies (exact Jaccard {recall['jaccard_min']:.3f}"
              f"-{recall['jaccard_max']:.3f}): copies removed at Jaccard >= 0.85: {recall['recall_at_or_above']:.4f}; "
              f"by Jaccard (copies, removed): {recall['bins']}; originals removed: {recall['originals_removed']}")
    for fresh, rss in probe.items():
        print(f"encoder probe, {'a new' if fresh else 'one'} Tokenizer per task: RSS after task 1 / {len(rss) // 2} / "
              f"{len(rss)}: {rss[0]:.0f} / {rss[len(rss) // 2 - 1]:.0f} / {rss[-1]:.0f} MB")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
