"""Which tokenizer an environment and its token-level servers load.

``tokenizer_name`` ``SmolLM2-135M-Instruct`` (:data:`SMOLLM2_ALIAS`) means atropos-serve's
bundled tokenizer (a local folder, no Hub access); any other name goes to
``AutoTokenizer.from_pretrained`` as it is.
"""

from __future__ import annotations

from typing import Any

from atroposlib.backends.registry import gives_token_ids
from atroposlib.envs.server_handling.server_baseline import ServerBaseline

__all__ = ["SMOLLM2_ALIAS", "load_tokenizer", "resolve_tokenizer_name", "with_server_tokenizers"]

#: ``tokenizer_name`` that means atropos-serve's bundled SmolLM2-135M-Instruct tokenizer.
SMOLLM2_ALIAS = "SmolLM2-135M-Instruct"


def resolve_tokenizer_name(name: str) -> str:
    """``name``, or the bundled tokenizer's folder for :data:`SMOLLM2_ALIAS`."""
    if name == SMOLLM2_ALIAS:
        # the model atropos-serve ships with: its local tokenizer, no Hub access needed
        from atroposlib.inference.assets import smollm2_tokenizer_dir

        return str(smollm2_tokenizer_dir())
    return name


def load_tokenizer(name: str) -> Any:
    """The Hugging Face tokenizer ``name`` names (see :func:`resolve_tokenizer_name`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_tokenizer_name(name))


def with_server_tokenizers(server_configs: Any, env_tokenizer_name: str) -> Any:
    """``server_configs`` (one or a list) with the tokenizer of token-level servers (every
    ``server_type`` but openai: ``atroposlib.backends.gives_token_ids``) fixed: ``tokenizer_name`` "none" becomes the env's tokenizer (instead of one
    named after ``model_name``, often a served alias such as "tiny" that is no tokenizer at
    all) and :data:`SMOLLM2_ALIAS` its folder. Other configs are returned unchanged."""
    env_tokenizer = resolve_tokenizer_name(env_tokenizer_name)

    def fix(cfg: Any) -> Any:
        if not isinstance(cfg, ServerBaseline) or not gives_token_ids(cfg.server_type):
            return cfg
        name = cfg.tokenizer_name
        if name == "none":
            return cfg.model_copy(update={"tokenizer_name": env_tokenizer})
        if name == SMOLLM2_ALIAS:
            return cfg.model_copy(update={"tokenizer_name": resolve_tokenizer_name(name)})
        return cfg

    if isinstance(server_configs, list):
        return [fix(c) for c in server_configs]
    return fix(server_configs)
