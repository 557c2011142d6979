"""The Hugging Face Trainer (with accelerate) fine-tuning a tiny GPT-2 built from a config on a
synthetic dataset, then evaluating: the Trainer picks 'cuda' by itself when it is available."""
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seed: int):
        self.ids = torch.randint(0, config.vocab_size, (32, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=2,
                             learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0,
                             logging_steps=2, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(1))
    result = trainer.train()
    evaluation = trainer.evaluate(eval_dataset=Tokens(2))

print(json.dumps({
    "device": str(trainer.args.device),
    "training_loss": result.training_loss,
    "logged_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    "eval_loss": evaluation["eval_loss"],
    "lm_head_sum": model.lm_head.weight.sum().item(),
}))
