"""Deterministic synthetic data for the built-in models; nothing is downloaded.

* :func:`markov_tokens`: a token stream from a random sparse Markov chain. Each token has only
  ``branching`` possible successors, so a model's loss visibly falls within ~100 steps, from
  ln(vocab_size) (5.5 nats for 256) towards the chain's entropy rate (about 1 nat for branching 4).
* :func:`zipf_tokens`: i.i.d. tokens with Zipf-skewed frequencies, for skewed MoE routing.
* :class:`TokenBatches`: (x, y) next-token batches cut from a stream; batch ``i`` is a pure
  function of (tokens, seed, i), so two runs (or a run resumed from a checkpoint) see the same data.
* :func:`classification_batches`: (x, labels) batches for the encoder classifier.

Everything uses its own ``torch.Generator`` seeded from the arguments, never the global RNG, and
lives on the CPU (the caller, or the engine, moves batches to the device).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import torch
from torch import Tensor

from zinf.errors import ConfigError


def _generator(*seeds: int) -> torch.Generator:
    """A CPU generator seeded from several non-negative integers (e.g. (seed, batch index))."""
    s = 0
    for x in seeds:
        s = (s * 1_000_003 + int(x)) % (1 << 63)
    return torch.Generator().manual_seed(s)


def markov_tokens(vocab_size: int, n_tokens: int, seed: int = 0, branching: int = 4) -> Tensor:
    """A (n_tokens,) LongTensor walked from a random Markov chain over ``vocab_size`` states in
    which each state has ``branching`` successors (drawn with replacement, so sometimes fewer
    distinct ones) with Dirichlet(1) transition probabilities. Takes ~0.3 s per million tokens
    (a Python loop)."""
    if vocab_size < 2 or n_tokens < 1 or branching < 1:
        raise ConfigError(f"markov_tokens needs vocab_size >= 2, n_tokens >= 1, branching >= 1; "
                          f"got {vocab_size}, {n_tokens}, {branching}")
    gen = _generator(seed)
    succ = torch.randint(vocab_size, (vocab_size, branching), generator=gen)  # successors of each state
    w = -torch.rand(vocab_size, branching, generator=gen).clamp_min(1e-12).log()  # Exp(1) -> Dirichlet(1)
    cum = (w.cumsum(dim=1) / w.sum(dim=1, keepdim=True)).tolist()  # CDF of each state's successors
    succ_l = succ.tolist()
    u = torch.rand(n_tokens, generator=gen).tolist()  # one uniform draw per step (inverse-CDF sampling)
    state = int(torch.randint(vocab_size, (1,), generator=gen))
    out = [0] * n_tokens
    last = branching - 1
    for i in range(n_tokens):
        out[i] = state
        state = succ_l[state][min(bisect.bisect_right(cum[state], u[i]), last)]
    return torch.tensor(out, dtype=torch.long)


def zipf_tokens(vocab_size: int, n_tokens: int, alpha: float = 1.2, seed: int = 0) -> Tensor:
    """A (n_tokens,) LongTensor of i.i.d. tokens with P(token k) proportional to (k + 1)^-alpha:
    token 0 is the most frequent (for vocab 256 and alpha 1.2, about 25% of all tokens)."""
    if vocab_size < 1 or n_tokens < 1 or alpha < 0:
        raise ConfigError(f"zipf_tokens needs vocab_size >= 1, n_tokens >= 1, alpha >= 0; "
                          f"got {vocab_size}, {n_tokens}, {alpha}")
    p = torch.arange(1, vocab_size + 1, dtype=torch.float64).pow(-alpha)
    return torch.multinomial(p / p.sum(), n_tokens, replacement=True, generator=_generator(seed))


class TokenBatches:
    """Next-token batches from a 1-D token stream.

    ``get(i)`` -> (x, y), two (batch_size, seq_len) LongTensors: ``batch_size`` windows starting at
    random offsets drawn from (seed, i) alone, and ``y`` = ``x`` shifted by one token. Any ``i >= 0``
    works; iterating yields ``get(0), get(1), ...`` for ``len(self)`` batches (one pass's worth of
    tokens).
    """

    def __init__(self, tokens: Tensor, batch_size: int, seq_len: int, seed: int = 0):
        if tokens.dim() != 1:
            raise ConfigError(f"TokenBatches needs a 1-D token tensor, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ConfigError(f"TokenBatches needs batch_size >= 1 and seq_len >= 1, got {batch_size}, {seq_len}")
        if tokens.numel() < seq_len + 1:
            raise ConfigError(f"TokenBatches needs at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.numel()}")
        self.tokens = tokens.to(torch.long).cpu()
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def __len__(self) -> int:
        return max(1, (self.tokens.numel() - 1) // (self.batch_size * self.seq_len))

    def get(self, i: int) -> tuple[Tensor, Tensor]:
        if i < 0:
            raise IndexError(f"batch index must be >= 0, got {i}")
        n_starts = self.tokens.numel() - self.seq_len  # windows of seq_len + 1 tokens that fit
        starts = torch.randint(n_starts, (self.batch_size,), generator=_generator(self.seed, i))
        window = starts[:, None] + torch.arange(self.seq_len + 1)  # (B, T + 1) indices into tokens
        chunk = self.tokens[window]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return (self.get(i) for i in range(len(self)))


class ClassificationBatches:
    """Sequence-classification batches: ``get(i)`` -> (x (batch_size, seq_len), labels (batch_size,)).

    Each class owns a random set of ``vocab_size // n_classes`` "signature" tokens (disjoint sets,
    fixed by ``seed``). A sequence of class c draws each token from c's signature set with
    probability ``signal``, else uniformly from the whole vocabulary; labels are uniform. A
    classifier that pools over positions learns it within a few dozen steps (chance loss = ln n_classes).
    """

    def __init__(self, vocab_size: int, n_classes: int, batch_size: int, seq_len: int,
                 seed: int = 0, signal: float = 0.5, n_batches: int = 1000):
        if n_classes < 1 or vocab_size < n_classes:
            raise ConfigError(f"classification_batches needs 1 <= n_classes <= vocab_size, got {n_classes}, {vocab_size}")
        if batch_size < 1 or seq_len < 1 or not 0.0 <= signal <= 1.0:
            raise ConfigError(f"classification_batches needs batch_size, seq_len >= 1 and signal in [0, 1]; "
                              f"got {batch_size}, {seq_len}, {signal}")
        self.vocab_size, self.n_classes = vocab_size, n_classes
        self.batch_size, self.seq_len, self.seed, self.signal, self.n_batches = batch_size, seq_len, seed, signal, n_batches
        per = vocab_size // n_classes
        perm = torch.randperm(vocab_size, generator=_generator(seed))
        self.signatures = perm[: per * n_classes].view(n_classes, per)  # (n_classes, per) token ids

    def __len__(self) -> int:
        return self.n_batches

    def get(self, i: int) -> tuple[Tensor, Tensor]:
        if i < 0:
            raise IndexError(f"batch index must be >= 0, got {i}")
        gen = _generator(self.seed, 1, i)  # (seed, 1, i): a stream apart from the signature draw
        B, T = self.batch_size, self.seq_len
        labels = torch.randint(self.n_classes, (B,), generator=gen)
        noise = torch.randint(self.vocab_size, (B, T), generator=gen)
        pick = torch.randint(self.signatures.size(1), (B, T), generator=gen)
        signature = self.signatures[labels[:, None], pick]  # (B, T): tokens of each row's class
        use_signature = torch.rand(B, T, generator=gen) < self.signal
        return torch.where(use_signature, signature, noise), labels

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return (self.get(i) for i in range(len(self)))


def classification_batches(vocab_size: int, n_classes: int, batch_size: int, seq_len: int,
                           seed: int = 0, signal: float = 0.5, n_batches: int = 1000) -> ClassificationBatches:
    """Deterministic (x, labels) batches for :class:`~zinf.models.encoder.EncoderClassifier`;
    see :class:`ClassificationBatches`. ``n_batches`` is only the length of one iteration;
    ``get(i)`` works for any ``i >= 0``."""
    return ClassificationBatches(vocab_size, n_classes, batch_size, seq_len, seed, signal, n_batches)
