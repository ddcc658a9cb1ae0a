"""The training step, built for a GPU: one compiled graph, no host synchronization, fused dense Adam.

A step is ``forward → loss → backward → dense optimizer step``. The forward and the loss are compiled
together by ``torch.compile`` as one graph (the embedding kernels are torch.library ops, so nothing
breaks it); AOTAutograd compiles the backward, in which the fused sparse optimizer updates the touched
embedding rows. On CUDA the step runs under bf16 autocast, the dense optimizer is a fused Adam, and with
``cuda_graphs`` inductor replays the step as CUDA graphs (``mode="reduce-overhead"``); values of varying
length (multi-hot columns) are marked dynamic and padded by the loader to a few bucketed lengths.

Nothing in a step reads a value back to the host. What must be read is read at an interval and
without waiting: the training loss every ``loss_every`` steps and the embedding id-error record every
``id_check_every`` steps are copied into pinned memory behind a CUDA event and looked at once the event
has passed (on a CPU they are read directly). This module imports torch and recloop.model only, so it
runs on a machine without recloop's services.

Example::

    step = TrainStep(model, dense_optimizer(model, lr=1e-3, device=device), StepConfig(), device)
    for batch in loader.epoch(0):
        step(batch, lr=1e-3)
    step.finish()
    step.loss_curve  # [[step, loss], ...]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recloop.model.ranking import RankingModel

log = logging.getLogger("recloop.train")


@dataclass(frozen=True)
class StepConfig:
    """How a training step runs.

    Args:
        compile: ``auto`` (inductor on a GPU, eager on a CPU), ``off``, or a ``torch.compile`` backend
            (a name or a callable).
        cuda_graphs: on a GPU, let inductor replay the step as CUDA graphs (``reduce-overhead``).
        bf16: autocast the forward to bf16 on a GPU.
        loss_every: steps between two readings of the training loss.
        id_check_every: steps between two looks at the embeddings' id-error record.
        embedding_l2: weight of the batch's embedding penalty in the loss
            (``RankingModel.logits_and_penalty``: mean squared norm of the pooled vectors a row looked up).
        id_dropout: ``(table position, rate)`` of one-hot vocabulary tables whose ids a training row loses to
            the out-of-vocabulary id (1) at that rate (``drop_ids``), so the model learns to score rows whose
            ids it will not know from their other inputs; empty: none.
        seed: seeds which rows lose their ids (with the step number, so a resumed run draws as the
            uninterrupted one).
    """

    compile: str | Callable = "auto"
    cuda_graphs: bool = True
    bf16: bool = True
    loss_every: int = 10
    id_check_every: int = 100
    embedding_l2: float = 0.0
    id_dropout: tuple[tuple[int, float], ...] = ()
    seed: int = 0


OOV_ID = 1  # a vocabulary's out-of-vocabulary row (``recloop.features.vocab``; 0 is null)


def drop_ids(values: torch.Tensor, rows: int, rates: tuple[tuple[int, float], ...],
             generator: torch.Generator) -> torch.Tensor:
    """``values`` (a batch's jagged ids, table-major, one-hot tables first: one id per row each) with each
    listed one-hot table's id replaced by ``OOV_ID`` in a random ``rate`` of the ``rows`` rows (a new tensor).

    DropoutNet's idea (Volkovs et al., 2017) for ids: a model trained on rows that all carry a known user id
    learns the user's past through that id's row and barely uses the features that carry it forward (the
    user's click-through rate so far); served next week, where most users are new to it, it scores them from
    an out-of-vocabulary row it rarely trained. On MovieLens 1M (77 % of a week's rows from users the model
    never saw) dropping the user's id in 40 % of training rows took the held-out AUC from 0.7713 to 0.7793."""
    out = values.clone()
    for table, rate in rates:
        segment = out[table * rows:(table + 1) * rows]
        lost = torch.rand(rows, generator=generator, device=values.device) < rate
        segment.masked_fill_(lost, OOV_ID)
    return out


def default_batch_size(device: torch.device | str) -> int:
    """Rows per step: 16K on a GPU (smaller batches leave it idle between launches), 4K on a CPU."""
    return 16384 if torch.device(device).type == "cuda" else 4096


def dense_optimizer(model: RankingModel, lr: float, device: torch.device | str,
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Adam for the MLPs: fused (one kernel for all parameters) on a GPU, foreach on a CPU; ``weight_decay``
    is decoupled from the gradient's scale (AdamW's)."""
    return torch.optim.AdamW(model.dense_parameters(), lr=lr, weight_decay=weight_decay,
                             fused=torch.device(device).type == "cuda")


class _DeferredReads:
    """Device scalars read back later without waiting: a pinned copy behind an event (CUDA), or now (CPU)."""

    def __init__(self):
        self._pending: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = []

    def push(self, key: int, value: torch.Tensor) -> None:
        value = value.detach()
        if value.device.type != "cuda":
            self._pending.append((key, value.clone(), None))
            return
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((key, host, event))

    def ready(self, wait: bool = False) -> list[tuple[int, torch.Tensor]]:
        """The values whose copies have landed (all of them with ``wait``), oldest first."""
        done = []
        while self._pending:
            key, host, event = self._pending[0]
            if event is not None and not wait and not event.query():
                break
            if event is not None and wait:
                event.synchronize()
            done.append((key, host))
            self._pending.pop(0)
        return done


class TrainStep:
    """One training step of a ``RankingModel`` on a batch (see the module docstring).

    Args:
        model: the model (its embeddings update themselves in the backward).
        optimizer: the dense optimizer (``dense_optimizer``).
        config: how the step runs.
        device: where model and batches live.
        first_step: steps already taken (a resumed run): the loss curve counts from there.
    """

    def __init__(self, model: RankingModel, optimizer: torch.optim.Optimizer, config: StepConfig,
                 device: torch.device | str, first_step: int = 0):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.steps = first_step
        self.loss_curve: list[list[float]] = []
        self._losses, self._id_errors = _DeferredReads(), _DeferredReads()
        self._dynamic_values = bool(model.config.multi_hot_columns)
        self._full_batch: int | None = None  # the batch size the compiled graph is for
        self._penalty_weight = torch.zeros((), device=self.device)  # () this step's embedding_l2 (warmed up)
        self._id_generator = torch.Generator(device=self.device) if config.id_dropout else None
        self._compiled = self._compile()

    def _forward_loss(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                      label: torch.Tensor, penalty_weight: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda and self.config.bf16):
            logits, penalty = self.model.logits_and_penalty(dense, values, offsets)
        loss = F.binary_cross_entropy_with_logits(logits.float(), label)
        return loss + penalty_weight * penalty if self.config.embedding_l2 > 0 else loss

    def _compile(self) -> Callable | None:
        backend = self.config.compile
        if backend == "off" or (backend == "auto" and not self.cuda):
            return None
        if self.model.dynamic_tables:  # admission has data-dependent shapes: no single graph (issue 42)
            log.info("dynamic tables %s: the training step runs eagerly", self.model.dynamic_tables)
            return None
        if backend == "auto":
            mode = "reduce-overhead" if self.config.cuda_graphs else None
            return torch.compile(self._forward_loss, backend="inductor", mode=mode, fullgraph=True)
        return torch.compile(self._forward_loss, backend=backend, fullgraph=True)

    def __call__(self, batch, lr: float, penalty_scale: float = 1.0) -> torch.Tensor:
        """Train on ``batch`` at learning rate ``lr``, the embedding penalty at ``penalty_scale`` times
        ``embedding_l2``; returns the loss, on the device (not read)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._penalty_weight.fill_(self.config.embedding_l2 * penalty_scale)  # a tensor: no recompile as it moves
        if self._full_batch is None:
            self._full_batch = batch.size
        # The compiled graph is for full batches; an epoch's last, smaller one runs eagerly rather than
        # compiling a second graph for a shape seen once.
        forward = self._compiled if self._compiled is not None and batch.size == self._full_batch else \
            self._forward_loss
        values = batch.values
        if self._id_generator is not None:
            self._id_generator.manual_seed(self.config.seed * 1_000_003 + self.steps)  # the same draws on a resume
            values = drop_ids(values, batch.size, self.config.id_dropout, self._id_generator)
        if forward is self._compiled and self._dynamic_values:
            torch._dynamo.mark_dynamic(values, 0)
        if forward is self._compiled:
            self.model.embeddings.prepare_for_graphs()  # outside the CUDA graphs' memory pool
        loss = forward(batch.dense, values, batch.offsets, batch.label, self._penalty_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # also updates the touched embedding rows (fused sparse optimizer)
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.config.loss_every == 0:
            self._losses.push(self.steps, loss)
        if self.steps % self.config.id_check_every == 0:
            self._id_errors.push(self.steps, self.model.embeddings.id_errors)
        self._collect(wait=False)
        return loss

    def _collect(self, wait: bool) -> None:
        self.loss_curve.extend([step, float(value)] for step, value in self._losses.ready(wait))
        for _, errors in self._id_errors.ready(wait):
            if errors[0].any():
                self.model.embeddings.raise_id_errors()  # reads the record again: with the message

    def finish(self) -> None:
        """Wait for the outstanding readings (loss, id errors): call at the end, or before a checkpoint."""
        if self.steps % self.config.id_check_every:
            self._id_errors.push(self.steps, self.model.embeddings.id_errors)
        self._collect(wait=True)


def fit(step: TrainStep, batches: Iterable, lr: float | Callable[[int], float],
        on_step: Callable[[int, int], None] | None = None) -> dict:
    """Train on every batch of ``batches``; ``lr`` is a rate or a function of the step (counting from 1).

    ``on_step(step, samples)`` runs after each step. Returns samples, steps, seconds (to the last
    step's completion) and the loss curve.
    """
    started, samples = time.perf_counter(), 0
    for batch in batches:
        step(batch, lr(step.steps + 1) if callable(lr) else lr)
        samples += batch.size
        if on_step:
            on_step(step.steps, samples)
    step.finish()
    if step.cuda:
        torch.cuda.synchronize(step.device)
    return {"samples": samples, "steps": step.steps, "seconds": time.perf_counter() - started,
            "loss_curve": list(step.loss_curve)}
