"""A small trainer for the conformance check's tests: right by default, wrong on request.

Reads the check's environment variables (``ATROPOS_API_URL``, ``ATROPOS_CHECK_MODEL``,
``ATROPOS_CHECK_STEPS``, ``ATROPOS_CHECK_BATCH_SIZE``, ``ATROPOS_CHECK_MAX_TOKEN_LEN``,
``ATROPOS_CHECK_OUTPUT``, ``ATROPOS_CHECK_GROUP_SIZE``), trains with torch and
``TrainerClient`` only (none of the example trainer's code: its advantages are computed here,
from the contract), reports each sequence with ``TrainerReport.sequence`` and saves
``final_model``. ``--report-only`` skips the model (for tests of the report-based rules). Each flag adds one defect the check
must name; ``verl`` adds the three defects verl's Atropos recipe has.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from atroposlib.api.client import TrainerClient
from atroposlib.testing import TrainerReport

DEFECTS = {
    "flip_sign": "train with the advantages' signs flipped",
    "ignore_mask": "train every token after the first (prompt and env tokens too)",
    "multi_turn_as_one": "train everything after the first trained token (tool/user tokens)",
    "zero_score": "set_advantage_to_zero applied to the score, before normalising",
    "ignore_explicit": "advantages from the scores even when the group has explicit ones",
    "no_ack": "GET /batch without ack (at-most-once)",
    "stale_ack": "always acknowledge the starting step (every batch comes again)",
    "lie": "report the contract's advantages, but train with their signs flipped",
    "version_from_step": "report the trainer's step as each sequence's policy_version",
}


def advantages(group: dict, args: argparse.Namespace) -> list[list[float]]:
    """Per-token advantages of each sequence (the contract, unless a defect says otherwise)."""
    scores = [float(s) for s in group["scores"]]
    overrides = group.get("overrides") or [{} for _ in scores]
    zeroed = [bool(o and o.get("set_advantage_to_zero")) for o in overrides]
    if args.zero_score:
        scores = [0.0 if z else s for s, z in zip(scores, zeroed, strict=True)]
    if len(scores) > 1:
        mean, std = statistics.fmean(scores), statistics.stdev(scores)
        per_seq = [(s - mean) / max(std, 1e-8) for s in scores]
    else:
        per_seq = scores
    result = []
    for i, tokens in enumerate(group["tokens"]):
        explicit = group.get("advantages")
        if explicit is not None and not args.ignore_explicit:
            row = [float(a) for a in explicit[i]]
            row = row * len(tokens) if len(row) == 1 else row
        else:
            row = [per_seq[i]] * len(tokens)
        if zeroed[i] and not args.zero_score:
            row = [0.0] * len(tokens)
        result.append(row)
    return result


def trained_flags(masks: list[int], args: argparse.Namespace) -> list[int]:
    flags = [int(j >= 1 and m != -100) for j, m in enumerate(masks)]
    if args.ignore_mask:
        return [int(j >= 1) for j in range(len(masks))]
    if args.multi_turn_as_one:
        first = flags.index(1)
        return [int(j >= first) for j in range(len(masks))]
    return flags


class Policy:
    """The model being trained (torch and transformers are imported only for it)."""

    def __init__(self, path: str, lr: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.loss = torch.zeros(())

    def add(self, tokens: list[int], flags: list[int], advs: list[float], scale: float) -> None:
        """Add ``-scale * mean over trained tokens of (advantage * log p(token))``."""
        torch = self.torch
        ids = torch.tensor([tokens])
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1], dim=-1)
        logp = logp.gather(1, ids[0, 1:, None])[:, 0]
        weight = torch.tensor(advs[1:]) * torch.tensor(flags[1:], dtype=torch.float32)
        self.loss = self.loss - scale * (weight * logp).sum() / max(sum(flags), 1)

    def step(self) -> None:
        self.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.loss = self.torch.zeros(())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name, text in DEFECTS.items():
        parser.add_argument("--" + name.replace("_", "-"), action="store_true", help=text)
    parser.add_argument("--verl", action="store_true", help="zero_score + ignore_explicit + "
                        "multi_turn_as_one")  # fmt: skip
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-token-len", type=int, help="register this, not the check's")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="no model: report what would be trained, take no step, save nothing (the check "
        "then judges the report alone; fast)",
    )
    args = parser.parse_args()
    if args.verl:
        args.zero_score = args.ignore_explicit = args.multi_turn_as_one = True

    env = os.environ
    policy = None if args.report_only else Policy(env["ATROPOS_CHECK_MODEL"], args.lr)
    report = TrainerReport(env["ATROPOS_TRAINER_REPORT"], standard_advantages=True, name="wrong")
    steps = int(env["ATROPOS_CHECK_STEPS"])
    client = TrainerClient(env["ATROPOS_API_URL"], ack=not args.no_ack)
    client.register(
        batch_size=int(env["ATROPOS_CHECK_BATCH_SIZE"]),
        max_token_len=args.max_token_len or int(env["ATROPOS_CHECK_MAX_TOKEN_LEN"]),
        checkpoint_dir=env["ATROPOS_CHECK_OUTPUT"],
        save_checkpoint_interval=steps,
        starting_step=0,
        num_steps=steps,
    )
    group_size = int(env.get("ATROPOS_CHECK_GROUP_SIZE") or 0)
    sign = -1.0 if (args.flip_sign or args.lie) else 1.0
    for _ in range(steps):
        batch = client.get_batch(timeout=120, poll=0.2)
        sizes = [len(group["tokens"]) for group in batch]
        if group_size and set(sizes) != {group_size}:  # as TRL's num_generations
            raise SystemExit(f"groups of {sizes} sequences; this trainer takes {group_size}")
        if args.stale_ack:
            client.last_step = 0
        rows = [
            (tokens, group["masks"][i], advs[i], group.get("policy_version"))
            for group in batch
            for advs in [advantages(group, args)]
            for i, tokens in enumerate(group["tokens"])
        ]
        for tokens, masks, advs, version in rows:
            flags = trained_flags(masks, args)
            if policy is not None:
                policy.add(tokens, flags, advs, sign / len(rows))
            reported = advs if args.lie else [sign * a for a in advs]
            if args.version_from_step:
                version = report.step
            report.sequence(tokens, flags, reported, policy_version=version)
        if policy is not None:
            policy.step()
        report.end_step()
    client.close()
    if policy is not None:
        policy.model.save_pretrained(Path(env["ATROPOS_CHECK_OUTPUT"]) / "final_model")


if __name__ == "__main__":
    main()
