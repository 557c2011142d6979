"""ELECTRA's replaced-token-detection pre-training (the google-research/electra recipe as the
Hugging Face examples port it), then ALBERT's MLM + sentence-order pre-training, shrunk: tiny
configs, no hub, seeded synthetic data.

ELECTRA: a small generator (``ElectraForMaskedLM``) fills the masked positions (labels -100
elsewhere), its argmax replaces them (``torch.where``), and the discriminator
(``ElectraForPreTraining``, under gradient checkpointing) learns which tokens were replaced; the
generator's embeddings are the discriminator's (one ``nn.Embedding`` shared), one AdamW over
both, a warm-up schedule from transformers, ``clip_grad_norm_``. The vocabulary then grows by new
tokens (``resize_token_embeddings(pad_to_multiple_of=8, mean_resizing=False)``, the new rows set
to the old rows' mean) before the discriminator is saved and loaded back
(``from_pretrained(dir).to(device)``).

ALBERT: ``AlbertForPreTraining`` (one shared layer group) with eager attention returning
``output_attentions``/``output_hidden_states`` (mean-pooled sentence embeddings), a cosine
schedule with hard restarts, and its evaluation read back by ``.tolist()``."""
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from transformers import (
    AlbertConfig,
    AlbertForPreTraining,
    ElectraConfig,
    ElectraForMaskedLM,
    ElectraForPreTraining,
    get_cosine_with_hard_restarts_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
VOCAB, PAD, CLS, SEP, MASK = 96, 0, 1, 2, 3
g = torch.Generator().manual_seed(7)


def batch_of(n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded [CLS] ... [SEP] rows of random lengths and their attention masks."""
    ids = torch.full((n, length), PAD)
    for i in range(n):
        k = int(torch.randint(length // 2, length - 1, (1,), generator=g))
        ids[i, 0], ids[i, 1:k], ids[i, k] = CLS, torch.randint(5, VOCAB, (k - 1,), generator=g), SEP
    return ids, (ids != PAD).long()


# ---------------------------------------------------------------- ELECTRA
common = dict(vocab_size=VOCAB, embedding_size=16, max_position_embeddings=32, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, pad_token_id=PAD)
generator = ElectraForMaskedLM(ElectraConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, **common)).to(device)
discriminator = ElectraForPreTraining(ElectraConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    intermediate_size=64, **common)).to(device)
discriminator.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
generator.electra.embeddings.word_embeddings = discriminator.electra.embeddings.word_embeddings  # tied, as in the paper
params = list({id(p): p for p in [*generator.parameters(), *discriminator.parameters()]}.values())
opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)
sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)

gen_losses, disc_losses, replaced_frac, grad_norms = [], [], [], []
for step in range(8):
    ids, attn = batch_of(4, 16)
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    chosen = (torch.rand(ids.shape, generator=g) < 0.25) & ~special
    ids, attn, chosen = ids.to(device), attn.to(device), chosen.to(device)
    masked = ids.masked_fill(chosen, MASK)
    gen_out = generator(input_ids=masked, attention_mask=attn, labels=torch.where(chosen, ids, -100))
    with torch.no_grad():
        sampled = gen_out.logits.argmax(-1)
    corrupted = torch.where(chosen, sampled, ids)
    is_replaced = (corrupted != ids).long()
    disc_out = discriminator(input_ids=corrupted, attention_mask=attn, labels=is_replaced)
    loss = gen_out.loss + 50.0 * disc_out.loss
    loss.backward()
    grad_norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    gen_losses.append(gen_out.loss.item())
    disc_losses.append(disc_out.loss.item())
    replaced_frac.append(is_replaced[attn.bool()].float().mean().item())

discriminator.eval()
ids, attn = batch_of(3, 16)
ids, attn = ids.to(device), attn.to(device)
with torch.no_grad():
    disc_logits = discriminator(input_ids=ids, attention_mask=attn).logits
    detected = (torch.sigmoid(disc_logits) > 0.5) & attn.bool()

# New tokens: the embedding matrix grows to a multiple of 8; the old rows are kept.
old_rows = discriminator.get_input_embeddings().weight.detach().clone()
resized = discriminator.resize_token_embeddings(VOCAB + 5, pad_to_multiple_of=8, mean_resizing=False)
with torch.no_grad():  # the new rows (drawn by the device's generator) start at the old rows' mean
    resized.weight[VOCAB:] = resized.weight[:VOCAB].mean(0, keepdim=True)
with tempfile.TemporaryDirectory() as tmp:
    discriminator.save_pretrained(tmp)
    reloaded = ElectraForPreTraining.from_pretrained(tmp).to(device).eval()
new_ids = torch.tensor([[CLS, VOCAB, VOCAB + 4, 7, SEP]], device=device)
with torch.no_grad():
    reloaded_logits = reloaded(input_ids=new_ids).logits

# ---------------------------------------------------------------- ALBERT
torch.manual_seed(1)
albert = AlbertForPreTraining(AlbertConfig(
    vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_hidden_groups=1,
    num_attention_heads=4, intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, pad_token_id=PAD,
    attn_implementation="eager")).to(device)
albert.train()
opt = torch.optim.AdamW(albert.parameters(), lr=3e-3)
sched = get_cosine_with_hard_restarts_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=6, num_cycles=2)
albert_losses, lrs = [], []
for step in range(6):
    a, _ = batch_of(4, 8)
    b, _ = batch_of(4, 8)
    swap = torch.rand(4, generator=g) < 0.5  # sentence order: 1 where the halves were swapped
    first, second = torch.where(swap[:, None], b, a), torch.where(swap[:, None], a, b)
    ids = torch.cat([first, second[:, 1:]], dim=1)
    tt = torch.cat([torch.zeros_like(first), torch.ones_like(second[:, 1:])], dim=1)
    labels = ids.clone()
    labels[(torch.rand(ids.shape, generator=g) > 0.2) | (ids == PAD)] = -100
    out = albert(input_ids=ids.to(device), attention_mask=(ids != PAD).long().to(device), token_type_ids=tt.to(device),
                 labels=labels.to(device), sentence_order_label=swap.long().to(device))
    out.loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    albert_losses.append(out.loss.item())
    lrs.append(sched.get_last_lr()[0])

albert.eval()
ids, attn = batch_of(3, 12)
ids, attn = ids.to(device), attn.to(device)
with torch.inference_mode():
    out = albert(input_ids=ids, attention_mask=attn, output_attentions=True, output_hidden_states=True)
    m = attn.unsqueeze(-1).float()
    pooled = F.normalize((out.hidden_states[-1] * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)
    similarity = pooled @ pooled.T
    attn_to_pad = out.attentions[-1].masked_select(~attn.bool()[:, None, None, :]).abs().max()

print(json.dumps({
    "device": str(next(discriminator.parameters()).device),
    "reloaded_device": str(next(reloaded.parameters()).device),
    "gen_losses": gen_losses,
    "disc_losses": disc_losses,
    "replaced_frac": replaced_frac,
    "grad_norms": grad_norms,
    "disc_logits": disc_logits.cpu().tolist(),
    "detected": detected.cpu().tolist(),
    "resized_shape": list(resized.weight.shape),
    "old_rows_kept": torch.equal(discriminator.get_input_embeddings().weight[:VOCAB], old_rows),
    "reloaded_logits": reloaded_logits.tolist(),
    "albert_losses": albert_losses,
    "lrs": lrs,
    "sop_logits": out.sop_logits.tolist(),
    "similarity": similarity.tolist(),
    "n_hidden_states": len(out.hidden_states),
    "attn_to_pad": attn_to_pad.item(),
}))
