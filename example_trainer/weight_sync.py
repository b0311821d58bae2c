"""The example trainer's weight sync: which library client its config names.

The clients themselves (``WeightSync``, ``NoSync``, ``AtroposServeReload``, ``SGLangReload``,
``VLLMRestart``, ``VLLMReload``, ``vllm_command`` ...) moved to :mod:`atroposlib.backends`, where
any trainer can use them; they are still importable from here (upstream's path).
:func:`make_weight_sync` picks one from a :class:`~example_trainer.config.TrainingConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atroposlib.backends import weight_sync_client
from atroposlib.backends.weight_sync import (  # noqa: F401 - upstream's import path
    POLICY_VERSION_ENV,
    POLICY_VERSION_MIDDLEWARE,
    SHARED_STORAGE_HINT,
    AtroposServeReload,
    InferenceLaunchError,
    MultiServerSync,
    NoSync,
    SGLangReload,
    VLLMReload,
    VLLMRestart,
    WeightSync,
    _json,
    _request,
    _wait_healthy,
    plugin_env,
    server_policy_version,
    vllm_command,
)

if TYPE_CHECKING:
    from example_trainer.config import TrainingConfig

__all__ = [
    "POLICY_VERSION_ENV",
    "POLICY_VERSION_MIDDLEWARE",
    "AtroposServeReload",
    "MultiServerSync",
    "NoSync",
    "SGLangReload",
    "VLLMReload",
    "VLLMRestart",
    "WeightSync",
    "make_weight_sync",
    "plugin_env",
    "vllm_command",
]


def make_weight_sync(config: TrainingConfig) -> WeightSync:
    """The weight-sync client ``config.inference``, ``config.launch_vllm`` and
    ``config.weight_sync`` name.

    - ``none``: :class:`NoSync` (checkpoints only).
    - ``vllm`` with ``launch_vllm`` (the default): the trainer launches vLLM and syncs it by
      ``weight_sync`` (``reload`` in place, ``restart``, ``nccl``).
    - anything else: a client of the server(s) already running at ``inference_url`` (several,
      comma-separated: synced together), from :func:`atroposlib.backends.weight_sync_client`.
    """
    if config.inference == "none":
        return NoSync()
    if config.inference == "vllm" and config.launch_vllm:
        return _launched_vllm(config)
    options: dict[str, Any] = {}
    weight_path = None
    if config.inference == "atropos-serve":
        options["transport"] = config.weight_sync_transport
    if config.inference in ("vllm", "trl-vllm-serve"):
        options["served_model_name"] = config.model_alias
        weight_path = config.weight_sync
    urls = [u.strip() for u in config.inference_url.split(",") if u.strip()]
    return weight_sync_client(config.inference, urls, weight_path=weight_path, **options)


def _launched_vllm(config: TrainingConfig) -> WeightSync:
    from example_trainer.grpo import compute_dtype_name  # grpo imports this module

    def build(model: str) -> list[str]:
        return vllm_command(
            model,
            served_model_name=config.model_alias,
            host=config.vllm_host,
            port=config.vllm_port,
            python=config.vllm_python,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            # the trainer divides its logits by the sampling temperature: the server must report
            # the log-probs of that same distribution (vLLM's default is the raw one)
            # and compute in the trainer's arithmetic dtype (vLLM's auto would serve a float32
            # checkpoint in float16: samples from another policy); --vllm-extra-args win
            extra_args=[
                "--logprobs-mode",
                "processed_logprobs",
                "--dtype",
                compute_dtype_name(config),
                *config.vllm_extra_args,
            ],
        )

    common: dict[str, Any] = {
        "url": f"http://{config.vllm_host}:{config.vllm_port}",
        "log_path": config.vllm_log or config.save_dir() / "logs" / "vllm.log",
        "startup_timeout": config.vllm_startup_timeout,
        "served_model_name": config.model_alias,
    }
    if config.weight_sync == "restart":
        return VLLMRestart(build, **common)
    if config.weight_sync == "nccl":
        from atroposlib.backends.weight_transfer import VLLMWeightTransfer

        return VLLMWeightTransfer(build, **common)
    return VLLMReload(build, **common)
