"""DatasetEnv: any Hugging Face or local JSONL/JSON dataset, scored by named reward functions.

Upstream's ``environments/dataset_environment/dataset_env.py``: a prompt field and an answer
field of each row, an optional system prompt, and a weighted sum of reward functions picked by
name from :data:`atroposlib.scoring.rewards.REWARD_FUNCTIONS` (``math_verify``/``accuracy``,
``exact_match``, ``contains``, ``choice_letter``, ``think_format``/``format``,
``boxed_format``).

Data:

* ``dataset_name`` (+ ``dataset_config``, ``split``): ``datasets.load_dataset(name, config,
  split=split)`` -- the default, for users with Hub access;
* ``dataset_path``: a local ``.jsonl`` file, a ``.json`` file (a list of rows, or
  ``{"data": [...]}``), or a folder holding ``{split}.jsonl``.

Evaluation uses ``eval_dataset_path`` or ``eval_dataset_name`` (+ ``eval_dataset_config``,
``eval_split``); without them, a ``dataset_path`` folder's ``{eval_split}.jsonl``, or (with no
``dataset_path``) ``dataset_name``'s ``eval_split``; a single local file has no eval set.

Settings go in a YAML file (``--config``, the ``env:`` section) or flags::

    run-api --port 8000 &  atropos-serve --port 9001 &
    python environments/dataset_environment/dataset_env.py process \\
        --config environments/dataset_environment/configs/gsm8k_local.yaml --env.total_steps 4
    python environments/dataset_environment/dataset_env.py evaluate \\
        --config environments/dataset_environment/configs/gsm8k_local.yaml \\
        --env.max_eval_items 50 --env.data_dir_to_save_evals evals/dataset

``reward_functions`` entries are a name, ``{name: ..., weight: ...}``, or upstream's
``{type: ..., weight: ..., params: {...}}`` (``params`` are passed to the function as keyword
arguments; the function ignores those it does not use).
"""

from __future__ import annotations

import logging
import random
import string
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from atroposlib.envs.base import (
    BaseEnv,
    ScoredDataGroup,
)
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import (
    Sample,
    apply_length_penalty,
    eval_completion,
    group_from_samples,
    log_reward_terms,
    sample_chat_group,
    weighted_reward,
)
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.rewards import (
    REWARD_FUNCTIONS,
    RewardFn,
)
from atroposlib.utils.data import load_rows

logger = logging.getLogger(__name__)

__all__ = [
    "DatasetEnv",
    "DatasetEnvConfig",
    "load_local_rows",
    "normalise_reward_spec",
    "render_prompt",
]


def normalise_reward_spec(spec: Any) -> list[dict[str, Any]]:
    """``reward_functions`` as ``[{"name", "weight", "params"}]``.

    Accepts names, ``{name|type, weight, params}`` dicts, or one comma-separated string
    (``"math_verify,think_format"``, as a flag gives it). Raises ValueError naming the bad
    entry and the known functions.
    """
    if spec is None:
        return []
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    if not isinstance(spec, list):
        raise ValueError(f"must be a list of reward functions, got {type(spec).__name__}")
    known = ", ".join(sorted(REWARD_FUNCTIONS))
    out = []
    for i, entry in enumerate(spec):
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"entry {i} must be a name or a mapping, got {entry!r}")
        unknown_keys = set(entry) - {"name", "type", "weight", "params"}
        if unknown_keys:
            raise ValueError(
                f"entry {i}: unknown keys {sorted(unknown_keys)} (allowed: name/type, weight, "
                "params)"
            )
        name = entry.get("name", entry.get("type"))
        if name not in REWARD_FUNCTIONS:
            raise ValueError(f"entry {i}: unknown reward function {name!r}; known: {known}")
        try:
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ValueError(
                f"entry {i} ({name}): weight must be a number, got {entry['weight']!r}"
            ) from None
        params = entry.get("params") or {}
        if not isinstance(params, dict):
            raise ValueError(f"entry {i} ({name}): params must be a mapping, got {params!r}")
        out.append({"name": name, "weight": weight, "params": params})
    return out


def render_prompt(template: str | None, row: dict[str, Any], prompt_field: str) -> str:
    """The user message of a row: ``row[prompt_field]``, put through ``template`` when set
    (``str.format`` with the row's fields, e.g. ``"Question: {question}\\nAnswer:"``).

    Raises KeyError naming the missing field and the row's keys.
    """
    if prompt_field not in row:
        raise KeyError(f"prompt_field {prompt_field!r} is not in the row; keys: {sorted(row)}")
    if not template:
        return str(row[prompt_field])
    try:
        return template.format(**row)
    except KeyError as exc:
        raise KeyError(
            f"prompt_template uses field {exc.args[0]!r}, not in the row; keys: {sorted(row)}"
        ) from None


def resolve_local_path(path: str | Path) -> Path:
    """``path`` as given, or from the repository root when it is relative and does not exist
    from the working directory (configs name bundled data such as ``environments/data/gsm8k``
    relative to the repository)."""
    path = Path(path).expanduser()
    if not path.exists() and not path.is_absolute() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    return path


def load_local_rows(path: str | Path, split: str) -> list[dict[str, Any]]:
    """``atroposlib.utils.data.load_rows`` (a ``.jsonl``/``.json`` file or a folder with
    ``{split}.jsonl``/``{split}.json``) for ``path`` as ``resolve_local_path`` finds it, so
    ``environments/data/gsm8k`` works from anywhere."""
    return load_rows(resolve_local_path(path), split)


REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository this file lives in (bundled data: ``environments/data``)."""


class DatasetEnvConfig(LocalEnvConfig):
    """Settings of the generic dataset environment (upstream's field names)."""

    group_size: int = 8
    use_wandb: bool = True
    total_steps: int = 1000
    batch_size: int = 12
    steps_per_eval: int = 100

    dataset_name: str | None = Field(
        default="gsm8k",
        description="Hugging Face dataset name (load_dataset(name, config, split))",
    )
    dataset_config: str | None = Field(default="main", description="Dataset configuration name")
    split: str = Field(default="train", description="Split to train on")
    dataset_path: str | None = Field(
        default=None,
        validate_default=True,
        description="Local .jsonl/.json file or folder with {split}.jsonl (instead of "
        "dataset_name)",
    )
    prompt_field: str = Field(default="question", description="Row field holding the prompt")
    answer_field: str | None = Field(
        default="answer", description="Row field holding the answer the rewards compare with"
    )
    prompt_template: str | None = Field(
        default=None,
        description="Optional str.format template for the user message over the row's fields, "
        "e.g. 'Question: {question}'",
    )
    system_prompt: str | None = Field(default=None, description="System prompt (none if unset)")
    reward_functions: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"name": "math_verify", "weight": 1.0, "params": {}}],
        validate_default=True,
        description="Reward functions by name with weights: [name, {name, weight, params}] "
        f"(known: {', '.join(sorted(REWARD_FUNCTIONS))})",
    )
    length_penalty: bool = Field(
        default=False,
        description="Upstream's length penalty when every completion in a group gets the "
        "maximum reward (scores scaled down above 50% of max_token_length)",
    )
    shuffle_dataset: bool = Field(default=True, description="Shuffle the training rows")
    seed: int = Field(default=42, description="Shuffle seed")
    temperature: float = Field(default=0.7, ge=0.0, description="Sampling temperature (train)")
    max_tokens: int = Field(
        default=-1, description="Generation budget per completion (-1: max_token_length)"
    )
    min_completion_tokens: int = Field(
        default=1, ge=0, description="Drop completions with fewer trainable tokens"
    )
    eval_dataset_name: str | None = Field(default=None, description="Hub evaluation dataset")
    eval_dataset_config: str | None = Field(default=None, description="Evaluation dataset config")
    eval_split: str = Field(default="test", description="Evaluation split")
    eval_dataset_path: str | None = Field(
        default=None, description="Local evaluation file or folder (like dataset_path)"
    )
    eval_temperature: float = Field(default=0.0, ge=0.0, description="Temperature for evaluate")
    max_eval_items: int = Field(default=100, description="Evaluate on the first N rows (-1: all)")

    @field_validator("reward_functions", mode="before")
    @classmethod
    def _check_rewards(cls, value: Any) -> list[dict[str, Any]]:
        spec = normalise_reward_spec(value)
        if not spec:
            raise ValueError("needs at least one reward function")
        return spec

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, value: str | None) -> str | None:
        if value:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
            except ValueError as exc:
                raise ValueError(f"not a valid str.format template: {exc}") from None
            if not all(f.isidentifier() for f in fields):
                raise ValueError(f"fields must be plain row field names, got {fields}")
        return value

    @field_validator("dataset_path", mode="after")
    @classmethod
    def _check_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and not info.data.get("dataset_name"):
            raise ValueError(
                "set dataset_name (a Hugging Face dataset) or dataset_path (a local file)"
            )
        return value

    @field_validator("prompt_field")
    @classmethod
    def _check_prompt_field(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a row field")
        return value


class DatasetEnv(BaseEnv):
    """A prompt/answer dataset with weighted named reward functions."""

    name = "dataset"
    env_config_cls = DatasetEnvConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rewards: list[tuple[str, RewardFn, float, dict[str, Any]]] = [
            (r["name"], REWARD_FUNCTIONS[r["name"]], r["weight"], r["params"])
            for r in self.config.reward_functions
        ]
        self.train: list[dict[str, Any]] = []
        self.test: list[dict[str, Any]] = []
        self.iter = 0

    default_server_configs = local_server_configs()

    # ------------------------------------------------------------------ data

    def _load(self, name: str | None, config: str | None, path: str | None, split: str):
        if path:
            return load_local_rows(path, split)
        from datasets import load_dataset

        return [dict(row) for row in load_dataset(name, config, split=split)]

    def _check_rows(self, rows: list[dict[str, Any]], where: str) -> None:
        if not rows:
            raise ValueError(f"{where}: the dataset has no rows")
        cfg = self.config
        render_prompt(cfg.prompt_template, rows[0], cfg.prompt_field)
        if cfg.answer_field and cfg.answer_field not in rows[0]:
            raise KeyError(
                f"{where}: answer_field {cfg.answer_field!r} is not in the rows; "
                f"keys: {sorted(rows[0])}"
            )

    async def setup(self) -> None:
        cfg = self.config
        self.train = self._load(cfg.dataset_name, cfg.dataset_config, cfg.dataset_path, cfg.split)
        self._check_rows(self.train, "dataset")
        if cfg.shuffle_dataset:
            random.Random(cfg.seed).shuffle(self.train)
        self.test = []
        if cfg.eval_dataset_path or cfg.eval_dataset_name:
            self.test = self._load(
                cfg.eval_dataset_name,
                cfg.eval_dataset_config,
                cfg.eval_dataset_path,
                cfg.eval_split,
            )
        elif cfg.dataset_path:
            if resolve_local_path(cfg.dataset_path).is_dir():
                try:
                    self.test = load_local_rows(cfg.dataset_path, cfg.eval_split)
                except FileNotFoundError:
                    self.test = []
        elif cfg.dataset_name:  # the training dataset's eval split
            self.test = self._load(cfg.dataset_name, cfg.dataset_config, None, cfg.eval_split)
        if self.test:
            self._check_rows(self.test, "eval dataset")
            if cfg.max_eval_items >= 0:
                self.test = self.test[: cfg.max_eval_items]
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        row = self.train[self.iter % len(self.train)]
        self.iter += 1
        return row

    def save_checkpoint(self, step: int, data: dict[str, Any] | None = None) -> None:
        data = dict(data or {})
        data["iter"] = self.iter
        super().save_checkpoint(step, data)

    def messages_for(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The chat sent to the model for a row."""
        messages = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        content = render_prompt(self.config.prompt_template, row, self.config.prompt_field)
        messages.append({"role": "user", "content": content})
        return messages

    # ------------------------------------------------------------------ scoring

    def reward_breakdown(self, completion: str, row: dict[str, Any]) -> dict[str, float]:
        """Each reward function's raw value (before weighting) for ``completion``."""
        field = self.config.answer_field
        answer = row.get(field) if field else None
        answer = None if answer is None else str(answer)
        fields = {k: v for k, v in row.items() if k not in (field, "answer", "completion")}
        out = {}
        for name, fn, _, params in self.rewards:
            try:
                out[name] = float(fn(completion, answer, **{**fields, **params}))
            except Exception:  # a malformed completion or row earns nothing, it never crashes
                out[name] = 0.0
        return out

    def weighted(self, breakdown: dict[str, float]) -> float:
        """The weighted reward of one completion's :meth:`reward_breakdown`."""
        return float(weighted_reward(breakdown, {n: w for n, _, w, _ in self.rewards}) or 0.0)

    def score_text(self, completion: str, row: dict[str, Any]) -> float:
        """The weighted reward of one completion."""
        return self.weighted(self.reward_breakdown(completion, row))

    @property
    def max_reward(self) -> float:
        """The best weighted reward a completion can get (every function returns 0..1)."""
        return float(sum(max(w, 0.0) for _, _, w, _ in self.rewards))

    def score_samples(self, samples: list[Sample], row: dict[str, Any]) -> ScoredDataGroup | None:
        """One group's ScoredDataGroup; None when nothing is left to train on."""
        kept = [s for s in samples if s.trainable_tokens >= self.config.min_completion_tokens]
        if not kept:
            return None
        terms = [self.reward_breakdown(s.text, row) for s in kept]
        group = group_from_samples(
            kept, [self.weighted(t) for t in terms], group_size=self.config.group_size
        )
        self.log_train_metric("train/mean_score", group["scores"])
        log_reward_terms(self, "train", terms)
        top = self.max_reward
        if self.config.length_penalty and top > 0:
            apply_length_penalty(self, group, full_score=top)
        return group  # a flat group is dropped (and counted) by the sender

    def _max_tokens(self) -> int:
        return (
            self.config.max_tokens if self.config.max_tokens > 0 else self.config.max_token_length
        )

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        samples = await sample_chat_group(
            self,
            self.messages_for(item),
            n=self.config.group_size,
            max_tokens=self._max_tokens(),
            temperature=self.config.temperature,
        )
        return self.score_samples(samples, item), []

    # ------------------------------------------------------------------ evaluation

    async def rollout_and_score_eval(self, row: dict[str, Any]) -> dict[str, Any]:
        """One answer to an eval row, with its weighted score and each function's value."""
        messages = self.messages_for(row)
        text, finish = await eval_completion(
            self, messages, self._max_tokens(), self.config.eval_temperature
        )
        breakdown = self.reward_breakdown(text, row)
        field = self.config.answer_field
        return {
            "messages": [*messages, {"role": "assistant", "content": text}],
            "gold_answer": None if not field else str(row.get(field)),
            "score": self.weighted(breakdown),
            "rewards": breakdown,
            "correct": breakdown[self.rewards[0][0]] > 0,
            "finish_reason": finish,
        }

    def summarize_eval(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Mean weighted score, the share the first reward function accepts
        (``eval/percent_correct``) and each function's mean (``eval/reward/<name>``)."""
        n = max(1, len(samples))
        metrics = {
            "eval/mean_score": sum(s["score"] for s in samples) / n,
            "eval/percent_correct": sum(s["correct"] for s in samples) / n,
            "eval/num_items": float(len(samples)),
        }
        for name, *_ in self.rewards:
            metrics[f"eval/reward/{name}"] = sum(s["rewards"][name] for s in samples) / n
        return metrics

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Answer every eval row (see ``summarize_eval`` for the metrics)."""
        if not self.test:
            logger.warning("evaluate: no eval data (set eval_dataset_path or eval_dataset_name)")
            return {}
        return await self.run_eval(
            [self.rollout_and_score_eval(row) for row in self.test],
            self.summarize_eval,
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self._max_tokens(),
            },
        )


if __name__ == "__main__":
    DatasetEnv.cli()
