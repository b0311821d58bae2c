"""Data generation from environment rollouts (``atropos-sft-gen``, ``atropos-dpo-gen``).

The tools stand in for a trainer of the trajectory API and turn scored groups into JSONL:

* :mod:`~atroposlib.datagen.options`: what the tools are asked to do (pydantic models, the
  source of their flags);
* :mod:`~atroposlib.datagen.select`: which sequences of a group are kept (SFT) or paired (DPO),
  and where prompt and completion split;
* :mod:`~atroposlib.datagen.lines`: the JSONL line shapes (``--format atropos|trl``);
* :mod:`~atroposlib.datagen.output`: an output file that only ever holds complete lines;
* :mod:`~atroposlib.datagen.tokenizer`: the tokenizer to decode with, offline when cached;
* :mod:`~atroposlib.datagen.loop`: the run loop (register, read batches, write, Ctrl-C).
"""

from atroposlib.datagen.lines import dpo_lines, dpo_num_steps, sft_lines, sft_num_steps
from atroposlib.datagen.loop import StopFlag, main_guard, run
from atroposlib.datagen.options import (
    DEFAULT_API_URL,
    DEFAULT_TOKENIZER,
    DatagenError,
    DatagenOptions,
    DpoOptions,
    SftOptions,
)
from atroposlib.datagen.output import JsonlOutput
from atroposlib.datagen.select import (
    chat_messages,
    common_prefix,
    group_messages,
    select_dpo_pairs,
    select_sft,
    split_group,
)
from atroposlib.datagen.tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_API_URL",
    "DEFAULT_TOKENIZER",
    "DatagenError",
    "DatagenOptions",
    "DpoOptions",
    "JsonlOutput",
    "SftOptions",
    "StopFlag",
    "chat_messages",
    "common_prefix",
    "dpo_lines",
    "dpo_num_steps",
    "group_messages",
    "load_tokenizer",
    "main_guard",
    "run",
    "select_dpo_pairs",
    "select_sft",
    "sft_lines",
    "sft_num_steps",
    "split_group",
]
