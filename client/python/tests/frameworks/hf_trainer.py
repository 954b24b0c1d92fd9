"""HF Transformers `Trainer` checkpointing into a directory (the mount's job directory), as a
user runs it: a tiny GPT-2 built from a config (no downloads), `save_steps`, `save_total_limit`.

    python hf_trainer.py OUTPUT_DIR MAX_STEPS [--kill-at STEP] [--resume] [--save-model]

Prints the loss of every step as `loss STEP VALUE`. With --kill-at, SIGKILLs itself in the middle
of the checkpoint save at that step (after the model is written, before the optimizer is), as a
preemption would; with --resume, resumes from the latest checkpoint in OUTPUT_DIR; with
--save-model, ends with `trainer.save_model()` (the model, its config and the training arguments
written at the top of OUTPUT_DIR).
"""

import os
import signal
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 128, (n, 16), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Losses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"loss {state.global_step} {logs['loss']:.6f}", flush=True)


def main() -> None:
    out, max_steps = sys.argv[1], int(sys.argv[2])
    kill_at = int(sys.argv[sys.argv.index("--kill-at") + 1]) if "--kill-at" in sys.argv else None
    resume = "--resume" in sys.argv
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ))
    args = TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=5,
        save_total_limit=2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(256), callbacks=[Losses()])
    if kill_at is not None:
        # Killed inside `_save_checkpoint` of step kill_at, after the model is written: the
        # checkpoint directory holds part of a checkpoint.
        save_optimizer = trainer._save_optimizer_and_scheduler

        def killed(output_dir):
            if trainer.state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            save_optimizer(output_dir)

        trainer._save_optimizer_and_scheduler = killed
    trainer.train(resume_from_checkpoint=True if resume else None)
    if "--save-model" in sys.argv:
        trainer.save_model()
    print("done", flush=True)


if __name__ == "__main__":
    main()
