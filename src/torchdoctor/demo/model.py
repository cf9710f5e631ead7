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
hidden units (large ``wi_0``/``wi_1``/``wo`` weights reading a massive embedding channel), which
mimics a checkpoint pretrained in bf16 whose activations grew past fp16's range (the reason mt5/T5
checkpoints overflow in fp16). Their size is calibrated at build time so that, on the first batch,
the feed-forward output peaks just under fp16's 65504 -- finite, as in the guide's 6.27e4 -- and
the following Dropout's 1/(1-p) rescale takes it past 65504 to inf. In fp32 (or bf16) the same
values are unremarkable.

fp16 here means ``torch.autocast("cpu", dtype=torch.float16)`` with fp32 master weights and a
GradScaler, i.e. the usual mixed-precision recipe (and the guide's): autocast runs Linear layers in
real fp16 on CPU, backward works, and AdamW keeps its state in fp32. ``model.half()`` would also run
fp16 on CPU, but pure-fp16 AdamW breaks on its own (eps=1e-8 rounds to 0 in fp16, so a parameter with
a zero gradient -- an embedding row absent from the batch -- gets 0/0 = nan), which would muddle a
demo about activation overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyT5Config", "TinyT5ForDemo", "TinyT5Output", "build_demo", "train_steps"]

FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyT5Config:
    """Sizes of the demo model; the defaults build and run 5 fp16 steps in well under a second on 2 cores."""

    vocab_size: int = 128
    d_model: int = 64
    d_kv: int = 16
    d_ff: int = 256
    num_heads: int = 4
    num_layers: int = 4
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    massive_value: float = 100.0
    """Value of embedding channel 0 for every token: the "massive activation" the outliers read."""
    outlier_block: int = 2
    """Index of the block whose feed-forward gets the outlier units."""
    num_outlier_units: int = 16
    """How many d_ff hidden units of that block are outliers."""
    outlier_peak: float = 6.27e4
    """Peak |output| of that feed-forward on the first batch in training mode (the guide's value)."""


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

        query, key, value = (
            split(self.q(hidden_states)),
            split(self.k(hidden_states)),
            split(self.v(hidden_states)),
        )
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


Batch = tuple[torch.Tensor, torch.Tensor]
"""(input_ids, labels), both int64 of shape (batch, length)."""


@torch.no_grad()
def _ffn_peak(model: TinyT5ForDemo, input_ids: torch.Tensor) -> float:
    """Peak |output| of the outlier block's feed-forward in eval mode (no dropout), in fp32.

    Calls the submodules directly rather than hooking them, so building the demo leaves no
    hooks behind.
    """
    block_index = model.config.outlier_block
    was_training = model.training
    model.eval()
    try:
        hidden = model.shared(input_ids)
        for block in model.encoder.block[:block_index]:
            hidden = block(hidden)
        layer = model.encoder.block[block_index].layer
        hidden = layer[0](hidden)
        output = layer[1].DenseReluDense(layer[1].layer_norm(hidden))
    finally:
        model.train(was_training)
    return float(output.abs().max())


@torch.no_grad()
def _add_outliers(model: TinyT5ForDemo, first_input_ids: torch.Tensor) -> None:
    """Give the model the massive channel and the outlier units, sized to ``outlier_peak``.

    Embedding channel 0 holds ``massive_value`` for every token, so after block 2's RMS norm it
    is about sqrt(d_model) for every token. The first ``num_outlier_units`` hidden units of that
    block's feed-forward read it through large ``wi_0``/``wi_1`` weights (gelu(16) * 64 = 1024
    each) and ``wo`` sums them into output channel 0, the same for every token: a guide-like
    outlier (the guide's mt5 has |wi_1| up to 26.6 and |wo| up to 6.44).

    The ``wo`` weights are then calibrated so that, with every outlier unit kept by the inner
    dropout, the output peaks at ``outlier_peak``: the eval-mode peak times 1/(1-p). With 16
    units about (1-p)^16 = 19% of tokens keep all of them, so the training-mode peak is that value
    on every draw of the dropout masks, and it does not depend on how a given
    torch version draws them (measured: within 1% over 40 draws).
    """
    c = model.config
    num = c.num_outlier_units
    ff = model.encoder.block[c.outlier_block].layer[1].DenseReluDense
    model.shared.weight[:, 0] = c.massive_value
    ff.wi_0.weight[:num, 0] = 2.0
    ff.wi_1.weight[:num, 0] = 8.0
    ff.wo.weight[0, :num] = 1.0
    target = c.outlier_peak * (1.0 - c.dropout_rate)
    # The peak is almost linear in the outlier wo weights (the other units add O(1)); a few
    # fixed-point steps land within 1e-4.
    for _ in range(3):
        ff.wo.weight[0, :num] *= target / _ffn_peak(model, first_input_ids)


def build_demo(
    seed: int = 0,
    *,
    config: TinyT5Config | None = None,
    num_batches: int = 8,
    batch_size: int = 8,
    length: int = 32,
) -> tuple[TinyT5ForDemo, list[Batch]]:
    """Build the demo model and its training batches, deterministically from ``seed``.

    The task maps every token through a fixed random permutation of the vocabulary, so a working
    run's loss goes down (slowly: the massive channel dominates every RMS norm, as it would in the
    checkpoint it mimics). Global RNG state is left untouched.

    Args:
        seed (int): seeds the weights, the batches and the permutation. Defaults to 0.
        config (TinyT5Config, optional): model sizes. Defaults to ``TinyT5Config()``.
        num_batches (int): batches returned; ``train_steps`` cycles through them. Defaults to 8.
        batch_size (int): sequences per batch. Defaults to 8.
        length (int): tokens per sequence. Defaults to 32.

    Returns:
        tuple[TinyT5ForDemo, list[Batch]]: the model (in training mode, fp32) and the batches.
    """
    config = config or TinyT5Config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyT5ForDemo(config)
    generator = torch.Generator().manual_seed(seed + 1)
    permutation = torch.randperm(config.vocab_size, generator=generator)
    batches = []
    for _ in range(num_batches):
        input_ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)
        batches.append((input_ids, permutation[input_ids]))
    _add_outliers(model, batches[0][0])
    model.train()
    return model, batches


_PRECISIONS = ("fp32", "fp16", "bf16")


def train_steps(
    model: TinyT5ForDemo,
    batches: list[Batch],
    steps: int,
    precision: str = "fp16",
    *,
    lr: float = 1e-2,
    optimizer: torch.optim.Optimizer | None = None,
    seed: int = 0,
    num_threads: int | None = 1,
) -> list[float]:
    """Run a plain training loop and return the loss of every step (nan/inf included).

    ``"fp16"`` is CPU autocast to float16 with fp32 master weights and a GradScaler: Linear
    layers and matmuls really compute in fp16, as in the guide's mixed-precision run, and a step
    whose gradients are not finite is skipped by the scaler (so the model is not destroyed and the
    loss stays nan for as long as the forward overflows). ``"bf16"`` is autocast to bfloat16
    (fp32's range, no scaler); ``"fp32"`` is plain fp32.

    Args:
        model (TinyT5ForDemo): the model from :func:`build_demo`; trained in place.
        batches (list[Batch]): (input_ids, labels) pairs, used in order and cycled.
        steps (int): number of optimizer steps.
        precision (str): ``"fp16"``, ``"bf16"`` or ``"fp32"``. Defaults to ``"fp16"``.
        lr (float): AdamW learning rate when ``optimizer`` is None. Defaults to 1e-2.
        optimizer (torch.optim.Optimizer, optional): an optimizer over ``model``'s parameters, e.g.
            to keep its state across calls or to hook its steps. Defaults to a new AdamW.
        seed (int): seeds the dropout masks (global RNG state is restored afterwards). Defaults to 0.
        num_threads (int, optional): torch intra-op threads while training, restored afterwards.
            The model is too small to gain from more than one, and on a busy machine OpenMP's
            barriers made 5 steps 10-30x slower with 2 threads than with 1 (measured on 2 cores).
            None leaves torch's setting alone. Defaults to 1.

    Returns:
        list[float]: one loss per step.

    Raises:
        ValueError: unknown ``precision``, or no batches.
    """
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(_PRECISIONS)}; got {precision!r}")
    if not batches:
        raise ValueError("train_steps needs at least one batch")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    model.train()
    losses: list[float] = []
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for step in range(steps):
                input_ids, labels = batches[step % len(batches)]
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = model(input_ids, labels=labels).loss
                assert loss is not None
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads_before)
    return losses


def precision_case(seed: int = 0) -> tuple[TinyT5ForDemo, dict[str, torch.Tensor]]:
    """The demo's model and its first batch, for ``torchdoctor precision torchdoctor.demo.model:precision_case``
    (a factory: ``(model, batch)``, the batch the forward's keyword arguments)."""
    model, batches = build_demo(seed)
    input_ids, labels = batches[0]
    return model, {"input_ids": input_ids, "labels": labels}
