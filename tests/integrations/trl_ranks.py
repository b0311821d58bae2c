"""A TRL trainer for ``accelerate launch``: ``AtroposGRPOTrainer`` on every rank, each writing what
it trained to ``OUT/rank<N>.jsonl`` (one line per training sequence: its completion ids).

Usage: ``accelerate launch --multi_gpu --num_processes 2 trl_ranks.py API_URL MODEL_DIR OUT STEPS``.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl import GRPOConfig  # noqa: E402

from atroposlib.integrations.trl import AtroposGRPOTrainer, AtroposRollout  # noqa: E402

api_url, model_dir, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])


class Recording(AtroposGRPOTrainer):
    def _compute_loss(self, model, inputs):
        rank = self.accelerator.process_index
        with open(out / f"rank{rank}.jsonl", "a") as handle:
            for ids, mask in zip(inputs["completion_ids"], inputs["completion_mask"], strict=True):
                handle.write(json.dumps(ids[mask.bool()].tolist()) + "\n")
        return super()._compute_loss(model, inputs)


args = GRPOConfig(
    output_dir=str(out / "trl"),
    max_steps=steps,
    per_device_train_batch_size=4,
    num_generations=4,
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    use_cpu=True,
    bf16=False,
    report_to=[],
    save_strategy="no",
    activation_checkpointing=False,
    logging_steps=1,
    disable_tqdm=True,
)
trainer = Recording(
    model_dir, args, rollout=AtroposRollout(api_url, max_token_len=64, batch_timeout=60)
)
trainer.train()
print(f"rank {trainer.accelerator.process_index} done", flush=True)
