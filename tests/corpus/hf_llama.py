"""A tiny Llama from a config (no weights, no hub): padded training steps, then batched,
left-padded generate(): greedy and beam search."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig, LlamaForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
model = LlamaForCausalLM(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)

g = torch.Generator().manual_seed(2)
lengths = [9, 5, 11]
input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
attention_mask = torch.zeros_like(input_ids)
for i, n in enumerate(lengths):
    input_ids[i, :n] = torch.randint(3, config.vocab_size, (n,), generator=g)
    attention_mask[i, :n] = 1
labels = input_ids.masked_fill(attention_mask == 0, -100)
input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)

losses = []
for step in range(4):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())

model.eval()
prompts = [[4, 8, 15, 16, 23], [42, 7], [11, 12, 13]]
width = max(map(len, prompts))
ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
out = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=5, do_sample=False)
beams = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=5, num_beams=3,
                       num_return_sequences=2, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)

print(json.dumps({
    "device": str(next(model.parameters()).device),
    "losses": losses,
    "param_sum": sum(p.detach().double().sum().item() for p in model.parameters()),
    "param_abs_sum": sum(p.detach().double().abs().sum().item() for p in model.parameters()),
    "greedy": out.tolist(),
    "beams": beams.sequences.tolist(),
    "beam_scores": beams.sequences_scores.tolist(),
}))
