"""A tiny T5 from a config (no weights, no hub): a few seq2seq training steps on padded
batches, then batched greedy generate()."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import T5Config, T5ForConditionalGeneration

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = T5Config(vocab_size=90, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                  num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
model = T5ForConditionalGeneration(config).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

g = torch.Generator().manual_seed(4)
src_len, tgt_len = [10, 6, 8], [5, 7, 3]
src = torch.zeros(3, max(src_len), dtype=torch.long)
tgt = torch.full((3, max(tgt_len)), -100, dtype=torch.long)
for i, (s, t) in enumerate(zip(src_len, tgt_len)):
    src[i, :s] = torch.randint(2, config.vocab_size, (s,), generator=g)
    tgt[i, :t] = torch.randint(2, config.vocab_size, (t,), generator=g)
src, tgt = src.to(device), tgt.to(device)
mask = src.ne(0).long()

losses = []
model.train()
for step in range(4):
    loss = model(input_ids=src, attention_mask=mask, labels=tgt).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())

model.eval()
gen = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=6, do_sample=False)
with torch.no_grad():
    enc = model.get_encoder()(input_ids=src, attention_mask=mask).last_hidden_state

print(json.dumps({
    "device": str(next(model.parameters()).device),
    "losses": losses,
    "encoder_out": enc[:, :2, :4].tolist(),
    "lm_head_sum": model.lm_head.weight.sum().item(),
    "generated": gen.tolist(),
}))
