"""What a training run leaves for people to read: held-out evaluations, a before/after table and
the training curves.

- :func:`eval_flags` are the env flags of a held-out evaluation (its held-out split, greedy)
  against the inference server that serves the current weights;
  :class:`example_trainer.eval_worker.EvalWorker` runs it, :func:`read_eval_metrics` reads what
  it wrote.
- :func:`before_after_table` formats two evaluations side by side.
- :func:`plot_training_curves` draws ``training_curves.png`` from ``metrics.jsonl``: reward,
  held-out accuracy, loss, entropy/KL and trainer throughput by step.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EVAL_PREFIX = "eval/"

_BAR = re.compile(r"(\d+)/(\d+) \[([0-9:]+)<([0-9:?]+)")


class EvaluationError(RuntimeError):
    """A held-out evaluation failed (the env's log says why)."""


def eval_flags(
    *,
    inference_url: str,
    model_name: str,
    tokenizer: str,
    env_args: Sequence[str] = (),
    server_type: str | None = None,
) -> list[str]:
    """The env command-line flags of a held-out evaluation against ``inference_url``: no
    wandb, the served model and its tokenizer, then ``env_args``."""
    return [
        "--env.use_wandb",
        "false",
        "--env.tokenizer_name",
        tokenizer,
        "--openai.base_url",
        f"{inference_url}/v1",
        "--openai.model_name",
        model_name,
        *(["--openai.server_type", server_type] if server_type else []),
        *env_args,
    ]


def eval_process_env() -> dict[str, str]:
    """The environment variables of an evaluation process (offline, unbuffered)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def eval_progress(log: Path) -> str | None:
    """The latest ``done/total`` of an evaluation's progress bar in ``log``, with times, or None.

    A bar such as ``eval:  60%|######    | 120/200 [01:40<01:07,  1.19item/s]`` reads
    ``120/200 items, 01:40 elapsed, ~01:07 left``.
    """
    try:
        with open(log, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - 4096))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return None
    matches = _BAR.findall(tail)
    if not matches:
        return None
    done, total, elapsed, remaining = matches[-1]
    return f"{done}/{total} items, {elapsed} elapsed, ~{remaining} left"


def read_eval_metrics(path: Path) -> dict[str, float]:
    """The numeric results of an evaluate ``metrics.json`` (its ``results.all`` entry)."""
    data = json.loads(path.read_text())
    results = data.get("results", {})
    chosen = results.get("all") or next(iter(results.values()), {})
    return {k: float(v) for k, v in chosen.items() if isinstance(v, (int, float))}


def _fmt(key: str, value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if _is_rate(key, value):
        return f"{100 * value:.1f}%"
    return f"{value:.3g}"


def _is_rate(key: str, value: float) -> bool:
    return 0.0 <= value <= 1.0 and not key.endswith(("seconds", "chars", "tokens"))


def before_after_table(
    before: Mapping[str, float], after: Mapping[str, float], title: str = ""
) -> str:
    """A plain-text table of every ``eval/`` metric before and after, with the change
    (percentage points for rates)."""
    keys = [k for k in before if k.startswith(EVAL_PREFIX)]
    keys += [k for k in after if k.startswith(EVAL_PREFIX) and k not in keys]
    width = max([len(k) for k in keys] + [len(title), 10])
    lines = [f"{title:<{width}}  {'before':>9}  {'after':>9}  {'change':>11}"]
    for key in keys:
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            change = "-"
        elif _is_rate(key, b) and _is_rate(key, a):
            change = f"{100 * (a - b):+.1f} pts"
        else:
            change = f"{a - b:+.3g}"
        lines.append(f"{key:<{width}}  {_fmt(key, b):>9}  {_fmt(key, a):>9}  {change:>11}")
    return "\n".join(lines)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` (unreadable lines are skipped)."""
    records = []
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_training_curves(
    metrics_path: Path,
    out_path: Path,
    *,
    eval_key: str = "eval/percent_correct",
    title: str = "",
) -> Path | None:
    """Draw ``out_path`` (PNG) from ``metrics_path``; returns it, or None without data.

    Panels: train reward mean (with a moving average), held-out ``eval_key`` at each
    evaluation (step 0 = before training), loss, policy entropy (and KL when logged), trainer
    tokens/s.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if eval_key in r]
    if not train and not evals:
        return None
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), dpi=80)
    (ax_reward, ax_eval, ax_loss), (ax_entropy, ax_speed, ax_text) = axes
    steps = [r["step"] for r in train]

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], float(r[key])) for r in train if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    xs, reward = series("reward_mean")
    ax_reward.plot(xs, reward, color="#9ecae1", lw=1, label="per step")
    if reward:
        ax_reward.plot(xs, _moving_average(reward, 10), color="#08519c", lw=2, label="10-step mean")
        ax_reward.legend(loc="lower right", fontsize=8)
    ax_reward.set_title("train reward (mean per batch)")

    if evals:
        ex = [r["step"] for r in evals]
        ey = [100 * float(r[eval_key]) for r in evals]
        ax_eval.plot(ex, ey, marker="o", color="#d94801", lw=2, zorder=3,
                     label=eval_key.removeprefix(EVAL_PREFIX))  # fmt: skip
        for x, y in zip(ex, ey, strict=True):
            ax_eval.annotate(f"{y:.0f}%", (x, y), textcoords="offset points", xytext=(0, 6),
                             ha="center", fontsize=8)  # fmt: skip
        top = max(ey)
        # the env's other held-out rates (e.g. percent_boxed), thinner
        others = sorted({k for r in evals for k in r if k.startswith(EVAL_PREFIX)} - {eval_key})
        for key in others:
            points = [(r["step"], float(r[key])) for r in evals if key in r]
            if not points or not all(_is_rate(key, v) for _, v in points):
                continue
            oy = [100 * v for _, v in points]
            ax_eval.plot([p[0] for p in points], oy, marker=".", lw=1, ls="--", zorder=2,
                         label=key.removeprefix(EVAL_PREFIX))  # fmt: skip
            top = max(top, *oy)
        if len(ax_eval.get_lines()) > 1:
            ax_eval.legend(loc="best", fontsize=7)
        ax_eval.set_ylim(0, max(100, top + 10))
    ax_eval.set_title("held-out evaluation (%, greedy)")

    xs, loss = series("loss")
    ax_loss.plot(xs, loss, color="#6a51a3", lw=1)
    ax_loss.axhline(0, color="#999", lw=0.5)
    ax_loss.set_title("GRPO loss")

    xs, entropy = series("entropy")
    if entropy:
        ax_entropy.plot(xs, entropy, color="#238b45", lw=1.5, label="entropy (nats/token)")
    xk, kl = series("kl")
    if kl and any(v != 0 for v in kl):
        ax_entropy.plot(xk, kl, color="#cb181d", lw=1.5, label="KL to reference")
    if entropy or kl:
        ax_entropy.legend(loc="upper right", fontsize=8)
    ax_entropy.set_title("policy entropy / KL at trained tokens")

    xs, speed = series("computed_tokens_per_s")
    if speed:  # positions run through forward + backward
        ax_speed.plot(xs, speed, color="#525252", lw=1, label="computed")
        xt, trained = series("trained_tokens_per_s")
        ax_speed.plot(xt, trained, color="#2171b5", lw=1, label="trained")
        ax_speed.legend(loc="upper right", fontsize=8)
        ax_speed.set_title("trainer tokens/s (computed, trained)")
    else:  # a trainer that only knows its batch (TRL): every token of the batch
        xs, speed = series("batch_tokens_per_s")
        ax_speed.plot(xs, speed, color="#525252", lw=1)
        ax_speed.set_title("trainer batch tokens/s")
    ax_speed.set_ylim(bottom=0)

    ax_text.axis("off")
    if train:
        last = train[-1]
        checkpoints = [float(r["checkpoint_seconds"]) for r in train if "checkpoint_seconds" in r]
        lines = [title] if title else []
        lines += [
            f"steps: {len(steps)}",
            f"sequences: {sum(int(r.get('sequences', 0)) for r in train)}",
            f"train time: {sum(float(r.get('train_seconds', 0)) for r in train) / 60:.1f} min",
            f"wait for batches: {sum(float(r.get('batch_wait_seconds', 0)) for r in train) / 60:.1f} min",
            f"weight sync: {sum(float(r.get('sync_seconds', 0)) for r in train) / 60:.1f} min",
            *(
                [f"checkpoints: {len(checkpoints)}, {sum(checkpoints) / 60:.1f} min"]
                if checkpoints
                else []
            ),
            f"last lr: {last.get('learning_rate', float('nan')):.2g}",
        ]
        if len(evals) >= 2:
            first, final = evals[0][eval_key], evals[-1][eval_key]
            lines.append(f"held-out: {100 * first:.1f}% -> {100 * final:.1f}%")
        ax_text.text(0.02, 0.95, "\n".join(lines), va="top", fontsize=10, family="monospace")
    for ax in (ax_reward, ax_eval, ax_loss, ax_entropy, ax_speed):
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
