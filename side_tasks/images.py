"""Image processing side task: resize + watermark + encode a directory of images.

One step processes one batch: decode, resize (bilinear, antialiased, so downscaling matches Pillow's
filter), alpha-composite the watermark, encode, and write each result atomically (temp file in the
output directory, fsync, ``os.replace``). Two choices, each per task:

* ``backend``: ``"torch"`` resizes with ``torch.nn.functional.interpolate``; ``"array"`` with NumPy and
  SciPy on a CPU, CuPy and ``cupyx.scipy`` on a GPU (:mod:`side_tasks.arrays`), one code path: the
  resize is two sparse matrix products with the same tent-filter weights (:func:`resample_matrix`).
* ``codec``: ``"pillow"`` decodes and encodes on the host; ``"nvjpeg"`` decodes and encodes JPEG on the
  GPU through nvJPEG (``torchvision.io``), so a JPEG never crosses the bus as pixels; ``"auto"`` (the
  default) takes nvJPEG on a GPU where torchvision offers it, Pillow otherwise, and Pillow for formats
  nvJPEG does not handle.

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
from side_tasks.arrays import ArrayBackend, array_backend, check_backend
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


def resample_matrix(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows, columns and weights of the (out_size x in_size) matrix of an antialiased bilinear resize.

    Output pixel ``i`` is centred at ``(i + 0.5) * scale`` of the input (``scale = in/out``) and takes
    a tent filter of half-width ``max(scale, 1)`` input pixels, normalised: plain bilinear when
    upscaling, a box-like average over the footprint when downscaling (what Pillow's BILINEAR and
    torch's ``interpolate(..., antialias=True)`` do). Each row has about ``2 * max(scale, 1)`` entries.
    """
    scale = in_size / out_size
    support = max(scale, 1.0)
    centres = (np.arange(out_size) + 0.5) * scale
    first = np.maximum(np.floor(centres - support + 0.5).astype(np.int64), 0)
    width = int(np.ceil(2 * support)) + 2
    cols = first[:, None] + np.arange(width)[None, :]
    weights = np.maximum(0.0, 1.0 - np.abs((cols + 0.5 - centres[:, None]) / support))
    weights[cols >= in_size] = 0.0
    weights /= weights.sum(axis=1, keepdims=True)
    rows = np.broadcast_to(np.arange(out_size)[:, None], cols.shape)
    keep = weights > 0
    return rows[keep], np.minimum(cols, in_size - 1)[keep], weights[keep].astype(np.float32)


def _resize_array(ab: ArrayBackend, image: Any, out_h: int, out_w: int) -> Any:
    """Resize an H x W x C float32 array of ``ab`` with two sparse products (see :func:`resample_matrix`)."""
    h, w, c = (int(v) for v in image.shape)
    xp, sparse = ab.xp, ab.sparse
    ry, cy, vy = resample_matrix(h, out_h)
    rx, cx, vx = resample_matrix(w, out_w)
    wy = sparse.csr_matrix((xp.asarray(vy), (xp.asarray(ry), xp.asarray(cy))), shape=(out_h, h))
    wx = sparse.csr_matrix((xp.asarray(vx), (xp.asarray(rx), xp.asarray(cx))), shape=(out_w, w))
    rows = wy @ image.reshape(h, w * c)  # (out_h, w * c)
    cols = wx @ rows.reshape(out_h, w, c).transpose(1, 0, 2).reshape(w, out_h * c)  # (out_w, out_h * c)
    return xp.ascontiguousarray(cols.reshape(out_w, out_h, c).transpose(1, 0, 2))


def nvjpeg_available(device: str) -> bool:
    """True where torchvision can decode and encode JPEG on this GPU (nvJPEG)."""
    if not device.startswith("cuda"):
        return False
    try:
        import torchvision.io as tvio
    except Exception:  # noqa: BLE001 - absent, or a build that does not load beside this torch
        return False
    return hasattr(tvio, "decode_jpeg") and hasattr(tvio, "encode_jpeg")


def pick_codec(codec: str, device: str, available: bool | None = None) -> str:
    """``pillow`` or ``nvjpeg`` for a task's ``codec`` argument on ``device``."""
    if codec not in ("auto", "pillow", "nvjpeg"):
        raise ConfigError(f"codec must be auto, pillow or nvjpeg, got {codec!r}")
    if codec == "pillow":
        return "pillow"
    ok = nvjpeg_available(device) if available is None else available
    if codec == "nvjpeg" and not ok:
        raise ConfigError(f"codec nvjpeg needs a GPU and torchvision with nvJPEG; {device} has neither: use "
                          "codec=pillow or auto")
    return "nvjpeg" if ok else "pillow"


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
        backend: str = "torch",
        codec: str = "auto",
    ) -> None:
        if format not in _FORMATS:
            raise ConfigError(f"unknown output format {format!r}: use one of {', '.join(_FORMATS)}")
        if max_side < 1 or batch_size < 1 or repeat < 1:
            raise ConfigError("max_side, batch_size and repeat must be >= 1")
        if not 0.0 <= opacity <= 1.0 or not 0.0 < watermark_scale <= 1.0:
            raise ConfigError("opacity must be in [0, 1] and watermark_scale in (0, 1]")
        self.backend = check_backend(backend)
        pick_codec(codec, "cpu", available=True)  # validates the name; the device decides in setup
        self.codec_arg = codec
        self.codec = "pillow"
        self.arrays: ArrayBackend | None = None
        self.input_dir = Path(input_dir) if input_dir else SAMPLE_PHOTOS_DIR
        # Missing inputs are refused when the task is built (at submit), not at its first bubble.
        if not self.input_dir.is_dir():
            raise DataFormatError(self.input_dir, "input directory not found")
        if watermark is not None and not Path(watermark).is_file():
            raise DataFormatError(watermark, "watermark image not found")
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
        self._marks: dict[tuple[int, int], Any] = {}

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
        host = _to_array(mark.convert("RGBA")).astype(np.float32) / 255.0
        # Premultiplied alpha: resizing then compositing needs no un-premultiply, and colour does
        # not bleed in from fully transparent pixels.
        premultiplied = np.concatenate([host[..., :3] * host[..., 3:4], host[..., 3:4]], axis=-1)
        self.codec = pick_codec(self.codec_arg, ctx.device)
        if self.backend == "array":
            self.arrays = array_backend(ctx.device)
            self.mark = self.arrays.asarray(premultiplied)  # H x W x 4
        else:
            self.mark = torch.from_numpy(premultiplied).permute(2, 0, 1).unsqueeze(0).to(self.device)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        ctx.logger.info("ImageWatermark: %d images from %s to %s (%s backend, %s codec)", len(self.files),
                        self.input_dir, self.output_dir, self.backend, self.codec)

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
        gpu_codec = self.codec == "nvjpeg"
        decoded = self._decode_nvjpeg(path) if gpu_codec and path.suffix.lower() in (".jpg", ".jpeg") else None
        if decoded is None:
            try:
                with Image.open(path) as image:
                    # Phone photos are stored sideways with an EXIF orientation tag: apply it.
                    decoded = torch.from_numpy(_to_array(ImageOps.exif_transpose(image).convert("RGB")))
            except (OSError, ValueError) as exc:
                raise DataFormatError(path, f"cannot decode image: {exc}") from None
        encode_on_gpu = gpu_codec and self.pil_format == "JPEG"
        if self.arrays is not None:
            out = self.render_array(decoded, to_host=not encode_on_gpu)
        else:
            out = self.render(decoded, to_host=not encode_on_gpu)
        if encode_on_gpu:
            data = self._encode_nvjpeg(out)
        else:
            buffer = io.BytesIO()
            options: dict[str, Any] = {} if self.pil_format == "PNG" else {"quality": self.quality}
            host = out if isinstance(out, np.ndarray) else out.numpy()
            Image.fromarray(host).save(buffer, format=self.pil_format, **options)
            data = buffer.getvalue()
        atomic_write_bytes(self.output_dir / self.output_name(index), data)

    def _decode_nvjpeg(self, path: Path) -> torch.Tensor | None:
        """An H x W x 3 uint8 tensor on the GPU, decoded by nvJPEG with EXIF orientation applied."""
        import torchvision.io as tvio

        try:
            data = tvio.read_file(str(path))
            chw = tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB, device=self.device,
                                   apply_exif_orientation=True)
        except (RuntimeError, OSError, ValueError) as exc:  # not a baseline JPEG nvJPEG takes: Pillow does
            log.debug("nvJPEG cannot decode %s (%s); decoding on the host", path, exc)
            return None
        return chw.permute(1, 2, 0)

    def _encode_nvjpeg(self, pixels: Any) -> bytes:
        import torchvision.io as tvio

        tensor = pixels if isinstance(pixels, torch.Tensor) else torch.from_dlpack(pixels)
        encoded = tvio.encode_jpeg(tensor.permute(2, 0, 1).contiguous(), quality=self.quality)
        return bytes(encoded.cpu().numpy().tobytes())

    def render(self, pixels: torch.Tensor, to_host: bool = True) -> torch.Tensor:
        """Resize and watermark one HxWx3 uint8 image (torch backend); returns the HxWx3 uint8 result,
        on the CPU unless ``to_host`` is false."""
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
        out = image.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0).contiguous()
        return out.cpu() if to_host else out

    def render_array(self, pixels: Any, to_host: bool = True) -> Any:
        """The array backend's :meth:`render`: the same resize, mark and composite with NumPy or CuPy.

        ``pixels`` is an HxWx3 uint8 host array, tensor, or (nvJPEG) GPU tensor; the result is a NumPy
        array unless ``to_host`` is false (then the backend's own array, for a GPU encoder).
        """
        ab = self.arrays
        assert ab is not None
        xp = ab.xp
        if isinstance(pixels, torch.Tensor) and pixels.device.type == "cuda" and ab.gpu:
            image = xp.from_dlpack(pixels).astype(xp.float32)  # the decoded image stays on the GPU
        else:
            image = ab.asarray(pixels).astype(xp.float32)
        height, width = int(image.shape[0]), int(image.shape[1])
        out_w, out_h = _output_size(width, height, self.max_side)
        image = _resize_array(ab, image, out_h, out_w)
        mark = self._mark_for_array(out_w, out_h)
        mark_h, mark_w = int(mark.shape[0]), int(mark.shape[1])
        margin = max(1, round(0.02 * out_w))
        top, left = max(0, out_h - mark_h - margin), max(0, out_w - mark_w - margin)
        region = image[top : top + mark_h, left : left + mark_w]
        alpha = mark[..., 3:4] * self.opacity
        image[top : top + mark_h, left : left + mark_w] = region * (1.0 - alpha) + 255.0 * mark[..., :3] * self.opacity
        out = xp.clip(xp.rint(image), 0, 255).astype(xp.uint8)
        return ab.to_host(out) if to_host else out

    def _mark_size(self, out_w: int, out_h: int, src_w: int, src_h: int) -> tuple[int, int]:
        mark_w = max(1, round(self.watermark_scale * out_w))
        mark_h = max(1, round(mark_w * src_h / src_w))
        limit_h = max(1, out_h - 2 * max(1, round(0.02 * out_w)))
        if mark_h > limit_h:  # a tall mark on a wide image: fit the height instead
            mark_w, mark_h = max(1, round(mark_w * limit_h / mark_h)), limit_h
        return min(mark_w, out_w), mark_h

    def _mark_for_array(self, out_w: int, out_h: int) -> Any:
        key = (out_w, out_h)
        cached = self._marks.get(key)
        if cached is None:
            assert self.arrays is not None
            src_h, src_w = int(self.mark.shape[0]), int(self.mark.shape[1])
            mark_w, mark_h = self._mark_size(out_w, out_h, src_w, src_h)
            cached = _resize_array(self.arrays, self.mark, mark_h, mark_w)
            if len(self._marks) > 64:
                self._marks.clear()
            self._marks[key] = cached
        return cached

    def _mark_for(self, out_w: int, out_h: int) -> torch.Tensor:
        """The watermark resized for an output size (cached: batches usually share sizes)."""
        key = (out_w, out_h)
        cached = self._marks.get(key)
        if cached is not None:
            return cached
        src_h, src_w = int(self.mark.shape[-2]), int(self.mark.shape[-1])
        mark_w, mark_h = self._mark_size(out_w, out_h, src_w, src_h)
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
