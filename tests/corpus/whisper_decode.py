"""A Whisper-style speech model as openai/whisper's model.py and decoding.py write it: a Conv1d+GELU
audio encoder with sinusoidal positions, a decoder whose key/value projections are cached by
forward hooks (torch.cat onto the cache, .detach()), logit filters (SuppressBlank, SuppressTokens
by index assignment, the timestamp rules with logsumexp and boolean masks), a greedy decoder with
sum_logprobs gated by the EOT mask, a beam search reading .tolist() per step and reordering the
cache by its beams' sources, and a sparse ``alignment_heads`` buffer moved with the model."""
import json

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
N_MELS, N_CTX_A, STATE, HEAD, LAYER, VOCAB, N_CTX_T = 8, 12, 16, 2, 2, 40, 16
SOT, EOT, NO_TS, TS_BEGIN = 30, 31, 32, 33


def sinusoids(length, channels, max_timescale=10000):
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.float()).type(x.dtype)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Conv1d(nn.Conv1d):
    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        q = self.query(x)
        if kv_cache is None or xa is None or self.key not in kv_cache:
            k = self.key(x if xa is None else xa)
            v = self.value(x if xa is None else xa)
        else:
            k = kv_cache[self.key]
            v = kv_cache[self.value]
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)), qk.detach()


class Block(nn.Module):
    def __init__(self, n_state, n_head, cross=False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross else None
        self.cross_attn_ln = LayerNorm(n_state) if cross else None
        self.mlp = nn.Sequential(Linear(n_state, 4 * n_state), nn.GELU(), Linear(4 * n_state, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        x = x + self.attn(self.attn_ln(x), mask=mask, kv_cache=kv_cache)[0]
        if self.cross_attn:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = Conv1d(N_MELS, STATE, kernel_size=3, padding=1)
        self.conv2 = Conv1d(STATE, STATE, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(N_CTX_A, STATE))
        self.blocks = nn.ModuleList([Block(STATE, HEAD) for _ in range(LAYER)])
        self.ln_post = LayerNorm(STATE)

    def forward(self, x):
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        assert x.shape[1:] == self.positional_embedding.shape, "incorrect audio shape"
        x = (x + self.positional_embedding).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, STATE)
        self.positional_embedding = nn.Parameter(torch.empty(N_CTX_T, STATE).normal_(0, 0.1))
        self.blocks = nn.ModuleList([Block(STATE, HEAD, cross=True) for _ in range(LAYER)])
        self.ln = LayerNorm(STATE)
        mask = torch.empty(N_CTX_T, N_CTX_T).fill_(-np.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, xa, kv_cache=None):
        offset = next(iter(kv_cache.values())).shape[1] if kv_cache else 0
        x = self.token_embedding(x) + self.positional_embedding[offset:offset + x.shape[-1]]
        x = x.to(xa.dtype)
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, kv_cache=kv_cache)
        x = self.ln(x)
        return (x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)).float()


class Whisper(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = AudioEncoder()
        self.decoder = TextDecoder()
        heads = torch.zeros(LAYER, HEAD, dtype=torch.bool)
        heads[LAYER // 2:] = True
        self.register_buffer("alignment_heads", heads.to_sparse(), persistent=False)

    def install_kv_cache_hooks(self):
        cache, hooks = {}, []

        def save_to_cache(module, _, output):
            if module not in cache or output.shape[1] > N_CTX_T:
                cache[module] = output
            else:
                cache[module] = torch.cat([cache[module], output], dim=1).detach()
            return cache[module]

        def install_hooks(layer):
            if isinstance(layer, MultiHeadAttention):
                hooks.append(layer.key.register_forward_hook(save_to_cache))
                hooks.append(layer.value.register_forward_hook(save_to_cache))
        self.decoder.apply(install_hooks)
        return cache, hooks


class Inference:
    def __init__(self, model, initial_token_length):
        self.model = model
        self.initial_token_length = initial_token_length
        self.kv_cache = {}
        self.hooks = []

    def logits(self, tokens, audio_features):
        if not self.kv_cache:
            self.kv_cache, self.hooks = self.model.install_kv_cache_hooks()
        if tokens.shape[-1] > self.initial_token_length:
            tokens = tokens[:, -1:]
        return self.model.decoder(tokens, audio_features, kv_cache=self.kv_cache)

    def cleanup_caching(self):
        for hook in self.hooks:
            hook.remove()
        self.kv_cache = {}
        self.hooks = []

    def rearrange_kv_cache(self, source_indices):
        if source_indices != list(range(len(source_indices))):
            for module in self.kv_cache:
                self.kv_cache[module] = self.kv_cache[module][source_indices].detach()


def apply_filters(logits, tokens, sample_begin):
    if tokens.shape[1] == sample_begin:  # SuppressBlank
        logits[:, [0, EOT]] = -np.inf
    logits[:, [1, 2, 3]] = -np.inf  # SuppressTokens
    logits[:, NO_TS] = -np.inf  # ApplyTimestampRules
    for k in range(tokens.shape[0]):
        sampled = tokens[k, sample_begin:]
        seq = [t for t in sampled.tolist()]
        last_was_timestamp = len(seq) >= 1 and seq[-1] >= TS_BEGIN
        penultimate_was_timestamp = len(seq) < 2 or seq[-2] >= TS_BEGIN
        if last_was_timestamp:
            if penultimate_was_timestamp:
                logits[k, TS_BEGIN:] = -np.inf
            else:
                logits[k, :EOT] = -np.inf
        timestamps = sampled[sampled.ge(TS_BEGIN)]
        if timestamps.numel() > 0:
            timestamp_last = timestamps[-1] + (0 if last_was_timestamp and not penultimate_was_timestamp else 1)
            logits[k, TS_BEGIN:timestamp_last] = -np.inf
    if tokens.shape[1] == sample_begin:
        logits[:, :TS_BEGIN] = -np.inf
    logprobs = F.log_softmax(logits.float(), dim=-1)
    for k in range(tokens.shape[0]):
        timestamp_logprob = logprobs[k, TS_BEGIN:].logsumexp(dim=-1)
        max_text_token_logprob = logprobs[k, :TS_BEGIN].max()
        if timestamp_logprob > max_text_token_logprob:
            logits[k, :TS_BEGIN] = -np.inf


def greedy_decode(model, mel, steps=8):
    audio = model.encoder(mel)
    n = mel.shape[0]
    tokens = torch.tensor([[SOT]]).repeat(n, 1).to(audio.device)
    sum_logprobs = torch.zeros(n, device=audio.device)
    inference = Inference(model, tokens.shape[1])
    try:
        for i in range(steps):
            logits = inference.logits(tokens, audio)[:, -1]
            apply_filters(logits, tokens, 1)
            next_tokens = logits.argmax(dim=-1)
            logprobs = F.log_softmax(logits.float(), dim=-1)
            current_logprobs = logprobs[torch.arange(logprobs.shape[0]), next_tokens]
            sum_logprobs += current_logprobs * (tokens[:, -1] != EOT)
            next_tokens[tokens[:, -1] == EOT] = EOT
            tokens = torch.cat([tokens, next_tokens[:, None]], dim=-1)
            if (tokens[:, -1] == EOT).all():
                break
    finally:
        inference.cleanup_caching()
    return tokens, sum_logprobs


def beam_search(model, mel, beam_size=3, steps=6):
    audio = model.encoder(mel).repeat_interleave(beam_size, dim=0)
    tokens = torch.tensor([[SOT]]).repeat(beam_size, 1).to(audio.device)
    inference = Inference(model, 1)
    sum_logprobs = [0.0] * beam_size
    finished = {}
    try:
        for i in range(steps):
            logprobs = F.log_softmax(inference.logits(tokens, audio)[:, -1].float(), dim=-1)
            scores, sources, next_tokens = {}, {}, []
            for j in range(beam_size):
                prefix = tokens[j].tolist()
                for logprob, token in zip(*logprobs[j].topk(beam_size + 1)):
                    new_logprob = sum_logprobs[j] + logprob.item()
                    seq = tuple(prefix + [token.item()])
                    scores[seq] = new_logprob
                    sources[seq] = j
            saved = 0
            new_sum, source_indices = [], []
            for seq in sorted(scores, key=scores.get, reverse=True):
                if seq[-1] == EOT:
                    finished[seq] = scores[seq]
                else:
                    new_sum.append(scores[seq])
                    next_tokens.append(seq)
                    source_indices.append(sources[seq])
                    saved += 1
                    if saved == beam_size:
                        break
            sum_logprobs = new_sum
            tokens = torch.tensor(next_tokens, device=tokens.device)
            inference.rearrange_kv_cache(source_indices)
    finally:
        inference.cleanup_caching()
    return [list(s) for s in next_tokens], sum_logprobs


torch.manual_seed(1)
model = Whisper().to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
mel = torch.randn(3, N_MELS, 2 * N_CTX_A).to(device)
target = torch.randint(0, SOT, (3, 6)).to(device)
losses = []
for _ in range(4):
    inp = torch.cat([torch.full((3, 1), SOT, device=device), target[:, :-1]], 1)
    logits = model.decoder(inp, model.encoder(mel))
    loss = F.cross_entropy(logits.transpose(1, 2), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
model.eval()
with torch.no_grad():
    tokens, slp = greedy_decode(model, mel)
    beams, beam_scores = beam_search(model, mel[:1])
print(json.dumps({"losses": losses, "greedy": tokens.tolist(), "sum_logprobs": slp.tolist(),
                  "beams": beams, "beam_scores": beam_scores,
                  "alignment_heads": model.alignment_heads.to_dense().sum().item(),
                  "device": str(tokens.device)}))
