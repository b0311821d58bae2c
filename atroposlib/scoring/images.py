"""Images for multimodal environments: encoding, OpenAI content parts, text fallbacks.

* ``encode_png(image)``: base64 PNG (what the ``images`` field of a group carries).
* ``image_message(text, images)``: a user message with OpenAI content parts
  (``{"type": "text"}`` then ``{"type": "image_url", "image_url": {"url": "data:..."}}``),
  the format vLLM, SGLang and hosted VLM APIs accept.
* ``flatten_for_text_model(messages)``: the same chat with each image replaced by a
  placeholder (and optionally an ASCII rendering), for chat templates and servers that take
  only strings.
"""

from __future__ import annotations

import base64
import io
from typing import Any

__all__ = [
    "ascii_art",
    "data_url",
    "encode_png",
    "flatten_for_text_model",
    "image_message",
]


def encode_png(image: Any) -> str:
    """A PIL image as base64 PNG text."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def data_url(b64_png: str) -> str:
    """``data:image/png;base64,...`` for an ``image_url`` content part."""
    return f"data:image/png;base64,{b64_png}"


def image_message(text: str, images_b64: list[str], role: str = "user") -> dict[str, Any]:
    """A chat message with the text first, then one ``image_url`` part per image."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images_b64]
    return {"role": role, "content": parts}


def ascii_art(
    image: Any, width: int = 32, palette: dict[str, tuple[int, int, int]] | None = None
) -> str:
    """A coarse text picture of ``image``: one character per cell, the initial of the
    nearest ``palette`` colour ('.' for the background, the first entry)."""
    palette = palette or {
        ".": (255, 255, 255),
        "r": (220, 30, 30),
        "g": (30, 160, 60),
        "b": (40, 80, 220),
        "y": (235, 200, 20),
        "k": (0, 0, 0),
    }
    height = max(1, round(width * image.height / image.width / 2))
    small = image.convert("RGB").resize((width, height))
    rows = []
    for y in range(height):
        row = []
        for x in range(width):
            px = small.getpixel((x, y))
            row.append(
                min(
                    palette,
                    key=lambda k: sum((a - b) ** 2 for a, b in zip(palette[k], px, strict=True)),
                )
            )
        rows.append("".join(row))
    return "\n".join(rows)


def flatten_for_text_model(
    messages: list[dict[str, Any]],
    placeholder: str = "<image>",
    renderings: list[str] | None = None,
) -> list[dict[str, Any]]:
    """``messages`` with string contents: text parts joined, each image part replaced by
    ``placeholder`` (followed by the matching entry of ``renderings`` when given)."""
    out = []
    index = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            pieces = []
            for part in content:
                if part.get("type") == "text":
                    pieces.append(part.get("text", ""))
                elif part.get("type") in ("image_url", "image"):
                    extra = ""
                    if renderings and index < len(renderings):
                        extra = "\n" + renderings[index]
                    pieces.append(f"\n{placeholder}{extra}\n")
                    index += 1
            content = "".join(pieces).strip()
        out.append({**m, "content": content})
    return out
