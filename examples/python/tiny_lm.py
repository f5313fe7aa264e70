"""The small transformer language model the Python examples train, and its synthetic
language (arithmetic progressions modulo the vocabulary: the next token is
predictable, so the loss falls as the model learns)."""

import torch
from torch import nn


class TinyLM(nn.Module):
    """A decoder-only transformer: embeddings, pre-norm blocks, tied-free lm head."""

    def __init__(self, vocab, d_model, layers, heads, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.causal[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def batch(vocab, seq, size, generator):
    """Sequences of a synthetic language: arithmetic progressions modulo vocab, so the
    next token is predictable and the loss falls as the model learns."""
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    step = torch.randint(1, 7, (size, 1), generator=generator)
    tokens = (start + step * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, optimizer, vocab, seq, size, generator):
    """One AdamW step on a fresh batch; returns the loss."""
    tokens, targets = batch(vocab, seq, size, generator)
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()
