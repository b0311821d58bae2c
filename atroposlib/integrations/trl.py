"""Train with TRL's ``GRPOTrainer`` on atroposlib environments (``pip install "atroposlib[trl]"``).

TRL's ``GRPOTrainer`` takes a ``rollout_func``: a function that, instead of sampling from the
model itself, returns token ids for the prompts of a step. :class:`AtroposRollout` is that
function, reading scored groups from ``run-api``. Environments run as they always do
(``python environments/X.py serve``); TRL never sees a prompt dataset.

What each part of a group becomes (the rules of :mod:`atroposlib.trainer.rows`):

* ``prompt_ids`` / ``completion_ids``: the sequence's tokens, exactly as sampled (no
  re-tokenising); the completion starts at the first trained token.
* ``env_mask``: 1 where ``masks`` trains the token, 0 for tokens the env wrote into the
  completion (tool results, user turns of a multi-turn episode). TRL leaves them out of the loss.
* ``logprobs``: the sampler's log-probabilities (``inference_logprobs``) where the server gave
  them, for TRL's importance-sampling correction (see below); None where it did not.
* the reward: the group's scores (:func:`atropos_score_reward`); ``set_advantage_to_zero`` makes
  a sample unscorable for plain ``GRPOTrainer``.

:class:`AtroposGRPOTrainer` is ``GRPOTrainer`` wired for this, and exact to the contract:

* advantages are the contract's (:func:`atroposlib.trainer.group_advantages`), not TRL's
  re-computation: explicit ``advantages`` from the env are used (per token too), and
  ``set_advantage_to_zero`` zeroes the advantage while the score stays in the group's baseline;
* the sampler's log-probabilities correct for batches the current weights did not sample
  (``importance_sampling``): ``"trl"`` (default) runs TRL's own correction
  (``vllm_importance_sampling_*`` settings: a truncated or masked ratio of the trained policy
  before the step to the sampler) although no vLLM is in TRL's hands, at the cost of one more
  forward pass per batch; tokens without a sampler log-prob get a ratio of 1. ``"sampler"``
  makes the sampler's log-probabilities the "old" policy of the clipped ratio (PPO against the
  sampler, as the example GRPO trainer does; no extra forward pass; a batch with a trained token
  the sampler gave no log-prob for falls back to the on-policy ratio). ``"off"``: ratio 1;
* after every optimizer step the new weights go to the inference server (``weight_sync``: an
  :mod:`atroposlib.backends` client, e.g. atropos-serve's reload) as policy version
  ``global_step``; the next ``GET /batch`` acknowledges the batch just trained (at-least-once:
  a batch whose step did not finish is handed out again after a restart);
* every group must hold exactly ``num_generations`` sequences (TRL normalises in fixed-size
  blocks): a group of another size stops training with an error naming both numbers.

Several processes (``accelerate launch --num_processes N``): rank 0 registers, pulls one batch
of ``generation_batch_size`` sequences per generation round and broadcasts it; each rank trains
its own contiguous slice of whole groups, so every sequence is trained once. Errors (a
malformed group, a wrong group size, run-api gone) are raised on every rank, so none waits
forever on the others.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from atroposlib.api.client import TrainerClient
from atroposlib.testing.report import report_from_env
from atroposlib.trainer.rows import MalformedGroupError, TrainingRow, rows_from_batch

try:
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - the trl extra installs them
    raise ImportError(
        f"atroposlib.integrations.trl needs TRL ({exc}): pip install 'atroposlib[trl]'"
    ) from exc

logger = logging.getLogger(__name__)

__all__ = [
    "AtroposGRPOTrainer",
    "AtroposRollout",
    "GroupSizeError",
    "WeightSyncTarget",
    "atropos_score_reward",
    "placeholder_dataset",
]


class GroupSizeError(ValueError):
    """A group whose size is not TRL's ``num_generations``."""


class WeightSyncTarget(Protocol):
    """What the adapter needs of a weight-sync client (every :mod:`atroposlib.backends` client
    that reloads from a folder has it): make the server serve ``checkpoint``."""

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float: ...


def atropos_score_reward(
    completions: list[Any],
    atropos_score: list[float] | None = None,
    atropos_zeroed: list[bool] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """The reward function that hands TRL the environments' scores (``reward_funcs=[this]``).

    A sequence whose group set ``set_advantage_to_zero`` gets None: unscorable for TRL, which
    then gives it an advantage of 0 (:class:`AtroposGRPOTrainer` uses the contract's advantages
    instead, where its score still counts in the group's baseline).
    """
    if atropos_score is None:
        raise ValueError(
            "atropos_score_reward needs the atropos_score field: use it with "
            "rollout_func=AtroposRollout(...)"
        )
    zeroed = atropos_zeroed or [False] * len(atropos_score)
    return [None if z else float(s) for s, z in zip(atropos_score, zeroed, strict=True)]


def placeholder_dataset(rows: int) -> Any:
    """A dataset of ``rows`` empty prompts: what drives TRL's loop when the environments own the
    prompts (TRL needs a ``train_dataset``; with ``rollout_func`` its prompts are never used)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [""] * rows})


class AtroposRollout:
    """``rollout_func`` for ``trl.GRPOTrainer``: token-exact rollouts from ``run-api``.

    Args:
        api_url: run-api's base URL.
        max_token_len: longest sequence accepted (sent as ``max_token_len`` at registration;
            run-api refuses longer groups from environments).
        batch_timeout: seconds to wait for one batch (None: wait forever, logging what it
            waits for).
        register_timeout: seconds to keep retrying ``/register`` while run-api starts.
        api_key: run-api's key (default: ``ATROPOS_API_KEY``).
        wandb_project, wandb_group: sent to run-api for the environments' W&B runs.
        client: a :class:`~atroposlib.api.client.TrainerClient` to use instead of a new one.
        after_fetch: called on the main process once a batch has arrived, before training on it
            (:class:`AtroposGRPOTrainer` pauses the inference server there).
    """

    def __init__(
        self,
        api_url: str = "http://localhost:8000",
        *,
        max_token_len: int = 4096,
        batch_timeout: float | None = None,
        register_timeout: float = 120.0,
        api_key: str | None = None,
        wandb_project: str = "",
        wandb_group: str = "",
        client: TrainerClient | None = None,
        after_fetch: Callable[[], None] | None = None,
    ) -> None:
        self.api_url = api_url
        self.after_fetch = after_fetch
        self.max_token_len = max_token_len
        self.batch_timeout = batch_timeout
        self.register_timeout = register_timeout
        self.wandb_project = wandb_project
        self.wandb_group = wandb_group
        self._client = client
        self._api_key = api_key
        self.registered_batch_size: int | None = None
        #: this rank's rows of the last rollout, in the order they were handed to TRL
        self.last_rows: list[TrainingRow] = []
        #: run-api's step of the last batch (acknowledged with the next ``GET /batch``)
        self.last_step: int | None = None
        #: seconds the last rollout waited for its batch
        self.last_wait: float = 0.0

    @property
    def client(self) -> TrainerClient:
        """The run-api client (created on first use, on the main process only)."""
        if self._client is None:
            self._client = TrainerClient(self.api_url, api_key=self._api_key)
        return self._client

    def close(self) -> None:
        """Close the HTTP client."""
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------------- rank 0

    def register(self, batch_size: int, num_steps: int, starting_step: int = 0) -> None:
        """``POST /register`` for batches of ``batch_size`` sequences (once)."""
        if self.registered_batch_size is not None:
            return
        self.client.register(
            batch_size=batch_size,
            max_token_len=self.max_token_len,
            checkpoint_dir="",
            save_checkpoint_interval=0,
            starting_step=starting_step,
            num_steps=num_steps,
            wandb_group=self.wandb_group,
            wandb_project=self.wandb_project,
            timeout=self.register_timeout,
        )
        self.registered_batch_size = batch_size
        logger.info("registered with %s for batches of %d sequences", self.api_url, batch_size)

    def fetch_rows(self, num_sequences: int, num_generations: int) -> list[TrainingRow]:
        """One batch from run-api as rows, checked against TRL's fixed group size."""
        started = time.monotonic()
        groups = self.client.get_batch(timeout=self.batch_timeout)
        self.last_wait = time.monotonic() - started
        self.last_step = self.client.last_step
        rows = rows_from_batch(groups)
        for g, group in enumerate(groups):
            size = len(group.get("tokens") or ())
            if size != num_generations:
                raise GroupSizeError(
                    f"group {g} of the batch of step {self.last_step} has {size} sequences but "
                    f"GRPOConfig.num_generations is {num_generations}: TRL normalises rewards "
                    "in blocks of num_generations, so every group must have exactly that many. "
                    f"Run the environments with --env.group_size {num_generations} (and keep "
                    "them from sending partial groups), or set num_generations to their "
                    "group size."
                )
        if len(rows) != num_sequences:
            raise GroupSizeError(
                f"run-api handed out {len(rows)} sequences, expected {num_sequences} "
                "(generation_batch_size): was it registered by another trainer?"
            )
        return rows

    # ----------------------------------------------------------------------- every rank

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``: this rank's share of one batch."""
        if not trainer.model.training:
            raise RuntimeError(
                "AtroposRollout serves training rollouts only: set GRPOConfig(eval_strategy='no') "
                "and evaluate with the environment's own `evaluate` command"
            )
        from accelerate.utils import broadcast_object_list

        accelerator = trainer.accelerator
        local = len(prompts)
        num_generations = trainer.num_generations
        world, rank = accelerator.num_processes, accelerator.process_index
        payload: list[TrainingRow] | BaseException | None = None
        if accelerator.is_main_process:
            try:
                if local % num_generations:
                    raise GroupSizeError(
                        f"each process trains {local} sequences per generation round "
                        "(per_device_train_batch_size x steps_per_generation), not a multiple "
                        f"of num_generations={num_generations}: a group would be split "
                        "between processes"
                    )
                self.register(local * world, int(trainer.args.max_steps), trainer.state.global_step)
                payload = self.fetch_rows(local * world, num_generations)
                if self.after_fetch is not None:
                    self.after_fetch()
            except (GroupSizeError, MalformedGroupError, RuntimeError) as exc:
                payload = exc
        if world > 1:
            payload = broadcast_object_list([payload], from_process=0)[0]
        if isinstance(payload, BaseException):
            raise payload
        assert payload is not None
        rows = payload[rank * local : (rank + 1) * local]
        self.last_rows = rows
        return self.output(rows)

    @staticmethod
    def output(rows: Sequence[TrainingRow]) -> dict[str, Any]:
        """``rows`` in ``rollout_func``'s output format (see the module docstring)."""
        prompt_ids, completion_ids, env_mask, logprobs = [], [], [], []
        for row in rows:
            prompt, completion, mask = row.prompt_ids, row.completion_ids, row.loss_mask
            sampler = row.sampler_logprobs or [None] * len(completion)
            if not completion:
                # nothing trained in it: TRL needs one completion token, which it will not train
                if len(prompt) < 2:
                    raise MalformedGroupError(
                        f"tokens[{row.index}]",
                        f"tokens[{row.index}] has a single token: nothing to train on",
                        row.group,
                    )
                prompt, completion, mask, sampler = prompt[:-1], prompt[-1:], [0], [None]
            prompt_ids.append(list(prompt))
            completion_ids.append(list(completion))
            env_mask.append(list(mask))
            logprobs.append(list(sampler))
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "env_mask": env_mask,
            "atropos_score": [row.score for row in rows],
            "atropos_zeroed": [row.advantage_source == "zeroed" for row in rows],
        }


# ------------------------------------------------------------------------------- the trainer


def score_trained_positions_only() -> None:
    """Make TRL's fused LM head score only the completion positions on a CPU too.

    TRL 1.16 runs the output head, in vocabulary tiles, only at the positions the loss reads
    when Triton is there (a GPU); elsewhere it scores *every* position, prompt included, to keep
    tile shapes fixed for compilers that recompile on each new shape. A CPU has no such
    compiler, and for short completions after long prompts (6 reply tokens after a 100-token
    prompt) scoring every position is most of a step's work. The log-probabilities are the same
    either way; ``tests/integrations/test_trl.py`` checks them against the model's own.
    """
    import trl.trainer.utils as trl_utils

    original = trl_utils._use_triton
    if getattr(original, "atropos_patched", False):
        return

    def compact(device: torch.device) -> bool:
        return original(device) or device.type == "cpu"

    compact.atropos_patched = True  # type: ignore[attr-defined]
    trl_utils._use_triton = compact


class _ServerWeights:
    """Stands where TRL keeps its vLLM client, so that TRL's own hook ("a rollout after the step
    changed syncs the weights") pushes to the environments' inference server."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def sync_weights(self) -> None:
        self.trainer.push_weights()


class AtroposCallback(TrainerCallback):
    """Pushes the weights to the inference server after every optimizer step."""

    def __init__(self, trainer: AtroposGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.push_weights()
        if self.trainer.report is not None:
            self.trainer.report.end_step()


class AtroposGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` training on run-api's batches (module docstring).

    Args:
        model: as ``GRPOTrainer`` (a model id/folder or a loaded model).
        args: a ``GRPOConfig``; ``max_steps`` must be set (the environments have no epochs).
        rollout: an :class:`AtroposRollout` (default: one for ``api_url``).
        api_url: run-api's base URL when ``rollout`` is not given.
        weight_sync: where each step's weights go (e.g.
            ``atroposlib.backends.AtroposServeReload(url)``); None: nowhere (warned: the
            environments keep sampling from the starting weights).
        sync_dir: folder the weights are written to for ``weight_sync`` (default:
            ``args.output_dir/atropos-weights``).
        reward_funcs: more reward functions on top of the environments' scores (their
            scores are the advantages' source here; these are logged by TRL).
        **kwargs: passed to ``GRPOTrainer`` (``processing_class``, ``callbacks`` ...).
    """

    def __init__(
        self,
        model: Any,
        args: Any,
        *,
        rollout: AtroposRollout | None = None,
        api_url: str = "http://localhost:8000",
        weight_sync: WeightSyncTarget | None = None,
        sync_dir: str | Path | None = None,
        pause_generation: bool = False,
        pause_mode: str = "abort",
        importance_sampling: str = "trl",
        reward_funcs: list[Callable[..., Any]] | None = None,
        train_dataset: Any = None,
        **kwargs: Any,
    ) -> None:
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError("GRPOConfig.max_steps must be set: environments have no epochs")
        if getattr(args, "use_vllm", False):
            raise ValueError(
                "GRPOConfig.use_vllm must be False: the environments' inference server "
                "generates; give AtroposGRPOTrainer a weight_sync for it instead"
            )
        if importance_sampling not in ("trl", "sampler", "off"):
            raise ValueError(
                f"importance_sampling={importance_sampling!r}: expected 'trl', 'sampler' or 'off'"
            )
        score_trained_positions_only()
        self.importance_sampling = importance_sampling
        self.atropos = rollout or AtroposRollout(api_url)
        self.weight_sync = weight_sync
        self.sync_dir = Path(sync_dir or Path(args.output_dir) / "atropos-weights")
        self.pushed_version: int | None = None
        #: what the loss trains on, for the conformance check (``ATROPOS_TRAINER_REPORT``)
        self.report = report_from_env(standard_advantages=True, name="trl")
        self.pause_mode = pause_mode
        self.paused = False
        if pause_generation:
            if weight_sync is None or not hasattr(weight_sync, "pause"):
                raise ValueError("pause_generation needs a weight_sync that can pause its server")
            self.atropos.after_fetch = self._pause
        self.sync_seconds: list[float] = []
        if train_dataset is None:
            train_dataset = placeholder_dataset(
                max(1, (args.generation_batch_size or 1) // max(args.num_generations or 1, 1))
            )
        super().__init__(
            model=model,
            reward_funcs=[atropos_score_reward, *(reward_funcs or [])],
            args=args,
            train_dataset=train_dataset,
            rollout_func=self.atropos,
            **kwargs,
        )
        self.add_callback(AtroposCallback(self))
        if weight_sync is None:
            logger.warning(
                "AtroposGRPOTrainer without weight_sync: the inference server keeps the "
                "starting weights and every batch comes from them"
            )
        if importance_sampling == "trl" and args.vllm_importance_sampling_correction:
            # TRL applies its sampler-mismatch correction only "with vLLM"; here the sampler
            # is the environments' server, whose log-probs come with each group.
            self.use_vllm = True
            self.vllm_mode = "server"
            self.vllm_generation = _ServerWeights(self)
            self._last_loaded_step = self.state.global_step

    # ----------------------------------------------------------------------- weights

    def _pause(self) -> None:
        self.weight_sync.pause(self.pause_mode)  # type: ignore[union-attr]
        self.paused = True

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            self.weight_sync.resume()  # type: ignore[union-attr]

    def push_weights(self) -> None:
        """Make the inference server serve the current weights as policy version
        ``global_step`` (once per step; the main process writes and asks)."""
        step = int(self.state.global_step)
        self._last_loaded_step = step
        if self.weight_sync is None or self.pushed_version == step:
            return
        if step == 0:  # the server already serves the starting weights
            self.pushed_version = 0
            self._resume()
            return
        seconds = 0.0
        if self.accelerator.is_main_process:
            started = time.monotonic()
            model = self.accelerator.unwrap_model(self.model)
            self.sync_dir.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(self.sync_dir, safe_serialization=True)
            tokenizer = getattr(self, "processing_class", None)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(self.sync_dir)
            try:
                self.weight_sync.sync(self.sync_dir, policy_version=step)
            finally:
                self._resume()
            seconds = time.monotonic() - started
            self.sync_seconds.append(seconds)
            logger.info("step %d: weights pushed to the inference server in %.2f s", step, seconds)
        self.accelerator.wait_for_everyone()
        self.pushed_version = step

    # -------------------------------------------------------------------- advantages

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        rows = self.atropos.last_rows
        self._check_temperatures(rows)
        self._check_truncation(rows)
        width = output["completion_ids"].shape[1]
        device = output["advantages"].device
        per_token = any(len(set(r.advantages)) > 1 for r in rows)
        if per_token:
            advantages = torch.zeros((len(rows), width), device=device)
            for i, row in enumerate(rows):
                values = row.advantages or [0.0]
                advantages[i, : len(values)] = torch.tensor(values, device=device)
        else:
            advantages = torch.tensor(
                [r.advantages[0] if r.advantages else 0.0 for r in rows], device=device
            )
        output["advantages"] = advantages
        # travels with its row through TRL's shuffle, for the report
        output["atropos_policy_version"] = torch.tensor(
            [-1 if r.policy_version is None else r.policy_version for r in rows], device=device
        )
        if self.importance_sampling == "sampler":
            self._sampler_as_old_policy(output)
        self._log_batch(rows)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        versions = inputs.pop("atropos_policy_version", None)
        if self.report is not None and model.training:
            self._report_rows(inputs, versions)
        sampler = (
            inputs.get("old_per_token_logps") if self.importance_sampling == "sampler" else None
        )
        if sampler is None or not model.training:
            return super()._compute_loss(model, inputs)
        # the mean ratio new/sampler over trained tokens, as the GRPO trainer logs it (about 1.0 on
        # the first step when trainer and sampler agree): read from the log-probs TRL computes
        seen: list[Any] = []
        compute = self._get_per_token_logps_and_entropies

        def capture(*args: Any, **kwargs: Any) -> Any:
            result = compute(*args, **kwargs)
            seen.append(result[0].detach())
            return result

        self._get_per_token_logps_and_entropies = capture  # type: ignore[method-assign]
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            del self._get_per_token_logps_and_entropies
        if seen:
            mask = inputs["completion_mask"].bool()
            if "tool_mask" in inputs:
                mask = mask & inputs["tool_mask"].bool()
            if bool(mask.any()):
                ratio = torch.exp(seen[0] - sampler)[mask].mean()
                self._metrics["train"]["atropos/mean_ratio"].append(float(ratio))
        return loss

    def _report_rows(self, inputs: dict[str, Any], versions: Any) -> None:
        """What this micro-batch's loss trains on, one sequence per row (``ATROPOS_TRAINER_REPORT``:
        the conformance check, ``docs/check-trainer.md``)."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        for i in range(mask.shape[0]):
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            width = int(inputs["completion_mask"][i].sum())
            completion = inputs["completion_ids"][i, :width].tolist()
            row_adv = (
                advantages[i, :width].tolist()
                if advantages.dim() == 2
                else [float(advantages[i])] * width
            )
            version = None if versions is None or int(versions[i]) < 0 else int(versions[i])
            self.report.sequence(  # type: ignore[union-attr]
                prompt + completion,
                [0] * len(prompt) + mask[i, :width].tolist(),
                [0.0] * len(prompt) + row_adv,
                policy_version=version,
            )

    def _sampler_as_old_policy(self, output: dict[str, Any]) -> None:
        """``importance_sampling="sampler"``: the clipped ratio's old policy is the sampler."""
        sampler = output.get("sampling_per_token_logps")
        if sampler is None:
            return
        mask = output["completion_mask"].bool()
        if "tool_mask" in output:
            mask = mask & output["tool_mask"].bool()
        if bool(torch.isnan(sampler[mask]).any()):
            if not getattr(self, "_warned_missing_sampler", False):
                logger.warning(
                    "a batch has trained tokens without sampler log-probs: on-policy ratio for it"
                )
                self._warned_missing_sampler = True
            return
        output["old_per_token_logps"] = torch.where(mask, sampler, torch.zeros_like(sampler))

    def _check_temperatures(self, rows: Sequence[TrainingRow]) -> None:
        for row in rows:
            if not math.isclose(row.temperature, self.temperature, rel_tol=1e-6):
                raise ValueError(
                    f"group {row.group} was sampled at temperature {row.temperature} "
                    "(1.0 when a group does not say) but GRPOConfig.temperature is "
                    f"{self.temperature}: TRL divides the policy's logits by that one "
                    "temperature, so set it to the environments' sampling temperature"
                )

    def _check_truncation(self, rows: Sequence[TrainingRow]) -> None:
        """TRL scores completions with a log-softmax over the whole vocabulary (trl#6789), while
        a server sampling with top-k/top-p/min-p reports log-probs of the truncated,
        renormalised distribution: every ratio would carry the kept mass (0.8 at top_p 0.8), not
        a policy change. Refused unless the ratio is not used (``importance_sampling="off"``)."""
        if self.importance_sampling == "off":
            return
        for row in rows:
            if row.top_k > 0 or row.top_p < 1.0 or row.min_p > 0.0:
                raise ValueError(
                    f"group {row.group} was sampled with top_k={row.top_k}, "
                    f"top_p={row.top_p}, min_p={row.min_p}: TRL's GRPOTrainer computes its "
                    "log-probs over the whole vocabulary, so the importance ratio to the "
                    "sampler's (truncated) log-probs would be scaled by the kept probability "
                    "mass (trl#6789). Sample without truncation, or train with "
                    "importance_sampling='off'"
                )

    def _log_batch(self, rows: Sequence[TrainingRow]) -> None:
        metrics = self._metrics["train"]
        step = int(self.state.global_step)
        behind = [step - r.policy_version for r in rows if r.policy_version is not None]
        if behind:
            metrics["atropos/staleness_mean"].append(sum(behind) / len(behind))
            metrics["atropos/staleness_max"].append(float(max(behind)))
        metrics["atropos/batch_wait_seconds"].append(self.atropos.last_wait)
        metrics["atropos/trained_tokens"].append(float(sum(r.num_trained for r in rows)))
        if self.sync_seconds:
            metrics["atropos/sync_seconds"].append(self.sync_seconds[-1])

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.accelerator.is_main_process:
                try:
                    self._resume()  # never leave a server we do not own paused
                finally:
                    self.atropos.close()
