"""A tiny BERT from a config (no weights, no hub) fine-tuned for sequence classification on
padded batches, with gradient checkpointing and a linear LR schedule; evaluated under inference_mode."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import BertConfig, BertForSequenceClassification

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32, num_labels=3,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = BertForSequenceClassification(config)
model.gradient_checkpointing_enable()
model.to(device)
opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=5)

g = torch.Generator().manual_seed(3)
lengths = [14, 6, 9, 3, 12, 8]
ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
for i, n in enumerate(lengths):
    ids[i, 0] = 101 % config.vocab_size  # a [CLS]-like id
    ids[i, 1:n] = torch.randint(5, config.vocab_size, (n - 1,), generator=g)
mask = (ids != 0).long()
token_type_ids = torch.zeros_like(ids)
labels = torch.tensor([0, 2, 1, 1, 0, 2])
batch = {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask,
                                          token_type_ids=token_type_ids, labels=labels).items()}

model.train()
losses, lrs = [], []
for epoch in range(5):
    out = model(**batch)
    out.loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    losses.append(out.loss.item())
    lrs.append(sched.get_last_lr()[0])

model.eval()
with torch.inference_mode():
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    preds = logits.argmax(-1)

print(json.dumps({
    "device": str(next(model.parameters()).device),
    "losses": losses,
    "lrs": lrs,
    "logits": logits.cpu().tolist(),
    "accuracy": (preds == batch["labels"]).float().mean().item(),
    "classifier_sum": model.classifier.weight.sum().item(),
}))
