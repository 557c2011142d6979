"""The PyTorch tutorial "NLP From Scratch: Translation with a Sequence to Sequence Network and
Attention" (its per-sentence form), shrunk: a GRU encoder whose outputs are written one step at a
time into a preallocated ``encoder_outputs``, an attention decoder over ``MAX_LENGTH`` positions,
teacher forcing chosen per sentence by ``random.random()``, the free-running branch fed
``topi.squeeze().detach()`` and stopped at EOS by ``.item()``, two SGD optimizers; then the
evaluation loop that collects words and ``decoder_attentions[di] = attn.data``, and the batched
2023 form (Bahdanau attention, ``topi.squeeze(-1).detach()``, a DataLoader over a TensorDataset)."""
import json
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
random.seed(0)
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1)
SOS_token, EOS_token = 0, 1
MAX_LENGTH = 7
N_IN, N_OUT, HIDDEN = 14, 12, 16


def make_pairs(n):
    pairs = []
    for _ in range(n):
        length = int(torch.randint(2, MAX_LENGTH - 1, (1,), generator=gen))
        src = torch.randint(2, N_IN, (length,), generator=gen).tolist() + [EOS_token]
        tgt = [(t * 3) % (N_OUT - 2) + 2 for t in src[:-1]][::-1] + [EOS_token]
        pairs.append((src, tgt))
    return pairs


def tensorFromSentence(indexes):
    return torch.tensor(indexes, dtype=torch.long, device=device).view(-1, 1)


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output, hidden = self.gru(embedded, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size, device=device)


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1, max_length=MAX_LENGTH):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.attn = nn.Linear(hidden_size * 2, max_length)
        self.attn_combine = nn.Linear(hidden_size * 2, hidden_size)
        self.dropout = nn.Dropout(dropout_p)
        self.gru = nn.GRU(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)
        attn_weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0), encoder_outputs.unsqueeze(0))
        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)
        output = F.relu(output)
        output, hidden = self.gru(output, hidden)
        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights


teacher_forcing_ratio = 0.5


def train(input_tensor, target_tensor, encoder, decoder, encoder_optimizer, decoder_optimizer,
          criterion, max_length=MAX_LENGTH):
    encoder_hidden = encoder.initHidden()
    encoder_optimizer.zero_grad()
    decoder_optimizer.zero_grad()
    input_length = input_tensor.size(0)
    target_length = target_tensor.size(0)
    encoder_outputs = torch.zeros(max_length, encoder.hidden_size, device=device)
    loss = 0
    for ei in range(input_length):
        encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
        encoder_outputs[ei] = encoder_output[0, 0]
    decoder_input = torch.tensor([[SOS_token]], device=device)
    decoder_hidden = encoder_hidden
    use_teacher_forcing = random.random() < teacher_forcing_ratio
    steps = 0
    if use_teacher_forcing:
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            loss += criterion(decoder_output, target_tensor[di])
            decoder_input = target_tensor[di]
            steps += 1
    else:
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            topv, topi = decoder_output.topk(1)
            decoder_input = topi.squeeze().detach()
            loss += criterion(decoder_output, target_tensor[di])
            steps += 1
            if decoder_input.item() == EOS_token:
                break
    loss.backward()
    encoder_optimizer.step()
    decoder_optimizer.step()
    return loss.item() / target_length, use_teacher_forcing, steps


def evaluate(encoder, decoder, sentence, max_length=MAX_LENGTH):
    with torch.no_grad():
        input_tensor = tensorFromSentence(sentence)
        input_length = input_tensor.size()[0]
        encoder_hidden = encoder.initHidden()
        encoder_outputs = torch.zeros(max_length, encoder.hidden_size, device=device)
        for ei in range(input_length):
            encoder_output, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
            encoder_outputs[ei] += encoder_output[0, 0]
        decoder_input = torch.tensor([[SOS_token]], device=device)
        decoder_hidden = encoder_hidden
        decoded_words = []
        decoder_attentions = torch.zeros(max_length, max_length)
        for di in range(max_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            decoder_attentions[di] = decoder_attention.data
            topv, topi = decoder_output.data.topk(1)
            if topi.item() == EOS_token:
                decoded_words.append("<EOS>")
                break
            else:
                decoded_words.append(topi.item())
            decoder_input = topi.squeeze().detach()
        return decoded_words, decoder_attentions[:di + 1]


pairs = make_pairs(12)
encoder = EncoderRNN(N_IN, HIDDEN).to(device)
attn_decoder = AttnDecoderRNN(HIDDEN, N_OUT, dropout_p=0.0).to(device)
encoder_optimizer = optim.SGD(encoder.parameters(), lr=0.05)
decoder_optimizer = optim.SGD(attn_decoder.parameters(), lr=0.05)
criterion = nn.NLLLoss()
training_pairs = [(tensorFromSentence(s), tensorFromSentence(t)) for s, t in
                  [random.choice(pairs) for _ in range(16)]]
losses, forced, steps = [], [], []
for it, (inp, tgt) in enumerate(training_pairs):
    loss, tf, n = train(inp, tgt, encoder, attn_decoder, encoder_optimizer, decoder_optimizer, criterion)
    losses.append(loss)
    forced.append(tf)
    steps.append(n)
encoder.eval()
attn_decoder.eval()
evaluations = []
for src, _ in pairs[:4]:
    words, attentions = evaluate(encoder, attn_decoder, src)
    evaluations.append({"words": words, "attn_sum": attentions.sum(1).tolist(),
                        "attn_argmax": attentions.argmax(1).tolist()})


# --- the batched 2023 form
class BahdanauAttention(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.Wa = nn.Linear(hidden_size, hidden_size)
        self.Ua = nn.Linear(hidden_size, hidden_size)
        self.Va = nn.Linear(hidden_size, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))
        scores = scores.squeeze(2).unsqueeze(1)
        weights = F.softmax(scores, dim=-1)
        context = torch.bmm(weights, keys)
        return context, weights


class BatchEncoder(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size, batch_first=True)

    def forward(self, input):
        return self.gru(self.embedding(input))


class BatchAttnDecoder(nn.Module):
    def __init__(self, hidden_size, output_size):
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.attention = BahdanauAttention(hidden_size)
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, encoder_outputs, encoder_hidden, target_tensor=None):
        batch_size = encoder_outputs.size(0)
        decoder_input = torch.empty(batch_size, 1, dtype=torch.long, device=device).fill_(SOS_token)
        decoder_hidden = encoder_hidden
        decoder_outputs, attentions = [], []
        for i in range(MAX_LENGTH):
            decoder_output, decoder_hidden, attn_weights = self.forward_step(
                decoder_input, decoder_hidden, encoder_outputs)
            decoder_outputs.append(decoder_output)
            attentions.append(attn_weights)
            if target_tensor is not None:
                decoder_input = target_tensor[:, i].unsqueeze(1)
            else:
                _, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze(-1).detach()
        decoder_outputs = torch.cat(decoder_outputs, dim=1)
        decoder_outputs = F.log_softmax(decoder_outputs, dim=-1)
        attentions = torch.cat(attentions, dim=1)
        return decoder_outputs, decoder_hidden, attentions

    def forward_step(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input)
        query = hidden.permute(1, 0, 2)
        context, attn_weights = self.attention(query, encoder_outputs)
        input_gru = torch.cat((embedded, context), dim=2)
        output, hidden = self.gru(input_gru, hidden)
        return self.out(output), hidden, attn_weights


input_ids = torch.zeros(len(pairs), MAX_LENGTH, dtype=torch.int32)
target_ids = torch.zeros(len(pairs), MAX_LENGTH, dtype=torch.int32)
for idx, (s, t) in enumerate(pairs):
    input_ids[idx, :len(s)] = torch.tensor(s)
    target_ids[idx, :len(t)] = torch.tensor(t)
train_data = TensorDataset(input_ids.to(device), target_ids.to(device))
loader = DataLoader(train_data, sampler=RandomSampler(train_data, generator=torch.Generator().manual_seed(3)),
                    batch_size=4)
benc, bdec = BatchEncoder(N_IN, HIDDEN).to(device), BatchAttnDecoder(HIDDEN, N_OUT).to(device)
eopt, dopt = optim.Adam(benc.parameters(), lr=0.01), optim.Adam(bdec.parameters(), lr=0.01)
batch_losses = []
for epoch in range(2):
    for input_tensor, target_tensor in loader:
        eopt.zero_grad()
        dopt.zero_grad()
        encoder_outputs, encoder_hidden = benc(input_tensor)
        decoder_outputs, _, _ = bdec(encoder_outputs, encoder_hidden, target_tensor)
        loss = criterion(decoder_outputs.view(-1, decoder_outputs.size(-1)), target_tensor.view(-1).long())
        loss.backward()
        eopt.step()
        dopt.step()
        batch_losses.append(loss.item())
with torch.no_grad():
    encoder_outputs, encoder_hidden = benc(input_ids[:3].to(device))
    decoder_outputs, decoder_hidden, attentions = bdec(encoder_outputs, encoder_hidden)
    _, topi = decoder_outputs.topk(1)
    decoded_ids = topi.squeeze()
print(json.dumps({"losses": losses, "forced": forced, "steps": steps, "evaluations": evaluations,
                  "batch_losses": batch_losses, "decoded": decoded_ids.tolist(),
                  "attn_sum": attentions.sum().item(), "device": str(decoded_ids.device)}))
