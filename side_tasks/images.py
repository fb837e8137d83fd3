"""Image processing side task: resize + watermark + encode a directory of images.

One step processes one batch: decode on the host (Pillow), upload, resize with
``torch.nn.functional.interpolate`` (bilinear, antialiased, so downscaling matches Pillow's
filter), alpha-composite the watermark, download, encode, and write each result atomically (temp
file in the output directory, fsync, ``os.replace``). The decoder and encoder stay on the host
because Pillow is what every installation has; the pixel work, which grows with the output size,
runs on the device.

Exactly-once output: the work list (file names, in sorted order) is fixed at the first ``setup``
and saved in the checkpoint, the cursor only advances after a whole batch is written, and each
output's name is a function of its input's name. A task stopped mid-batch therefore redoes that
batch on resume and overwrites the same files: nothing is lost, nothing is duplicated, and a
reader never sees a half-written image.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont, ImageOps

from freeride.errors import ConfigError
from freeride.task import SideTask, TaskContext
from side_tasks._io import DATA_DIR, atomic_write_bytes
from side_tasks.errors import DataFormatError, check_fits

log = logging.getLogger(__name__)

#: Input file extensions picked up from the directory (case-insensitive).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif"})
_FORMATS = {"jpeg": ("JPEG", "jpg"), "png": ("PNG", "png"), "webp": ("WEBP", "webp")}
#: Bundled real photographs (see side_tasks/data/README.md), the default input.
SAMPLE_PHOTOS_DIR = DATA_DIR / "photos"
#: Input size assumed by :meth:`ImageWatermark.estimate_memory` when it cannot look (12 MP).
_ASSUMED_INPUT_PIXELS = 4000 * 3000


def default_watermark() -> Image.Image:
    """A deterministic RGBA text mark ("freeride" on a translucent band), used when none is given."""
    font = ImageFont.load_default()
    probe = ImageDraw.Draw(Image.new("RGBA", (1, 1)))
    left, top, right, bottom = probe.textbbox((0, 0), "freeride", font=font)
    width, height = int(right - left) + 8, int(bottom - top) + 6
    mark = Image.new("RGBA", (width, height), (0, 0, 0, 96))
    ImageDraw.Draw(mark).text((4 - left, 3 - top), "freeride", font=font, fill=(255, 255, 255, 255))
    return mark


def _output_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _batch_bytes(input_pixels: list[int], max_side: int) -> int:
    """Device bytes of one batch: float32 RGB input, output and blend temporaries per image,
    plus the uint8 copies (images are processed one at a time within the batch, but the
    allocator keeps the largest blocks cached)."""
    out_pixels = max_side * max_side
    return sum(4 * 3 * (px + 3 * out_pixels) + 3 * (px + out_pixels) for px in input_pixels) + (8 << 20)


class ImageWatermark(SideTask):
    """Resize every image of a directory so its long side is ``max_side`` pixels, stamp a
    watermark in the bottom-right corner, and encode it into ``output_dir``.

    Args:
        input_dir: directory of images; default: the bundled sample photographs.
        output_dir: where results go; default ``<work_dir>/out``.
        max_side: long side of the output in pixels (up- or downscaling, aspect kept).
        watermark: path to an RGBA image (PNG); default: a generated "freeride" mark.
        opacity: watermark opacity in [0, 1], applied on top of its own alpha.
        watermark_scale: watermark width as a fraction of the output width.
        batch_size: images per step.
        format: ``jpeg``, ``png`` or ``webp``.
        quality: JPEG/WebP quality.
        repeat: process the directory this many times (``name.N.ext`` outputs), for benchmarks
            that need a longer stream than the directory holds.
    """

    progress_unit: ClassVar[str] = "images"
    memory_estimate_bytes: ClassVar[int | None] = 1 << 30

    def __init__(
        self,
        input_dir: str | None = None,
        output_dir: str | None = None,
        max_side: int = 1024,
        watermark: str | None = None,
        opacity: float = 0.5,
        watermark_scale: float = 0.25,
        batch_size: int = 4,
        format: str = "jpeg",
        quality: int = 90,
        repeat: int = 1,
    ) -> None:
        if format not in _FORMATS:
            raise ConfigError(f"unknown output format {format!r}: use one of {', '.join(_FORMATS)}")
        if max_side < 1 or batch_size < 1 or repeat < 1:
            raise ConfigError("max_side, batch_size and repeat must be >= 1")
        if not 0.0 <= opacity <= 1.0 or not 0.0 < watermark_scale <= 1.0:
            raise ConfigError("opacity must be in [0, 1] and watermark_scale in (0, 1]")
        self.input_dir = Path(input_dir) if input_dir else SAMPLE_PHOTOS_DIR
        self.output_dir_arg = output_dir
        self.max_side = int(max_side)
        self.watermark_path = watermark
        self.opacity = float(opacity)
        self.watermark_scale = float(watermark_scale)
        self.batch_size = int(batch_size)
        self.pil_format, self.extension = _FORMATS[format]
        self.quality = int(quality)
        self.repeat = int(repeat)
        self.files: list[str] = []
        self._clashing_stems: set[str] = set()
        self.cursor = 0
        self._marks: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def list_images(input_dir: Path) -> list[str]:
        """Image file names in ``input_dir``, sorted (the task's fixed work order)."""
        if not input_dir.is_dir():
            raise DataFormatError(input_dir, "input directory not found")
        names = sorted(
            p.name
            for p in input_dir.iterdir()
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not names:
            raise DataFormatError(input_dir, f"no images found (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})")
        return names

    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        """One batch of the largest inputs at the requested size, plus Pillow's decoded copies."""
        max_side = int(kwargs.get("max_side", 1024))
        batch = int(kwargs.get("batch_size", 4))
        pixels = [_ASSUMED_INPUT_PIXELS] * batch
        try:
            directory = Path(kwargs.get("input_dir") or SAMPLE_PHOTOS_DIR)
            sizes = sorted((cls._pixels(directory / n) for n in cls.list_images(directory)), reverse=True)
            pixels = sizes[:batch]
        except (OSError, ConfigError):
            pass
        return 2 * _batch_bytes(pixels, max_side)

    @staticmethod
    def _pixels(path: Path) -> int:
        with Image.open(path) as image:  # reads the header only
            return int(image.width * image.height)

    def setup(self, ctx: TaskContext) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.device)
        self._set_files(self.list_images(self.input_dir))
        self.output_dir = Path(self.output_dir_arg) if self.output_dir_arg else Path(ctx.work_dir) / "out"
        try:
            sizes = sorted((self._pixels(self.input_dir / n) for n in self.files), reverse=True)
        except OSError as exc:
            raise DataFormatError(self.input_dir, f"cannot read image header: {exc}") from None
        check_fits(
            f"ImageWatermark (batch of {self.batch_size}, max side {self.max_side})",
            2 * _batch_bytes(sizes[: self.batch_size], self.max_side),
            ctx.memory_limit_bytes,
            "lower batch_size or max_side, or raise the task's memory limit",
        )
        mark = default_watermark() if self.watermark_path is None else self._open_watermark()
        rgba = torch.from_numpy(_to_array(mark.convert("RGBA"))).permute(2, 0, 1).to(self.device)
        rgba = rgba.float() / 255.0
        # Premultiplied alpha: resizing then compositing needs no un-premultiply, and colour does
        # not bleed in from fully transparent pixels.
        self.mark = torch.cat([rgba[:3] * rgba[3:4], rgba[3:4]]).unsqueeze(0)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        ctx.logger.info("ImageWatermark: %d images from %s to %s", len(self.files), self.input_dir, self.output_dir)

    def _open_watermark(self) -> Image.Image:
        assert self.watermark_path is not None
        try:
            return Image.open(self.watermark_path)
        except (OSError, ValueError) as exc:
            raise DataFormatError(self.watermark_path, f"cannot open watermark: {exc}") from None

    @property
    def total(self) -> int:
        return len(self.files) * self.repeat

    def output_name(self, index: int) -> str:
        """The output file name of work item ``index`` (a pure function of the input name)."""
        name = self.files[index % len(self.files)]
        stem = name.rsplit(".", 1)[0]
        if stem in self._clashing_stems:
            stem = name  # a.png and a.jpg both present: keep them apart
        suffix = f".{index // len(self.files)}" if self.repeat > 1 else ""
        return f"{stem}{suffix}.{self.extension}"

    def _set_files(self, files: list[str]) -> None:
        self.files = files
        stems = Counter(name.rsplit(".", 1)[0] for name in files)
        self._clashing_stems = {stem for stem, count in stems.items() if count > 1}

    def done(self) -> bool:
        return self.cursor >= self.total

    def progress(self) -> float:
        return float(self.cursor)

    def step(self) -> None:
        end = min(self.cursor + self.batch_size, self.total)
        for index in range(self.cursor, end):
            self._process(index)
        self.cursor = end

    def _process(self, index: int) -> None:
        path = self.input_dir / self.files[index % len(self.files)]
        try:
            with Image.open(path) as image:
                # Phone photos are stored sideways with an EXIF orientation tag: apply it.
                pixels = _to_array(ImageOps.exif_transpose(image).convert("RGB"))
        except (OSError, ValueError) as exc:
            raise DataFormatError(path, f"cannot decode image: {exc}") from None
        out = self.render(torch.from_numpy(pixels))
        buffer = io.BytesIO()
        options: dict[str, Any] = {} if self.pil_format == "PNG" else {"quality": self.quality}
        Image.fromarray(out.numpy()).save(buffer, format=self.pil_format, **options)
        atomic_write_bytes(self.output_dir / self.output_name(index), buffer.getvalue())

    def render(self, pixels: torch.Tensor) -> torch.Tensor:
        """Resize and watermark one HxWx3 uint8 image; returns the HxWx3 uint8 result on the CPU."""
        height, width = int(pixels.shape[0]), int(pixels.shape[1])
        out_w, out_h = _output_size(width, height, self.max_side)
        image = pixels.to(self.device).permute(2, 0, 1).unsqueeze(0).float()
        image = F.interpolate(image, size=(out_h, out_w), mode="bilinear", align_corners=False, antialias=True)
        mark = self._mark_for(out_w, out_h)
        mark_h, mark_w = int(mark.shape[-2]), int(mark.shape[-1])
        margin = max(1, round(0.02 * out_w))
        top, left = max(0, out_h - mark_h - margin), max(0, out_w - mark_w - margin)
        region = image[:, :, top : top + mark_h, left : left + mark_w]
        alpha = mark[:, 3:4] * self.opacity
        image[:, :, top : top + mark_h, left : left + mark_w] = (
            region * (1.0 - alpha) + 255.0 * mark[:, :3] * self.opacity
        )
        return image.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0).contiguous().cpu()

    def _mark_for(self, out_w: int, out_h: int) -> torch.Tensor:
        """The watermark resized for an output size (cached: batches usually share sizes)."""
        key = (out_w, out_h)
        cached = self._marks.get(key)
        if cached is not None:
            return cached
        src_h, src_w = int(self.mark.shape[-2]), int(self.mark.shape[-1])
        mark_w = max(1, round(self.watermark_scale * out_w))
        mark_h = max(1, round(mark_w * src_h / src_w))
        limit_h = max(1, out_h - 2 * max(1, round(0.02 * out_w)))
        if mark_h > limit_h:  # a tall mark on a wide image: fit the height instead
            mark_w, mark_h = max(1, round(mark_w * limit_h / mark_h)), limit_h
        mark_w = min(mark_w, out_w)
        resized = F.interpolate(self.mark, size=(mark_h, mark_w), mode="bilinear", align_corners=False, antialias=True)
        if len(self._marks) > 64:
            self._marks.clear()
        self._marks[key] = resized
        return resized

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "files": list(self.files), "repeat": self.repeat}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        files = list(state["files"])
        missing = [name for name in files if not (self.input_dir / name).is_file()]
        if missing:
            raise DataFormatError(
                self.input_dir, f"{len(missing)} input image(s) of the checkpoint are gone, e.g. {missing[0]}"
            )
        if int(state["repeat"]) != self.repeat:
            raise ConfigError(f"checkpoint was taken with repeat={state['repeat']}, this task has repeat={self.repeat}")
        # The work list of the first run wins: images added since are not mixed into its order.
        self._set_files(files)
        self.cursor = int(state["cursor"])


def _to_array(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.uint8).copy()
