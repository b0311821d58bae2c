"""Multimodal shapes: rendered scenes match their answers, scoring, VLM message format, and
``process`` end to end (images in every group)."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO
from tests.environments.test_gsm8k import assert_valid_groups, make_env, run_process

sys.path.insert(0, str(REPO / "environments"))

from multimodal_shapes_server import (  # noqa: E402
    COLORS,
    MultimodalShapesEnv,
    render_scene,
    score_reply,
)


def _components(image: Image.Image, rgb: tuple[int, int, int]) -> int:
    """Connected regions of exactly ``rgb`` (4-neighbourhood)."""
    w, h = image.size
    px = image.load()
    seen = set()
    count = 0
    for y in range(h):
        for x in range(w):
            if (x, y) in seen or px[x, y] != rgb:
                continue
            count += 1
            stack = [(x, y)]
            seen.add((x, y))
            while stack:
                cx, cy = stack.pop()
                for nx, ny in ((cx + 1, cy), (cx - 1, cy), (cx, cy + 1), (cx, cy - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] == rgb:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
    return count


@pytest.mark.parametrize("seed", range(6))
def test_total_counts_match_the_pixels(seed: int) -> None:
    scene = render_scene(seed, "count_total")
    drawn = sum(_components(scene["image"], rgb) for rgb in COLORS.values())
    assert str(drawn) == scene["answer"] == str(len(scene["shapes"]))


def test_scenes_are_seeded_and_varied() -> None:
    a, b = render_scene(42), render_scene(42)
    assert a["question"] == b["question"] and a["image"].tobytes() == b["image"].tobytes()
    kinds = {render_scene(s)["kind"] for s in range(40)}
    assert kinds == {"count_color_shape", "count_total", "read_number"}
    number = render_scene(3, "read_number")
    assert number["answer"].isdigit() and number["shapes"] == []


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("I count them. <answer>3</answer>", 1.0),
        ("<answer>three</answer>", 1.0),
        ("<answer>4</answer>", -0.5),
        ("There are 3 shapes.", -1.0),  # no tags
        ("<answer>3", -1.0),  # malformed
        ("", -1.0),
    ],
)
def test_score_reply(text: str, score: float) -> None:
    assert score_reply(text, "3") == score


def test_vlm_and_text_fallback_messages(tiny_model_dir: Path) -> None:
    env = make_env(MultimodalShapesEnv, tiny_model_dir, image_transport="content_parts")
    scene = render_scene(1)
    vlm, request, b64 = env.build_messages(scene)
    assert request is vlm
    parts = vlm[1]["content"]
    assert parts[0] == {"type": "text", "text": scene["question"]}
    assert parts[1]["type"] == "image_url"
    assert parts[1]["image_url"]["url"] == "data:image/png;base64," + b64
    png = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert png.size == (224, 224) and png.tobytes() == scene["image"].tobytes()
    env.config.image_transport = "text_fallback"
    _, request, _ = env.build_messages(scene)
    text = request[1]["content"]
    assert isinstance(text, str) and text.startswith(scene["question"]) and "<image>" in text
    assert any(c in text for c in "rgby")  # the ASCII view shows coloured cells


@pytest.mark.slow
def test_process_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = run_process(
        "multimodal_shapes_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "2",
        "--env.max_answer_tokens",
        "12",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 2)
    for group in groups:
        assert len(group["images"]) == 2
        Image.open(io.BytesIO(base64.b64decode(group["images"][0]))).verify()
        assert group["messages"][0][1]["content"][1]["type"] == "image_url"
        assert all(s in (-1.0, -0.5, 1.0) for s in group["scores"])
