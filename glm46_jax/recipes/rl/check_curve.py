"""`python -m glm46_jax.recipes.rl.check_curve RUN_DIR [--reward-run DIR]`: what an RL run against a reward model did,
from its files: held-out exact match before and after, the reward model's check over the steps (the proxy win rate
against the labeller's, Gao et al.'s over-optimisation picture; docs/rl.md#the-reward-model-check) as a table and as
<run_dir>/check_curve.png, and whether the check stopped the run.

    python -m glm46_jax.recipes.rl.check_curve runs/rlhf_tiny/round1/ppo --reward-run runs/rlhf_tiny/round1/reward
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from glm46_jax import cli
from glm46_jax.errors import InputError
from glm46_jax.recipes.rl import heldout

COLUMNS = ("eval/accuracy", "eval/check_win_rate", "eval/check_proxy_win_rate", "eval/check_agreement")


def _json(path: str) -> Any:
    if not os.path.isfile(path):
        raise InputError(f"{path}: not found; run the stage that writes it first (make rlhf runs them in order)")
    with open(path) as f:
        return json.load(f)


def check_records(run_dir: str) -> list[dict[str, float]]:
    """The run's evaluation records that carry the check, in step order (the last record per step)."""
    records = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if "eval/check_win_rate" in r:
                records[r["step"]] = r
    return [records[s] for s in sorted(records)]


def summary_lines(run_dir: str, reward_runs: Sequence[str] = ()) -> list[str]:
    """What make rlhf prints of a PPO run: each reward model's held-out pair accuracy (`reward_runs`: the ensemble's
    members), held-out accuracy before and after, the stop, and the check per evaluation."""
    lines = []
    for i, reward_run in enumerate(reward_runs):
        rm = _json(os.path.join(reward_run, "heldout.json"))
        which = f" {i + 1} of {len(reward_runs)}" if len(reward_runs) > 1 else ""
        lines.append(f"reward model{which}: held-out pair accuracy {rm['start']['accuracy']:.3f} -> "
                     f"{rm['end']['accuracy']:.3f} on {rm['end']['pairs']:.0f} pairs")
    r, status = _json(os.path.join(run_dir, "heldout.json")), _json(os.path.join(run_dir, "status.json"))
    a, b, n = r["start_accuracy"], r["end"]["accuracy"], r["problems"]
    se = (a * (1 - a) / n) ** 0.5
    line = f"held-out exact-match accuracy on {n} problems (greedy): {a:.3f} +- {se:.3f} before -> {b:.3f} after "
    if r.get("start_passed") is not None:  # the gain's own (paired) standard error
        g = heldout.gain([r])
        line += f"({g.mean:+.3f} +- {g.se:.3f} paired, {g.mean / g.se if g.se else 0.0:+.1f} standard errors)"
    else:
        line += f"({b - a:+.3f}, {(b - a) / se:+.1f} standard errors of the start)"
    lines.append(line)
    if status.get("reason"):
        ended = status.get("rolled_back_to", status["step"])
        lines.append(f"stopped at step {status['step']}: {status['reason']}; ended on step {ended}")
    records = check_records(run_dir)
    if records:
        lines.append("step  " + "  ".join(c.removeprefix("eval/") for c in COLUMNS))
        lines += [f"{x['step']:>4}  " + "  ".join(f"{x.get(c, float('nan')):>{len(c) - 5}.3f}" for c in COLUMNS)
                  for x in records]
    return lines


def plot(run_dir: str) -> str:
    """<run_dir>/check_curve.png: the check's win rates (and held-out accuracy) against the step."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InputError("the check curve needs matplotlib: pip install matplotlib") from e
    records = check_records(run_dir)
    fig, ax = plt.subplots(figsize=(6, 4))
    for column in COLUMNS[:3]:
        ax.plot([r["step"] for r in records], [r[column] for r in records], marker=".",
                label=column.removeprefix("eval/"))
    ax.set_xlabel("step")
    ax.set_ylabel("share")
    ax.set_title("reward model (proxy) vs labeller (gold) against the starting policy")
    ax.legend()
    path = os.path.join(run_dir, "check_curve.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm46_jax.recipes.rl.check_curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="an RL run with rl.labeller set")
    p.add_argument("--reward-run", action="append", default=[],
                   help="a reward run it used (its held-out pair accuracy is printed too); once per ensemble member")
    args = p.parse_args(argv)
    print("\n".join(summary_lines(args.run_dir, args.reward_run)))
    if check_records(args.run_dir):
        print(f"-> {plot(args.run_dir)}")
    else:
        print("no reward-model check in this run (rl.labeller unset): no curve", file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
