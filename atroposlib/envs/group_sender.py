"""The group sender: what ``BaseEnv.handle_send_to_api`` does with a scored group.

0. (**Build** it from single trajectories, for envs that implement ``collect_trajectory``:
   :func:`group_from_trajectories`.)
1. **Check** it (:meth:`GroupSender.check_group`): a group that fails is dropped and counted in
   ``env.drop_counts`` by reason. **Stamp** it: a group without a ``policy_version`` gets the
   lowest policy version of the servers the rollout's requests went to, each as known when its
   request started (none when no server reports one, or outside a rollout).
2. **Record** it: the W&B rollout table, the JSONL file of ``data_path_to_save_groups``.
3. **Send** it, stamped with ``env_id``: concurrent sends are coalesced into one
   ``/scored_data_list`` request (at most ``MAX_GROUPS_PER_POST`` groups); a combined request
   the API does not take at once is split back into its submissions, each retried on its own
   until ``send_timeout`` (``RolloutApiClient.send``: outages, 5xx, 429 ``Retry-After``), and
   an API that forgot the env id is registered with again and the send repeated.

A failed send is counted (``send_failed``, ``refused``) and logged, never raised to the rollout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from atroposlib.envs.sending import ApiRefused, UnknownEnvError, encode_json_body
from atroposlib.envs.server_handling.policy_version import rollout_policy_version
from atroposlib.schema import ITEM_KEYS, REQUIRED_KEYS, ScoredDataGroup, ScoredDataItem
from atroposlib.type_definitions import Item

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

# a child of the logger upstream's envs configure (``atroposlib.envs.base``)
logger = logging.getLogger("atroposlib.envs.base.sender")

__all__ = ["MAX_GROUPS_PER_POST", "GroupSender", "group_from_trajectories"]

#: Most groups per ``/scored_data_list`` request when sends are coalesced.
MAX_GROUPS_PER_POST = 64


def group_from_trajectories(
    results: Sequence[Any], group_size: int
) -> tuple[ScoredDataGroup | None, list[Item]]:
    """``(group, backlog)`` from the ``(ScoredDataItem | None, backlog)`` pairs that
    ``collect_trajectory`` calls returned: ``tokens``, ``masks``, ``scores`` of the items that
    are not None, each optional per-sequence key that every item has (so lists stay aligned
    with ``tokens``), the lowest ``policy_version`` of the items that set one, and the items'
    ``group_overrides`` merged, with ``group_size`` set to the number of items when that is not
    ``group_size``. The group is None when no item came back.

    Raises:
        ValueError: A result is not such a pair.
    """
    backlog: list[Item] = []
    items: list[ScoredDataItem] = []
    for result in results:
        if not isinstance(result, tuple) or len(result) != 2:
            raise ValueError(
                "collect_trajectory must return (ScoredDataItem | None, backlog), got "
                f"{type(result).__name__}"
            )
        scored, more = result
        backlog.extend(more or [])
        if scored is None:
            continue
        if not isinstance(scored, dict):
            raise ValueError(
                "collect_trajectory must return a ScoredDataItem (a dict) or None, got "
                f"{type(scored).__name__}"
            )
        items.append(scored)
    if not items:
        return None, backlog
    group: ScoredDataGroup = {
        "tokens": [it["tokens"] for it in items],
        "masks": [it["masks"] for it in items],
        "scores": [it["scores"] for it in items],
    }
    for key in ITEM_KEYS:
        values = [it.get(key) for it in items]
        if all(v is not None for v in values):
            group[key] = values
    versions = [it["policy_version"] for it in items if it.get("policy_version") is not None]
    if versions:
        group["policy_version"] = min(versions)
    overrides: dict[str, Any] = {}
    for it in items:
        overrides.update(it.get("group_overrides") or {})
    group["group_overrides"] = overrides
    if len(items) != group_size and "group_size" not in overrides:
        overrides["group_size"] = len(items)
    return group, backlog


def scored_alike(scores: Any) -> bool:
    """Whether a group's ``scores`` are several and all equal: no learning signal under a group
    baseline (what ``ensure_scores_are_not_same`` drops; a group of one is never "alike")."""
    return bool(scores) and len(scores) > 1 and len(set(scores)) == 1


class GroupSender:
    """Checks, records and sends an env's groups (``env._group_sender``).

    Args:
        env: The environment (its config, tokenizer, counters and W&B buffer).
    """

    def __init__(self, env: BaseEnv) -> None:
        self.env = env
        self._pending: list[tuple[list[dict], asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        # counters (``env.drop_counts`` and friends read these): why work was dropped (reason
        # -> count: ``error``, ``timeout``, ``group_size``, ``same_scores``, ``too_long``,
        # ``malformed``, ``send_failed``, ``refused``), groups sent
        self.drop_counts: Counter[str] = Counter()
        self.groups_sent = 0
        self.items_sent_this_step = 0
        self._flat_report = (time.monotonic(), 0)  # when flat groups were last reported, count

    async def handle(
        self,
        scored_data: ScoredDataGroup | list[ScoredDataGroup | None] | None,
        item: Item,
        do_send_to_api: bool,
        abort_on_any_max_length_exceeded: bool,
    ) -> list[ScoredDataGroup]:
        """``handle_send_to_api``: check, record and (``do_send_to_api``) send; the valid
        groups."""
        env = self.env
        was_list = isinstance(scored_data, list)
        groups = scored_data if was_list else [scored_data]
        valid: list[ScoredDataGroup] = []
        version = rollout_policy_version()
        flat = signal = 0  # groups that scored alike / valid groups that did not
        for group in groups:
            if group is None:
                continue
            reason = self.check_group(group, abort_on_any_max_length_exceeded)
            alike = reason != "malformed" and scored_alike(group.get("scores"))
            flat += alike  # kept (not dropped) where ensure_scores_are_not_same is off
            if reason is not None:
                self.drop_counts[reason] += 1
                continue
            signal += not alike
            if version is not None and group.get("policy_version") is None:
                group["policy_version"] = version
            for key in ("ref_logprobs", "overrides", "group_overrides"):
                group.setdefault(key, None)
            group.setdefault("distill_token_ids", None)
            group.setdefault("distill_logprobs", None)
            if env.config.include_messages and group.get("messages") is None:
                group["messages"] = [
                    [{"role": "user", "content": env.tokenizer.decode(seq)}]
                    for seq in group["tokens"]
                ]
            if env._wandb_logging.active:
                await env.add_rollouts_for_wandb(group, item)
            if env.jsonl_writer is not None:
                # the trainer step the group was made at, for the rollout page's headers
                env.jsonl_writer.write({**group, "step": env.curr_step})
            valid.append(group)
        selective = getattr(env, "flat_items", None)
        if selective is not None and (valid or flat):
            # the item's history for selective rollouts: flat when no group had a signal
            selective.record(item, flat=signal == 0)
        if valid and do_send_to_api:
            self.items_sent_this_step += len(valid)
            payload: Any = valid[0] if not was_list and len(valid) == 1 else valid
            try:
                await self.send(payload)
            except Exception as exc:  # noqa: BLE001 - counted and logged, never raised
                self._log_send_failure(exc, len(valid))
        return valid

    def check_group(self, group: dict, abort_on_too_long: bool) -> str | None:
        """Why ``group`` must be dropped (``malformed``, ``group_size``, ``same_scores``,
        ``too_long``), or None to send it. Also records its completion lengths for W&B."""
        env = self.env
        tokens = group.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            logger.warning("Dropping a group without tokens: %s", str(group)[:200])
            return "malformed"
        for key in REQUIRED_KEYS[1:]:  # masks, scores: one entry per token list
            values = group.get(key)
            if not isinstance(values, list) or len(values) != len(tokens):
                logger.warning(
                    "Dropping a group whose %r (%s) does not match its %d token lists",
                    key,
                    "missing" if values is None else f"{len(values)} entries",
                    len(tokens),
                )
                return "malformed"
        overrides = group.get("group_overrides") or {}
        expected = overrides.get("group_size", env.config.group_size)
        if len(tokens) != expected:
            logger.warning(
                "Dropping a group of %d sequences (expected group_size %d)", len(tokens), expected
            )
            return "group_size"
        scores = group["scores"]
        if env.config.ensure_scores_are_not_same and scored_alike(scores):
            logger.debug("Dropping a group whose scores are all %s", scores[0])
            self._report_flat_groups()
            return "same_scores"
        for mask in group["masks"]:
            env.completion_lengths.append(sum(1 for m in mask if m != -100))
        if env.max_token_len > 0 and abort_on_too_long:
            longest = max(len(seq) for seq in tokens)
            if longest >= env.max_token_len:
                logger.warning(
                    "Dropping a group with a sequence of %d tokens (trainer max_token_len %d)",
                    longest,
                    env.max_token_len,
                )
                return "too_long"
        return None

    def _report_flat_groups(self, every: float = 30.0) -> None:
        """At most every ``every`` seconds, say how many groups were dropped for scoring
        alike: while most are, a trainer waits long for each batch and this is why.
        (State in ``self._flat_report``: when last reported, the count then.)"""
        since, reported = self._flat_report
        now, total = time.monotonic(), self.drop_counts["same_scores"] + 1
        if now - since >= every:
            selective = getattr(self.env, "flat_items", None)
            logger.info(
                "%d group(s) dropped in the last %.0f s: all replies scored alike, no learning "
                "signal (ensure_scores_are_not_same); %d sent so far%s",
                total - reported,
                now - since,
                self.groups_sent,
                ""
                if selective is None
                else f"; {selective.skipped} item(s) skipped before rollout, flat the last "
                "time (flat_item_retry_prob)",
            )
            self._flat_report = (now, total)

    def _log_send_failure(self, exc: BaseException, n_groups: int) -> None:
        if isinstance(exc, ApiRefused):
            self.drop_counts["refused"] += n_groups
            logger.error("The API refused %d group(s): %s", n_groups, exc)
        else:
            self.drop_counts["send_failed"] += n_groups
            logger.error(
                "Failed to send %d group(s): %s",
                n_groups,
                exc,
                exc_info=(type(exc), exc, exc.__traceback__),
            )

    # ------------------------------------------------------------------ coalesced sending

    async def send(self, scored_data: dict | list[dict]) -> None:
        """Send one group (``/scored_data``) or several (``/scored_data_list``), stamped with
        ``env_id``; concurrent sends are coalesced into one request.

        Raises:
            ApiRefused: The API refused the data (4xx).
            TimeoutError: The API stayed unreachable, failing or full for ``send_timeout``.
        """
        groups = scored_data if isinstance(scored_data, list) else [scored_data]
        future = asyncio.get_running_loop().create_future()
        self._pending.append((groups, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._sender_loop())
        await future

    async def close(self) -> None:
        """Stop the sender task (sends still waiting are cancelled)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sender_loop(self) -> None:
        while self._pending:
            take: list[tuple[list[dict], asyncio.Future]] = []
            n = 0
            while self._pending and (
                not take or n + len(self._pending[0][0]) <= MAX_GROUPS_PER_POST
            ):
                entry = self._pending.pop(0)
                take.append(entry)
                n += len(entry[0])
            if len(take) > 1 and await self._try_post_once([g for gs, _ in take for g in gs]):
                for _, fut in take:
                    _settle(fut, None)
                self._count_sent(n)
                continue
            # one submission, or a combined request the API did not take at once (full queue,
            # refused data, outage): each submission on its own, with full retry handling, so
            # one bad group or a queue too small for the whole list never holds up the rest
            for groups, fut in take:
                try:
                    await self._post_groups(groups)
                except Exception as exc:  # noqa: BLE001 - handed to the waiting worker
                    _settle(fut, exc)
                else:
                    _settle(fut, None)
                    self._count_sent(len(groups))

    def _count_sent(self, n_groups: int) -> None:
        self.groups_sent += n_groups
        self.env._sent_since_status += n_groups

    async def _try_post_once(self, groups: list[dict]) -> bool:
        """One ``/scored_data_list`` attempt with no retry; whether the API took it."""
        for group in groups:
            group["env_id"] = self.env.env_id
        body, headers = encode_json_body(groups)
        try:
            resp = await self.env.api.client.post(
                "/scored_data_list", content=body, headers=headers
            )
        except httpx.TransportError:
            return False
        return resp.status_code < 300

    async def _post_groups(self, groups: list[dict]) -> None:
        env = self.env
        deadline = time.monotonic() + env.config.send_timeout
        while True:
            env_id = env.env_id
            for group in groups:
                group["env_id"] = env_id
            path = "/scored_data" if len(groups) == 1 else "/scored_data_list"
            payload = groups[0] if len(groups) == 1 else groups
            try:
                await env.api.send(path, payload, max(1.0, deadline - time.monotonic()))
                return
            except UnknownEnvError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the API kept forgetting this env") from None
                await env._registration.reregister(env_id)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
