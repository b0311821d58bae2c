"""The run viewer behind ``view-run``: every group taken from a run, rendered as HTML in a
Gradio page.

:class:`RunViewer` stands in for the trainer of a run (through
:class:`atroposlib.api.client.TrainerClient`) and keeps **every** group of every batch taken
(Previous/Next walk through them): the prompt, each completion with its score, the chat
messages when the env sent them, images of multimodal groups, and on demand the tokens with the
ones the trainer learns from highlighted. A counter shows the API's queue (``GET /status``).
It can also show the JSONL written by an environment's ``process`` command, with no server.

:func:`render_group` is the HTML of one group (all text escaped); :func:`build_app` the page.
The static page of a whole JSONL file is :mod:`atroposlib.frontend.jsonl2html`; both use
:mod:`atroposlib.frontend.groups` for scores and JSONL reading.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from atroposlib.datagen.options import DEFAULT_API_URL, DEFAULT_TOKENIZER, DatagenError
from atroposlib.datagen.select import split_group
from atroposlib.datagen.tokenizer import load_tokenizer
from atroposlib.frontend.groups import iter_jsonl, score_sign

log = logging.getLogger("atroposlib.view_run")

__all__ = [
    "CSS",
    "GROUPS_PER_BATCH",
    "launch",
    "RunViewer",
    "ViewRunOptions",
    "build_app",
    "image_data_urls",
    "read_groups_file",
    "render_group",
    "render_messages",
    "render_tokens",
]

GROUPS_PER_BATCH = 8
MAX_IMAGES = 16
_DATA_URL = re.compile(r"data:image/(?:png|jpeg|jpg|gif|webp);base64,[A-Za-z0-9+/=]+")
_MAGIC = {
    b"\x89PNG": "png",
    b"\xff\xd8\xff": "jpeg",
    b"GIF8": "gif",
    b"RIFF": "webp",
}

CSS = """
.av-group { font-size: 14px; }
.av-head { font-weight: 600; margin: 4px 0 8px; }
.av-box { border: 1px solid #d0d0d0; border-radius: 6px; padding: 8px; margin: 6px 0; }
.av-label { font-weight: 600; margin-bottom: 4px; }
.av-text { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace;
  margin: 0; }
.av-score { font-weight: 600; }
.av-pos { border-left: 6px solid #2e9e4f; }
.av-neg { border-left: 6px solid #c94040; }
.av-zero { border-left: 6px solid #999; }
.av-msg { margin: 4px 0; }
.av-role { font-weight: 600; text-transform: capitalize; }
.av-tok { font-family: ui-monospace, monospace; white-space: pre-wrap; border-radius: 2px; }
.av-trained { background: #c8f0c8; }
.av-prompt-tok { color: #777; }
.av-image { max-width: 320px; max-height: 320px; margin: 4px; border: 1px solid #ccc; }
"""


# ----------------------------------------------------------------------------- rendering


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def image_data_urls(images: Any) -> list[str]:
    """``data:image/...`` URLs for the images of a group (base64 strings or data URLs, nested
    in lists any way); anything else is skipped. At most ``MAX_IMAGES``."""
    found: list[str] = []

    def visit(value: Any) -> None:
        if len(found) >= MAX_IMAGES:
            return
        if isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, Mapping):
            url = value.get("url") or value.get("image_url") or value.get("image")
            if url is not None:
                visit(url)
        elif isinstance(value, str):
            url = _as_data_url(value)
            if url:
                found.append(url)

    visit(images)
    return found


def _as_data_url(text: str) -> str | None:
    text = text.strip()
    if text.startswith("data:"):
        match = _DATA_URL.fullmatch(text)
        return text if match else None
    try:
        head = base64.b64decode(text[:24] + "=" * (-len(text[:24]) % 4), validate=False)
    except ValueError:
        return None
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            if re.fullmatch(r"[A-Za-z0-9+/=\s]+", text):
                return f"data:image/{kind};base64,{''.join(text.split())}"
    return None


def _render_content(content: Any) -> str:
    """A message's content: text, or OpenAI content parts (text and images)."""
    if isinstance(content, str):
        return f'<pre class="av-text">{_esc(content)}</pre>'
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(f'<pre class="av-text">{_esc(part.get("text", ""))}</pre>')
            elif isinstance(part, Mapping) and part.get("type") in ("image_url", "image"):
                urls = image_data_urls(part)
                parts.extend(f'<img class="av-image" alt="image" src="{u}">' for u in urls)
                if not urls:
                    parts.append('<pre class="av-text">[image]</pre>')
            else:
                parts.append(f'<pre class="av-text">{_esc(json.dumps(part))}</pre>')
        return "".join(parts)
    if content is None:
        return ""
    return f'<pre class="av-text">{_esc(json.dumps(content))}</pre>'


def render_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """Chat messages as role-labelled blocks (escaped)."""
    out = []
    for m in messages:
        role = _esc(m.get("role", "?"))
        body = _render_content(m.get("content"))
        if m.get("tool_calls"):
            body += f'<pre class="av-text">{_esc(json.dumps(m["tool_calls"]))}</pre>'
        out.append(
            f'<div class="av-msg av-role-{role}"><span class="av-role">{role}</span>{body}</div>'
        )
    return "".join(out)


def render_tokens(tokenizer: Any, tokens: Sequence[int], masks: Sequence[int] | None) -> str:
    """Every token as a span: trained ones (mask != -100) highlighted, prompt ones grey."""
    if masks is None or len(masks) != len(tokens):
        masks = list(tokens)
    spans = []
    trained = 0
    for tok, mask in zip(tokens, masks, strict=True):
        text = tokenizer.decode([tok]) if tokenizer is not None else f"[{tok}]"
        cls = "av-trained" if mask != -100 else "av-prompt-tok"
        trained += mask != -100
        spans.append(f'<span class="av-tok {cls}" title="id {int(tok)}">{_esc(text)}</span>')
    return (
        f'<div class="av-label">tokens: {trained} of {len(tokens)} trained '
        f'(<span class="av-tok av-trained">trained</span> '
        f'<span class="av-tok av-prompt-tok">prompt, not trained</span>)</div>'
        f'<div class="av-tokens">{"".join(spans)}</div>'
    )


def _leading_common(lists: Sequence[Sequence[Any]]) -> int:
    if not lists:
        return 0
    k = 0
    shortest = min(len(x) for x in lists)
    while k < shortest - 1 and all(x[k] == lists[0][k] for x in lists):
        k += 1
    return k


def render_group(
    group: Mapping[str, Any],
    tokenizer: Any,
    title: str,
    show_tokens: bool = False,
) -> str:
    """One scored group as HTML: prompt, images, and each completion with its score.

    Chat groups (``messages``) show their shared leading messages as the prompt and each
    sequence's remaining messages; token-only groups are decoded with ``tokenizer`` (token ids
    when it is None). All text is escaped.
    """
    scores = list(group.get("scores") or [])
    tokens = group.get("tokens") or []
    masks = group.get("masks") or []
    messages = group.get("messages") or []
    chat = bool(messages) and all(isinstance(m, list) for m in messages)
    n = max(len(scores), len(tokens), len(messages))
    parts = [f'<div class="av-group"><div class="av-head">{_esc(title)}</div>']
    if chat:
        k = _leading_common(messages)
        prompt_html = render_messages(messages[0][:k]) if k else ""
        completions = [render_messages(m[k:]) for m in messages]
    elif messages and all(isinstance(m, str) for m in messages):
        prompt_html = ""
        completions = [f'<pre class="av-text">{_esc(m)}</pre>' for m in messages]
    elif tokens and tokenizer is not None:
        texts = split_group(tokenizer, group)
        prompt = os.path.commonprefix([p for p, _ in texts]) if texts else ""
        prompt_html = f'<pre class="av-text">{_esc(prompt)}</pre>'
        completions = [
            f'<pre class="av-text">{_esc((p + c)[len(prompt) :])}</pre>' for p, c in texts
        ]
    else:
        prompt_html = '<pre class="av-text">(no tokenizer: showing token ids)</pre>'
        completions = [f'<pre class="av-text">{_esc(t)}</pre>' for t in tokens]
    parts.append(f'<div class="av-box av-prompt"><div class="av-label">Prompt</div>{prompt_html}')
    images = image_data_urls(group.get("images"))
    parts.extend(f'<img class="av-image" alt="image {i}" src="{u}">' for i, u in enumerate(images))
    parts.append("</div>")
    for i in range(n):
        score = scores[i] if i < len(scores) else None
        kind = {"positive": "av-pos", "negative": "av-neg"}.get(score_sign(score) or "", "av-zero")
        body = completions[i] if i < len(completions) else ""
        if show_tokens and i < len(tokens):
            body += render_tokens(tokenizer, tokens[i], masks[i] if i < len(masks) else None)
        parts.append(
            f'<div class="av-box av-completion {kind}" data-index="{i}">'
            f'<div class="av-score">Completion {i + 1} · Score: {_esc(score)}</div>{body}</div>'
        )
    parts.append("</div>")
    return "".join(parts)


# ----------------------------------------------------------------------------- state


def read_groups_file(path: str | Path) -> list[dict[str, Any]]:
    """The groups of a ``process`` JSONL file (one group per line; other lines skipped)."""
    groups = []
    skipped = 0
    for _, obj, _ in iter_jsonl(path):
        if isinstance(obj, dict) and ("tokens" in obj or "messages" in obj):
            groups.append(obj)
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d lines that are not scored groups", path, skipped)
    return groups


class RunViewer:
    """What the page shows: every group taken so far (shared by all browser tabs)."""

    def __init__(
        self,
        tokenizer_name: str,
        client: TrainerClient | None = None,
        batch_wait_s: float = 30.0,
    ) -> None:
        self.tokenizer_name = tokenizer_name
        self.client = client
        self.batch_wait_s = batch_wait_s
        self.groups: list[tuple[int, int, int, dict[str, Any]]] = []  # (batch, g, of, group)
        self.batches = 0
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self.tokenizer_error: str | None = None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer, loaded once on first use (None when it cannot be loaded)."""
        if self._tokenizer is None and self.tokenizer_error is None:
            try:
                self._tokenizer = load_tokenizer(self.tokenizer_name)
            except DatagenError as exc:
                self.tokenizer_error = str(exc)
                log.warning("%s", exc)
        return self._tokenizer

    def add_batch(self, groups: Sequence[dict[str, Any]]) -> int:
        """Keep a batch; the index of its first group."""
        with self._lock:
            self.batches += 1
            first = len(self.groups)
            for g, group in enumerate(groups):
                self.groups.append((self.batches, g + 1, len(groups), group))
            return first

    def grab_next(self) -> tuple[int | None, str]:
        """Take the next batch from the API (waiting up to ``batch_wait_s``)."""
        if self.client is None:
            return None, "No API: this page shows a file."
        deadline = time.monotonic() + self.batch_wait_s
        while True:
            batch = self.client.try_batch(timeout=max(0.0, deadline - time.monotonic()))
            if batch:
                return self.add_batch(batch), f"Took batch {self.batches} ({len(batch)} groups)."
            if time.monotonic() >= deadline:
                return None, f"No batch ready after {self.batch_wait_s:.0f}s."
            time.sleep(0.5)

    def status(self) -> str:
        """The live counter line."""
        kept = f"{len(self.groups)} groups in {self.batches} batches kept"
        if self.client is None:
            return f"File mode · {kept}"
        try:
            st = self.client.status(timeout=0)
        except TrajectoryAPIError as exc:
            return f"API unreachable ({_esc(exc)}) · {kept}"
        return (
            f"Queue: {st.get('queue_size')} groups waiting · step {st.get('current_step')} · {kept}"
        )

    def page(self, index: int, show_tokens: bool) -> tuple[str, str]:
        """(position line, group HTML) for the group at ``index``."""
        if not self.groups:
            return "No groups yet.", (
                '<div class="av-group av-empty">Press <b>Grab Next Batch</b> to take a batch '
                "from the API.</div>"
            )
        index = max(0, min(index, len(self.groups) - 1))
        batch, g, of, group = self.groups[index]
        tok = self.tokenizer if (show_tokens or not group.get("messages")) else None
        title = f"Batch {batch} · group {g} of {of}"
        if group.get("env_id") is not None:
            title += f" · env {group['env_id']}"
        position = f"Group {index + 1} of {len(self.groups)} ({title})"
        if self.tokenizer_error and (show_tokens or not group.get("messages")):
            position += f" · tokenizer: {self.tokenizer_error}"
        return position, render_group(group, tok, title, show_tokens)


# ----------------------------------------------------------------------------- UI


def build_app(viewer: RunViewer, title: str = "Atropos run viewer") -> Any:
    """The Gradio Blocks page for ``viewer``."""
    import gradio as gr

    file_mode = viewer.client is None
    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        gr.Markdown(f"## {title}")
        status = gr.Markdown(viewer.status(), elem_id="av-status")
        with gr.Row():
            grab = gr.Button(
                "Grab Next Batch", variant="primary", elem_id="av-grab", visible=not file_mode
            )
            prev = gr.Button("Previous", elem_id="av-prev")
            nxt = gr.Button("Next", elem_id="av-next")
            show_tokens = gr.Checkbox(label="Show tokens and masks", elem_id="av-show-tokens")
        message = gr.Markdown("", elem_id="av-message")
        position = gr.Markdown(elem_id="av-position")
        view = gr.HTML(elem_id="av-view")
        index = gr.State(0)

        def show(i: int, tokens: bool) -> tuple[int, str, str]:
            pos, body = viewer.page(i, tokens)
            return max(0, min(i, max(len(viewer.groups) - 1, 0))), pos, body

        def on_grab(i: int, tokens: bool) -> tuple[int, str, str, str, str]:
            try:
                first, msg = viewer.grab_next()
            except TrajectoryAPIError as exc:
                first, msg = None, f"Error: {exc}"
            new_i, pos, body = show(i if first is None else first, tokens)
            return new_i, pos, body, msg, viewer.status()

        grab.click(
            on_grab,
            inputs=[index, show_tokens],
            outputs=[index, position, view, message, status],
            api_name="get_batch",
        )
        prev.click(lambda i, t: show(i - 1, t), [index, show_tokens], [index, position, view])
        nxt.click(lambda i, t: show(i + 1, t), [index, show_tokens], [index, position, view])
        show_tokens.change(show, [index, show_tokens], [index, position, view])
        demo.load(show, [index, show_tokens], [index, position, view])
        if not file_mode:
            gr.Timer(2.0).tick(viewer.status, outputs=status)
    return demo


def launch(
    viewer: RunViewer,
    *,
    host: str,
    port: int,
    share: bool = False,
    allowed_hosts: str = "",
    title: str = "Atropos run viewer",
) -> None:
    """Serve the page of ``viewer`` until interrupted.

    Other web pages cannot use it (:mod:`atroposlib.utils.http_security`): requests naming
    another host are refused (DNS rebinding; ``allowed_hosts`` adds names, comma-separated), and
    so are POSTs a page of another origin sends; Gradio's own CORS already answers only
    localhost origins. ``share`` opens a public Gradio link (then no Host check).
    """
    import gradio as gr
    from starlette.middleware import Middleware

    from atroposlib.utils.http_security import HttpSecurityMiddleware, loopback_hosts, split_names

    demo = build_app(viewer, title)
    theme = gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=["ui-monospace", "monospace"],
    )
    security = Middleware(
        HttpSecurityMiddleware,
        # a share link's tunnel arrives under its own name: no Host check then
        allowed_hosts=None if share else loopback_hosts(host, split_names(allowed_hosts)),
    )
    demo.launch(
        app_kwargs={"middleware": [security]},
        server_name=host,
        server_port=port,
        share=share,
        theme=theme,
        css=CSS,
        ssr_mode=False,
        footer_links=[],
    )


class ViewRunOptions(BaseModel):
    """The options of ``view-run`` (upstream's, plus ``--api-url``, ``--share``, ``--file``)."""

    port: int = Field(9001, ge=1, le=65535, description="Port of the page.")
    host: str = Field(
        "127.0.0.1", description="Address to bind (0.0.0.0 exposes the page to the network)."
    )
    group_size: int = Field(
        2, ge=1, description="Sequences per group (batch_size = group_size * 8)."
    )
    max_token_len: int = Field(
        2048, ge=1, description="Longest sequence accepted; registered with the API."
    )
    tokenizer: str = Field(
        DEFAULT_TOKENIZER,
        description="Tokenizer to decode tokens with: a local folder or a Hugging Face name "
        "(cache first, so it works offline once cached).",
    )
    api_url: str = Field(DEFAULT_API_URL, description="Trajectory API address.")
    num_steps: int = Field(
        1000, ge=1, description="Steps announced to environments (they stop after this many)."
    )
    batch_wait: float = Field(
        30.0, ge=0, description="Seconds 'Grab Next Batch' waits for a batch before giving up."
    )
    file: str | None = Field(
        None, description="Show this process JSONL file instead; no API is used."
    )
    share: bool = Field(False, description="Also open a public Gradio share link (off by default).")
    allowed_hosts: str = Field(
        "",
        description="Host names (comma-separated) accepted in the Host header besides "
        "localhost, 127.0.0.1 and [::1] (checked against DNS rebinding when bound to loopback).",
    )
