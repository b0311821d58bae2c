"""The environment ``bench/api_scale.py`` runs N copies of: a real ``BaseEnv``, kept light.

Each rollout is one chat request with ``n=group_size`` to the inference server
(``--openai.base_url``; the bench's stand-in answers at once), then a group of ``group_size``
sequences of ``seq_len`` tokens (the first ``prompt_len`` masked), scored by reply length,
handed to the real group sender (check, stamp, coalesce, gzip, POST to ``run-api``). Tokens
are drawn from a pool made once at start, so the env spends its CPU on the runtime and the
sender, not on making data.

POST latency is measured on the sender's own HTTP client (httpx event hooks): every
``/scored_data`` and ``/scored_data_list`` request appends ``wall-clock end, seconds, status,
path`` to ``$SCALE_BENCH_LOG`` (one file per process), flushed every half second; the env's
drop counters (``send_failed``, ``refused``, ...) are appended as ``# drops {json}`` lines.

    python bench/scale_env.py serve --env.rollout_server_url http://127.0.0.1:8000 \\
        --openai.base_url http://127.0.0.1:9000/v1 [--env.group_size 8] [--env.seq_len 1024]
    python bench/scale_env.py fork 64 serve ...     # 64 env processes forked after the imports
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig  # noqa: E402

POOL = 64  # distinct token sequences per process


class ScaleEnvConfig(BaseEnvConfig):
    """``BaseEnvConfig`` plus the shape of the groups this env sends."""

    seq_len: int = Field(default=1024, ge=2, description="Tokens per sequence (prompt + reply)")
    prompt_len: int = Field(default=128, ge=1, description="Masked (prompt) tokens per sequence")


class ScaleEnv(BaseEnv):
    """A rollout per item: one ``n=group_size`` chat request, a synthetic group of tokens."""

    name = "scale_bench"
    env_config_cls = ScaleEnvConfig

    @classmethod
    def config_init(cls) -> tuple[ScaleEnvConfig, list[APIServerConfig]]:
        """Defaults for the bench: no W&B, small worker count, never stopping on its own."""
        return ScaleEnvConfig(
            tokenizer_name="SmolLM2-135M-Instruct",
            group_size=8,
            use_wandb=False,
            wandb_name="scale_bench",
            max_token_length=4096,
            total_steps=10**9,
            max_num_workers=4,
            max_batches_offpolicy=1000,
            ensure_scores_are_not_same=False,
        ), [
            APIServerConfig(
                base_url="http://127.0.0.1:9000/v1",
                api_key="x",
                model_name="stub",
                health_check=False,
            )
        ]

    async def setup(self) -> None:
        """The token pool, and the latency hooks on the sender's HTTP client."""
        rng = random.Random(os.getpid())
        length, prompt = self.config.seq_len, min(self.config.prompt_len, self.config.seq_len - 1)
        self.pool = [[rng.randrange(49152) for _ in range(length)] for _ in range(POOL)]
        self.mask_pool = [[-100] * prompt + seq[prompt:] for seq in self.pool]
        self.i = 0
        self._log_path = os.environ.get("SCALE_BENCH_LOG")
        self._lines: list[str] = []
        self._flushed = time.monotonic()
        if self._log_path:
            client = self.api.client
            client.event_hooks["request"].append(self._on_request)
            client.event_hooks["response"].append(self._on_response)

    async def _on_request(self, request) -> None:  # noqa: ANN001 - httpx.Request
        if request.url.path.startswith("/scored_data"):
            request.extensions["scale_t0"] = time.perf_counter()

    async def _on_response(self, response) -> None:  # noqa: ANN001 - httpx.Response
        t0 = response.request.extensions.get("scale_t0")
        if t0 is None:
            return
        now = time.perf_counter()
        self._lines.append(
            f"{time.time():.4f} {now - t0:.6f} {response.status_code} {response.request.url.path}\n"
        )
        if time.monotonic() - self._flushed > 0.5:
            self._flush()

    def _flush(self) -> None:
        self._flushed = time.monotonic()
        with open(self._log_path, "a") as log:
            log.writelines(self._lines)
            log.write(f"# drops {json.dumps(dict(self.drop_counts))} {self.groups_sent}\n")
        self._lines.clear()

    async def get_next_item(self) -> int:
        """Item numbers 1, 2, 3, ..."""
        self.i += 1
        return self.i

    async def collect_trajectories(self, item: int) -> tuple[dict, list]:
        """One chat request with ``n=group_size``; a group from the pool, scored by reply."""
        reply = await self.server.chat_completion(
            messages=[{"role": "user", "content": f"q{item}"}],
            n=self.config.group_size,
            max_tokens=4,
        )
        picks = [(item + i) % POOL for i in range(len(reply.choices))]
        group = {
            "tokens": [self.pool[p] for p in picks],
            "masks": [self.mask_pool[p] for p in picks],
            "scores": [float(len(c.message.content or "")) for c in reply.choices],
        }
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        """No evaluation."""
        return None


def fork_envs(count: int, argv: list[str]) -> None:
    """Run ``count`` env processes, each ``ScaleEnv.cli()`` with ``argv``, forked from this one
    after the imports (so they share the imported modules' memory copy-on-write; a process that
    imports ``atroposlib.envs.base`` on its own holds ~330 MiB, most of it torch's, pulled in
    through ``transformers``). ``$SCALE_BENCH_LOG`` may hold ``{i}``, the env's index. Waits
    for them; SIGTERM is passed on."""
    template = os.environ.get("SCALE_BENCH_LOG", "")
    children = []
    for i in range(count):
        pid = os.fork()
        if pid == 0:
            if template:
                os.environ["SCALE_BENCH_LOG"] = template.replace("{i}", str(i))
            sys.argv = [sys.argv[0], *argv]
            try:
                ScaleEnv.cli()
            finally:
                os._exit(0)
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    for child in children:
        _, code = os.waitpid(child, 0)
        status = status or os.waitstatus_to_exitcode(code)
    sys.exit(status)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "fork":
        fork_envs(int(sys.argv[2]), sys.argv[3:])
    else:
        ScaleEnv.cli()
