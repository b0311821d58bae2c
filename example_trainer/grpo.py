"""Example GRPO trainer for Atropos (``atropos-grpo``).

The loop: register with run-api, then for each step pull a batch, compute the GRPO loss over
its micro-batches, take an AdamW step, and every ``weight_sync_interval`` steps save
``step_N`` and get the inference server onto it (reload or restart vLLM, hot-reload
atropos-serve or SGLang; ``example_trainer/weight_sync.py``).

    atropos-grpo --model SmolLM2-135M-Instruct --inference atropos-serve \\
        --inference-url http://127.0.0.1:9001 --training-steps 20 --batch-size 4 \\
        --gradient-accumulation-steps 4 --seq-len 512 --save-path runs/ckpt

Padding and advantages: ``example_trainer/data.py``; the loss: ``example_trainer/loss.py``;
process management: ``example_trainer/inference_process.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from atroposlib.inference.models import resolve_model_source
from atroposlib.testing.report import report_from_env
from atroposlib.trainer.throughput import (
    BF16_SPEEDUP_FOR_MIXED,
    bf16_speedup,
    gemm_peak,
    model_flops,
    step_throughput,
)
from atroposlib.utils.shm_weights import SegmentSpaceError
from example_trainer import weight_sync
from example_trainer.api import TrainerAPIClient, TrajectoryAPIError
from example_trainer.budget import TimeBudget
from example_trainer.checkpoint import (
    CheckpointSpaceError,
    latest_resumable,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
    save_trainer_state,
    step_dir,
)
from example_trainer.config import TrainingConfig, load_config, lr_multiplier
from example_trainer.data import TrainingBatch, prepare_batch
from example_trainer.forward import check_fast_path, check_packed_path, policy_logprobs
from example_trainer.inference_process import InferenceLaunchError
from example_trainer.loss import grpo_loss
from example_trainer.metrics import TrainingLogger, staleness_metrics
from example_trainer.weight_sync import WeightSync

logger = logging.getLogger("example_trainer")


# ---------------------------------------------------------------------------------- setup


def resolve_precision(config: TrainingConfig) -> str:
    """``config.dtype`` with ``auto`` resolved: ``bf16-mixed`` where bfloat16 matrix products
    are measured at least :data:`~atroposlib.trainer.throughput.BF16_SPEEDUP_FOR_MIXED` times
    faster than float32 ones on the training device (GPUs, CPUs with AVX-512 BF16 or AMX),
    else ``float32`` (CPUs that emulate bfloat16)."""
    if config.dtype != "auto":
        return config.dtype
    return _auto_precision(str(config.device), config.torch_threads or torch.get_num_threads())


@functools.cache
def _auto_precision(device: str, threads: int) -> str:
    speedup = bf16_speedup(device, threads)
    precision = "bf16-mixed" if speedup >= BF16_SPEEDUP_FOR_MIXED else "float32"
    logger.info(
        "precision auto: %s (bfloat16 matrix products run %.2fx as fast as float32 ones here)",
        precision,
        speedup,
    )
    return precision


def resolve_dtype(config: TrainingConfig) -> torch.dtype:
    """The dtype the trained weights are kept in (and synced to the server in): bfloat16 only
    for ``dtype=bfloat16``; float32 otherwise, ``bf16-mixed`` included."""
    return torch.bfloat16 if resolve_precision(config) == "bfloat16" else torch.float32


def compute_dtype(config: TrainingConfig) -> torch.dtype:
    """The dtype the forward and backward passes' matrix products run in, and so the one the
    inference server must compute in for its samples to come from the trainer's policy."""
    return torch.float32 if resolve_precision(config) == "float32" else torch.bfloat16


def compute_dtype_name(config: TrainingConfig) -> str:
    """:func:`compute_dtype` as a server's ``--dtype`` and the GEMM peak's key name it
    (``float32`` or ``bfloat16``)."""
    return str(compute_dtype(config)).removeprefix("torch.")


def autocast(config: TrainingConfig) -> contextlib.AbstractContextManager[Any]:
    """The context the forward pass and loss run in: bfloat16 autocast for ``bf16-mixed``
    (the backward pass follows the forward's dtypes by itself), nothing otherwise."""
    if resolve_precision(config) != "bf16-mixed":
        return contextlib.nullcontext()
    device_type = torch.device(config.device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def rounded_away_fraction(model: torch.nn.Module, update: float) -> float:
    """The fraction of ``model``'s low-precision weights that an update of size ``update``
    leaves unchanged (``w + update == w`` in the weight's own dtype); 0.0 for float32 weights.

    An AdamW step moves each weight by about the learning rate, so for pure-bfloat16 training
    this is (a lower bound of) the share of weights that never move."""
    lost = total = 0
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype not in (torch.bfloat16, torch.float16) or not param.requires_grad:
                continue
            lost += int((param + update == param).sum())
            total += param.numel()
    return lost / total if total else 0.0


def warn_if_updates_round_away(model: torch.nn.Module, config: TrainingConfig) -> float:
    """Warn when ``model``'s 16-bit weights would round an update of ``config.lr`` away on
    more than a tenth of them (pure-bfloat16 training at a small learning rate); returns that
    fraction."""
    lost = rounded_away_fraction(model, config.lr)
    if lost > 0.1:
        logger.warning(
            "dtype=%s: an update of lr=%g leaves %.0f%% of the weights unchanged (bfloat16 "
            "keeps ~3 significant digits), so most of the model will not train; use --dtype "
            "bf16-mixed (float32 weights, bfloat16 arithmetic) or float32",
            config.dtype,
            config.lr,
            100 * lost,
        )
    return lost


def check_server_precision(config: TrainingConfig) -> str | None:
    """Warn when an atropos-serve at ``config.inference_url`` computes in another dtype than
    the trainer (its ``/health`` reports it): its samples then come from another policy (a
    float32 server for bf16-mixed training clipped 58% of tokens and collapsed). Returns the
    warning, or None (same dtype, another server kind, or no answer)."""
    want = compute_dtype_name(config)
    if config.inference != "atropos-serve":
        if config.inference != "none" and not (config.inference == "vllm" and config.launch_vllm):
            logger.info(  # a launched vLLM is given --dtype; other servers cannot be asked
                "the trainer computes in %s: the inference server should too (--dtype %s), "
                "or its samples come from another policy than the one trained",
                want,
                want,
            )
        return None
    from atroposlib.backends import server_health

    for url in (u.strip().rstrip("/") for u in config.inference_url.split(",") if u.strip()):
        served = server_health(url).get("dtype")
        if served and served != want:
            message = (
                f"atropos-serve at {url} computes in {served}, this trainer in {want} "
                f"(--dtype {resolve_precision(config)}): its samples come from another policy "
                f"than the one trained; restart it with --dtype {want} or train with "
                f"--dtype {'float32' if served == 'float32' else 'bf16-mixed'}"
            )
            logger.warning(message)
            return message
    return None


def load_policy(source: str, config: TrainingConfig) -> tuple[torch.nn.Module, Any]:
    """Load the model to train (and its tokenizer) from a folder or model name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the trainer's own progress line is enough
    path = resolve_model_source(source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(config))
    model.to(config.device)
    model.config.use_cache = False
    if config.gradient_checkpointing:
        # transformers 5 renamed it; the old name still works but warns
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    return model, tokenizer


def freeze_embeddings(model: torch.nn.Module) -> tuple[int, bool]:
    """Stop training ``model``'s input embeddings, and with them its output layer when the two
    are one tensor (tied); an untied output layer keeps training. Logs what stays fixed and
    returns the number of parameters frozen and whether the output layer is among them.
    Optimizers built afterwards (:func:`make_optimizer`, Hugging Face's ``Trainer``) leave them
    out."""
    weight = model.get_input_embeddings().weight
    weight.requires_grad_(False)
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is weight
    logger.info(
        "freeze_embeddings: %.1fM of %.1fM parameters fixed (the token embeddings%s)",
        weight.numel() / 1e6,
        sum(p.numel() for p in model.parameters()) / 1e6,
        ", tied with the output layer" if tied else "; the untied output layer trains",
    )
    return weight.numel(), tied


def make_optimizer(model: torch.nn.Module, config: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW, fused into one kernel where torch supports it for the device (~6x faster steps
    than the per-tensor loop on a CPU for a 135M model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def make_weight_sync(config: TrainingConfig) -> WeightSync:
    """The weight-sync strategy ``config.inference`` (and ``config.weight_sync``) names."""
    return weight_sync.make_weight_sync(config)


def init_wandb(config: TrainingConfig) -> Any | None:
    """A W&B run when ``use_wandb`` is set (``wandb_mode`` offline/disabled need no network)."""
    if not config.use_wandb:
        return None
    import wandb

    return wandb.init(
        project=config.wandb_project,
        group=config.wandb_group,
        mode=config.wandb_mode,
        dir=str(config.save_dir()),
        config=config.model_dump(),
    )


# ---------------------------------------------------------------------------- one step


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: TrainingBatch,
    config: TrainingConfig,
    ref_model: torch.nn.Module | None = None,
    *,
    fast: bool = True,
    recent_grad_norms: Sequence[float] = (),
) -> dict[str, float]:
    """Forward/backward every micro-batch of ``batch``, clip, and take one optimizer step.

    ``fast``: use the trained-positions-only log-prob path (see ``example_trainer.forward``).
    A batch with nothing to train (every sequence skipped for a zero advantage) takes no
    optimizer step: AdamW would still move the weights on momentum and weight decay alone. The
    learning-rate schedule advances with the optimizer steps (warm-up counts steps taken).
    ``recent_grad_norms``: the earlier steps' gradient norms, for ``config.skip_grad_spikes``
    (:func:`is_grad_spike`); a spike takes no optimizer step and sets ``grad_spike_skipped``.
    """
    model.train()
    device = config.device
    loss_total = 0.0
    sums: dict[str, float] = {}
    entropy: dict[str, float] = {}
    run_tokens = float(batch.run_tokens)
    # what the loss trains on, for atropos-check-trainer (only when ATROPOS_TRAINER_REPORT is set)
    report = report_from_env(standard_advantages=True, name="example_trainer")
    forward_seconds = backward_seconds = 0.0
    for mb in batch.micro_batches:
        started = time.perf_counter()
        with autocast(config):  # bf16-mixed: the backward pass follows the forward's dtypes
            logp = policy_logprobs(model, mb, device, fast=fast, stats=entropy)
            ref_logp = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_logp = policy_logprobs(ref_model, mb, device, fast=fast)
            loss, metrics = grpo_loss(
                logp,
                mb.advantages.to(device),
                mb.mask.to(device),
                mb.old_logprobs.to(device),
                ref_logp,
                clip_eps=config.clip_eps,
                clip_delta=config.clip_delta,
                kl_coef=config.kl_coef,
                normalization=config.loss_normalization,
                num_sequences=batch.num_sequences,
                num_tokens=batch.num_tokens,
            )
        backward_started = time.perf_counter()
        forward_seconds += backward_started - started
        loss.backward()
        backward_seconds += time.perf_counter() - backward_started
        if report is not None:
            report.shifted_rows(mb.input_ids, mb.labels, mb.advantages, prefix_ids=mb.prefix_ids)
        loss_total += loss.item()
        weight = float(mb.mask.sum()) / max(run_tokens, 1.0)
        for key, value in metrics.items():
            if key.endswith("_max"):  # a maximum over the micro-batches, not a mean
                sums[key] = max(sums.get(key, value), value)
            else:
                sums[key] = sums.get(key, 0.0) + value * weight
    stepped = bool(batch.micro_batches)
    grad_norm = 0.0
    spike = False
    optimizer_started = time.perf_counter()
    if stepped:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        spike = is_grad_spike(grad_norm, recent_grad_norms, config.skip_grad_spikes)
        if spike:
            stepped = False
        else:
            optimizer.step()
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    optimizer_seconds = time.perf_counter() - optimizer_started
    if report is not None:
        report.end_step()
    return {
        "loss": loss_total,
        "grad_norm": grad_norm,
        "learning_rate": scheduler.get_last_lr()[0],
        "optimizer_step": float(stepped),
        **({"grad_spike_skipped": float(spike)} if config.skip_grad_spikes else {}),
        # where train_seconds goes (forward includes the loss)
        "forward_seconds": forward_seconds,
        "backward_seconds": backward_seconds,
        "optimizer_seconds": optimizer_seconds,
        **sums,
        **(
            {"entropy": entropy["entropy_sum"] / entropy["entropy_tokens"]}
            if entropy.get("entropy_tokens")
            else {}
        ),
    }


#: earlier steps whose gradient norms :func:`is_grad_spike` needs before it judges a step
GRAD_SPIKE_MIN_HISTORY = 4
#: the most recent steps whose median a gradient norm is compared with
GRAD_SPIKE_WINDOW = 8


def is_grad_spike(grad_norm: float, recent: Sequence[float], factor: float | None) -> bool:
    """Whether ``grad_norm`` (before clipping) is a spike to skip: more than ``factor`` times
    the median of the last :data:`GRAD_SPIKE_WINDOW` of ``recent`` (the norms of earlier steps
    that took an optimizer step). Never with ``factor`` None or fewer than
    :data:`GRAD_SPIKE_MIN_HISTORY` earlier norms; a norm that is not finite is always one once
    skipping is on (clipping cannot rescue it)."""
    baseline = grad_norm_baseline(recent)
    if factor is None or baseline is None:
        return False
    return not math.isfinite(grad_norm) or grad_norm > factor * baseline


def grad_norm_baseline(recent: Sequence[float]) -> float | None:
    """The median of the last :data:`GRAD_SPIKE_WINDOW` of ``recent``, the norm a spike is
    measured against; None with fewer than :data:`GRAD_SPIKE_MIN_HISTORY`."""
    if len(recent) < GRAD_SPIKE_MIN_HISTORY:
        return None
    return statistics.median(recent[-GRAD_SPIKE_WINDOW:])


# ------------------------------------------------------------------------------ the loop


StepCallback = Callable[[int, Path | None], dict[str, float] | None]
"""Called after each step once the inference server serves that step's weights (when the step
synced): ``(step, synced checkpoint folder, save_path when the weights went through shared
memory, or None when the step did not sync)``; returned numbers join the step's
metrics."""


def train(
    config: TrainingConfig,
    on_step: StepCallback | None = None,
    *,
    on_ready: Callable[[], None] | None = None,
    sync_at_end: bool | None = None,
    budget: TimeBudget | None = None,
) -> Path:
    """Run GRPO training as configured; returns the folder of the final model.

    ``on_ready`` runs once the inference server serves the starting weights and the trainer
    is registered, before the first batch is requested (e.g. to evaluate the base model, then
    start environments). ``on_step`` (see :data:`StepCallback`) lets a caller act on the live
    weights, e.g. run a held-out evaluation every few steps. ``sync_at_end``: whether the last
    step syncs the server too: True always, False never (a caller that stops the server right
    after), None (default) when the server outlives the trainer (a vLLM the trainer launched
    stops with it, so it is not restarted for the last step). ``budget``: the time budget that
    may end training before ``training_steps`` (default: one built from ``max_time`` and
    ``min_steps``, counted from this call); its ``stopped_at`` tells ``on_step`` which step was
    the last.

    With ``keep_checkpoints=0`` no ``step_N`` folder stays: one written for a weight sync is
    deleted once the server has loaded it, and the last step is written once, as
    ``final_model``, without optimizer state.
    """
    if budget is None and config.max_time is not None:
        budget = TimeBudget(config.max_time, min_steps=config.min_steps)
    torch.manual_seed(config.seed)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    save_path = config.save_dir()
    save_path.mkdir(parents=True, exist_ok=True)

    resume_from = _resume_folder(config)
    # a folder vLLM and atropos-serve can load (the packaged SmolLM2 is converted once)
    start_model = str(resume_from or resolve_model_source(config.model_name))
    model, tokenizer = load_policy(start_model, config)
    if config.freeze_embeddings:
        freeze_embeddings(model)
    precision = resolve_precision(config)
    warn_if_updates_round_away(model, config)
    with autocast(config):  # the paths are compared in the precision they will run in
        fast = check_fast_path(model, config.device)
        pack_tokens = config.resolved_pack_tokens()
        if pack_tokens and not check_packed_path(model, config.device):
            pack_tokens = 0
    logger.info(
        "precision: %s; log-probabilities: %s; %s",
        precision,
        "trained positions only" if fast else "full forward pass",
        f"sequences packed ({pack_tokens} tokens per pass, shared beginnings once)"
        if pack_tokens
        else f"micro-batches of {config.batch_size} padded sequences",
    )
    flops = model_flops(model)
    peak_flops = config.peak_flops or gemm_peak(
        str(config.device), compute_dtype_name(config),
        torch.get_num_threads(),
    )  # fmt: skip
    if peak_flops:
        logger.info(
            "mfu is measured against %.1f GFLOP/s (%s)",
            peak_flops / 1e9,
            "peak_flops" if config.peak_flops else "this machine's GEMM peak, bench/gemm_peak.py",
        )
    ref_model = None
    if config.kl_coef > 0:
        ref_model, _ = load_policy(config.reference_model or config.model_name, config)
        ref_model.eval().requires_grad_(False)
    optimizer = make_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, config.warmup_steps, config.training_steps, config.lr_scheduler_type
        ),
    )
    step = 0
    if resume_from is not None:
        state = load_trainer_state(resume_from)
        optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        step = int(state["step"])
        logger.info("resumed from %s at step %d", resume_from, step)

    run = init_wandb(config)
    log = TrainingLogger(
        config.training_steps,
        step,
        config.metrics_path(),
        progress=config.progress,
        wandb_run=run,
    )
    sync = make_weight_sync(config)
    sync.attach(model)
    check_server_precision(config)
    api = TrainerAPIClient(config.atropos_url)
    paused = False
    final: Path | None = None
    last = False
    synced_step = step
    #: evaluations pinned to a step's weights, not logged yet: request id -> step
    evals_pending: dict[int, int] = {}
    eval_every = config.eval_every
    #: gradient norms of the steps that moved the weights, for skip_grad_spikes
    grad_norms: list[float] = []
    final: Path | None = None
    try:
        launching = config.inference == "vllm" and config.launch_vllm
        log.status("starting the inference server" if launching else "")
        sync.start(start_model, policy_version=step)
        api.register(
            batch_size=config.api_batch_size,
            max_token_len=config.seq_len,
            checkpoint_dir=str(save_path),
            save_checkpoint_interval=config.checkpoint_interval or config.training_steps,
            starting_step=step,
            num_steps=config.training_steps,
            wandb_group=config.wandb_group or "",
            wandb_project=config.wandb_project or "",
            timeout=config.register_timeout,
        )
        if on_ready is not None:
            on_ready()
        while step < config.training_steps:
            log.status(f"step {step + 1}: waiting for a batch")
            waited = time.monotonic()
            wait_left = budget.wait_left(step) if budget is not None else None
            if wait_left is not None and (
                config.batch_timeout is None or wait_left < config.batch_timeout
            ):
                groups = _batch_within(api, max(0.0, wait_left))
                if groups is None:  # the budget ran out while waiting: the last step was
                    assert budget is not None
                    budget.stop_waiting(step, time.monotonic() - waited)
                    break
            else:
                groups = api.get_batch(timeout=config.batch_timeout)
            # The step's own work starts here: the server pauses before the batch is laid out,
            # so that nothing else competes with it for the cores.
            started = time.monotonic()
            if config.pause_generation:
                sync.pause(config.pause_mode)
                paused = True
            batch = prepare_batch(
                groups,
                config.batch_size,
                # a shared prompt needs its key/value cache, which checkpointing turns off
                share_prefix=config.share_prompt_prefix and not config.gradient_checkpointing,
                skip_zero_advantage=config.skip_zero_advantage and config.kl_coef == 0,
                pad_multiple=config.pad_multiple,
                upstream_padding=config.upstream_padding,
                pack_tokens=0 if config.upstream_padding else pack_tokens,
            )
            if batch.group_scores and batch.flat_groups == len(batch.group_scores):
                logger.warning(
                    "step %d: all %d groups scored alike: no learning signal in this batch%s",
                    step + 1,
                    len(batch.group_scores),
                    " (no optimizer step)" if not batch.micro_batches else "",
                )
            metrics = train_step(
                model,
                optimizer,
                scheduler,
                batch,
                config,
                ref_model,
                fast=fast,
                recent_grad_norms=grad_norms,
            )
            if metrics.get("grad_spike_skipped"):
                logger.warning(
                    "step %d: gradient norm %.3g is more than %g times the median of the last "
                    "steps' (%.3g): optimizer step skipped (skip_grad_spikes), the weights stay",
                    step + 1,
                    metrics["grad_norm"],
                    config.skip_grad_spikes,
                    grad_norm_baseline(grad_norms),
                )
            elif metrics["optimizer_step"]:
                grad_norms.append(metrics["grad_norm"])
            train_seconds = time.monotonic() - started
            step += 1
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(f"loss is {metrics['loss']} at step {step}")

            last = step == config.training_steps or (
                budget is not None and budget.is_last(step, time.monotonic() - waited)
            )
            # vLLM launched here stops with the trainer: no restart after the last step.
            sync_now = (step % config.weight_sync_interval == 0 or last) and (
                not last or (sync.outlives_trainer if sync_at_end is None else sync_at_end)
            )
            checkpoint_now = (
                config.checkpoint_interval > 0 and step % config.checkpoint_interval == 0
            )
            save_seconds = reload_seconds = 0.0
            synced: Path | None = None
            folder: Path | None = None
            disk_sync = sync_now and sync.needs_checkpoint
            save_started = time.monotonic()
            # A folder is written at the checkpoint interval, for a sync that reads one (disk)
            # and at the end. The end writes final_model itself unless a step_N is wanted there
            # (checkpoint interval, or a disk sync whose copies are kept).
            if checkpoint_now or disk_sync or last:
                as_final = (
                    last and not checkpoint_now and (not disk_sync or config.keep_checkpoints == 0)
                )
                target = save_path / "final_model" if as_final else step_dir(save_path, step)
                folder = save_checkpoint(target, model, tokenizer, step=step)
                if as_final:
                    final = folder
                # optimizer state only where resuming needs it; keep_checkpoints=0 asks for
                # the smallest footprint (the model alone)
                if checkpoint_now or (last and config.keep_checkpoints != 0):
                    save_trainer_state(
                        folder,
                        step=step,
                        optimizer=optimizer,
                        scheduler=scheduler,
                        config=config.model_dump(),
                    )
                if config.keep_checkpoints:
                    prune_checkpoints(save_path, config.keep_checkpoints, protect={folder})
            save_seconds = time.monotonic() - save_started
            sync_timings: dict[str, float] = {}
            if sync_now:
                log.status(f"step {step}: weight sync ({sync.description})")
                reload_seconds = sync.sync(folder if disk_sync else None, policy_version=step)
                sync_timings = dict(getattr(sync, "last_timings", None) or {})
                synced = folder if disk_sync and folder is not None else save_path
                synced_step = step
            if not config.keep_checkpoints and folder is not None:
                # keep_checkpoints=0: the server has loaded the copy, nothing needs it any more
                # (the newest resumable checkpoint is always kept)
                prune_checkpoints(save_path, 0)
            if paused:
                sync.resume()
                paused = False
            if budget is not None:
                budget.record(time.monotonic() - waited, waited=started - waited)

            extra = on_step(step, synced) if on_step is not None else None
            log.log(
                step,
                {
                    **metrics,
                    **(extra or {}),
                    "reward_mean": batch.reward_mean,
                    "sequences": batch.num_sequences,
                    "tokens": batch.total_tokens,
                    "trained_tokens": batch.num_tokens,
                    "computed_tokens": batch.computed_tokens,
                    "skipped_sequences": batch.skipped_sequences,
                    "flat_group_fraction": batch.flat_groups / max(len(batch.group_scores), 1),
                    **staleness_metrics(batch.policy_versions, step),
                    # a batch with nothing to train is no measure of speed
                    **(
                        step_throughput(
                            seconds=train_seconds,
                            batch_tokens=batch.total_tokens,
                            computed_tokens=batch.computed_tokens,
                            trained_tokens=batch.run_tokens,
                            flops=flops,
                            head_tokens=None if fast else batch.computed_tokens,
                            peak_flops=peak_flops,
                        )
                        if batch.micro_batches
                        else {}
                    ),
                    "train_seconds": train_seconds,
                    "batch_wait_seconds": started - waited,
                    # A sync through a checkpoint (disk) includes writing it; a checkpoint
                    # written only for the interval or the end is its own figure, not a sync.
                    "sync_seconds": reload_seconds + (save_seconds if disk_sync else 0.0),
                    "save_seconds": save_seconds,
                    "reload_seconds": reload_seconds,
                    **(
                        {"checkpoint_seconds": save_seconds}
                        if folder is not None and not disk_sync
                        else {}
                    ),
                    **({"sync_through_shm": float(sync.transport == "shm")} if sync_now else {}),
                    **{f"sync_{k}": v for k, v in sync_timings.items() if k != "sync_seconds"},
                },
            )
            if synced is not None and eval_every and step % eval_every == 0:
                try:
                    request = api.request_eval(step, step=step)
                except TrajectoryAPIError as exc:
                    # upstream's run-api has no /eval-request: say so once and train on
                    logger.warning("pinned evaluations are off: %s", exc)
                    eval_every = 0
                else:
                    evals_pending[int(request["request_id"])] = step
            _collect_evals(api, log, evals_pending, config, wait=config.eval_barrier)
            if budget is not None and budget.stopped_at == step:
                log.status(f"step {step} is the last: {budget.reason}")
                break
        _collect_evals(api, log, evals_pending, config, wait=True)
        if final is None:
            final = save_checkpoint(save_path / "final_model", model, tokenizer, step=step)
        ended_waiting = budget is not None and budget.stopped_at == step and not last
        if (
            ended_waiting
            and synced_step != step
            and (sync.outlives_trainer if sync_at_end is None else sync_at_end)
        ):
            # the budget ended training while it waited for a batch: the server gets the last
            # step's weights, as after any last step
            log.status(f"step {step}: weight sync ({sync.description})")
            sync.sync(final if sync.needs_checkpoint else None, policy_version=step)
        logger.info("final model saved to %s", final)
        return final
    finally:
        if paused:  # never leave a server we do not own paused
            try:
                sync.resume()
            except InferenceLaunchError as exc:
                logger.warning("could not resume the inference server: %s", exc)
        log.close()
        sync.close()
        api.close()


def _batch_within(api: TrainerAPIClient, seconds: float) -> list[dict] | None:
    """The next batch if it comes within ``seconds``, else None (errors the API reports before
    then are raised as usual)."""
    deadline = time.monotonic() + seconds
    try:
        return api.get_batch(timeout=seconds)
    except TrajectoryAPIError:
        if time.monotonic() < deadline:
            raise
        return None


def _collect_evals(
    api: TrainerAPIClient,
    log: TrainingLogger,
    pending: dict[int, int],
    config: TrainingConfig,
    *,
    wait: bool,
) -> None:
    """Log the pinned evaluations that are complete (``wait``: wait for each, up to
    ``eval_timeout``, then log what arrived)."""
    for request_id, eval_step in list(pending.items()):
        if wait:
            log.status(f"step {eval_step}: waiting for the environments' evaluations")
        try:
            results = api.eval_results(request_id, wait=wait, timeout=config.eval_timeout)
        except TrajectoryAPIError as exc:  # run-api restarted or reset: the request is gone
            logger.warning("evaluation of step %d is lost: %s", eval_step, exc)
            del pending[request_id]
            continue
        if results.get("complete") or wait:
            log.log_eval(eval_step, results)
            del pending[request_id]


def _resume_folder(config: TrainingConfig) -> Path | None:
    if config.resume is None:
        return None
    if config.resume == "latest":
        folder = latest_resumable(config.save_dir())
        if folder is None:
            raise FileNotFoundError(
                f"--resume latest: no resumable step_N checkpoint under {config.save_dir()}"
            )
        return folder
    folder = Path(config.resume).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"--resume {folder}: no such folder")
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-grpo``."""
    config = load_config(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        final = train(config)
    except KeyboardInterrupt:
        print("atropos-grpo: interrupted; child processes stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except (CheckpointSpaceError, SegmentSpaceError) as exc:
        raise SystemExit(f"atropos-grpo: {exc.strerror}") from None
    print(f"atropos-grpo: done; final model in {final}", file=sys.stderr)


if __name__ == "__main__":
    main()
