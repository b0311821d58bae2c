"""Multimodal shapes: count shapes or read text in images the environment renders (PIL).

Each item is a seeded 224x224 scene: circles, squares and triangles in red, green, blue and
yellow (non-overlapping), and a question: "How many red circles?", "How many shapes in
total?", or "What number is written in the image?" (a rendered 2-4 digit number). The model
answers in ``<answer>...</answer>``: 1.0 correct, -0.5 wrong, -1.0 no answer.

The image travels two ways:

* in the prompt as an OpenAI ``image_url`` content part (``data:image/png;base64``), the
  format of vLLM/SGLang/hosted VLMs, with ``--env.image_transport content_parts``;
* in every group's ``images`` field (base64 PNG per sequence) for the trainer.

Text-only models (the default SmolLM2 through atropos-serve) can't take image parts:
``--env.image_transport text_fallback`` (the default) sends an ``<image>`` placeholder followed
by a coarse ASCII rendering of the picture instead; the logged messages keep the content
parts either way, so the data is VLM-ready.

    python environments/multimodal_shapes_server.py process --env.total_steps 4
    python environments/multimodal_shapes_server.py serve --env.image_transport content_parts \\
        --openai.base_url http://vlm:8000/v1 --openai.model_name Qwen/Qwen2.5-VL-3B-Instruct \\
        --openai.server_type openai --env.tokenizer_name Qwen/Qwen2.5-VL-3B-Instruct
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, Literal

from PIL import Image, ImageDraw, ImageFont
from pydantic import Field

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import eval_completion, group_from_samples, sample_chat_group
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.images import ascii_art, encode_png, flatten_for_text_model, image_message

SYSTEM_PROMPT = (
    "You are looking at an image. Answer the question about it. Put only the final answer "
    "inside <answer></answer>, for example <answer>3</answer>."
)
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
SIZE = 224
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
_WORDS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
          "seven": 7, "eight": 8, "nine": 9, "ten": 10}  # fmt: skip


def render_scene(seed: int, kind: str | None = None) -> dict[str, Any]:
    """A seeded scene: ``{"image" (PIL), "question", "answer" (str), "kind", "shapes"}``."""
    rng = random.Random(seed)
    kind = kind or rng.choice(["count_color_shape", "count_total", "read_number"])
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    if kind == "read_number":
        number = str(rng.randint(10, 9999))
        font = ImageFont.load_default(size=64)
        color = COLORS[rng.choice(list(COLORS))]
        box = draw.textbbox((0, 0), number, font=font)
        w, h = box[2] - box[0], box[3] - box[1]
        x = rng.randint(4, max(4, SIZE - w - 8)) - box[0]
        y = rng.randint(4, max(4, SIZE - h - 8)) - box[1]
        draw.text((x, y), number, fill=color, font=font)
        return {
            "image": image,
            "question": "What number is written in the image?",
            "answer": number,
            "kind": kind,
            "shapes": [],
        }
    shapes: list[tuple[str, str, int, int, int]] = []
    for _ in range(rng.randint(2, 7)):
        for _attempt in range(50):
            r = rng.randint(12, 22)
            cx, cy = rng.randint(r + 2, SIZE - r - 3), rng.randint(r + 2, SIZE - r - 3)
            if all(math.hypot(cx - x, cy - y) > r + rr + 6 for _, _, x, y, rr in shapes):
                shapes.append((rng.choice(SHAPES), rng.choice(list(COLORS)), cx, cy, r))
                break
    for shape, color, cx, cy, r in shapes:
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "square":
            draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    if kind == "count_total":
        question, answer = "How many shapes are in the image?", len(shapes)
    else:
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        if rng.random() < 0.7 and shapes:  # usually ask about something present
            shape, color = rng.choice(shapes)[:2]
        answer = sum(1 for s, c, *_ in shapes if s == shape and c == color)
        question = f"How many {color} {shape}s are in the image?"
    return {
        "image": image,
        "question": question,
        "answer": str(answer),
        "kind": kind,
        "shapes": shapes,
    }


def score_reply(text: str | None, answer: str) -> float:
    """1.0 when the last ``<answer>`` holds ``answer`` (digits, or a number word for counts),
    -0.5 for another answer, -1.0 when there is no ``<answer>``."""
    found = _ANSWER.findall(text or "")
    if not found:
        return -1.0
    given = found[-1].strip().lower().rstrip(".")
    given = str(_WORDS.get(given, given)).replace(",", "")
    return 1.0 if given == answer else -0.5


class ShapesEnvConfig(LocalEnvConfig):
    """Settings of the multimodal shapes environment."""

    max_token_length: int = 1024
    ensure_scores_are_not_same: bool = False

    image_transport: Literal["content_parts", "text_fallback"] = Field(
        default="text_fallback",
        description="content_parts: OpenAI image parts (VLM servers); text_fallback: "
        "<image> placeholder plus an ASCII rendering (text-only models)",
    )
    ascii_width: int = Field(default=32, ge=8, description="Columns of the ASCII rendering")
    max_answer_tokens: int = Field(default=64, ge=1, description="Generation budget")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")
    seed: int = Field(default=0, description="Seed of the scenes")
    num_eval_items: int = Field(default=32, ge=1, description="Fixed scenes evaluate() asks")


class MultimodalShapesEnv(BaseEnv):
    """Count shapes / read numbers in rendered images."""

    name = "multimodal_shapes"
    env_config_cls = ShapesEnvConfig

    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.eval_seeds = [
            10_000_000 + self.config.seed * 1000 + i for i in range(self.config.num_eval_items)
        ]

    async def get_next_item(self) -> dict[str, Any]:
        return {"seed": self.rng.randrange(2**31)}

    def build_messages(self, scene: dict[str, Any]) -> tuple[list[dict], list[dict], str]:
        """``(vlm_messages, request_messages, image_b64)``: the VLM-ready chat (content
        parts), what is sent to the server (per ``image_transport``), the PNG."""
        b64 = encode_png(scene["image"])
        vlm = [
            {"role": "system", "content": SYSTEM_PROMPT},
            image_message(scene["question"], [b64]),
        ]
        if self.config.image_transport == "content_parts":
            return vlm, vlm, b64
        art = ascii_art(scene["image"], self.config.ascii_width)
        legend = "(ASCII view: r=red g=green b=blue y=yellow .=background)"
        return vlm, flatten_for_text_model(vlm, renderings=[f"{legend}\n{art}"]), b64

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        scene = render_scene(item["seed"])
        vlm, request, b64 = self.build_messages(scene)
        samples = await sample_chat_group(
            self,
            request,
            n=self.config.group_size,
            max_tokens=self.config.max_answer_tokens,
            temperature=self.config.temperature,
            # image parts: a text chat template cannot render them, so the trained tokens
            # are the chat re-tokenized with an <image> placeholder
            retokenize=self.config.image_transport == "content_parts",
        )
        texts = [s.text for s in samples]
        group = group_from_samples(
            samples,
            [score_reply(t, scene["answer"]) for t in texts],
            group_size=self.config.group_size,
            messages=[[*vlm, {"role": "assistant", "content": t}] for t in texts],
        )
        group["images"] = [b64] * len(texts)
        self.log_train_metric(
            "train/percent_correct", [1.0 if s == 1.0 else 0.0 for s in group["scores"]]
        )
        return group, []

    async def _eval_one(self, seed: int) -> dict[str, Any]:
        """A greedy answer about the fixed scene ``seed``."""
        scene = render_scene(seed)
        _, request, _ = self.build_messages(scene)
        text, _ = await eval_completion(self, request, self.config.max_answer_tokens, 0.0)
        score = score_reply(text, scene["answer"])
        return {
            "question": scene["question"],
            "gold_answer": scene["answer"],
            "response": text,
            "kind": scene["kind"],
            "score": score,
            "correct": score == 1.0,
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """``eval/accuracy``, ``eval/answer_rate`` and the accuracy per question kind."""
        n = max(1, len(samples))
        metrics = {
            "eval/accuracy": sum(s["correct"] for s in samples) / n,
            "eval/answer_rate": sum(s["score"] > -1.0 for s in samples) / n,
        }
        by_kind: dict[str, list[float]] = {}
        for s in samples:
            by_kind.setdefault(s["kind"], []).append(float(s["correct"]))
        for kind, values in sorted(by_kind.items()):
            metrics[f"eval/accuracy_{kind}"] = sum(values) / len(values)
        return metrics

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_one(seed) for seed in self.eval_seeds],
            self.summarize_eval,
            generation_parameters={"temperature": 0.0, "max_tokens": self.config.max_answer_tokens},
        )


if __name__ == "__main__":
    MultimodalShapesEnv.cli()
