"""Small model training side tasks: one optimiser step per ``step()``.

Both tasks are deterministic functions of their arguments and seed, so that a resumed run ends
bit-for-bit where an uninterrupted one does on the CPU (on CUDA, up to the non-determinism of
cuDNN kernels). Everything that evolves is in ``state_dict``: model and optimiser state, the
data generator's RNG state, the epoch permutation and cursor, and torch's global RNG (dropout).
Learning-rate schedules are pure functions of the step number, so there is no scheduler object
to save. All data randomness comes from one CPU ``torch.Generator``, whose output is then moved
to the device: the same stream on CPU and CUDA.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

try:
    # The first optimiser built in a process imports torch._dynamo (torch.optim wraps its methods
    # in dynamo's "disable" decorator): about 1.5 s of CPU. setup() builds the optimiser and runs
    # inside bubbles; importing it here moves that cost to the worker's start, outside them.
    import torch._dynamo  # noqa: F401
except ImportError:  # pragma: no cover - a torch without dynamo imports nothing more in setup
    pass

from freeride.errors import ConfigError
from freeride.task import SideTask, TaskContext
from side_tasks.errors import check_fits
from side_tasks.training.data import ImageDataset, check_image_dataset, check_text, load_image_dataset, load_text
from side_tasks.training.models import LSTMLanguageModel, ResNet18

log = logging.getLogger(__name__)

#: What the formulas do not count: allocator slack, and the torch runtime that an optimiser step
#: first loads (about 100 MiB of resident memory, which a CPU worker's RSS watchdog counts).
_OVERHEAD_BYTES = 160 << 20
#: The bundled digits on the device (1,797 x 3 x 32 x 32 uint8 plus labels), rounded up.
_DIGITS_BYTES = 8 << 20


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class _TrainingTask(SideTask):
    """Shared bookkeeping: step counter, RNGs, running loss, checkpoint format."""

    progress_unit: ClassVar[str] = "samples"

    def __init__(self, batch_size: int, max_steps: int, seed: int) -> None:
        if batch_size < 1 or max_steps < 1:
            raise ConfigError("batch_size and max_steps must be >= 1")
        self.batch_size = int(batch_size)
        self.max_steps = int(max_steps)
        self.seed = int(seed)
        self.steps = 0
        self.loss_ema: float | None = None
        self.last_loss: float | None = None

    def _build(self, ctx: TaskContext) -> None:
        self.device = torch.device(ctx.device)
        self._forked_devices = [self.device] if self.device.type == "cuda" else []
        self.generator = torch.Generator().manual_seed(self.seed)
        # Parameter init (and dropout, later) draw from torch's global RNG, which is the caller's:
        # the task keeps a private copy of it, seeded here, so results depend on the seed alone.
        with torch.random.fork_rng(devices=self._forked_devices):
            torch.manual_seed(self.seed)
            self.model = self._make_model().to(self.device)
            self.global_rng = _rng_state(self.device)
        self.optimizer = self._make_optimizer()

    @contextmanager
    def _private_global_rng(self) -> Iterator[None]:
        """Run a block on the task's own global-RNG stream (for dropout), leaving the caller's
        untouched. Costs a state copy per step, so only tasks that draw from it use it."""
        with torch.random.fork_rng(devices=self._forked_devices):
            _set_rng_state(self.global_rng, self.device)
            yield
            self.global_rng = _rng_state(self.device)

    def _make_model(self) -> nn.Module:
        raise NotImplementedError

    def _make_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def _warm_up(self, inputs: torch.Tensor, loss_of: Any) -> None:
        """One forward and backward pass on a constant batch, leaving no trace.

        The first call of each kernel in a process is slow (oneDNN primitives, the autograd engine:
        75 ms against 3.5 ms for the LSTM's steady step on a CPU core). As the task's first measured
        step, that sample alone made the worker's step-time estimate fit no bubble, and the task
        starved until the manager re-probed it 200 bubbles later; setup() pays it instead. No
        optimiser step, no draw from the task's generator; gradients are dropped and the buffers
        (batch-norm statistics) and torch's global RNG restored, so results stay a function of the
        seed alone.
        """
        saved = {name: buf.clone() for name, buf in self.model.named_buffers()}
        with torch.random.fork_rng(devices=self._forked_devices):
            self.model.train()
            loss_of(self.model(inputs)).backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buf in self.model.named_buffers():
                buf.copy_(saved[name])

    def _record(self, loss: torch.Tensor) -> None:
        value = float(loss.detach())
        self.last_loss = value
        self.loss_ema = value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * value
        self.steps += 1

    def done(self) -> bool:
        return self.steps >= self.max_steps

    def progress(self) -> float:
        return float(self.steps * self.batch_size)

    def _base_state(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "loss_ema": self.loss_ema,
            "last_loss": self.last_loss,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "global_rng": self.global_rng,
        }

    def _load_base_state(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.loss_ema = state["loss_ema"]
        self.last_loss = state["last_loss"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.global_rng = state["global_rng"]


class ResNet18Training(_TrainingTask):
    """Train ResNet-18 (CIFAR variant, 32x32 inputs) with SGD, one batch per step.

    Recipe: SGD with Nesterov momentum 0.9 and weight decay 5e-4, a cosine learning-rate decay
    over ``max_steps``, random crops (4-pixel padding) and, where the classes allow it, horizontal
    flips; epochs are fresh permutations of the training set. The dataset lives on the device as
    uint8 (CIFAR-10: 150 MB).

    Args:
        dataset: ``"digits"`` (bundled real handwritten digits), a CIFAR python directory, or an
            ``.npz`` file (see :mod:`side_tasks.training.data`).
        batch_size: samples per step (64, as in the reference system's profile).
        lr: peak learning rate.
        max_steps: optimiser steps in all.
        width: channels of the first stage (64 is ResNet-18; smaller for quick tests).
        flip: random horizontal flips; default on, except for digits (a mirrored digit is not one).
        seed: seeds init, shuffling and augmentation.
    """

    memory_estimate_bytes: ClassVar[int | None] = 1 << 30

    def __init__(
        self,
        dataset: str = "digits",
        batch_size: int = 64,
        lr: float = 0.05,
        max_steps: int = 2000,
        width: int = 64,
        flip: bool | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, max_steps, seed)
        if width < 1:
            raise ConfigError(f"width must be >= 1, got {width}")
        check_image_dataset(dataset)  # a missing dataset is refused at submit, not at the first bubble
        self.dataset_spec = dataset
        self.lr = float(lr)
        self.width = int(width)
        self.flip = (dataset != "digits") if flip is None else bool(flip)
        self.epoch = 0
        self.cursor = 0

    @classmethod
    def estimate_bytes(cls, width: int, batch_size: int, num_classes: int = 100, data_bytes: int = 0) -> int:
        """Weights, gradients and momentum (3 copies), activations of one batch, the data."""
        params = 4 * (11_173_962 * (width / 64) ** 2 + 512 * (width / 64) * num_classes)
        return int(3 * params + batch_size * ResNet18.activation_bytes_per_sample(width) + data_bytes) + _OVERHEAD_BYTES

    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        # CIFAR-10/100 is 180 MB as uint8; other .npz files are unknown until loaded.
        data_bytes = _DIGITS_BYTES if kwargs.get("dataset", "digits") == "digits" else 200 << 20
        return cls.estimate_bytes(int(kwargs.get("width", 64)), int(kwargs.get("batch_size", 64)), 100, data_bytes)

    def setup(self, ctx: TaskContext) -> None:
        data: ImageDataset = load_image_dataset(self.dataset_spec)
        check_fits(
            f"ResNet18Training (width {self.width}, batch {self.batch_size})",
            self.estimate_bytes(self.width, self.batch_size, data.num_classes, data.nbytes),
            ctx.memory_limit_bytes,
            "lower batch_size or width, or raise the task's memory limit",
        )
        if data.train_labels.shape[0] < self.batch_size:
            raise ConfigError(f"batch_size {self.batch_size} is larger than the training set")
        self.num_classes = data.num_classes
        self._build(ctx)
        self.train_images = data.train_images.to(self.device)
        self.train_labels = data.train_labels.to(self.device)
        self.test_images = data.test_images.to(self.device)
        self.test_labels = data.test_labels.to(self.device)
        stats = data.train_images.float()
        self.mean = stats.mean(dim=(0, 2, 3), keepdim=True).to(self.device)
        self.std = stats.std(dim=(0, 2, 3), keepdim=True).clamp(min=1.0).to(self.device)
        self.permutation = torch.randperm(self.train_labels.shape[0], generator=self.generator)
        zeros = torch.zeros(self.batch_size, 3, 32, 32, device=self.device)
        labels = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
        self._warm_up(zeros, lambda out: F.cross_entropy(out, labels))
        ctx.logger.info(
            "ResNet18Training: %d train / %d test samples, %d classes, %.1fM parameters on %s",
            self.train_labels.shape[0], self.test_labels.shape[0], self.num_classes,
            _param_bytes(self.model) / 4e6, ctx.device,
        )  # fmt: skip

    def _make_model(self) -> nn.Module:
        return ResNet18(num_classes=self.num_classes, width=self.width)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def learning_rate(self, step: int) -> float:
        return 0.5 * self.lr * (1.0 + math.cos(math.pi * min(step, self.max_steps) / self.max_steps))

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        count = self.train_labels.shape[0]
        if self.cursor + self.batch_size > count:  # drop the ragged tail: steady step time
            self.epoch += 1
            self.cursor = 0
            self.permutation = torch.randperm(count, generator=self.generator)
        index = self.permutation[self.cursor : self.cursor + self.batch_size].to(self.device)
        self.cursor += self.batch_size
        images = (self.train_images[index].float() - self.mean) / self.std
        # Random 32x32 crops of the 4-pixel zero-padded images, gathered in one indexing op.
        padded = F.pad(images, (4, 4, 4, 4))
        offsets = torch.randint(0, 9, (2, self.batch_size), generator=self.generator).to(self.device)
        ramp = torch.arange(32, device=self.device)
        rows = (offsets[0][:, None] + ramp)[:, None, :, None]
        cols = (offsets[1][:, None] + ramp)[:, None, None, :]
        if self.flip:
            flips = torch.rand(self.batch_size, generator=self.generator).to(self.device) < 0.5
            cols = torch.where(flips[:, None, None, None], cols.flip(-1), cols)
        batch = torch.arange(self.batch_size, device=self.device)[:, None, None, None]
        channels = torch.arange(3, device=self.device)[None, :, None, None]
        return padded[batch, channels, rows, cols], self.train_labels[index]

    def step(self) -> None:
        if self.done():
            return
        self.model.train()
        images, labels = self._next_batch()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.steps)
        loss = F.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self._record(loss)

    @torch.no_grad()
    def evaluate(self, batch_size: int = 256) -> float:
        """Top-1 accuracy on the held-out split (eval-mode BatchNorm, no augmentation)."""
        self.model.eval()
        correct = 0
        for start in range(0, self.test_labels.shape[0], batch_size):
            images = (self.test_images[start : start + batch_size].float() - self.mean) / self.std
            predicted = self.model(images).argmax(dim=1)
            correct += int((predicted == self.test_labels[start : start + batch_size]).sum())
        return correct / max(1, self.test_labels.shape[0])

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "epoch": self.epoch, "cursor": self.cursor, "permutation": self.permutation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.permutation = state["permutation"].cpu()


class LSTMLanguageModelTraining(_TrainingTask):
    """Train a byte-level LSTM language model with Adam, one batch of sequences per step.

    Each step draws ``batch_size`` random windows of ``seq_len + 1`` bytes from the first 90% of
    the text (the last 10% is held out for :meth:`evaluate`) and predicts every next byte. Progress
    is counted in sequences (samples). Gradients are clipped to norm 1, the usual LSTM recipe.

    Args:
        text: ``"python-docs"`` (the Python reference manual shipped with CPython) or a path.
        seq_len, batch_size: window length in bytes and windows per step.
        embed, hidden, layers, dropout: model size.
        lr: Adam learning rate.
        max_steps: optimiser steps in all.
        seed: seeds init, sampling and dropout.
    """

    memory_estimate_bytes: ClassVar[int | None] = 512 << 20

    def __init__(
        self,
        text: str = "python-docs",
        seq_len: int = 128,
        batch_size: int = 32,
        embed: int = 64,
        hidden: int = 256,
        layers: int = 2,
        dropout: float = 0.0,
        lr: float = 2e-3,
        max_steps: int = 2000,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, max_steps, seed)
        if seq_len < 2 or embed < 1 or hidden < 1 or layers < 1 or not 0.0 <= dropout < 1.0:
            raise ConfigError("need seq_len >= 2, embed, hidden, layers >= 1 and 0 <= dropout < 1")
        check_text(text)  # a missing text is refused at submit, not at the first bubble
        self.text_spec = text
        self.seq_len = int(seq_len)
        self.embed_dim = int(embed)
        self.hidden = int(hidden)
        self.layers = int(layers)
        self.dropout = float(dropout)
        self.lr = float(lr)

    @classmethod
    def estimate_bytes(
        cls, seq_len: int, batch_size: int, embed: int, hidden: int, layers: int, text_bytes: int
    ) -> int:
        """Weights + gradients + Adam's two moments (4 copies); per time step and sample, the
        LSTM keeps its 4 gates, cell and hidden state per layer and the logits and their grad."""
        params = 256 * embed + 4 * hidden * (embed + hidden + 2) + (layers - 1) * 4 * hidden * (2 * hidden + 2)
        params += 257 * hidden
        activations = batch_size * seq_len * (layers * 8 * hidden + 3 * 256 + embed)
        return 4 * (4 * params + activations) + text_bytes + _OVERHEAD_BYTES

    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        return cls.estimate_bytes(
            int(kwargs.get("seq_len", 128)), int(kwargs.get("batch_size", 32)), int(kwargs.get("embed", 64)),
            int(kwargs.get("hidden", 256)), int(kwargs.get("layers", 2)), 1 << 20,
        )  # fmt: skip

    def setup(self, ctx: TaskContext) -> None:
        raw = load_text(self.text_spec)
        check_fits(
            f"LSTMLanguageModelTraining (hidden {self.hidden}, batch {self.batch_size} x {self.seq_len})",
            self.estimate_bytes(self.seq_len, self.batch_size, self.embed_dim, self.hidden, self.layers, len(raw)),
            ctx.memory_limit_bytes,
            "lower batch_size, seq_len or hidden, or raise the task's memory limit",
        )
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        cut = int(len(data) * 0.9)
        if cut < self.seq_len + 2 or len(data) - cut < self.seq_len + 2:
            raise ConfigError(f"text {self.text_spec!r} has {len(data)} bytes, too short for seq_len {self.seq_len}")
        self._build(ctx)
        self.train_data = data[:cut].to(self.device)
        self.test_data = data[cut:].to(self.device)
        tokens = torch.zeros(self.batch_size, self.seq_len, dtype=torch.int64, device=self.device)
        self._warm_up(tokens, lambda out: F.cross_entropy(out.reshape(-1, LSTMLanguageModel.VOCAB), tokens.reshape(-1)))
        ctx.logger.info("LSTMLanguageModelTraining: %d bytes of text on %s", len(data), ctx.device)

    def _make_model(self) -> nn.Module:
        return LSTMLanguageModel(self.embed_dim, self.hidden, self.layers, self.dropout)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=self.lr)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = starts.to(self.device)[:, None] + torch.arange(self.seq_len + 1, device=self.device)
        windows = data[index]
        return windows[:, :-1], windows[:, 1:]

    def step(self) -> None:
        if self.done():
            return
        self.model.train()
        starts = torch.randint(0, len(self.train_data) - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        inputs, targets = self._windows(self.train_data, starts)
        if self.dropout > 0:
            with self._private_global_rng():
                logits = self.model(inputs)
        else:
            logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, LSTMLanguageModel.VOCAB), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self._record(loss)

    @torch.no_grad()
    def evaluate(self, max_windows: int = 64) -> float:
        """Held-out loss in bits per byte, on evenly spaced windows of the last 10%."""
        self.model.eval()
        span = len(self.test_data) - self.seq_len - 1
        count = max(1, min(max_windows, span))
        starts = torch.linspace(0, span, count).long()
        inputs, targets = self._windows(self.test_data, starts)
        logits = self.model(inputs)
        nats = F.cross_entropy(logits.reshape(-1, LSTMLanguageModel.VOCAB), targets.reshape(-1))
        return float(nats) / math.log(2)

    def state_dict(self) -> dict[str, Any]:
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
