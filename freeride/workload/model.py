"""A small GPT, built stage by stage for pipeline parallelism.

The model is an embedding, ``layers`` pre-norm transformer blocks and a head. :func:`build_chunk`
builds one pipeline chunk (a contiguous run of blocks, with the embedding on the first chunk and the
final norm and head on the last) so that no rank ever materialises the whole model. Every block's
weights come from a generator seeded with ``(seed, block index)``, so a chunk is the same whichever
rank builds it and however the model is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from freeride.errors import ConfigError
from freeride.training.memory import split_layers


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    seq_len: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "heads", "layers", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ConfigError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPTChunk(nn.Module):
    """Blocks ``[first, last)`` of the model, plus the embedding and/or head at the ends."""

    def __init__(self, cfg: GPTConfig, first: int, last: int) -> None:
        super().__init__()
        self.is_first = first == 0
        self.is_last = last == cfg.layers
        gen_state = torch.random.get_rng_state()
        try:
            if self.is_first:
                torch.manual_seed(cfg.seed * 1_000_003 + 7)
                self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
                self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
            blocks = []
            for i in range(first, last):
                torch.manual_seed(cfg.seed * 1_000_003 + 1000 + i)
                blocks.append(Block(cfg))
            self.blocks = nn.ModuleList(blocks)
            if self.is_last:
                torch.manual_seed(cfg.seed * 1_000_003 + 11)
                self.ln = nn.LayerNorm(cfg.d_model)
                self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        finally:
            torch.random.set_rng_state(gen_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok(x) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = self.head(self.ln(x))
        return x


def build_chunk(cfg: GPTConfig, chunk: int, chunks: int) -> GPTChunk:
    first, last = split_layers(cfg.layers, chunks)[chunk]
    return GPTChunk(cfg, first, last)


def synthetic_batch(cfg: GPTConfig, batch: int, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets for one iteration, identical on every rank."""
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + iteration)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
