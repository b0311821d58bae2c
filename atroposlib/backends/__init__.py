"""Inference backends: one descriptor each, and weight-sync clients any trainer can call.

::

    from atroposlib.backends import get_backend, weight_sync_client

    vllm = get_backend("vllm")            # what the library knows about vLLM
    vllm.command(model, served_model_name="policy", port=9001)   # how to start it
    vllm.server_type, vllm.token_ids, vllm.logprobs, vllm.policy_version, vllm.weight_paths

    sync = weight_sync_client("vllm", "http://127.0.0.1:9001")   # a server already running
    sync.start(base_model_folder, policy_version=0)
    for step in ...:
        ...                                 # train, save_pretrained(folder)
        sync.sync(folder, policy_version=step)
    sync.close()

Backends: ``atropos-serve``, ``vllm``, ``sglang``, ``trl-vllm-serve`` and ``openai`` (any
OpenAI-compatible endpoint, which cannot take weights: asking for its client raises
:class:`WeightSyncUnsupported` saying so). ``docs/backends.md`` has the table.

Importing this package needs neither torch nor vLLM (the NCCL transport imports them when it
connects).
"""

from atroposlib.backends.registry import (
    BACKENDS,
    Backend,
    BackendName,
    LogprobKind,
    WeightPath,
    WeightSyncUnsupported,
    get_backend,
    gives_token_ids,
    serves_token_generate,
    sync_weights,
    weight_sync_client,
)
from atroposlib.backends.vllm_plugins import PLUGIN_DIR
from atroposlib.backends.weight_sync import (
    API_KEY_MIDDLEWARE,
    POLICY_VERSION_ENV,
    POLICY_VERSION_MIDDLEWARE,
    AtroposServeReload,
    InferenceLaunchError,
    MultiServerSync,
    NoSync,
    SGLangReload,
    VLLMReload,
    VLLMRestart,
    WeightSync,
    auth_headers,
    plugin_env,
    server_health,
    server_policy_version,
    vllm_command,
)
from atroposlib.backends.weight_transfer import (
    GlooTransport,
    Transport,
    VLLMNcclTransport,
    VLLMWeightTransfer,
)
from atroposlib.utils.processes import ChildProcess

__all__ = [
    "API_KEY_MIDDLEWARE",
    "BACKENDS",
    "PLUGIN_DIR",
    "POLICY_VERSION_ENV",
    "POLICY_VERSION_MIDDLEWARE",
    "AtroposServeReload",
    "Backend",
    "BackendName",
    "ChildProcess",
    "GlooTransport",
    "InferenceLaunchError",
    "LogprobKind",
    "MultiServerSync",
    "NoSync",
    "SGLangReload",
    "Transport",
    "VLLMNcclTransport",
    "VLLMReload",
    "VLLMRestart",
    "VLLMWeightTransfer",
    "WeightPath",
    "WeightSync",
    "WeightSyncUnsupported",
    "auth_headers",
    "get_backend",
    "gives_token_ids",
    "serves_token_generate",
    "plugin_env",
    "server_health",
    "server_policy_version",
    "sync_weights",
    "vllm_command",
    "weight_sync_client",
]
