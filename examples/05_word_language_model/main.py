"""A word-level language model trained in the shape of PyTorch's word_language_model example
(pytorch/examples, word_language_model/main.py), guarded by trainguard (main_plain.py is the same loop
without it: ``diff main_plain.py main.py`` shows the changed lines).

Its own shape, kept on purpose: the corpus batchified into columns and walked in order by truncated
backpropagation through time (``get_batch`` over ``range(0, train_data.size(0) - 1, args.bptt)``), an
LSTM's hidden state carried from one window to the next (``repackage_hidden``), its own gradient clip, a
manual SGD update (``p.data.add_(p.grad, alpha=-lr)``), the learning rate divided by 4 whenever the
validation loss does not improve, its own evaluation after each epoch and ``torch.save`` of the best
model, reloaded for the test loss. The corpus is generated (no download): sentences of a small grammar.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from typing import Any

import torch
from torch import nn

from trainer_sidecar import Guardian

parser = argparse.ArgumentParser(description="PyTorch word-level LSTM language model")
parser.add_argument("--emsize", type=int, default=32, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=32, help="number of hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20.0, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=6, help="upper epoch limit")
parser.add_argument("--batch-size", type=int, default=10, help="batch size")
parser.add_argument("--bptt", type=int, default=12, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.2, help="dropout applied to layers (0 = no dropout)")
parser.add_argument("--sentences", type=int, default=600, help="sentences in the generated training text")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="report interval")
parser.add_argument("--save", type=str, default="runs/05_word_language_model/model.pt", help="best model")
args = parser.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)
device = torch.device("cpu")

###############################################################################
# Load data (generated: a small grammar's sentences, the same every run)
###############################################################################

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the teacher"]
VERBS = ["sees", "likes", "follows", "finds", "hears", "chases", "helps"]
OBJECTS = ["the ball", "a tree", "the house", "her friend", "the river", "a small fish", "the moon"]
PLACES = ["in the park", "at home", "near the sea", "after school", "in the morning"]


def sentences(count: int, rng: random.Random) -> list[list[str]]:
    out = []
    for _ in range(count):
        words = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}".split()
        if rng.random() < 0.5:
            words += rng.choice(PLACES).split()
        out.append([*words, "<eos>"])
    return out


class Dictionary:
    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


class Corpus:
    def __init__(self, count: int) -> None:
        self.dictionary = Dictionary()
        rng = random.Random(0)
        self.train = self.tokenize(sentences(count, rng))
        self.valid = self.tokenize(sentences(count // 6, rng))
        self.test = self.tokenize(sentences(count // 6, rng))

    def tokenize(self, lines: list[list[str]]) -> torch.Tensor:
        ids = [self.dictionary.add_word(word) for line in lines for word in line]
        return torch.tensor(ids, dtype=torch.int64)


corpus = Corpus(args.sentences)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    # Work out how cleanly we can divide the dataset into bsz parts, trim off the remainder, and lay
    # the parts out as columns.
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

###############################################################################
# Build the model
###############################################################################


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(
        self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        emb = self.drop(self.encoder(tokens))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, ...]:
        weight = next(self.parameters())
        shape = (self.nlayers, bsz, self.nhid)
        return (weight.new_zeros(shape), weight.new_zeros(shape))


ntokens = len(corpus.dictionary)
model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
criterion = nn.NLLLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
nbatches = len(range(0, train_data.size(0) - 1, args.bptt))
guardian = Guardian(model, optimizer, max_steps=args.epochs * nbatches)


class Carried(dict[str, Any]):
    """What the loop carries from one step to the next besides model and optimizer, checkpointed."""

    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.update(state)


carried = Carried(hidden=None, best_val_loss=None)
guardian.track("loop", carried)

###############################################################################
# Training code
###############################################################################


def repackage_hidden(h: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Wraps hidden states in new Tensors, to detach them from their history."""
    return tuple(v.detach() for v in h)


# get_batch subdivides the source data into chunks of length args.bptt: the target of each token is
# the next one, and the chunks along dimension 0 are walked in order, so the hidden state carries over.
def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i : i + seq_len]
    target = source[i + 1 : i + 1 + seq_len].view(-1)
    return data, target


@guardian.busy("eval")
def evaluate(data_source: torch.Tensor) -> float:
    # Turn on evaluation mode which disables dropout.
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train() -> None:
    # Turn on training mode which enables dropout.
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        if (epoch - 1) * nbatches + batch < guardian.step_count:  # trained before a resume
            hidden = carried["hidden"]
            continue
        data, targets = get_batch(train_data, i)
        # Starting each batch, we detach the hidden state from how it was previously produced.
        # If we didn't, the model would try backpropagating all the way to start of the dataset.
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        carried["hidden"] = repackage_hidden(hidden)
        loss = criterion(output, targets)
        guardian.backward(loss)

        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        guardian.step()

        total_loss += loss.item()
        losses_seen.append(loss.item())
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(
                f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} batches | "
                f"lr {optimizer.param_groups[0]['lr']:02.2f} | "
                f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f} | "
                f"ppl {math.exp(cur_loss):8.2f}",
                flush=True,
            )
            total_loss = 0.0
            start_time = time.time()


def weights_digest() -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


# Loop over epochs.
os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
losses_seen: list[float] = []
val_losses = []
for epoch in range(1, args.epochs + 1):
    if epoch * nbatches < guardian.step_count:  # an epoch a resumed run has finished, its end too
        continue
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    val_losses.append(val_loss)
    print("-" * 89)
    print(
        f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | "
        f"valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}",
        flush=True,
    )
    print("-" * 89)
    # Save the model if the validation loss is the best we've seen so far.
    if not carried["best_val_loss"] or val_loss < carried["best_val_loss"]:
        torch.save(model.state_dict(), args.save)
        carried["best_val_loss"] = val_loss
    else:
        # Anneal the learning rate if no improvement has been seen in the validation dataset.
        optimizer.param_groups[0]["lr"] /= 4.0

final_weights = weights_digest()
# Load the best saved model and run it on the test data.
model.load_state_dict(torch.load(args.save))
test_loss = evaluate(test_data)
print("=" * 89)
print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
print("=" * 89, flush=True)
summary = {"weights": final_weights, "val_losses": val_losses, "test_loss": test_loss}
print(json.dumps({**summary, "last_losses": losses_seen[-5:]}), flush=True)
