"""A tiny T5-shaped encoder whose fp16 training overflows where the debugging guide's mt5 did.

``torchdoctor demo`` trains it to show an fp16 overflow being found, explained and fixed, on CPU,
with no download. Module names and classes mirror transformers' T5 so the report reads like the
guide's (``encoder.block.2.layer.1.DenseReluDense`` is a gated-GELU feed-forward, ``...layer.1.dropout``
follows it, and so on)::

    model, batches = build_demo(seed=0)
    train_steps(model, batches, steps=3, precision="fp16")      # [nan, nan, nan]
    with keep_fp32(model.encoder.block[2].layer[1], model=model):
        train_steps(model, batches, steps=5, precision="fp16")  # finite

The overflow is put there on purpose: block 2's feed-forward is initialised with a few "outlier"
hidden units (large ``wi_1`` columns and ``wo`` rows), which mimics a checkpoint pretrained in bf16
whose activations grew past fp16's range (the reason mt5/T5 checkpoints overflow in fp16). Their
size is calibrated at build time so that, on the first batch, the feed-forward output peaks just
under fp16's 65504 -- finite, as in the guide's 6.27e4 -- and the following Dropout's 1/(1-p) rescale
takes it past 65504 to inf. In fp32 (or bf16) the same values are unremarkable.

fp16 here means ``torch.autocast("cpu", dtype=torch.float16)`` with fp32 master weights and a
GradScaler, i.e. the usual mixed-precision recipe (and the guide's): autocast runs Linear layers in
real fp16 on CPU, backward works, and AdamW keeps its state in fp32. ``model.half()`` would also run
fp16 on CPU, but pure-fp16 AdamW breaks on its own (eps=1e-8 rounds to 0 in fp16, so a parameter with
a zero gradient -- an embedding row absent from the batch -- gets 0/0 = nan), which would muddle a
demo about activation overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyT5Config", "TinyT5ForDemo", "TinyT5Output", "build_demo", "train_steps"]

FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyT5Config:
    """Sizes of the demo model; the defaults run 5 training steps in about a second on 2 CPU cores."""

    vocab_size: int = 128
    d_model: int = 64
    d_kv: int = 16
    d_ff: int = 256
    num_heads: int = 4
    num_layers: int = 4
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    outlier_block: int = 2
    """Index of the block whose feed-forward gets the outlier units."""
    num_outlier_units: int = 8
    """How many d_ff hidden units of that block are outliers."""
    outlier_peak: float = 0.92 * FP16_MAX
    """Peak |output| of that block's feed-forward on the first batch, without dropout (calibrated)."""


class TinyT5LayerNorm(nn.Module):
    """T5's RMS norm: no mean subtraction, no bias, variance computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class TinyT5DenseGatedGeluDense(nn.Module):
    """T5 v1.1's feed-forward: ``wo(dropout(gelu(wi_0(x)) * wi_1(x)))``."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_gelu = F.gelu(self.wi_0(hidden_states), approximate="tanh")
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = self.dropout(hidden_gelu * hidden_linear)
        return self.wo(hidden_states)


class TinyT5LayerFF(nn.Module):
    """Pre-norm feed-forward sublayer with a residual add, as in T5."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.DenseReluDense = TinyT5DenseGatedGeluDense(config)
        self.layer_norm = TinyT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        forwarded_states = self.DenseReluDense(self.layer_norm(hidden_states))
        return hidden_states + self.dropout(forwarded_states)


class TinyT5Attention(nn.Module):
    """T5 self-attention without relative position bias (the demo task is per token)."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.d_kv = config.d_kv
        inner_dim = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, inner_dim, bias=False)
        self.o = nn.Linear(inner_dim, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden_states.shape

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, length, self.num_heads, self.d_kv).transpose(1, 2)

        query, key, value = split(self.q(hidden_states)), split(self.k(hidden_states)), split(self.v(hidden_states))
        # T5 does not scale the scores by 1/sqrt(d_kv) (it is folded into q's init) and takes the
        # softmax in fp32.
        scores = torch.matmul(query, key.transpose(-1, -2))
        weights = self.dropout(F.softmax(scores.float(), dim=-1).type_as(scores))
        context = torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, -1)
        return self.o(context)


class TinyT5LayerSelfAttention(nn.Module):
    """Pre-norm self-attention sublayer with a residual add, as in T5."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.SelfAttention = TinyT5Attention(config)
        self.layer_norm = TinyT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attention_output = self.SelfAttention(self.layer_norm(hidden_states))
        return hidden_states + self.dropout(attention_output)


class TinyT5Block(nn.Module):
    """``layer.0`` self-attention then ``layer.1`` feed-forward."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList([TinyT5LayerSelfAttention(config), TinyT5LayerFF(config)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class TinyT5Stack(nn.Module):
    """The encoder: dropout on the embeddings, ``block.{i}``, then ``final_layer_norm``."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.block = nn.ModuleList([TinyT5Block(config) for _ in range(config.num_layers)])
        self.final_layer_norm = TinyT5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(inputs_embeds)
        for block in self.block:
            hidden_states = block(hidden_states)
        return self.dropout(self.final_layer_norm(hidden_states))


@dataclass
class TinyT5Output:
    """What :class:`TinyT5ForDemo` returns (``loss`` is None without labels)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyT5ForDemo(nn.Module):
    """Embedding (``shared``), encoder, LM head and a token-level cross-entropy loss."""

    def __init__(self, config: TinyT5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = TinyT5Stack(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # T5's initialisation (transformers' T5PreTrainedModel._init_weights with factor 1.0).
        c = self.config
        nn.init.normal_(self.shared.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=c.d_model**-0.5)
        for block in self.encoder.block:
            attention = block.layer[0].SelfAttention
            nn.init.normal_(attention.q.weight, std=(c.d_model * c.d_kv) ** -0.5)
            nn.init.normal_(attention.k.weight, std=c.d_model**-0.5)
            nn.init.normal_(attention.v.weight, std=c.d_model**-0.5)
            nn.init.normal_(attention.o.weight, std=(c.num_heads * c.d_kv) ** -0.5)
            ff = block.layer[1].DenseReluDense
            nn.init.normal_(ff.wi_0.weight, std=c.d_model**-0.5)
            nn.init.normal_(ff.wi_1.weight, std=c.d_model**-0.5)
            nn.init.normal_(ff.wo.weight, std=c.d_ff**-0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TinyT5Output:
        logits = self.lm_head(self.encoder(self.shared(input_ids)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))
        return TinyT5Output(loss=loss, logits=logits)
