"""pytorch/examples word_language_model, shrunk: LSTM and GRU language models trained with
truncated BPTT, hidden-state repackaging, gradient clipping and the example's manual SGD update."""
import json
import math

import torch
import torch.nn as nn

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous().to(device)


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def run(rnn_type):
    torch.manual_seed(1111)
    ntokens, bptt, lr, clip = 50, 8, 5.0, 0.25
    corpus = torch.randint(0, ntokens, (400,), generator=torch.Generator().manual_seed(7))
    train_data = batchify(corpus[:320], 4)
    val_data = batchify(corpus[320:], 2)
    model = RNNModel(rnn_type, ntokens, 16, 24, 2).to(device)
    criterion = nn.NLLLoss()
    model.train()
    hidden = model.init_hidden(4)
    losses = []
    for i in range(0, min(train_data.size(0) - 1, 5 * bptt), bptt):
        data, targets = get_batch(train_data, i, bptt)
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    model.eval()
    total, hidden = 0.0, model.init_hidden(2)
    with torch.no_grad():
        for i in range(0, val_data.size(0) - 1, bptt):
            data, targets = get_batch(val_data, i, bptt)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total += len(data) * criterion(output, targets).item()
    val_loss = total / (len(val_data) - 1)
    return {"device": str(next(model.parameters()).device), "losses": losses, "val_loss": val_loss,
            "val_ppl": math.exp(val_loss),
            "hidden_sum": (hidden[0] if rnn_type == "LSTM" else hidden).sum().item(),
            "weight_sums": [p.sum().item() for p in model.rnn.parameters()]}


print(json.dumps({"lstm": run("LSTM"), "gru": run("GRU")}))
