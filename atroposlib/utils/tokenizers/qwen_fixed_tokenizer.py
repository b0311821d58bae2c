"""A Qwen tokenizer whose chat template renders tool calls without ``list.append()``.

Qwen's own templates use ``list.append()`` in places that sandboxed Jinja rejects; this wrapper
loads the tokenizer normally and swaps in ``qwen_chat_template.jinja`` (shipped next to this
module), which renders the same ChatML layout: a ``# Tools`` system block, ``<tool_call>`` JSON in
assistant turns (arguments as a dict or a JSON string), and consecutive ``tool`` messages as
``<tool_response>`` blocks in one user turn.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

TEMPLATE_NAME = "qwen_chat_template.jinja"

__all__ = ["QwenFixedTokenizer"]


class QwenFixedTokenizer:
    """Wraps ``AutoTokenizer.from_pretrained(...)`` with the fixed chat template.

    Every attribute other than ``apply_chat_template`` is the wrapped tokenizer's (``encode``,
    ``decode``, ``eos_token_id``...); the wrapped tokenizer is ``.tokenizer``.
    """

    @classmethod
    def _load_chat_template(cls) -> str:
        """The fixed template's text."""
        try:
            path = resources.files("atroposlib.utils.tokenizers").joinpath(TEMPLATE_NAME)
            return path.read_text(encoding="utf-8")
        except (FileNotFoundError, ModuleNotFoundError, OSError):
            return (Path(__file__).parent / TEMPLATE_NAME).read_text(encoding="utf-8")

    def __init__(self, model_name_or_path: str, **kwargs: Any) -> None:
        """Load the tokenizer of ``model_name_or_path`` (``kwargs`` go to ``from_pretrained``)."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **kwargs)
        self.tokenizer.chat_template = self._load_chat_template()

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally; guard against recursion before
        # ``tokenizer`` exists (copy/pickle create instances without calling __init__).
        if name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Tokenize, as the wrapped tokenizer does."""
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The wrapped tokenizer's ``apply_chat_template`` with the fixed template."""
        return self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
