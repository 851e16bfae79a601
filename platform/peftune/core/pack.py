"""Packed execution: K trials of one method trained in lockstep over ONE frozen backbone.

A pack runs K ``TrainConfig`` of one method (its *members*) in one process: each step concatenates the members'
copies of the batch (K * B rows), so every frozen matmul, attention and LayerNorm runs once for all of them, while
what a member trains runs per member on its own rows. Each member IS its solo run's state (a ``train.Trial``),
built and driven by the solo run's own pieces, with its own dropout generator: it reports and checkpoints what its
solo run would, to the bit at the tested sizes (tests/test_pack.py) and within rounding where a shared kernel
computes a row differently for more rows. A member may stop mid-pack; the others are unchanged by it.

What packs: ``lora`` (the LoRA paper's init), ``bitfit`` and ``adapter``; :func:`check_packable` refuses anything
else, naming the field, and :func:`pack_key` is what a pack's members share. Here: :class:`Pack` (build, step,
stop a member, epochs), its packed forward (mirroring ``BertModel.forward`` and ``MultitaskModel.forward`` op for
op) and :func:`run_pack`; ``peftune.sweep.packing`` runs packs in a sweep. The design and its limits: docs/design.md,
"Packed trials"; the measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peftune import methods
from peftune.base.errors import UserError
from peftune.core.model import MultitaskModel
from peftune.core.train import (
    PreparedData,
    TrainConfig,
    TrainingDiverged,
    Trial,
    autocast_for,
    epoch_plan,
    epoch_seed,
    resolve_precision,
    select_device,
    to_device,
)
from peftune.inputs.backbone import cast_frozen, stacked_qkv
from peftune.inputs.dropout import attention, drawing_from, dropout, member_dropout
from peftune.methods.adapter import TaskAdapters
from peftune.methods.lora import LoraLinear, fused_qkv

PACKABLE = ("lora", "bitfit", "adapter")
# what every member must share: the batches (tasks, sampling, seed, epochs -> the same `epoch_plan`), and what a
# step computes them in; everything else (lr, head_lr, dropout, weight decay, warmup, clip, sizes) is per member
SHARED_FIELDS = ("method", "tasks", "batch_size", "sampling", "temperature", "epochs", "seed", "pooling", "device",
                 "precision", "eval_splits", "report_fractions")  # fmt: skip
# method options that shape what the members share: where the adapters sit, what LoRA adapts
SHARED_OPTIONS = {"lora": ("targets", "init"), "adapter": ("layers",), "bitfit": ()}


def packs(method: str, options: dict) -> bool:
    """Whether a configuration of ``method`` with these method ``options`` can be a pack's member at all (its
    method packs, and it is not a PiSSA/OLoRA LoRA)."""
    return method in PACKABLE and (method != "lora" or options.get("init", "lora") == "lora")


def pack_key(config: TrainConfig) -> tuple:
    """What members of one pack must share (``check_packable``): configs with equal keys pack together."""
    options = methods.make_method_config(config.method, config.method_options_with_dropout())
    shared = tuple(repr(getattr(config, name)) for name in SHARED_FIELDS)
    return (*shared, *(repr(getattr(options, name)) for name in SHARED_OPTIONS[config.method]), config.dropout > 0)


def check_packable(configs: list[TrainConfig]) -> None:
    """Refuse (one line, naming the field) configs that cannot train as one pack; each then runs alone."""
    if not configs:
        raise UserError("a pack needs at least one member")
    first = configs[0]
    if first.method not in PACKABLE:
        raise UserError(f"method {first.method!r} does not pack (packable: {', '.join(PACKABLE)}); it runs alone")
    if not packs(first.method, first.method_options):
        raise UserError("LoRA init pissa/olora rewrites the frozen weights a pack shares: such a member runs alone")
    if first.method == "lora" and len({config.dropout > 0 for config in configs}) > 1:
        # at dropout 0 the solo run feeds x itself to A (F.dropout returns it): autograd then sums x's three gradient
        # contributions (residual, frozen projection, LoRA path) in another order than behind a dropout node
        raise UserError("LoRA members at dropout 0 and above 0 sum their gradients in other orders: they pack apart")
    for index, config in enumerate(configs[1:], start=1):
        for name in SHARED_FIELDS:
            if getattr(config, name) != getattr(first, name):
                raise UserError(
                    f"member {index} differs from member 0 in {name} ({getattr(config, name)!r} vs "
                    f"{getattr(first, name)!r}): it cannot share the pack's batches; it runs alone"
                )
        ours = methods.make_method_config(first.method, first.method_options_with_dropout())
        theirs = methods.make_method_config(config.method, config.method_options_with_dropout())
        for name in SHARED_OPTIONS[first.method]:
            if getattr(theirs, name) != getattr(ours, name):
                raise UserError(
                    f"member {index} differs from member 0 in method option {name} ({getattr(theirs, name)!r} vs "
                    f"{getattr(ours, name)!r}): the pack shares it; it runs alone"
                )


@dataclass
class Member:
    """One member: its solo run's state (``train.Trial``: model, optimizer, schedule, guard, history, counters,
    reports and checkpoints) and its dropout stream, the global RNG of its solo run."""

    index: int
    trial: Trial
    generator: torch.Generator
    stopped: str | None = None  # why it stopped before its last epoch (a scheduler's stop, a divergence)
    divergence: str | None = None  # its divergence guard's reason, where that stopped it

    @property
    def config(self) -> TrainConfig:
        return self.trial.config

    @property
    def model(self) -> MultitaskModel:
        return self.trial.model

    @property
    def trainable(self) -> list[torch.Tensor]:
        return self.trial.trainable

    @property
    def history(self) -> list[dict]:
        return self.trial.history


class Pack:
    """K members trained in lockstep; ``step`` trains the active ones on one batch, ``stop`` drops one.

    ``reports``: each member's report function (``train.ReportFn``, as ``run_trial`` takes; None: none), called with
    its solo run's metrics and checkpoint at its rungs and epoch ends. ``decide(pack)``: called after every step and
    every epoch's end, to stop the members a scheduler stopped on what they reported (``Pack.stop``) before the pack
    trains on."""

    def __init__(self, configs: list[TrainConfig], prepared: PreparedData, reports: list | None = None,
                 decide: Callable[[Pack], None] | None = None, shared_draws: bool | None = None):  # fmt: skip
        """``shared_draws``: draw the members' dropout bits with ``member_dropout`` (each mask's bits once for the
        members whose streams agree; the CPU's cheap mask only), rather than each member's draws apart, on its own
        rows, by its solo run's very calls (``drawing_from``: any device). None: shared on the CPU, apart elsewhere.
        Both give each member its solo run's masks."""
        check_packable(configs)
        missing = [t for t in configs[0].tasks if t not in prepared.tasks]
        if missing:
            raise UserError(f"tasks {missing} were not prepared; prepared: {sorted(prepared.tasks)}")
        self.config, self.prepared, self.decide = configs[0], prepared, decide
        self.device = select_device(self.config.device)
        self.shared_draws = self.device.type == "cpu" if shared_draws is None else shared_draws
        if self.shared_draws and self.device.type != "cpu":
            raise UserError(f"device {self.device}: shared draws are the CPU's cheap mask; draw apart there")
        self.precision = resolve_precision(self.device, self.config.precision)
        self.tasks = {t: prepared.tasks[t] for t in self.config.tasks}
        # the frozen ops' weights, shared: its parameters ARE the pretrained tensors, as every member's frozen ones
        self.frozen = prepared.backbone.build(self.device, copy=False).requires_grad_(False)
        if self.precision == "bf16":  # cast once for the pack (each solo run casts its own)
            cast_frozen(self.frozen, torch.bfloat16)
        reports = reports or [None] * len(configs)
        self.members = [
            # each built as its solo run builds its model, draw for draw, over the pack's frozen tensors
            Member(i, Trial(config, prepared, report, shared=self.frozen), torch.Generator(self.device))
            for i, (config, report) in enumerate(zip(configs, reports, strict=True))
        ]
        self.active = list(self.members)  # the members still training, in the order of their rows

    # ------------------------------------------------------------------------- stepping

    def stop(self, member: Member | int, reason: str = "stopped") -> None:
        """Stop a member (a scheduler's decision, a divergence): the others go on, unchanged by it."""
        member = self.members[member] if isinstance(member, int) else member
        if member in self.active:
            self.active.remove(member)
            member.stopped = reason

    def begin_epoch(self, epoch: int) -> list:
        """Seed each active member's dropout stream as its solo run seeds the global RNG and start its epoch, on the
        pack's clock (the pack's training time: every member's steps run in it, no member's evaluations); the
        epoch's batches."""
        plan = epoch_plan(self.config, self.tasks, self.prepared.pad_token_id, epoch)
        started, evaluated_before = time.perf_counter(), self._evaluated()

        def clock() -> float:
            return time.perf_counter() - started - (self._evaluated() - evaluated_before)

        for member in self.active:
            member.generator.manual_seed(epoch_seed(member.config, epoch))
            member.trial.begin_epoch(epoch, len(plan), clock)
        return plan

    def _evaluated(self) -> float:
        return sum(member.trial.eval_time for member in self.members)

    def step(self, batch) -> list[torch.Tensor]:
        """One optimizer step of every active member on ``batch``; their losses, detached, in ``self.active`` order."""
        members = self.active
        batch = to_device(batch, self.device)
        with autocast_for(self.device, self.precision):
            outputs = self.forward(batch.task, batch.input_ids, batch.attention_mask, batch.token_type_ids)
        losses = [
            m.model.tasks[batch.task].loss(out.float(), batch.labels) for m, out in zip(members, outputs, strict=True)
        ]
        for member in members:
            member.trial.optimizer.zero_grad(set_to_none=True)
        # d(sum)/d(loss_k) = 1: each member's gradient is exactly its own loss's, as in its solo run
        torch.stack(losses).sum().backward()
        for member in members:
            member.trial.update()  # its own clip, AdamW step and schedule
        return [loss.detach() for loss in losses]

    # ------------------------------------------------------------------------- the packed forward

    def forward(self, task: str, input_ids, attention_mask, token_type_ids) -> list[torch.Tensor]:
        """(B, T) token tensors of one task -> each active member's (B, num_outputs) head outputs.

        Mirrors ``BertModel.forward`` and ``MultitaskModel.forward`` op for op (the same ops in the same order
        on each member's rows), on K * B rows: member k's rows are k*B .. (k+1)*B - 1 throughout."""
        members = self.active
        K = len(members)
        embeddings = self.frozen.embeddings
        x = embeddings.embed(input_ids, token_type_ids)  # (B, T, E): the same for every member
        norms = [m.model.backbone.embeddings.LayerNorm for m in members]
        if _frozen(norms):
            x = norms[0](x).repeat(K, 1, 1)  # (K*B, T, E): every member's copy
        else:  # each member's own LayerNorm (BitFit's bias, adapters' trained LayerNorms) on the same rows
            x = torch.cat([F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps) for n in norms])
        x = self._dropout(x, [embeddings.dropout.p] * K)
        if self.frozen.embeddings_project is not None:  # ELECTRA's E -> H, each member's (BitFit trains its bias)
            x = self._linear([m.model.backbone.embeddings_project for m in members], x)  # (K*B, T, H)
        # (K*B, 1, 1, T): as BertModel.forward, a finite large negative where attending is not allowed
        bias = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        bias = bias.repeat(K, 1, 1, 1)
        for i, layer in enumerate(self.frozen.encoder.layer):
            x = self._layer(task, layer, [m.model.backbone.encoder.layer[i] for m in members], x, bias)
        model = members[0].model
        if model.pooling == "cls" and self.frozen.pooler is None:  # no pooler: [CLS]'s hidden state (BertModel)
            pooled = x[:, 0]
        elif model.pooling == "cls":  # the [CLS] pooler (under mean pooling the solo run computes it unused: skipped)
            pooled = torch.tanh(self._linear([m.model.backbone.pooler.dense for m in members], x[:, 0]))
        with torch.autocast(x.device.type, enabled=False):  # pooling and heads in fp32, as MultitaskModel
            hidden = x.float()
            if model.pooling == "mean":
                weights = attention_mask.repeat(K, 1).unsqueeze(-1).to(hidden.dtype)  # (K*B, T, 1)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (K*B, H)
            else:
                pooled = pooled.float()
            outputs = []
            for member, rows in zip(members, _rows(pooled, K), strict=True):
                drop, linear = member.model.heads[task]  # Sequential(Dropout, Linear)
                outputs.append(linear(self._own_dropout(member, rows, drop.p)))  # (B, n)
        return outputs

    def _layer(self, task: str, frozen, mine: list[nn.Module], x, bias):
        """One encoder layer (BertLayer.forward) on K*B rows; ``mine``: each member's own layer (its parameters)."""
        K = len(mine)
        KB, T, H = x.shape
        attn = frozen.attention.self
        q, k, v = (
            t.view(KB, T, attn.num_heads, attn.head_dim).transpose(1, 2)  # (K*B, nh, T, hd)
            for t in self._qkv(attn, [layer.attention.self for layer in mine], x)
        )
        y = self._attention(q, k, v, bias, attn.dropout_p)
        y = y.transpose(1, 2).reshape(KB, T, -1)  # (K*B, T, H)
        outs = [layer.attention.output for layer in mine]
        h = self._dropout(self._linear([o.dense for o in outs], y), [frozen.attention.output.dropout.p] * K)
        x = self._layer_norm([o.LayerNorm for o in outs], self._adapter(task, [o.adapter for o in outs], h) + x)
        h = frozen.intermediate.act(self._linear([layer.intermediate.dense for layer in mine], x))  # (K*B, T, I)
        outs = [layer.output for layer in mine]
        h = self._dropout(self._linear([o.dense for o in outs], h), [frozen.output.dropout.p] * K)
        return self._layer_norm([o.LayerNorm for o in outs], self._adapter(task, [o.adapter for o in outs], h) + x)

    def _dropout(self, x, ps: list[float]):
        """Training dropout of each active member's rows of ``x`` (K*B, ...), with its ``ps[k]``, from its stream."""
        if self.shared_draws:
            return member_dropout(x, ps, [m.generator for m in self.active])
        rows = _rows(x, len(ps))
        return torch.cat([self._own_dropout(m, r, p) for m, r, p in zip(self.active, rows, ps, strict=True)])

    def _own_dropout(self, member: Member, rows, p: float):
        """Training dropout of one member's rows, drawn from its stream as its solo run draws it."""
        if self.shared_draws:
            return dropout(rows, p, True, generator=member.generator)
        with drawing_from(member.generator):
            return dropout(rows, p, True)

    def _attention(self, q, k, v, bias, p: float):
        """Attention with dropout on K*B rows (q, k, v: (K*B, nh, T, hd); bias: (K*B, 1, 1, T)). Shared draws: one
        attention over every row, each member's probabilities dropped from its stream. Apart: each member's own
        attention on its rows, its solo run's call, drawing from its stream (CUDA's fused kernel draws inside)."""
        members = self.active
        if self.shared_draws:
            generators = [m.generator for m in members]
            return attention(
                q, k, v, bias, p, True, drop=lambda probs: member_dropout(probs, [p] * len(members), generators)
            )
        out = []
        for member, *parts in zip(members, *(_rows(t, len(members)) for t in (q, k, v, bias)), strict=True):
            with drawing_from(member.generator):
                out.append(attention(*parts, p, True))
        return torch.cat(out)

    def _qkv(self, frozen, mine: list[nn.Module], x):
        """q, k, v (each (K*B, T, H)) as each member's BertSelfAttention computes them."""
        if mine[0].qkv_projection is fused_qkv:  # LoRA on all three
            return self._lora_qkv(mine, x)
        if all(isinstance(getattr(mine[0], n), nn.Linear) for n in ("query", "key", "value")):
            weight, bias = stacked_qkv((frozen.query, frozen.key, frozen.value), x)  # (3H, H), (3H,)
            if not any(m.query.bias.requires_grad for m in mine):
                out = F.linear(x, weight, bias)
            else:  # BitFit: each member's stacked biases
                biases = torch.stack([stacked_qkv((m.query, m.key, m.value))[1] for m in mine])  # (K, 3H)
                out = _linear_with_member_bias(x, weight, biases)
            return out.split(frozen.query.out_features, dim=-1)
        return tuple(self._linear([getattr(m, n) for m in mine], x) for n in ("query", "key", "value"))

    def _linear(self, linears: list[nn.Module], x):
        """Each member's version of one linear (frozen, with its own bias, or LoRA-adapted) on its rows."""
        if isinstance(linears[0], LoraLinear):
            return self._lora_linear(linears, x)
        if not linears[0].bias.requires_grad:  # frozen: one matmul for every member
            return linears[0](x)
        lowp = linears[0].lowp  # the frozen weight cast once, as autocast would cast it
        weight = lowp.weight if lowp is not None and lowp.applies(x) else linears[0].weight
        return _linear_with_member_bias(x, weight, torch.stack([m.bias for m in linears]))

    def _lora_qkv(self, attentions: list[nn.Module], x):
        """``lora.fused_qkv`` for K members: the frozen q/k/v matmul once over all rows; one dropout of x per member;
        then each member's [A_q; A_k; A_v] and scaled block-diagonal B on its own rows (see ``_rows``)."""
        members = [(a.query, a.key, a.value) for a in attentions]
        base_weight, base_bias = stacked_qkv([m.base_layer for m in members[0]], x)  # (3H, H), (3H,): shared
        h = self._dropout(x, [lin[0].dropout for lin in members])
        base = F.linear(x, base_weight, base_bias)  # (K*B, T, 3H)
        lora = []
        for lin, rows in zip(members, _rows(h, len(members)), strict=True):
            a_weight = torch.cat([m.lora_A["default"].weight for m in lin])  # (3r, H)
            b_weight = torch.block_diag(*(m.lora_B["default"].weight * m.scaling for m in lin))  # (3H, 3r)
            lora.append(F.linear(F.linear(rows, a_weight), b_weight))  # (B, T, 3H)
        return (base + torch.cat(lora)).split(x.shape[-1], dim=-1)

    def _lora_linear(self, linears: list[LoraLinear], x):
        """``LoraLinear.forward`` for K members: the frozen base once, each member's B A dropout(x) on its rows."""
        h = self._dropout(x, [m.dropout for m in linears])
        base = linears[0].base_layer(x)
        lora = [
            m.lora_B["default"](m.lora_A["default"](rows)) * m.scaling
            for m, rows in zip(linears, _rows(h, len(linears)), strict=True)
        ]
        return base + torch.cat(lora)

    def _adapter(self, task: str, hooks: list[nn.Module], x):
        """The adapter hook (Identity, or each member's Houlsby adapter for ``task``) on its own rows."""
        if not isinstance(hooks[0], TaskAdapters):
            return x
        out = []
        for hook, member, rows in zip(hooks, self.active, _rows(x, len(hooks)), strict=True):
            adapter = hook.per_task[task]
            h = self._own_dropout(member, adapter.act(adapter.down(rows)), adapter.dropout.p)
            out.append(rows + adapter.up(h))  # (B, T, H): HoulsbyAdapter.forward
        return torch.cat(out)

    def _layer_norm(self, norms: list[nn.LayerNorm], x):
        """One LayerNorm: once over all rows where frozen, else once per member with its gain and bias."""
        if _frozen(norms):
            return norms[0](x)
        rows = x.split(x.shape[0] // len(norms))
        return torch.cat(
            [F.layer_norm(r, n.normalized_shape, n.weight, n.bias, n.eps) for n, r in zip(norms, rows, strict=True)]
        )

    # ------------------------------------------------------------------------- epochs

    def train_epoch(self, epoch: int) -> None:
        """One epoch of every active member: its steps, each member's bookkeeping after each (its rung reports, its
        divergence guard: a diverged member stops, the others go on), then each member's epoch end (evaluation,
        history, report and checkpoint), all by its solo run's code."""
        plan = self.begin_epoch(epoch)
        for step, batch in enumerate(plan):
            if not self.active:
                break
            for member, loss in zip(list(self.active), self.step(batch), strict=True):
                try:
                    member.trial.after_step(step, batch, loss)
                except TrainingDiverged as error:
                    self.stop(member, f"diverged: {error}")
                    member.divergence = str(error)
            if self.decide is not None:
                self.decide(self)
        for member in list(self.active):
            member.trial.finish_epoch()
        if self.decide is not None:
            self.decide(self)


def run_pack(configs: list[TrainConfig], prepared: PreparedData, reports: list | None = None,
             decide: Callable[[Pack], None] | None = None) -> Pack:  # fmt: skip
    """Train ``configs`` as one pack (see :class:`Pack`); the pack, each member's history, model and why it stopped
    early in ``pack.members``."""
    pack = Pack(configs, prepared, reports, decide)
    for epoch in range(pack.config.epochs):
        if not pack.active:
            break
        pack.train_epoch(epoch)
    return pack


def _rows(x, members: int) -> tuple[torch.Tensor, ...]:
    """Each member's rows of ``x`` (K*B, ...): contiguous (B, ...) views, one split node for autograd.

    A member's own matmuls (LoRA's A and B, an adapter's projections, its head) run on its rows one member at a time,
    as ``F.linear`` on the solo run's shapes: the solo run's very op, so the same sums to the bit. Batched as one bmm
    (ranks and bottlenecks zero-padded to the largest, or grouped by size) they were not: MKL picks another kernel
    for another width or batch, and some gradients summed in another order, so a member's loss drifted from its
    solo run's within a few steps (docs/benchmarks.md, "Exactness on a CPU at MiniLM's shapes").
    On the CPU the loop costs a few microseconds a call, against the frozen matmuls' milliseconds."""
    return x.split(x.shape[0] // members)


def _frozen(modules: list[nn.Module]) -> bool:
    """No member trains these modules' parameters: they are the pack's shared frozen ones."""
    return not any(p.requires_grad for module in modules for p in module.parameters())


def _linear_with_member_bias(x, weight, biases):
    """``F.linear(x_k, weight, biases[k])`` for each member's rows x_k of ``x`` (K*B, ..., in), as one ``baddbmm``:
    per member it is the ``addmm`` the solo run computes (the bias in the matmul's accumulator, bit for bit)."""
    K = biases.shape[0]
    rows = x.reshape(K, -1, x.shape[-1])  # (K, B*T, in)
    out = torch.baddbmm(biases.unsqueeze(1), rows, weight.t().expand(K, -1, -1))  # (K, B*T, out)
    return out.view(*x.shape[:-1], -1)
