"""Tokenizer wrappers (a Qwen tokenizer with a tool-calling chat template that renders in the
sandboxed Jinja environment)."""

from atroposlib.utils.tokenizers.qwen_fixed_tokenizer import QwenFixedTokenizer

__all__ = ["QwenFixedTokenizer"]
