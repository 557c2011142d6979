"""The PyTorch tutorial "NLP From Scratch: Classifying Names with a Character-Level RNN" (the
2024 version), shrunk: ``torch.set_default_device`` to the accelerator, a Dataset building one-hot
line tensors and label tensors on the default device, ``random_split`` with a device
``torch.Generator``, an ``nn.RNN`` classifier trained on shuffled mini-batches with
``clip_grad_norm_``, then a confusion matrix filled by ``argmax`` and the top guesses by ``topk``."""
import json
import random
import string

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

device = torch.device("cpu")
if torch.cuda.is_available():
    device = torch.device("cuda")
torch.set_default_device(device)
torch.manual_seed(0)
random.seed(0)

allowed_characters = string.ascii_letters + " .,;'"
n_letters = len(allowed_characters)


def letterToIndex(letter):
    if letter not in allowed_characters:
        return allowed_characters.find("_")
    return allowed_characters.find(letter)


def lineToTensor(line):
    tensor = torch.zeros(len(line), 1, n_letters)
    for li, letter in enumerate(line):
        tensor[li][0][letterToIndex(letter)] = 1
    return tensor


LANGS = {
    "English": ["Smith", "Brown", "Taylor", "Walker", "Wright", "Hughes", "Green", "Hall"],
    "Italian": ["Rossi", "Russo", "Ferrari", "Esposito", "Bianchi", "Romano", "Colombo", "Ricci"],
    "Japanese": ["Sato", "Suzuki", "Takahashi", "Tanaka", "Watanabe", "Ito", "Yamamoto", "Nakamura"],
}


class NamesDataset(Dataset):
    def __init__(self):
        self.data, self.data_tensors, self.labels, self.labels_tensors = [], [], [], []
        self.labels_uniq = sorted(LANGS)
        for label, names in LANGS.items():
            for name in names:
                self.data.append(name)
                self.data_tensors.append(lineToTensor(name))
                self.labels.append(label)
        for idx in range(len(self.labels)):
            temp_tensor = torch.tensor([self.labels_uniq.index(self.labels[idx])], dtype=torch.long)
            self.labels_tensors.append(temp_tensor)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return self.labels_tensors[idx], self.data_tensors[idx], self.labels[idx], self.data[idx]


alldata = NamesDataset()
train_set, test_set = torch.utils.data.random_split(
    alldata, [.75, .25], generator=torch.Generator(device=device).manual_seed(2024))


class CharRNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.rnn = nn.RNN(input_size, hidden_size)
        self.h2o = nn.Linear(hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, line_tensor):
        rnn_out, hidden = self.rnn(line_tensor)
        output = self.h2o(hidden[0])
        output = self.softmax(output)
        return output


rnn = CharRNN(n_letters, 16, len(alldata.labels_uniq))


def train(rnn, training_data, n_epoch=3, n_batch_size=4, learning_rate=0.2, criterion=None):
    criterion = criterion or nn.NLLLoss()
    current_loss = 0
    all_losses = []
    rnn.train()
    optimizer = torch.optim.SGD(rnn.parameters(), lr=learning_rate)
    for iter in range(1, n_epoch + 1):
        rnn.zero_grad()
        batches = list(range(len(training_data)))
        random.shuffle(batches)
        batches = [batches[i:i + n_batch_size] for i in range(0, len(batches), n_batch_size)]
        for idx, batch in enumerate(batches):
            batch_loss = 0
            for i in batch:
                (label_tensor, text_tensor, label, text) = training_data[i]
                output = rnn.forward(text_tensor)
                loss = criterion(output, label_tensor)
                batch_loss += loss
            batch_loss.backward()
            nn.utils.clip_grad_norm_(rnn.parameters(), 3)
            optimizer.step()
            optimizer.zero_grad()
            current_loss += batch_loss.item() / len(batch)
        all_losses.append(current_loss / len(batches))
        current_loss = 0
    return all_losses


def label_from_output(output, output_labels):
    top_n, top_i = output.topk(1)
    label_i = top_i[0].item()
    return output_labels[label_i], label_i


all_losses = train(rnn, train_set)
confusion = torch.zeros(len(alldata.labels_uniq), len(alldata.labels_uniq))
rnn.eval()
with torch.no_grad():
    for i in range(len(test_set)):
        (label_tensor, text_tensor, label, text) = test_set[i]
        output = rnn(text_tensor)
        guess, guess_i = label_from_output(output, alldata.labels_uniq)
        confusion[alldata.labels_uniq.index(label)][guess_i] += 1
for i in range(len(alldata.labels_uniq)):
    denom = confusion[i].sum()
    if denom > 0:
        confusion[i] = confusion[i] / denom
with torch.no_grad():
    output = rnn(lineToTensor("Yamada"))
    topv, topi = output.topk(2, 1, True)
print(json.dumps({
    "losses": all_losses, "train_indices": list(train_set.indices), "confusion": confusion.cpu().tolist(),
    "top": [[v.item(), alldata.labels_uniq[i.item()]] for v, i in zip(topv[0], topi[0])],
    "softmax": F.softmax(output, 1).cpu().tolist(), "device": str(confusion.device),
}))
