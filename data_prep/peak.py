"""Peak memory of every task, per stage: each stage's first block resets the process's high-water mark of resident
memory (Linux: `/proc/self/clear_refs`), its last block saves the mark as `<work>/rss/<stage>/<rank>.json`.

Resetting makes the number the task's own even where one process runs many tasks (one local worker runs every task
of every stage in the driver). The numbers vary between runs, so they are printed and kept in the work folder, not in
metadata.json (whose bytes do not depend on how the run went). Elsewhere than Linux the mark is the process's
lifetime peak (`ru_maxrss`).
"""

from __future__ import annotations

import resource
import sys

from datatrove.data import DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep

from data_prep.work import load_json, save_json


def reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (Linux >= 4.0)
    except OSError:
        pass


def peak_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB elsewhere


class ResetPeak(PipelineStep):
    """First block of a stage: not a generator, so it runs when the task starts, before any block's work."""

    name, type = "reset peak RSS", "📊 - STATS"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        reset()
        return data


class SavePeak(PipelineStep):
    """Last block of a stage: passes the documents through, then saves the task's peak RSS."""

    name, type = "save peak RSS", "📊 - STATS"

    def __init__(self, work: str, stage: str):
        super().__init__()
        self.work, self.stage = work, stage

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        yield from data or ()
        save_json(get_datafolder(self.work), f"rss/{self.stage}/{rank:05d}.json", {"peak_mb": round(peak_mb(), 1)})


def wrapped(work: str, stage: str, pipeline: list) -> list:
    return [ResetPeak(), *pipeline, SavePeak(work, stage)]


def stage_peaks(work: str, tasks: dict[str, int]) -> dict[str, dict[str, float]]:
    """{stage: {"max_mb": largest task, "tasks": tasks measured}} from the work folder (tasks a re-run skipped keep
    the numbers of the run that did them)."""
    folder, out = get_datafolder(work), {}
    for stage, n in tasks.items():
        peaks = [load_json(folder, f"rss/{stage}/{r:05d}.json")["peak_mb"] for r in range(n)
                 if folder.isfile(f"rss/{stage}/{r:05d}.json")]
        if peaks:
            out[stage] = {"max_mb": max(peaks), "tasks": len(peaks)}
    return out
