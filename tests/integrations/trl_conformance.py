"""TRL's GRPOTrainer through ``atroposlib.integrations.trl``, as ``atropos-check-trainer`` runs it.

Everything comes from the check's variables (docs/check-trainer.md): the model to train, run-api,
the group size (``num_generations``), the batch (one per optimizer step), the steps, the report
(written by ``AtroposGRPOTrainer`` itself when ``ATROPOS_TRAINER_REPORT`` is set) and, with
``--serve``, the inference server to push every step's weights to.
"""

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl import GRPOConfig  # noqa: E402

from atroposlib.backends import weight_sync_client  # noqa: E402
from atroposlib.integrations.trl import AtroposGRPOTrainer, AtroposRollout  # noqa: E402

env = os.environ
out = env["ATROPOS_CHECK_OUTPUT"]
args = GRPOConfig(
    output_dir=f"{out}/trl",
    max_steps=int(env["ATROPOS_CHECK_STEPS"]),
    num_generations=int(env["ATROPOS_CHECK_GROUP_SIZE"]),
    per_device_train_batch_size=int(env["ATROPOS_CHECK_BATCH_SIZE"]),
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    use_cpu=True,
    bf16=False,  # TRL's default autocasts to bfloat16, on a CPU too
    report_to=[],
    save_strategy="no",
    activation_checkpointing=False,
    logging_steps=1,
    disable_tqdm=True,
)
server = env.get("ATROPOS_INFERENCE_URL")
trainer = AtroposGRPOTrainer(
    env["ATROPOS_CHECK_MODEL"],
    args,
    rollout=AtroposRollout(
        env["ATROPOS_API_URL"],
        max_token_len=int(env["ATROPOS_CHECK_MAX_TOKEN_LEN"]),
        batch_timeout=120,
    ),
    weight_sync=weight_sync_client("atropos-serve", server) if server else None,
)
trainer.train()
trainer.save_model(f"{out}/final_model")
