"""``ManagedServer``: a server wrapper that records exact tokens, masks and logprobs.

Every completion becomes a ``SequenceNode``: the prompt and completion tokens exactly as the
backend saw and produced them, a training mask (-100 on prompt positions) and logprobs (1.0 on
prompt positions). A later request whose prompt text starts with a node's text *extends* that
node: the node's tokens are reused verbatim and only the new suffix is tokenized, so multi-turn
conversations stay token-exact and earlier completions stay trainable.

Default mode keeps a flat list of the latest node per conversation (an extended node is
replaced); ``track_tree=True`` keeps every node, keyed by its text.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from typing import Any

from openai.types.chat.chat_completion import ChatCompletion, ChatCompletionMessage, Choice
from openai.types.completion import Completion, CompletionChoice
from pydantic import BaseModel, PrivateAttr

try:  # openai>=1.99 splits function and custom tool calls
    from openai.types.chat import ChatCompletionMessageFunctionToolCall as _SdkToolCall
    from openai.types.chat.chat_completion_message_function_tool_call import (
        Function as _SdkFunction,
    )
except ImportError:  # older openai
    from openai.types.chat import ChatCompletionMessageToolCall as _SdkToolCall
    from openai.types.chat.chat_completion_message_tool_call import Function as _SdkFunction

from atroposlib.envs.server_handling.server_baseline import APIServer

logger = logging.getLogger(__name__)


class _ItemAccess:
    """``obj["field"]`` and ``obj.get("field")`` as well as ``obj.field``: upstream attached
    tool calls to replies as plain dicts, and environments written for it subscript them."""

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:  # type: ignore[attr-defined]
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]``, or ``default`` for a field it does not have."""
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields  # type: ignore[attr-defined]


class ToolCallFunction(_ItemAccess, _SdkFunction):
    """The SDK's tool-call ``Function`` (``name``, ``arguments``), also readable as a dict."""


class ToolCall(_ItemAccess, _SdkToolCall):
    """The SDK's function tool call (``id``, ``type``, ``function``), also readable as a dict
    (``tool_call["function"]["name"]``), as upstream's replies were."""

    function: ToolCallFunction


class SequenceNode(BaseModel):
    """One tracked sequence (prompt + completion).

    Attributes:
        full_text: Prompt text plus completion text.
        tokens: Every token id, prompt then completion.
        masked_tokens: ``tokens`` with -100 on positions not to train on (prompts).
        logprobs: Per-token logprobs; 1.0 on prompt positions.
        metadata: ``{"finish_reason": ...}`` and other per-node facts.
    """

    full_text: str
    tokens: list[int]
    masked_tokens: list[int]
    logprobs: list[float]
    metadata: dict[str, Any] | None = None

    # ``full_text`` with the completion decoded *with* special tokens (e.g. a trailing EOS);
    # chat templates re-render those, so this is the text a follow-up prompt starts with.
    _raw_text: str | None = PrivateAttr(default=None)

    def prefix_texts(self) -> list[str]:
        """Texts a follow-up prompt may start with to extend this node, longest first."""
        texts = {self.full_text}
        if self._raw_text:
            texts.add(self._raw_text)
        return sorted(texts, key=len, reverse=True)


class ManagedServer:
    """Wraps an ``APIServer`` (any object with ``tokens_and_logprobs_completion``) and tracks
    ``SequenceNode``s for training.

    Use ``chat_completion``/``completion`` as on a server; read ``get_state()`` for the nodes
    and ``reset()`` between groups.
    """

    _THINK_OPEN = "__MNGD_THINK__"
    _THINK_CLOSE = "__MNGD_ENDTHINK__"

    def __init__(
        self,
        server: APIServer,
        tokenizer: Any | None = None,
        track_tree: bool = False,
        tool_parser: str | None = None,
        preserve_think_blocks: bool = False,
    ) -> None:
        """
        Args:
            server: The backend server (must provide ``tokens_and_logprobs_completion``).
            tokenizer: HF tokenizer; defaults to ``server.tokenizer``, else one loaded from the
                server's tokenizer/model name, else None (with a warning).
            track_tree: Keep every node (dict by text) instead of the latest per conversation.
            tool_parser: Tool-call parser name (e.g. ``"hermes"``); enables ``tools``.
            preserve_think_blocks: Render earlier ``<think>`` blocks as the chat template does
                (by default they are protected from templates that strip them, so prompts
                keep extending earlier nodes).
        """
        self.server = server
        self.tokenizer = tokenizer
        self.track_tree = track_tree
        self._tool_parser_name = tool_parser
        self._translator: Any = None
        self._preserve_think_blocks = preserve_think_blocks
        self.sequences: dict[str, SequenceNode] = {}
        self.current_nodes: list[SequenceNode] = []
        if self.tokenizer is None:
            self._initialize_tokenizer()

    # ------------------------------------------------------------------ setup

    def _initialize_tokenizer(self) -> None:
        if hasattr(self.server, "tokenizer"):  # the server's choice, even None
            self.tokenizer = self.server.tokenizer
            return
        try:
            from transformers import AutoTokenizer

            config = self.server.config
            name = getattr(config, "tokenizer_name", "none")
            self.tokenizer = AutoTokenizer.from_pretrained(
                config.model_name if name in (None, "none") else name
            )
        except Exception as exc:  # any load failure: run without a tokenizer
            warnings.warn(
                f"Could not initialize tokenizer: {exc}. "
                "Sequence tracking will be limited without tokenizer.",
                stacklevel=3,
            )
            self.tokenizer = None

    def _get_translator(self) -> Any:
        """The ``ToolCallTranslator`` for ``tool_parser``, created on first use (None when
        no parser was requested or it cannot be built)."""
        if self._translator is None and self._tool_parser_name and self.tokenizer is not None:
            from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator

            try:
                self._translator = ToolCallTranslator(
                    tokenizer=self.tokenizer, parser_name=self._tool_parser_name
                )
            except Exception as exc:
                warnings.warn(
                    f"Failed to create ToolCallTranslator: {exc}. Tool call parsing is disabled.",
                    stacklevel=2,
                )
                self._tool_parser_name = None
        return self._translator

    # ------------------------------------------------------------------ prompts

    def _convert_messages_to_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> str:
        """Render ``messages`` with the chat template; the generation prompt is added unless
        the last message is the assistant's (which is then continued)."""
        if tools and self._get_translator() is not None:
            messages = self._get_translator().convert_messages_for_template(messages)
        if self.tokenizer is None or not hasattr(self.tokenizer, "apply_chat_template"):
            return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in messages)
        add_generation_prompt = not messages or messages[-1].get("role") != "assistant"
        if not self._preserve_think_blocks:
            messages = self._protect_think_blocks(messages)
        template_kwargs: dict[str, Any] = {
            "tokenize": False,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            template_kwargs["tools"] = tools
        if not add_generation_prompt:
            template_kwargs["continue_final_message"] = True
        try:
            prompt = self.tokenizer.apply_chat_template(messages, **template_kwargs)
        except (TypeError, ValueError):
            template_kwargs.pop("continue_final_message", None)
            prompt = self.tokenizer.apply_chat_template(messages, **template_kwargs)
        return prompt.replace(self._THINK_OPEN, "<think>").replace(self._THINK_CLOSE, "</think>")

    def _protect_think_blocks(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Swap ``<think>``/``</think>`` in earlier assistant turns for placeholders."""
        out = []
        for msg in messages:
            content = msg.get("content")
            if msg.get("role") == "assistant" and isinstance(content, str) and "<think>" in content:
                content = content.replace("<think>", self._THINK_OPEN).replace(
                    "</think>", self._THINK_CLOSE
                )
                out.append({**msg, "content": content})
            else:
                out.append(msg)
        return out

    def _debug_requests_enabled(self) -> bool:
        return os.getenv("ATROPOS_DEBUG_REQUESTS", "0") == "1"

    # ------------------------------------------------------------------ node bookkeeping

    def _candidate_nodes(self) -> list[SequenceNode]:
        return list(self.sequences.values()) if self.track_tree else self.current_nodes

    def _match(self, input_text: str) -> tuple[SequenceNode | None, str]:
        """The node whose text is the longest prefix of ``input_text``, and that text."""
        best: SequenceNode | None = None
        best_text = ""
        for node in self._candidate_nodes():
            for text in node.prefix_texts():
                if len(text) > len(best_text) and input_text.startswith(text):
                    best, best_text = node, text
                    break
        return best, best_text

    def _find_extending_node(self, input_text: str) -> SequenceNode | None:
        """The tracked node ``input_text`` extends (its text is a prefix), or None."""
        return self._match(input_text)[0]

    def _find_parent_node(self, input_text: str) -> SequenceNode | None:
        """Tree mode: the node whose text is exactly ``input_text``."""
        return self.sequences.get(input_text)

    def _encode_fresh(self, text: str) -> list[int]:
        tokens = self.tokenizer.encode(text, add_special_tokens=True)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        # Templates that write the BOS themselves would otherwise get a second one.
        if bos is not None and len(tokens) >= 2 and tokens[0] == tokens[1] == bos:
            tokens = tokens[1:]
        return tokens

    def _compute_input_ids(self, input_text: str, extending_node: SequenceNode | None) -> list[int]:
        """Prompt token ids: the extended node's tokens plus the new suffix tokenized without
        special tokens, or the whole prompt tokenized (one BOS) for a fresh sequence."""
        if extending_node is None:
            return self._encode_fresh(input_text)
        matched = next((t for t in extending_node.prefix_texts() if input_text.startswith(t)), None)
        if matched is None:
            return self._encode_fresh(input_text)
        suffix = input_text[len(matched) :]
        if not suffix:
            return list(extending_node.tokens)
        return list(extending_node.tokens) + self.tokenizer.encode(suffix, add_special_tokens=False)

    def _create_sequence_node(
        self,
        input_text: str,
        parent_node: SequenceNode | None,
        prompt_tokens: list[int],
        output_tokens: list[int],
        output_logprobs: list[float],
        completion_text: str,
        finish_reason: str = "stop",
        extending_node: SequenceNode | None = None,
        raw_completion_text: str | None = None,
    ) -> SequenceNode:
        """Build a node: prompt positions masked (-100, logprob 1.0) except where they are the
        extended node's own tokens, whose mask and logprobs are carried over."""
        output_tokens = list(output_tokens)
        output_logprobs = list(output_logprobs)[: len(output_tokens)]
        output_logprobs += [1.0] * (len(output_tokens) - len(output_logprobs))
        prompt_tokens = list(parent_node.tokens) if parent_node is not None else list(prompt_tokens)
        base = extending_node or parent_node
        if base is not None and prompt_tokens[: len(base.tokens)] == base.tokens:
            suffix_len = len(prompt_tokens) - len(base.tokens)
            masked = list(base.masked_tokens) + [-100] * suffix_len + output_tokens
            logprobs = list(base.logprobs) + [1.0] * suffix_len + output_logprobs
        else:
            masked = [-100] * len(prompt_tokens) + output_tokens
            logprobs = [1.0] * len(prompt_tokens) + output_logprobs
        node = SequenceNode(
            full_text=input_text + completion_text,
            tokens=prompt_tokens + output_tokens,
            masked_tokens=masked,
            logprobs=logprobs,
            metadata={"finish_reason": finish_reason},
        )
        if raw_completion_text is not None and raw_completion_text != completion_text:
            node._raw_text = input_text + raw_completion_text
        return node

    def _store(self, node: SequenceNode, extending_node: SequenceNode | None) -> None:
        if self.track_tree:
            self.sequences[node.full_text] = node
            return
        if extending_node is not None:
            for idx, existing in enumerate(self.current_nodes):
                if existing is extending_node:
                    self.current_nodes[idx] = node
                    return
        self.current_nodes.append(node)

    def _decode(self, tokens: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return "".join(chr(t) for t in tokens if t > 31)
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    async def _generate_and_track(
        self, prompt: str, kwargs: dict[str, Any], keep_special_tokens: bool = False
    ) -> list[tuple[str, str, str]]:
        """Run ``prompt`` through the backend, store one node per choice and return
        ``(text, markup_text, finish_reason)`` per choice: ``text`` without special tokens,
        ``markup_text`` with them (tool tags may be special) but without trailing ones (EOS),
        which chat templates write themselves."""
        extending_node = self._find_extending_node(prompt)
        request = dict(kwargs)
        request["prompt"] = prompt
        request.setdefault("model", self.server.config.model_name)
        if self.tokenizer is not None:
            request["input_ids"] = self._compute_input_ids(prompt, extending_node)
        if self._debug_requests_enabled():
            logger.debug(
                "[ATROPOS_REQ_DEBUG] n=%s max_tokens=%s extending=%s prompt=%r",
                request.get("n"),
                request.get("max_tokens"),
                extending_node is not None,
                prompt[:600],
            )
        (
            prompt_tokens,
            outputs,
            output_logprobs,
            finish_reasons,
        ) = await self.server.tokens_and_logprobs_completion(**request)
        results = []
        first_store = True
        for i, output_tokens in enumerate(outputs):
            raw_reason = finish_reasons[i] if i < len(finish_reasons) else "stop"
            finish_reason = (
                raw_reason.get("type", "stop") if isinstance(raw_reason, dict) else raw_reason
            ) or "stop"
            text = self._decode(output_tokens, skip_special_tokens=True)
            markup = self._decode(self._strip_trailing_special(output_tokens), False)
            raw_text = self._decode(output_tokens, skip_special_tokens=False)
            node = self._create_sequence_node(
                input_text=prompt,
                parent_node=None,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                output_logprobs=output_logprobs[i] if i < len(output_logprobs) else [],
                completion_text=markup if keep_special_tokens else text,
                finish_reason=finish_reason,
                extending_node=extending_node,
                raw_completion_text=raw_text,
            )
            # The first choice replaces the extended node; further choices are new branches.
            self._store(node, extending_node if first_store else None)
            first_store = False
            results.append((text, markup, finish_reason))
        return results

    def _strip_trailing_special(self, tokens: list[int]) -> list[int]:
        special = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        end = len(tokens)
        while end > 0 and tokens[end - 1] in special:
            end -= 1
        return list(tokens[:end])

    # ------------------------------------------------------------------ public API

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """A tracked chat completion (``messages``, ``n``, sampling kwargs, and ``tools`` /
        ``tool_choice`` when a tool parser is set). Returns an OpenAI ``ChatCompletion``."""
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        has_tools = bool(tools) and self._get_translator() is not None
        if has_tools and tool_choice is None:
            tool_choice = "auto"
        messages = kwargs.pop("messages", [])
        prompt = self._convert_messages_to_prompt(messages, tools=tools if has_tools else None)
        results = await self._generate_and_track(prompt, kwargs, keep_special_tokens=has_tools)
        choices = []
        for i, (text, markup, finish_reason) in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if has_tools and tool_choice != "none":
                content, tool_calls, parsed_reason = self._get_translator().parse_model_output(
                    raw_text=markup,
                    tool_choice=tool_choice if isinstance(tool_choice, str) else "auto",
                    tools=tools,
                )
                if tool_calls:
                    message["content"] = content
                    finish_reason = parsed_reason
                    message["tool_calls"] = [
                        ToolCall.model_validate(_tool_call_dict(tc)) for tc in tool_calls
                    ]
            choices.append(
                Choice(
                    finish_reason=finish_reason,
                    index=i,
                    message=ChatCompletionMessage(**message),
                )
            )
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.server.config.model_name,
            object="chat.completion",
            choices=choices,
        )

    async def completion(self, **kwargs: Any) -> Completion:
        """A tracked text completion (``prompt``, ``n``, sampling kwargs)."""
        prompt = kwargs.pop("prompt", "")
        results = await self._generate_and_track(prompt, kwargs)
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.server.config.model_name,
            object="text_completion",
            choices=[
                CompletionChoice(finish_reason=reason, index=i, text=text)
                for i, (text, _, reason) in enumerate(results)
            ],
        )

    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}`` (default mode) or ``{"sequences": {...}, "tree": {...}}``
        (tree mode); copies, so ``reset()`` does not empty them."""
        if self.track_tree:
            return {"sequences": dict(self.sequences), "tree": dict(self.sequences)}
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget all tracked nodes."""
        self.sequences.clear()
        self.current_nodes.clear()

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Prompt logprobs from the backend for ``prompt``, ``messages`` (rendered with the
        chat template) or ``input_ids``; returns ``{prompt_tokens, prompt_topk_token_ids,
        prompt_topk_logprobs}``."""
        request = dict(kwargs)
        messages = request.pop("messages", None)
        if messages is not None:
            request["prompt"] = self._convert_messages_to_prompt(messages)
        if not hasattr(self.server, "get_logprobs"):
            raise NotImplementedError(
                f"{self.server.__class__.__name__} does not implement get_logprobs. "
                "Strict mode requires backend prompt logprobs."
            )
        return await self.server.get_logprobs(**request)


def _tool_call_dict(tool_call: Any) -> dict[str, Any]:
    """A parsed tool call (dict or object with ``id`` and ``function``) as OpenAI's dict."""
    if isinstance(tool_call, dict):
        function = tool_call.get("function", {})
        return {
            "id": tool_call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": function.get("name", ""),
                "arguments": function.get("arguments", "{}"),
            },
        }
    return {
        "id": tool_call.id,
        "type": "function",
        "function": {"name": tool_call.function.name, "arguments": tool_call.function.arguments},
    }


class DummyManagedServer:
    """``ManagedServer`` look-alike for OpenAI endpoints, which give no token ids or logprobs.

    Every node holds the same placeholder tokens and logprobs (``metadata["dummy_tokens"]``
    is True). NOT suitable for training.
    """

    DUMMY_TOKENS = list(range(128))
    DUMMY_MASKED_TOKENS = [-100] + DUMMY_TOKENS[1:]
    DUMMY_LOGPROBS = [-0.5] * 128

    def __init__(
        self, server: APIServer, tokenizer: Any | None = None, track_tree: bool = False
    ) -> None:
        self.server = server
        self.track_tree = track_tree
        self.sequences: dict[str, SequenceNode] = {}
        self.current_nodes: list[SequenceNode] = []

    @staticmethod
    def _messages_to_text(messages: list[dict[str, Any]]) -> str:
        return "\n\n".join(f"{m['role']}:{m.get('content')}" for m in messages)

    def _create_dummy_node(self, full_text: str, finish_reason: str = "stop") -> SequenceNode:
        return SequenceNode(
            full_text=full_text,
            tokens=list(self.DUMMY_TOKENS),
            masked_tokens=list(self.DUMMY_MASKED_TOKENS),
            logprobs=list(self.DUMMY_LOGPROBS),
            metadata={"finish_reason": finish_reason, "dummy_tokens": True},
        )

    def _store(self, node: SequenceNode) -> None:
        if self.track_tree:
            self.sequences[node.full_text] = node
        else:
            self.current_nodes.append(node)

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """The server's chat completion, tracked with placeholder tokens."""
        messages = kwargs.get("messages", [])
        response = await self.server.chat_completion(**kwargs)
        for choice in response.choices:
            text = self._messages_to_text(
                [*messages, {"role": "assistant", "content": choice.message.content or ""}]
            )
            self._store(self._create_dummy_node(text, choice.finish_reason or "stop"))
        return response

    async def completion(self, **kwargs: Any) -> Completion:
        """The server's completion, tracked with placeholder tokens."""
        prompt = kwargs.get("prompt", "")
        response = await self.server.completion(**kwargs)
        for choice in response.choices:
            node = self._create_dummy_node(f"{prompt}{choice.text or ''}", choice.finish_reason)
            self._store(node)
        return response

    def get_state(self) -> dict[str, Any]:
        """As ``ManagedServer.get_state``."""
        if self.track_tree:
            return {"sequences": dict(self.sequences), "tree": dict(self.sequences)}
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget all tracked nodes."""
        self.sequences.clear()
        self.current_nodes.clear()

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Not available: an OpenAI endpoint gives no prompt logprobs."""
        raise NotImplementedError(
            "DummyManagedServer does not support get_logprobs in strict mode. "
            "Use a backend with real prompt logprob support."
        )


def reply_message(choice: Any) -> dict[str, Any]:
    """The assistant message of an OpenAI ``Choice`` as a chat dict: ``content`` ("" when
    empty, None when the turn is only tool calls) and ``tool_calls`` as plain dicts."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
    tool_calls = getattr(choice.message, "tool_calls", None)
    if tool_calls:
        message["tool_calls"] = [
            tc.model_dump() if hasattr(tc, "model_dump") else dict(tc) for tc in tool_calls
        ]
        if not choice.message.content:
            message["content"] = None
    return message


class RetokenizingManagedServer:
    """A managed session for servers that return no token ids (plain OpenAI endpoints), or
    for prompts a text chat template cannot render exactly (image content parts).

    Requests go to ``server`` as they are (usually the ``ServerManager``, so routing and the
    splitting of large ``n`` are unchanged); each reply becomes a ``SequenceNode`` whose
    ``tokens``/``masked_tokens`` come from ``tokenize_for_trainer`` over the chat (rendered
    with ``chat_for_template``). Logprobs are unknown: ``provides_logprobs`` is False and
    ``logprobs`` is empty; ``metadata["retokenized"]`` is True.

    As with ``ManagedServer``, a request whose messages continue an earlier node's chat
    *extends* it (the first choice replaces the node): the new node then trains on every
    assistant turn of the chat (``train_on_all_assistant_turns``), a fresh one only on its
    last turn (so few-shot examples in the prompt are not trained on).
    """

    provides_logprobs = False

    def __init__(self, server: Any, tokenizer: Any) -> None:
        """
        Args:
            server: Anything with an async ``chat_completion(**kwargs)`` returning an OpenAI
                ``ChatCompletion`` (a ``ServerManager`` or one ``APIServer``).
            tokenizer: The HF tokenizer of the trained model (required).
        """
        if tokenizer is None:
            raise ValueError("re-tokenizing a chat needs the model's tokenizer")
        self.server = server
        self.tokenizer = tokenizer
        self.current_nodes: list[SequenceNode] = []
        self._chats: list[list[dict[str, str]]] = []  # the chat of each node, rendered

    def _extended(self, chat: list[dict[str, str]]) -> int | None:
        """Index of the node whose chat is the longest prefix of ``chat``, or None."""
        best, best_len = None, 0
        for i, known in enumerate(self._chats):
            if best_len < len(known) <= len(chat) and chat[: len(known)] == known:
                best, best_len = i, len(known)
        return best

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """The server's chat completion; one re-tokenized node per choice."""
        from atroposlib.utils.tokenize_for_trainer import chat_for_template, tokenize_for_trainer

        response = await self.server.chat_completion(**kwargs)
        prompt = chat_for_template(kwargs.get("messages", []))
        extended = self._extended(prompt)
        for i, choice in enumerate(response.choices):
            chat = [*prompt, *chat_for_template([reply_message(choice)])]
            reason = choice.finish_reason or ""
            out = tokenize_for_trainer(
                self.tokenizer,
                chat,
                train_on_all_assistant_turns=extended is not None,
                finish_reason=reason,
            )
            node = SequenceNode(
                full_text="".join(f"{m['role']}: {m['content']}\n" for m in chat),
                tokens=out["tokens"],
                masked_tokens=out["masks"],
                logprobs=[],
                metadata={"finish_reason": reason or "stop", "retokenized": True},
            )
            if i == 0 and extended is not None:
                self.current_nodes[extended] = node
                self._chats[extended] = chat
            else:
                self.current_nodes.append(node)
                self._chats.append(chat)
        return response

    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}`` as ``ManagedServer.get_state`` (a copy)."""
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget all tracked nodes."""
        self.current_nodes.clear()
        self._chats.clear()


class ManagedServerAdapter:
    """Makes a ``ManagedServer`` look like ``openai.AsyncOpenAI`` for libraries that take a
    client: ``client.chat.completions.create()``, ``client.completions.create()`` and
    ``client.base_url``."""

    def __init__(self, managed_server: ManagedServer, base_url: str) -> None:
        self._managed = managed_server
        self.base_url = base_url
        self.chat = _Namespace(completions=_Creator(managed_server.chat_completion))
        self.completions = _Creator(managed_server.completion)

    async def post(self, path: str, body: dict, cast_to: type) -> Any:
        """Not supported."""
        raise NotImplementedError(f"ManagedServerAdapter does not support post() for {path!r}.")

    def copy(self, **kwargs: Any) -> Any:
        """Not supported."""
        raise NotImplementedError("ManagedServerAdapter does not support copy().")


class _Namespace:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class _Creator:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    async def create(self, **kwargs: Any) -> Any:
        return await self._fn(**kwargs)
