"""Teacher distillation: scored groups enriched with a teacher model's prompt logprobs.

``TeacherDistillationEnv`` is a ``BaseEnv`` whose groups, before they are sent (or written by
``process``), get ``distill_token_ids`` and ``distill_logprobs`` (``[sequence][position][k]``)
from a second inference server, the teacher, asked for the top-k prompt logprobs of every
sequence. Only same-tokenizer distillation is supported: the student's token ids go to the
teacher unchanged and the teacher's top-k ids index the student's vocabulary, so the two
tokenizers must have the same vocabulary (checked at start-up).

The teacher server comes from ``teacher_server_configs=`` (a list, one ``APIServerConfig`` or a
``ServerBaseline``), or on the command line from ``teacher_config_init()``, a ``teacher:``
section of the YAML config and ``--teacher.*`` flags (same fields as ``--openai.*``), in all
three modes (upstream wired them only into ``serve``).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC
from typing import Any

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.constants import NAMESPACE_SEP, OPENAI_NAMESPACE
from atroposlib.envs.server_handling.openai_server import resolve_openai_configs
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.type_definitions import Item
from atroposlib.utils.cli import extract_namespace, merge_dicts

logger = logging.getLogger(__name__)

__all__ = ["TeacherDistillationConfig", "TeacherDistillationEnv"]

TeacherServerConfigs = ServerBaseline | APIServerConfig | list[APIServerConfig]


class TeacherDistillationConfig(BaseEnvConfig):
    """``BaseEnvConfig`` plus the teacher switches."""

    teacher_enabled: bool = Field(
        default=False,
        description="Whether to fetch teacher prompt logprobs for distillation.",
    )
    teacher_top_k: int = Field(
        default=0,
        ge=-1,
        description=(
            "Number of extra prompt logprobs to fetch beyond the selected token. "
            "Use 0 for selected-token-only prompt logprobs and <= -1 to disable "
            "teacher fetching."
        ),
    )


class TeacherDistillationEnv(BaseEnv, ABC):
    """A ``BaseEnv`` that attaches teacher distillation arrays to every scored group.

    Payload shape: ``distill_token_ids[sequence][position][k]`` (student vocabulary ids) and
    ``distill_logprobs[sequence][position][k]``. A group's ``group_overrides`` may set
    ``teacher_top_k`` (for that group) or ``skip_teacher_top_k: true``. When any teacher call
    of a group fails the group is still sent, without a distillation payload.
    """

    env_config_cls = TeacherDistillationConfig
    teacher_namespace = "teacher"

    @classmethod
    def teacher_config_init(cls) -> TeacherServerConfigs | None:
        """The default teacher server(s) for the command line; ``None`` for none."""
        return None

    @classmethod
    def _resolve_teacher_server_configs(
        cls,
        default_teacher_server_configs: TeacherServerConfigs | None,
        yaml_config: dict[str, Any],
        cli_passed_flags: dict[str, Any],
    ) -> ServerBaseline | list[APIServerConfig] | None:
        """The teacher configs from the default, the YAML ``teacher`` section and the
        ``teacher.*`` flags (CLI > YAML > default), resolved like the ``openai`` ones;
        ``None`` when none of the three names a teacher."""
        teacher_cli = extract_namespace(cli_passed_flags, f"{cls.teacher_namespace}{NAMESPACE_SEP}")
        yaml_teacher: Any = (yaml_config or {}).get(cls.teacher_namespace, {})
        if default_teacher_server_configs is None and not teacher_cli and not yaml_teacher:
            return None

        effective: TeacherServerConfigs = (
            default_teacher_server_configs
            if default_teacher_server_configs is not None
            else APIServerConfig()
        )
        if (
            isinstance(effective, ServerBaseline)
            and not isinstance(effective, APIServerConfig)
            and (teacher_cli or yaml_teacher)
        ):
            effective = APIServerConfig(**effective.model_dump())

        default_single: Any = effective
        if isinstance(effective, list) and len(effective) == 1:
            default_single = effective[0]
        if isinstance(yaml_teacher, list) and len(yaml_teacher) == 1:
            yaml_teacher = yaml_teacher[0]
        teacher_dict: dict[str, Any] = {}
        if isinstance(default_single, APIServerConfig) and isinstance(yaml_teacher, dict):
            teacher_dict = merge_dicts(default_single.model_dump(), yaml_teacher, teacher_cli)

        return resolve_openai_configs(
            default_server_configs=effective,
            openai_config_dict=teacher_dict,
            yaml_config={OPENAI_NAMESPACE: yaml_teacher},
            cli_passed_flags={
                f"{OPENAI_NAMESPACE}{NAMESPACE_SEP}{key}": value
                for key, value in teacher_cli.items()
            },
            logger=logger,
        )

    def __init__(
        self,
        config: TeacherDistillationConfig,
        server_configs: ServerBaseline | list[APIServerConfig],
        teacher_server_configs: TeacherServerConfigs | None = None,
        slurm: bool = False,
        testing: bool = False,
    ) -> None:
        """Like ``BaseEnv``; with ``config.teacher_enabled``, ``teacher_server_configs`` is
        required and its tokenizer must match the env's.

        Raises:
            ValueError: teacher enabled without a teacher config, or a teacher tokenizer whose
                vocabulary differs from the student's.

        An env class listed before this one among a subclass's bases (upstream's
        ``GSM8kTeacherDistillEnv(GSM8kEnv, TeacherDistillationEnv)``) calls this as
        ``super().__init__(config, server_configs, slurm, testing)``: a bool in the third place
        is ``slurm``, and the teacher configs then come from the command line
        (:data:`atroposlib.envs.options.ENV_INIT_EXTRAS`). Upstream raised TypeError there.
        """
        if isinstance(teacher_server_configs, bool):
            teacher_server_configs, slurm, testing = None, teacher_server_configs, slurm
        if teacher_server_configs is None:
            from atroposlib.envs.options import ENV_INIT_EXTRAS

            teacher_server_configs = (ENV_INIT_EXTRAS.get() or {}).get("teacher_server_configs")
        super().__init__(config, server_configs, slurm=slurm, testing=testing)
        self.teacher_server: ServerManager | None = None
        if not config.teacher_enabled:
            return
        if teacher_server_configs is None:
            raise ValueError(
                "teacher_enabled=True but no teacher server configuration was provided. "
                "Pass teacher_server_configs=... when instantiating the environment "
                "directly, or give --teacher.* flags (or a 'teacher:' YAML section) on the "
                "command line."
            )
        source: ServerBaseline | list[APIServerConfig] = (
            [teacher_server_configs]
            if isinstance(teacher_server_configs, APIServerConfig)
            else teacher_server_configs
        )
        self.teacher_server = ServerManager(source, slurm=False, testing=False)
        teacher_cfg = source[0] if isinstance(source, list) else source
        tokenizer_name = getattr(teacher_cfg, "tokenizer_name", "none")
        if tokenizer_name in ("", "none", None):
            tokenizer_name = teacher_cfg.model_name
        self._validate_teacher_tokenizer_compatibility(tokenizer_name)

    def _validate_teacher_tokenizer_compatibility(self, teacher_tokenizer_name: str) -> None:
        """Raise ``ValueError`` unless the teacher's tokenizer has the student's vocabulary
        (same name: accepted without loading)."""
        student_name = getattr(self.tokenizer, "name_or_path", None) or ""
        if student_name == teacher_tokenizer_name:
            return
        try:
            from transformers import AutoTokenizer

            teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_tokenizer_name, use_fast=True)
        except Exception as exc:
            raise ValueError(
                "Cross-tokenizer distillation is not supported, and the teacher tokenizer "
                f"'{teacher_tokenizer_name}' could not be loaded to verify compatibility: {exc}"
            ) from exc
        if self.tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
            raise ValueError(
                "Cross-tokenizer distillation is not supported. Student tokenizer "
                f"'{student_name or type(self.tokenizer).__name__}' and teacher tokenizer "
                f"'{teacher_tokenizer_name}' do not match."
            )

    async def _fetch_teacher_for_sequence(
        self, token_ids: list[int], top_k: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The teacher's top-k prompt token ids and logprobs for one sequence."""
        assert self.teacher_server is not None
        payload = await self.teacher_server.get_logprobs(
            input_ids=token_ids, top_k=top_k, max_tokens=1, split="train"
        )
        return payload["prompt_topk_token_ids"], payload["prompt_topk_logprobs"]

    @staticmethod
    def _without_payload(group: ScoredDataGroup) -> ScoredDataGroup:
        group["distill_token_ids"] = None
        group["distill_logprobs"] = None
        return group

    async def _attach_teacher_distillation(self, group: ScoredDataGroup) -> ScoredDataGroup:
        """``group`` with ``distill_token_ids``/``distill_logprobs`` set (or set to ``None``
        when skipped, disabled for the group, or when a teacher call fails)."""
        if not self.config.teacher_enabled or self.teacher_server is None:
            return group
        sequences = group.get("tokens") or []
        overrides = group.get("group_overrides") or {}
        if not sequences or overrides.get("skip_teacher_top_k", False):
            return self._without_payload(group)
        top_k = int(overrides.get("teacher_top_k", self.config.teacher_top_k))
        if top_k <= -1:
            return self._without_payload(group)

        results = await asyncio.gather(
            *(self._fetch_teacher_for_sequence(seq, top_k) for seq in sequences),
            return_exceptions=True,
        )
        token_ids: list[list[list[int]]] = []
        logprobs: list[list[list[float]]] = []
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.warning(
                    "Teacher logprob fetch failed for sequence %s: %s. The group is sent "
                    "without a distillation payload.",
                    index,
                    result,
                )
                return self._without_payload(group)
            ids_k, logprobs_k = result
            if len(ids_k) != len(logprobs_k):
                logger.warning(
                    "Teacher top-k lengths differ for sequence %s (%s != %s). The group is "
                    "sent without a distillation payload.",
                    index,
                    len(ids_k),
                    len(logprobs_k),
                )
                return self._without_payload(group)
            token_ids.append(ids_k)
            logprobs.append(logprobs_k)
        group["distill_token_ids"] = token_ids
        group["distill_logprobs"] = logprobs
        return group

    async def handle_send_to_api(
        self,
        scored_data: ScoredDataGroup | list[ScoredDataGroup | None] | None,
        item: Item = None,
        do_send_to_api: bool = True,
        abort_on_any_max_length_exceeded: bool = True,
    ) -> list[ScoredDataGroup]:
        """Attach the teacher payload to each group, then send as ``BaseEnv`` does."""
        groups = scored_data if isinstance(scored_data, list) else [scored_data]
        enriched = [
            await self._attach_teacher_distillation(group) for group in groups if group is not None
        ]
        payload: Any
        if isinstance(scored_data, list):
            payload = enriched
        else:
            payload = enriched[0] if enriched else scored_data
        return await super().handle_send_to_api(
            payload,
            item=item,
            do_send_to_api=do_send_to_api,
            abort_on_any_max_length_exceeded=abort_on_any_max_length_exceeded,
        )
