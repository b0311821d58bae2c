"""Render a JSONL file of scored rollout groups as a static, self-contained HTML page.

Each JSONL line is one group: ``{"messages": [...], "scores": [...], ...}`` where every entry
of ``messages`` is one rollout, either a string or a conversation (a list of
``{"role", "content"}`` dicts, content possibly a list of OpenAI content parts). Every rollout
becomes a box coloured by the sign of its score; every group a collapsible ``<details>``.

Unlike upstream, all model output is HTML-escaped (markdown still renders): a completion that
contains ``<script>`` shows as text and never runs, unsafe link targets (``javascript:``...) are
removed, and the page's own script runs under a per-page CSP nonce. Keyboard navigation: ``j``/``k``
or the up/down arrows move between rollouts, ``n``/``p`` or right/left between groups, ``o`` or
Enter expands/collapses the current group, ``e``/``c`` expand/collapse all.

Command line: ``python -m atroposlib.frontend.jsonl2html IN.jsonl [OUT.html]``.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import re
import secrets
import sys
import threading
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any
from xml.etree.ElementTree import Element

import markdown
from markdown.treeprocessors import Treeprocessor

from atroposlib.frontend.groups import iter_jsonl, score_sign

logger = logging.getLogger(__name__)

TEMPLATE_FILE = Path(__file__).resolve().parent / "template.html"
"""The page template, shipped next to this module (placeholders ``{title}``, ``{groups_html}``)."""

MARKDOWN_EXTENSIONS = ["fenced_code", "tables", "nl2br"]

_PLACEHOLDER = re.compile(r"\{(title|groups_html|nonce)\}")
_SAFE_URL_SCHEMES = {"http", "https", "mailto"}
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*):")

__all__ = [
    "TEMPLATE_FILE",
    "create_html_for_group",
    "generate_html",
    "get_score_class",
    "main",
    "render_markdown",
]


# --- Markdown without raw HTML ----------------------------------------------------------------


def _is_safe_url(url: str, image: bool) -> bool:
    # Browsers ignore ASCII whitespace and control characters inside a scheme ("java\tscript:").
    compact = re.sub(r"[\x00-\x20\x7f]+", "", url)
    match = _SCHEME.match(compact)
    if match is None:
        return True  # relative URL or fragment
    scheme = match.group(1).lower()
    if scheme in _SAFE_URL_SCHEMES:
        return True
    return image and scheme == "data" and compact[5:].lower().startswith("image/")


class _SanitizeLinks(Treeprocessor):
    """Drop ``href``/``src`` attributes with schemes that can run code (``javascript:`` ...)."""

    def run(self, root: Element) -> None:
        for element in root.iter():
            for attr in ("href", "src"):
                value = element.get(attr)
                if value is not None and not _is_safe_url(value, image=element.tag == "img"):
                    del element.attrib[attr]


_local = threading.local()


def _markdown() -> markdown.Markdown:
    """A per-thread Markdown converter that escapes raw HTML instead of passing it through."""
    md = getattr(_local, "md", None)
    if md is None:
        md = markdown.Markdown(extensions=MARKDOWN_EXTENSIONS)
        # Without these, "<script>" in the source is escaped like any other text.
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")
        md.treeprocessors.register(_SanitizeLinks(md), "atropos_sanitize_links", 0)
        _local.md = md
    md.reset()
    return md


def render_markdown(text: str) -> str:
    """Markdown (fenced code, tables, newline-to-``<br>``) to HTML, with raw HTML escaped."""
    return _markdown().convert(text)


# --- Content extraction -----------------------------------------------------------------------


def _content_to_text(content: Any) -> str:
    """Message content (a string, OpenAI content parts, or anything else) as markdown text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping):
                kind = part.get("type")
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif kind == "image_url":
                    parts.append("*[image]*")
                elif kind in ("input_audio", "audio"):
                    parts.append("*[audio]*")
                else:
                    parts.append(_as_code(part))
            else:
                parts.append(str(part))
        return "\n\n".join(parts)
    if isinstance(content, Mapping):
        return _as_code(content)
    return str(content)


def _as_code(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, indent=2, default=str)
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}json\n{text}\n{fence}"


def _message_to_markdown(message: Any) -> str:
    if not isinstance(message, Mapping):
        return str(message)
    role = message.get("role", "unknown")
    role_text = str(role).capitalize() if role is not None else "Unknown"
    text = _content_to_text(message.get("content"))
    if message.get("tool_calls"):
        calls = _as_code(message["tool_calls"])
        text = f"{text}\n\n{calls}" if text else calls
    return f"**{role_text}**: {text}"


def _rollout_to_markdown(rollout: Any) -> str:
    """One rollout (a string, a conversation or a single message) as markdown text."""
    if isinstance(rollout, str):
        return rollout
    if isinstance(rollout, Mapping):
        return _message_to_markdown(rollout)
    if isinstance(rollout, Sequence) and not isinstance(rollout, (bytes, bytearray)):
        return "\n\n".join(_message_to_markdown(m) for m in rollout)
    return str(rollout)


# --- HTML ---------------------------------------------------------------------------------------


def get_score_class(score: Any) -> str:
    """CSS class for a score: ``reward-positive``, ``reward-negative``, ``reward-zero``, or ``""``
    when the score is not a number."""
    sign = score_sign(score)
    return f"reward-{sign}" if sign else ""


def create_html_for_group(group_data: Mapping[str, Any], index: int) -> str:
    """HTML for one group: a collapsible ``<details>`` with one box per rollout.

    Args:
        group_data: A mapping with ``messages`` (one entry per rollout: a string or a list of
            message dicts) and ``scores`` (one per rollout). If their lengths differ both are
            cut to the shorter, with a warning.
        index: The group's number, shown as "Group N" and used in element ids.

    Returns:
        The HTML snippet, or ``""`` when the group has no rollouts to show.
    """
    messages = group_data.get("messages") or []
    scores = group_data.get("scores") or []
    if isinstance(messages, (str, Mapping)):
        messages = [messages]
    if not isinstance(scores, Sequence) or isinstance(scores, str):
        scores = [scores]
    messages, scores = list(messages), list(scores)

    if len(messages) != len(scores):
        count = min(len(messages), len(scores))
        logger.warning(
            "Group %d has %d messages but %d scores; showing the first %d of each",
            index,
            len(messages),
            len(scores),
            count,
        )
        messages, scores = messages[:count], scores[:count]

    items = []
    for i, (rollout, score) in enumerate(zip(messages, scores, strict=True)):
        body = render_markdown(_rollout_to_markdown(rollout))
        score_class = get_score_class(score)
        items.append(
            f'<div class="item {score_class}" id="group-{index}-item-{i}">\n'
            f"    <h4>Content {i}</h4>\n"
            f'    <div class="content-block">\n{body}\n    </div>\n'
            f"    <p><strong>Reward:</strong> {html.escape(str(score))}</p>\n"
            f"</div>"
        )

    if not items:
        logger.warning("Group %d has no rollouts to show; skipping it", index)
        return ""

    # No re-indentation: it would add spaces inside <pre> blocks.
    inner = "\n".join(items)
    return (
        "<details>\n"
        f"    <summary>{_summary(group_data, index, scores)}</summary>\n"
        '    <div class="group-content">\n'
        f"{inner}\n"
        "    </div>\n"
        "</details>\n"
    )


def _summary(group_data: Mapping[str, Any], index: int, scores: list[Any]) -> str:
    """The collapsed header: group number, trainer step (when recorded), mean score, size."""
    parts = [f"Group {index}"]
    step = group_data.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        parts.append(f"step {step}")
    numeric = [float(s) for s in scores if isinstance(s, (int, float)) and not isinstance(s, bool)]
    if numeric:
        mean = sum(numeric) / len(numeric)
        parts.append(f'<span class="{get_score_class(mean)}-text">mean score {mean:+.3f}</span>')
    parts.append(f"{len(scores)} rollout{'s' if len(scores) != 1 else ''}")
    return " &middot; ".join(parts)


def _fill_template(template: str, values: Mapping[str, str]) -> str:
    """Replace ``{name}`` placeholders in one pass (so substituted text is never re-scanned and
    the template's CSS/JS braces need no escaping)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def _read_template() -> str:
    try:
        return resources.files("atroposlib.frontend").joinpath("template.html").read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return TEMPLATE_FILE.read_text(encoding="utf-8")


def generate_html(input_path: str | Path, output_path: str | Path | None = None) -> Path:
    """Render the JSONL file ``input_path`` as an HTML page.

    Lines that are not JSON objects with ``messages`` and ``scores`` are skipped with a warning
    that names the line number.

    Args:
        input_path: The JSONL file.
        output_path: Where to write the page; defaults to ``input_path`` with an ``.html``
            suffix. Missing parent folders are created.

    Returns:
        The path of the written HTML file.

    Raises:
        FileNotFoundError: ``input_path`` does not exist.
    """
    source = Path(input_path)
    if not source.is_file():
        raise FileNotFoundError(f"Input file not found: {source}")
    target = source.with_suffix(".html") if output_path is None else Path(output_path)

    groups: list[str] = []
    for line_num, data, error in iter_jsonl(source):
        if error is not None:
            logger.warning("Skipping line %d: invalid JSON (%s)", line_num, error)
            continue
        if not isinstance(data, dict) or "messages" not in data or "scores" not in data:
            logger.warning("Skipping line %d: not an object with 'messages' and 'scores'", line_num)
            continue
        group_html = create_html_for_group(data, len(groups))
        if group_html:
            groups.append(group_html)

    if groups:
        groups_html = "\n".join(groups)
    else:
        logger.warning("No groups to render in %s", source)
        groups_html = "<p>No data to display. The input file is empty or has no valid groups.</p>"

    page = _fill_template(
        _read_template(),
        {
            "title": html.escape(f"Rendered Messages - {source.name}"),
            "groups_html": groups_html,
            "nonce": secrets.token_urlsafe(16),
        },
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    logger.info("Wrote %s (%d groups)", target, len(groups))
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m atroposlib.frontend.jsonl2html IN [OUT]``: write the HTML page, print its path."""
    parser = argparse.ArgumentParser(
        prog="python -m atroposlib.frontend.jsonl2html",
        description="Render a JSONL file of scored groups (messages + scores) as an HTML page.",
    )
    parser.add_argument("input_path", help="the JSONL file")
    parser.add_argument(
        "output_path", nargs="?", default=None, help="the HTML file (default: INPUT with .html)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        out = generate_html(args.input_path, args.output_path)
    except (FileNotFoundError, OSError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(f"Successfully generated HTML file: {out.absolute()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
