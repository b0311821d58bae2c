"""The quick start's second trainer: TRL's ``GRPOTrainer`` through ``atroposlib.integrations.trl``.

``atropos-quickstart --trainer trl`` runs the same loop as the default GRPO trainer (run-api,
atropos-serve, the environment, held-out evaluations before/after) with TRL in its place, so the
two can be compared on the same recipe. :func:`train_trl` has the signature of
:func:`example_trainer.grpo.train` and maps its :class:`~example_trainer.config.TrainingConfig`
onto a ``GRPOConfig``:

================================  ===========================================================
TrainingConfig                    GRPOConfig
================================  ===========================================================
``lr``, ``weight_decay``          ``learning_rate``, ``weight_decay``
``warmup_steps``                  ``warmup_steps``
``lr_scheduler_type``             ``lr_scheduler_type`` (``constant``: ``constant_with_warmup``)
``training_steps``                ``max_steps``
``batch_size`` (micro-batch)      ``per_device_train_batch_size``
``gradient_accumulation_steps``   ``gradient_accumulation_steps``
``max_grad_norm``, ``seed``       the same
``clip_eps``, ``kl_coef``         ``epsilon``, ``beta``
``clip_delta``                    ``delta``
``loss_normalization``            ``loss_type``: ``grpo`` (sequence) or ``dapo`` (token)
``pause_generation``              :class:`AtroposGRPOTrainer` ``pause_generation``
================================  ===========================================================

plus ``num_generations`` = the environment's group size and ``temperature`` = its sampling
temperature. The weights reach atropos-serve after every step through its reload; the final
model is written to ``save_path/final_model``. Per-step metrics go to ``metrics.jsonl`` with the
GRPO trainer's names (``loss``, ``reward_mean``, ``train_seconds``, ``sync_seconds`` ...), so
the quick start's table and curves read both.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from example_trainer.checkpoint import space_errors, tensor_bytes
from example_trainer.config import TrainingConfig
from example_trainer.grpo import StepCallback, freeze_embeddings, resolve_precision

logger = logging.getLogger("example_trainer.trl")


def grpo_config(config: TrainingConfig, *, num_generations: int, temperature: float) -> Any:
    """The ``trl.GRPOConfig`` that matches ``config`` (see the module docstring)."""
    from trl import GRPOConfig

    cpu = config.device == "cpu"
    return GRPOConfig(
        output_dir=str(config.save_dir()),
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_steps,
        lr_scheduler_type=(
            "constant_with_warmup"
            if config.lr_scheduler_type == "constant"
            else config.lr_scheduler_type
        ),
        max_steps=config.training_steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        num_generations=num_generations,
        temperature=temperature,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        epsilon=config.clip_eps,
        delta=config.clip_delta,
        beta=config.kl_coef,
        loss_type="grpo" if config.loss_normalization == "sequence" else "dapo",
        # activations are small at these sizes; recomputing them costs a third more compute
        activation_checkpointing=config.gradient_checkpointing,
        use_cpu=cpu,
        # TRL keeps the float32 weights loaded below: bf16 is its autocast (bf16-mixed)
        bf16=resolve_precision(config) != "float32",
        logging_steps=1,
        report_to=["wandb"] if config.use_wandb else [],
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=not config.progress,
        dataloader_num_workers=0,
    )


def train_trl(
    config: TrainingConfig,
    on_step: StepCallback | None = None,
    *,
    on_ready: Callable[[], None] | None = None,
    sync_at_end: bool = False,
    num_generations: int,
    temperature: float = 1.0,
) -> Path:
    """Train with TRL's GRPOTrainer on run-api's batches; returns the final model's folder.

    ``on_ready``, ``on_step`` and ``sync_at_end`` mean what they mean for
    :func:`example_trainer.grpo.train` (the weights are pushed after every step, so
    ``sync_at_end`` is always honoured).
    """
    del sync_at_end  # every step syncs, the last one included
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from atroposlib.backends import weight_sync_client
    from atroposlib.inference.models import resolve_model_source
    from atroposlib.integrations.trl import AtroposGRPOTrainer, AtroposRollout

    if config.inference != "atropos-serve":
        raise ValueError("--trainer trl: the quick start syncs TRL's weights to atropos-serve only")
    if config.resume:
        raise ValueError("--trainer trl: --resume is not supported (TRL's own checkpoints are off)")
    hf_logging.disable_progress_bar()
    # TRL 1.16 calls transformers' old gradient-checkpointing names at every step; nothing a
    # user can act on
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated")
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")
    if config.skip_grad_spikes is not None:
        # a recipe's setting for the GRPO trainer; TRL's Trainer steps its optimizer itself
        logger.info("skip_grad_spikes is the GRPO trainer's: TRL takes every optimizer step")
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    save_path = config.save_dir()
    save_path.mkdir(parents=True, exist_ok=True)
    metrics_path = config.metrics_path()
    source = resolve_model_source(config.model_name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if config.freeze_embeddings:
        freeze_embeddings(model)  # TRL's Trainer builds its optimizer from the trainable parameters
    args = grpo_config(config, num_generations=num_generations, temperature=temperature)
    sync = weight_sync_client("atropos-serve", config.inference_url)
    sync.start(source, policy_version=0)
    rollout = AtroposRollout(
        config.atropos_url,
        max_token_len=config.seq_len,
        batch_timeout=config.batch_timeout,
        register_timeout=config.register_timeout,
        wandb_project=config.wandb_project or "",
        wandb_group=config.wandb_group or "",
    )
    trainer = AtroposGRPOTrainer(
        model,
        args,
        rollout=rollout,
        weight_sync=sync,
        sync_dir=save_path / "served_weights",
        pause_generation=config.pause_generation,
        pause_mode=config.pause_mode,
        # PPO against the sampler's log-probs, as the GRPO trainer: no extra forward pass
        importance_sampling="sampler",
        processing_class=tokenizer,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from example_trainer.metrics import TrainingLogger

    # one line per step from the GRPO trainer's logger instead of TRL's dicts
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    log = TrainingLogger(config.training_steps, 0, metrics_path, progress=config.progress)
    trainer.add_callback(_log_callback(trainer, log, on_step))
    if on_ready is not None:
        on_ready()

    def weight_bytes() -> int:
        return tensor_bytes(model.parameters())

    # TRL writes the weights for each sync (sync_dir) and at the end: a full disk is one line
    try:
        with space_errors(save_path, "the TRL run's weights under", weight_bytes):
            trainer.train()
    finally:
        log.close()
    final = save_path / "final_model"
    with space_errors(final, "the final model", weight_bytes):
        trainer.save_model(str(final))
        tokenizer.save_pretrained(final)
    logger.info("final model saved to %s", final)
    return final


_RENAMED = {
    "reward": "reward_mean",
    "entropy": "entropy",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
    "atropos/batch_wait_seconds": "batch_wait_seconds",
    "atropos/staleness_mean": "staleness_mean",
    "atropos/staleness_max": "staleness_max",
    "atropos/trained_tokens": "trained_tokens",
    "sampling/importance_sampling_ratio/mean": "mean_ratio",
    "atropos/mean_ratio": "mean_ratio",
}


def _log_callback(trainer: Any, log: Any, on_step: StepCallback | None) -> Any:
    """Each step: ``on_step`` once the weights are on the server, then one record with the GRPO
    trainer's metric names through its :class:`~example_trainer.metrics.TrainingLogger`."""
    from transformers import TrainerCallback

    class QuickstartLog(TrainerCallback):
        def __init__(self) -> None:
            self.started = time.monotonic()
            self.extra: dict[str, float] = {}
            self.tokens_seen = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # after AtroposGRPOTrainer's own callback: the step's weights are on the server
            step_seconds = time.monotonic() - self.started
            sync = trainer.sync_seconds[-1] if trainer.sync_seconds else 0.0
            self.extra = {
                "sync_seconds": sync,
                "train_seconds": max(step_seconds - sync - trainer.atropos.last_wait, 0.0),
            }
            if on_step is not None:
                self.extra.update(on_step(int(state.global_step), trainer.sync_dir) or {})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any):
            if not logs or "loss" not in logs:
                return
            metrics = {"loss": float(logs["loss"])}
            metrics.update({new: float(logs[old]) for old, new in _RENAMED.items() if old in logs})
            metrics.update(self.extra)
            seen = float(logs.get("num_tokens", self.tokens_seen))
            batch_tokens, self.tokens_seen = seen - self.tokens_seen, seen
            if batch_tokens > 0 and metrics.get("train_seconds"):
                # every token of the batch (prompts included); TRL runs each sequence whole,
                # so its computed tokens are at least this (plus padding)
                metrics["batch_tokens_per_s"] = batch_tokens / metrics["train_seconds"]
            metrics.update({f"trl/{k}": v for k, v in logs.items() if isinstance(v, int | float)})
            log.log(int(state.global_step), metrics)

    return QuickstartLog()
