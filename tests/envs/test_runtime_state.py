"""``BaseEnv``'s runtime state lives on the runtime objects that own it (registration, serve
loop, group sender, W&B logging); upstream's attribute names still read and write it, and
defaults come from the config class (``LocalEnvConfig``, ``default_server_configs``)."""

from __future__ import annotations

from collections import Counter

import pytest

from atroposlib.envs import BaseEnv, LocalEnvConfig, local_server_configs
from atroposlib.envs.base import BaseEnvConfig, ServerBaseline

OWNED = {
    "_registration": ("env_id", "status_dict", "curr_step", "max_token_len", "checkpoint_dir",
                      "checkpoint_interval", "wandb_project", "wandb_group", "wandb_prepend"),
    "_serve_loop": ("workers", "running_items", "backlog", "eval_runner", "retried_rollouts",
                    "task_duration", "succeeded_task_duration", "failed_task_duration",
                    "mainloop_timings", "workers_added_list"),
    "_group_sender": ("drop_counts", "groups_sent", "items_sent_this_step"),
    "_wandb_logging": ("rollouts_for_wandb", "completion_lengths", "eval_metrics"),
}  # fmt: skip


class QuietConfig(LocalEnvConfig):
    group_size: int = 8
    max_token_length: int = 512


class QuietEnv(BaseEnv):
    name = "quiet"
    env_config_cls = QuietConfig
    default_server_configs = local_server_configs(num_requests_for_eval=8)

    async def setup(self) -> None:
        pass

    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        return {}


class EarlyEnv(QuietEnv):
    def __init__(self, *args, **kwargs) -> None:
        self.eval_metrics = []  # upstream code sets these after super().__init__()
        super().__init__(*args, **kwargs)


def test_upstream_names_read_and_write_the_owners_state() -> None:
    env = QuietEnv(*QuietEnv.config_init())
    for owner, names in OWNED.items():
        for name in names:
            assert getattr(env, name) is getattr(getattr(env, owner), name), name
            assert name not in vars(env), name  # one home for the value
    env.curr_step = 7
    env.eval_metrics = [("eval/x", 1.0)]
    env.drop_counts["error"] += 1
    assert env._registration.curr_step == 7
    assert env._wandb_logging.eval_metrics == [("eval/x", 1.0)]
    assert env._group_sender.drop_counts == Counter(error=1)
    assert sorted(vars(env)) == [
        "_api", "_group_sender", "_registration", "_serve_loop", "_wandb_logging", "config",
        "jsonl_writer", "max_num_workers", "server", "tokenizer",
    ]  # fmt: skip


def test_setting_runtime_state_before_init_says_what_to_do() -> None:
    with pytest.raises(AttributeError, match="call super\\(\\).__init__ first"):
        EarlyEnv(*QuietEnv.config_init())


def test_defaults_live_on_the_config_class() -> None:
    config, servers = QuietEnv.config_init()
    assert (config.group_size, config.max_token_length) == (8, 512)
    assert (config.tokenizer_name, config.use_wandb, config.total_steps) == (
        "SmolLM2-135M-Instruct", False, 100,
    )  # fmt: skip
    # a redeclared default keeps the field's description and bounds
    field = QuietConfig.model_fields["group_size"]
    assert field.description == BaseEnvConfig.model_fields["group_size"].description
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        QuietConfig(group_size=0)
    assert [s.num_requests_for_eval for s in servers] == [8]
    again = QuietEnv.config_init()[1]
    assert again[0] is not servers[0]  # a fresh copy each time
    # an env without default_server_configs keeps upstream's ServerBaseline
    assert isinstance(BaseEnv.config_init()[1], ServerBaseline)


class FlushingEnv(QuietEnv):
    """Its evaluation straddles a ``wandb_log``, which empties ``eval_metrics``."""

    async def evaluate(self, *args, **kwargs):
        await self.evaluate_log({"eval/first": 1.0})
        self._wandb_logging.eval_metrics = []  # what wandb_log does once it has logged them
        await self.evaluate_log({"eval/second": 2.0})


async def test_a_pinned_evaluation_keeps_its_result_when_wandb_log_flushes_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from atroposlib.envs import pinned_eval

    async def versions(env, fresh: bool = False):
        return [3]

    monkeypatch.setattr(pinned_eval, "server_versions", versions)
    env = FlushingEnv(*QuietEnv.config_init())
    env.eval_metrics = [("eval/older", 0.5)]  # queued before the evaluation started
    report = await pinned_eval._evaluate_at(env, {"request_id": "r", "policy_version": 3}, 3)
    assert report["status"] == "done"
    assert report["metrics"] == {"eval/first": 1.0, "eval/second": 2.0}
