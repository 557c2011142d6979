"""A tiny GPT-2 from a config (no weights, no hub): padded training steps, then batched,
left-padded generate(), greedy and sampled."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
model = GPT2LMHeadModel(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

g = torch.Generator().manual_seed(1)
lengths = [12, 7, 10, 4]
input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
attention_mask = torch.zeros_like(input_ids)
for i, n in enumerate(lengths):  # right-padded, as a training collator pads
    input_ids[i, :n] = torch.randint(3, config.vocab_size, (n,), generator=g)
    attention_mask[i, :n] = 1
labels = input_ids.masked_fill(attention_mask == 0, -100)
batch = {k: v.to(device) for k, v in
         dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels).items()}

losses = []
model.train()
for step in range(4):
    out = model(**batch)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    losses.append(out.loss.item())

model.eval()
prompts = [[5, 9, 14, 3], [7, 8], [21, 30, 40]]
width = max(map(len, prompts))
ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded for generation
mask = (ids != 0).long()
ids, mask = ids.to(device), mask.to(device)
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    sampled = []
    for _ in range(2):
        torch.manual_seed(1234)
        sampled.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                      do_sample=True, top_k=20, temperature=0.9))

print(json.dumps({
    "device": str(next(model.parameters()).device),
    "losses": losses,
    "param_sums": [p.detach().double().sum().item() for p in model.parameters()][:8],
    "last_logits": logits[:, -1, :8].tolist(),
    "greedy": greedy.tolist(),
    # the gateway's random numbers are not the CPU's: compare shape, validity and repeatability only
    "sampled_shape": list(sampled[0].shape),
    "sampled_repeatable": torch.equal(sampled[0], sampled[1]),
    "sampled_keeps_prompt": torch.equal(sampled[0][:, :width], ids),
    "sampled_in_vocab": bool(((sampled[0] >= 0) & (sampled[0] < config.vocab_size)).all()),
}))
