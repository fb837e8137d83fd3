"""Image task: output matches a Pillow reference on both backends (torch; NumPy/SciPy, the logic CuPy runs
on a GPU), exactly-once atomic output across resumes, the codec choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from side_task_helpers import make_ctx, run_interrupted, run_to_end

from freeride.errors import ConfigError
from side_tasks.errors import DataFormatError, TaskTooLarge
from side_tasks.images import SAMPLE_PHOTOS_DIR, ImageWatermark, pick_codec, resample_matrix


def _make_inputs(directory: Path, count: int = 5) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        # Smooth gradients plus a little texture: close to a photo's statistics, cheap to make.
        h, w = 30 + 4 * i, 40 + 3 * i
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(directory / f"img{i:02d}.png")
    (directory / "notes.txt").write_text("not an image")
    return directory


def _outputs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("backend", ["torch", "array"])
def test_output_matches_pillow_resize_and_alpha_composite(tmp_path: Path, backend: str) -> None:
    source = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    source = np.asarray(Image.fromarray(source).filter(ImageFilter.SMOOTH))
    mark = np.zeros((24, 48, 4), dtype=np.uint8)
    mark[..., 0], mark[..., 3] = 255, 200
    mark[6:18, 12:36, 3] = 50
    (tmp_path / "in").mkdir()
    Image.fromarray(source).save(tmp_path / "in" / "a.png")
    Image.fromarray(mark, "RGBA").save(tmp_path / "mark.png")
    task = ImageWatermark(
        str(tmp_path / "in"), max_side=96, watermark=str(tmp_path / "mark.png"),
        opacity=0.75, watermark_scale=0.5, format="png", backend=backend,
    )  # fmt: skip
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    ours = np.asarray(Image.open(tmp_path / "w" / "out" / "a.png")).astype(float)

    resized = np.asarray(Image.fromarray(source).resize((96, 72), Image.BILINEAR)).astype(float)
    overlay = np.zeros((72, 96, 4), dtype=np.uint8)
    overlay[72 - 24 - 2 : 72 - 2, 96 - 48 - 2 : 96 - 2] = mark
    overlay[..., 3] = np.round(overlay[..., 3] * 0.75).astype(np.uint8)
    expected = Image.alpha_composite(
        Image.fromarray(resized.round().astype(np.uint8)).convert("RGBA"), Image.fromarray(overlay, "RGBA")
    )
    expected_rgb = np.asarray(expected.convert("RGB")).astype(float)
    assert ours.shape == expected_rgb.shape == (72, 96, 3)
    assert np.abs(ours - expected_rgb).mean() < 1.0
    assert np.abs(ours - expected_rgb).max() <= 6


def test_resumed_task_neither_loses_nor_duplicates_images(tmp_path: Path) -> None:
    inputs = _make_inputs(tmp_path / "in")

    def factory() -> ImageWatermark:
        return ImageWatermark(str(inputs), max_side=32, batch_size=2)

    whole = factory()
    whole.setup(make_ctx(tmp_path / "whole"))
    run_to_end(whole)
    resumed = run_interrupted(factory, tmp_path / "resumed", stop_after=1)
    assert resumed.progress() == whole.progress() == 5
    assert _outputs(tmp_path / "resumed" / "out") == _outputs(tmp_path / "whole" / "out")
    assert sorted(_outputs(tmp_path / "whole" / "out")) == [f"img{i:02d}.jpg" for i in range(5)]


def test_batch_redone_after_crash_overwrites_instead_of_duplicating(tmp_path: Path) -> None:
    inputs = _make_inputs(tmp_path / "in")
    task = ImageWatermark(str(inputs), max_side=32, batch_size=2)
    task.setup(make_ctx(tmp_path / "w"))
    task.step()
    checkpoint = task.state_dict()
    task.step()  # writes a batch, then "crashes" before its next checkpoint
    again = ImageWatermark(str(inputs), max_side=32, batch_size=2)
    again.setup(make_ctx(tmp_path / "w"))
    again.load_state_dict(checkpoint)
    run_to_end(again)
    names = sorted((tmp_path / "w" / "out").iterdir())
    assert [p.name for p in names] == [f"img{i:02d}.jpg" for i in range(5)]


def test_images_added_after_start_do_not_change_the_resumed_work_list(tmp_path: Path) -> None:
    inputs = _make_inputs(tmp_path / "in", count=3)
    task = ImageWatermark(str(inputs), max_side=16, batch_size=1)
    task.setup(make_ctx(tmp_path / "w"))
    task.step()
    state = task.state_dict()
    Image.new("RGB", (8, 8)).save(inputs / "a-new.png")  # sorts first: would shift the order
    again = ImageWatermark(str(inputs), max_side=16, batch_size=1)
    again.setup(make_ctx(tmp_path / "w"))
    again.load_state_dict(state)
    run_to_end(again)
    assert sorted(p.name for p in (tmp_path / "w" / "out").iterdir()) == ["img00.jpg", "img01.jpg", "img02.jpg"]


def test_repeat_writes_one_output_per_pass(tmp_path: Path) -> None:
    inputs = _make_inputs(tmp_path / "in", count=2)
    task = ImageWatermark(str(inputs), max_side=16, repeat=2, format="webp")
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    assert sorted(p.name for p in (tmp_path / "w" / "out").iterdir()) == [
        "img00.0.webp", "img00.1.webp", "img01.0.webp", "img01.1.webp",
    ]  # fmt: skip


def test_bundled_sample_photos_are_real_images() -> None:
    names = ImageWatermark.list_images(SAMPLE_PHOTOS_DIR)
    assert len(names) >= 4
    for name in names:
        with Image.open(SAMPLE_PHOTOS_DIR / name) as image:
            pixels = np.asarray(image.convert("L"), dtype=float)
        assert min(image.size) >= 200 and pixels.std() > 20  # photographs, not blank or tiny


def test_default_task_processes_bundled_photos(tmp_path: Path) -> None:
    task = ImageWatermark(max_side=64)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    outputs = sorted((tmp_path / "w" / "out").iterdir())
    assert len(outputs) == task.progress() == len(ImageWatermark.list_images(SAMPLE_PHOTOS_DIR))
    assert max(Image.open(outputs[0]).size) == 64


def test_setup_refuses_batch_that_cannot_fit_the_limit(tmp_path: Path) -> None:
    task = ImageWatermark(max_side=8192, batch_size=8)
    with pytest.raises(TaskTooLarge, match="lower batch_size or max_side"):
        task.setup(make_ctx(tmp_path / "w", memory_limit_bytes=64 << 20))


def test_memory_estimate_reads_input_sizes() -> None:
    small = ImageWatermark.estimate_memory(max_side=256)
    large = ImageWatermark.estimate_memory(max_side=4096)
    assert small is not None and large is not None and large > 10 * small


def test_missing_or_empty_input_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="input directory not found"):
        ImageWatermark(str(tmp_path / "nope")).setup(make_ctx(tmp_path / "w"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFormatError, match="no images found"):
        ImageWatermark(str(tmp_path / "empty")).setup(make_ctx(tmp_path / "w"))


def test_corrupt_image_is_reported_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(DataFormatError, match=r"broken\.jpg"):
        task = ImageWatermark(str(tmp_path / "in"))
        task.setup(make_ctx(tmp_path / "w"))
        run_to_end(task)


def test_render_keeps_aspect_ratio_when_upscaling() -> None:
    task = ImageWatermark(max_side=100)
    task.device = torch.device("cpu")
    task.mark = torch.ones(1, 4, 4, 8)
    out = task.render(torch.zeros(30, 60, 3, dtype=torch.uint8))
    assert tuple(out.shape) == (50, 100, 3) and out.dtype == torch.uint8


def test_inputs_sharing_a_stem_get_distinct_outputs(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    Image.new("RGB", (10, 10), "red").save(tmp_path / "in" / "a.png")
    Image.new("RGB", (10, 10), "blue").save(tmp_path / "in" / "a.bmp")
    Image.new("RGB", (10, 10), "green").save(tmp_path / "in" / "b.png")
    task = ImageWatermark(str(tmp_path / "in"), max_side=8)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    assert sorted(p.name for p in (tmp_path / "w" / "out").iterdir()) == ["a.bmp.jpg", "a.png.jpg", "b.jpg"]


def test_exif_orientation_is_applied_before_resizing(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees clockwise to display
    Image.new("RGB", (40, 20), "white").save(tmp_path / "in" / "p.jpg", exif=exif)
    task = ImageWatermark(str(tmp_path / "in"), max_side=20)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    assert Image.open(tmp_path / "w" / "out" / "p.jpg").size == (10, 20)


def test_the_array_backend_renders_what_the_torch_backend_renders(tmp_path: Path) -> None:
    pixels = np.asarray(Image.fromarray(np.random.default_rng(3).integers(0, 256, (123, 211, 3), dtype=np.uint8))
                        .filter(ImageFilter.SMOOTH))
    outputs = []
    for backend in ("torch", "array"):
        task = ImageWatermark(str(SAMPLE_PHOTOS_DIR), max_side=97, backend=backend)
        task.setup(make_ctx(tmp_path / backend))
        out = task.render(torch.from_numpy(pixels.copy())) if backend == "torch" else task.render_array(pixels)
        outputs.append(np.asarray(out, dtype=float))
    assert outputs[0].shape == outputs[1].shape == (57, 97, 3)
    assert np.abs(outputs[0] - outputs[1]).max() <= 2 and np.abs(outputs[0] - outputs[1]).mean() < 0.5


@pytest.mark.parametrize(("size_in", "size_out"), [(100, 37), (37, 100), (64, 64), (5, 1)])
def test_resample_rows_are_normalised_tent_weights(size_in: int, size_out: int) -> None:
    rows, cols, weights = resample_matrix(size_in, size_out)
    dense = np.zeros((size_out, size_in))
    np.add.at(dense, (rows, cols), weights)
    assert np.allclose(dense.sum(axis=1), 1.0, atol=1e-6)
    assert (weights > 0).all() and cols.min() >= 0 and cols.max() < size_in
    ramp = np.arange(size_in, dtype=float)  # a linear ramp stays linear (away from the edges)
    mid = slice(size_out // 4, max(size_out // 4 + 1, 3 * size_out // 4))
    centres = (np.arange(size_out) + 0.5) * size_in / size_out - 0.5
    assert np.allclose((dense @ ramp)[mid], centres[mid], atol=0.51)


def test_resumed_task_on_the_array_backend_neither_loses_nor_duplicates_images(tmp_path: Path) -> None:
    inputs = _make_inputs(tmp_path / "in", count=7)

    def factory() -> ImageWatermark:
        return ImageWatermark(str(inputs), max_side=24, batch_size=2, format="png", backend="array")

    whole = factory()
    whole.setup(make_ctx(tmp_path / "whole"))
    run_to_end(whole)
    resumed = run_interrupted(factory, tmp_path / "resumed", stop_after=2)
    assert resumed.done()
    assert _outputs(tmp_path / "whole" / "out") == _outputs(tmp_path / "resumed" / "out")


def test_the_codec_is_nvjpeg_only_on_a_gpu_that_offers_it() -> None:
    assert pick_codec("auto", "cpu") == "pillow"
    assert pick_codec("auto", "cuda:0", available=True) == "nvjpeg"
    assert pick_codec("auto", "cuda:0", available=False) == "pillow"
    assert pick_codec("pillow", "cuda:0", available=True) == "pillow"
    with pytest.raises(ConfigError, match="codec nvjpeg needs a GPU"):
        pick_codec("nvjpeg", "cpu")
    with pytest.raises(ConfigError, match="codec must be"):
        ImageWatermark(codec="gif")


def test_missing_inputs_are_refused_when_the_task_is_built(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match="input directory not found"):
        ImageWatermark(str(tmp_path / "nope"))
    with pytest.raises(DataFormatError, match="watermark image not found"):
        ImageWatermark(watermark=str(tmp_path / "mark.png"))
