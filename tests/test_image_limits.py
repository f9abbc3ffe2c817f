"""Preprocessing limits and safety: images checked from their header, mmserve's pixel limit the
only one in force, user text that would break the tokenizer refused with a clear error, image
work done outside any lock with the same tokens and pixels as the Hugging Face processor, and
the memory it touched given back on request.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from mmserve.demo.checkpoint import demo_model_path
from mmserve.processing.images import InvalidInputError, image_hash, load_image
from mmserve.processing.processor import InputProcessor
from tests.conftest import make_image

PILLOW_DEFAULT_LIMIT = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS as Pillow ships it


def _png_header(width: int, height: int) -> bytes:
    """A PNG with a valid header (1-bit greyscale) and no pixel data: what Pillow reads when it
    opens a file, without anything to decode."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(text: str, images: list) -> dict:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "images": images}


@cache
def _processor(path: str, max_image_pixels: int = 50_000_000) -> InputProcessor:
    return InputProcessor(path, AutoConfig.from_pretrained(path, local_files_only=True),
                          max_image_pixels)


@pytest.fixture(scope="module")
def clip_processor(clip_llama: str) -> InputProcessor:
    return _processor(clip_llama)


@pytest.fixture
def pillow_default_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from Pillow's shipped limit; whatever the test raises it to is undone after."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOW_DEFAULT_LIMIT)


# ------------------------------------------------------------------ 1. thin images
THIN = (40, 1_250_000)  # 50 M pixels: within the default pixel limit, 31,250:1


@pytest.fixture(scope="module")
def thin_png() -> bytes:
    return _png(Image.new("1", THIN))  # 7 KB on disk; 150 MB once decoded to RGB


@pytest.mark.parametrize("source", ["bytes", "data URL", "path", "PIL image"])
def test_thin_image_is_refused_before_any_expensive_work(source: str, thin_png: bytes,
                                                         tmp_path) -> None:
    path = tmp_path / "thin.png"
    path.write_bytes(thin_png)
    image = {"bytes": thin_png, "data URL": _data_url(thin_png), "path": str(path),
             "PIL image": Image.new("1", THIN)}[source]
    t0 = time.perf_counter()
    with pytest.raises(InvalidInputError, match=r"31250:1, over mmserve's limit of 200:1"):
        load_image(image, 50_000_000)
    assert time.perf_counter() - t0 < 0.5  # the image is never decoded


def test_aspect_ratio_is_checked_from_the_header(thin_png: bytes) -> None:
    # No pixel data at all: only a header check can give this error (else "cannot decode").
    with pytest.raises(InvalidInputError, match="MAX_IMAGE_ASPECT_RATIO"):
        load_image(_png_header(*THIN), 50_000_000)


@pytest.mark.parametrize("size", [(200, 1), (1, 200), (400, 2)])
def test_aspect_ratio_up_to_200_to_1_is_allowed(size: tuple[int, int]) -> None:
    assert load_image(Image.new("L", size), 1_000).size == size


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (4001, 20)])
def test_aspect_ratio_over_200_to_1_is_refused(size: tuple[int, int]) -> None:
    with pytest.raises(InvalidInputError, match="Crop the image, or pad its short side"):
        load_image(_png(Image.new("L", size)), 1_000_000)


def test_thin_image_in_a_chat_request_is_an_invalid_input(clip_processor: InputProcessor,
                                                           thin_png: bytes) -> None:
    prompt = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(thin_png)}},
        {"type": "text", "text": "what is this?"}]}]}
    t0 = time.perf_counter()
    with pytest.raises(InvalidInputError, match="aspect ratio"):
        clip_processor.process(prompt)
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------ 2. one pixel limit
@pytest.mark.usefixtures("pillow_default_limit")
def test_max_image_pixels_above_pillows_limit_is_honoured() -> None:
    header = _png_header(12_000, 12_000)  # 144 M pixels: Pillow alone warns (error with us)
    # Past the header check, decoding fails for want of pixel data, not for Pillow's limit.
    with pytest.raises(InvalidInputError) as info:
        load_image(header, 200_000_000)
    assert "decompression bomb" not in str(info.value)
    assert str(PILLOW_DEFAULT_LIMIT) not in str(info.value)

    from mmserve.processing.images import check_image  # the header-only path
    assert check_image(header, 200_000_000) == (12_000, 12_000)
    assert Image.MAX_IMAGE_PIXELS == 200_000_000  # raised to ours, process-wide


@pytest.mark.usefixtures("pillow_default_limit")
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize(("size", "max_pixels"), [
    ((300, 300), 10_000),  # under Pillow's limit: mmserve's check
    ((12_000, 12_000), 100_000_000),  # Pillow would warn (between its limit and twice it)
    ((20_000, 20_000), 100_000_000),  # Pillow refuses at open (over twice its limit)
])
def test_every_pixel_limit_error_names_mmserves_setting(size: tuple[int, int],
                                                        max_pixels: int) -> None:
    with pytest.raises(InvalidInputError) as info:
        load_image(_png_header(*size), max_pixels)
    message = str(info.value)
    assert f"exceeds the limit of {max_pixels} pixels" in message
    assert "--max-image-pixels" in message and "max_image_pixels" in message
    assert "decompression bomb" not in message


# ------------------------------------------------------------------ 3, 4. text that breaks
@pytest.mark.parametrize(("messages", "num_images", "where"), [
    ([{"role": "user", "content": [{"type": "text", "text": "look: <image> here"}]}], 0,
     "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<image>?"}]}],
     1, "messages[0].content[1].text"),
    ([{"role": "system", "content": "<image>"}, {"role": "user", "content": "hi"}], 0,
     "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "an <image>"}], 0,
     "messages[1].content"),
])
def test_image_placeholder_typed_as_text_is_an_invalid_input(
        clip_processor: InputProcessor, messages: list, num_images: int, where: str) -> None:
    images = [make_image(1, (30, 30))] * num_images
    with pytest.raises(InvalidInputError, match=r"image parts \(\{\"type\": \"image_url\"") as info:
        clip_processor.process({"messages": messages, "images": images})
    assert info.value.param == where
    assert where in str(info.value)


def test_prompt_form_still_counts_placeholders(clip_processor: InputProcessor) -> None:
    with pytest.raises(InvalidInputError, match="1 <image> placeholder.* but 0 image"):
        clip_processor.process({"prompt": "USER: <image>\nhi\nASSISTANT:", "images": []})
    ok = clip_processor.process({"prompt": "USER: <image>\nhi\nASSISTANT:",
                                 "images": [make_image(2, (20, 20))]})
    assert len(ok.images) == 1


@pytest.mark.parametrize(("prompt", "where"), [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "bad \ud800"}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "system", "content": "\udfff system"},
                   {"role": "user", "content": "hi"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x\ud83d"}]}, "messages[0].content"),
    ({"prompt": "USER: \ud800\nASSISTANT:"}, "prompt"),
])
def test_lone_surrogate_is_an_invalid_input(clip_processor: InputProcessor, prompt: dict,
                                            where: str) -> None:
    with pytest.raises(InvalidInputError, match="lone UTF-16 surrogate") as info:
        clip_processor.process(prompt)
    assert info.value.param == where
    assert str(info.value).startswith(where)


def test_surrogate_pair_is_text(clip_processor: InputProcessor) -> None:
    # "\ud83d\ude00" arrives from JSON as one character, which is fine.
    assert clip_processor.process(_chat("smile \U0001f600", [])).token_ids


# ------------------------------------------------------------------ 5. split processing
PARITY_IMAGES = [make_image(0, (40, 30)), make_image(1, (23, 57)),
                 make_image(2, (64, 64)).convert("L"), make_image(3, (100, 41)).convert("RGBA")]


def _prompts(n_images: int) -> list[dict]:
    images = PARITY_IMAGES[n_images:2 * n_images] if n_images else []
    raw = [_png(img) for img in images]
    chat = _chat("describe " * (n_images + 1) + "these", images)
    # PNG bytes go through decoding; touching placeholders through the prompt form.
    prompt = {"prompt": "USER: " + "<image>" * n_images + "\nwhat?\nASSISTANT:", "images": raw}
    system = {"messages": [{"role": "system", "content": "Be brief."},
                           *chat["messages"]], "images": raw}
    return [chat, prompt, system]


@pytest.mark.parametrize("model", ["clip-llama", "siglip-qwen2", "clip-mistral", "demo"])
def test_split_processing_equals_the_hugging_face_processor(
        checkpoints: dict[str, str], model: str) -> None:
    path = str(demo_model_path()) if model == "demo" else checkpoints[model]
    proc = _processor(path)
    for n_images in (0, 1, 2):
        for prompt in _prompts(n_images):
            out = proc.process(prompt)
            if "messages" in prompt:
                text, images = proc.render_chat(prompt["messages"], list(prompt["images"]))
            else:
                text, images = prompt["prompt"], prompt["images"]
            decoded = [load_image(im, proc.max_image_pixels) for im in images]
            ref = proc.processor(text=text, images=decoded or None, return_tensors="pt")
            assert out.token_ids == ref["input_ids"][0].tolist(), (model, prompt)
            assert len(out.images) == n_images
            ids = ref["input_ids"][0]
            for k, image in enumerate(out.images):
                assert torch.equal(image.pixel_values["pixel_values"], ref["pixel_values"][k:k + 1])
                assert image.hash == image_hash(decoded[k])
                span = ids[image.offset:image.end]
                assert image.length == proc.tokens_per_image
                assert bool((span == proc.image_token_id).all())
            assert int((ids == proc.image_token_id).sum()) == n_images * proc.tokens_per_image


def test_tokenizer_calls_are_serialized_and_image_work_is_not(
        clip_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads at once: results equal one thread's, never two tokenizer calls at a time,
    and the image processor runs in several threads together."""
    proc = InputProcessor(clip_llama, AutoConfig.from_pretrained(clip_llama), 1_000_000)
    prompts = [_chat(f"request {i}", [make_image(i, (30 + i, 40))]) for i in range(8)]
    expected = [proc.process(p) for p in prompts]

    active = {"tokenizer": 0, "image": 0}
    most = {"tokenizer": 0, "image": 0}
    count_lock = threading.Lock()

    def spy(kind: str, call):
        def wrapper(self, *args, **kwargs):
            with count_lock:
                active[kind] += 1
                most[kind] = max(most[kind], active[kind])
            try:
                time.sleep(0.03)  # widen the window in which calls could overlap
                return call(self, *args, **kwargs)
            finally:
                with count_lock:
                    active[kind] -= 1
        return wrapper

    for kind, obj in (("tokenizer", proc.tokenizer), ("image", proc.processor.image_processor)):
        monkeypatch.setattr(type(obj), "__call__", spy(kind, type(obj).__call__))
    results: dict[int, object] = {}
    start = threading.Barrier(4)

    def worker(indices: list[int]) -> None:
        start.wait()
        for i in indices:
            results[i] = proc.process(prompts[i])

    threads = [threading.Thread(target=worker, args=([t, t + 4],)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most["tokenizer"] == 1
    assert most["image"] >= 2
    for i, exp in enumerate(expected):
        assert results[i].token_ids == exp.token_ids
        assert torch.equal(results[i].images[0].pixel_values["pixel_values"],
                           exp.images[0].pixel_values["pixel_values"])


@pytest.fixture(scope="module")
def large_png() -> bytes:
    """A 6000 x 4000 photo-sized PNG (24 M pixels, under the default limit)."""
    w, h = 6000, 4000
    rgb = np.empty((h, w, 3), np.uint8)
    rgb[..., 0] = (np.arange(w) * 7 % 256)[None, :]
    rgb[..., 1] = (np.arange(h) * 5 % 256)[:, None]
    rgb[..., 2] = 90
    return _png(Image.fromarray(rgb))


def test_large_image_does_not_hold_up_a_small_request(clip_processor: InputProcessor,
                                                      large_png: bytes) -> None:
    big_started = threading.Event()
    times: dict[str, tuple[float, float]] = {}

    def run(name: str, prompt: dict) -> None:
        t0 = time.perf_counter()
        if name == "big":
            big_started.set()
        clip_processor.process(prompt)
        times[name] = (t0, time.perf_counter())

    big = threading.Thread(target=run, args=("big", _chat("what is this?", [large_png])))
    big.start()
    big_started.wait()
    time.sleep(0.05)  # let it get into decoding
    run("small", _chat("and this?", [make_image(4, (48, 48))]))
    big.join()
    big_time = times["big"][1] - times["big"][0]
    small_time = times["small"][1] - times["small"][0]
    assert times["small"][1] < times["big"][1]
    assert small_time < 0.2 * big_time, (small_time, big_time)


# ------------------------------------------------------------------ 6. memory
def test_processed_prompt_reports_its_preprocessing_peak(clip_processor: InputProcessor) -> None:
    assert clip_processor.process(_chat("no image", [])).preprocess_peak_bytes == 0
    img = make_image(5, (300, 200))
    out = clip_processor.process(_chat("one image", [img]))
    decoded = 300 * 200 * 3
    pixels = out.images[0].pixel_values["pixel_values"].nelement() * 4
    assert out.preprocess_peak_bytes >= decoded + pixels
    two = clip_processor.process(_chat("two", [img, make_image(6, (30, 20))]))
    assert two.preprocess_peak_bytes > out.preprocess_peak_bytes  # one more pixel tensor


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):  # no such name: not glibc
        return False


def _run_script(script: str, *args: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], check=True,
                          capture_output=True, text=True,
                          env=dict(os.environ, MMSERVE_KEEP_HEAP="1")).stdout.split()


@pytest.mark.skipif(not _glibc(), reason="malloc_trim is glibc's; elsewhere a no-op")
def test_release_free_memory_gives_back_what_preprocessing_kept() -> None:
    # A fresh interpreter: keep_freed_memory() is process-wide and cannot be undone.
    out = _run_script("""
        import os, threading
        import numpy as np, torch
        from mmserve.worker.cpu_allocator import keep_freed_memory, release_free_memory

        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        assert keep_freed_memory()
        def preprocess():  # 200 blocks of 1 MiB, freed, in a thread as the server does
            blocks = [np.ones(1 << 20, np.uint8) for _ in range(100)]
            blocks += [torch.ones(1 << 18) for _ in range(100)]
            preprocess.peak = rss()
        base = rss()
        t = threading.Thread(target=preprocess)
        t.start()
        t.join()
        kept = rss()
        released = release_free_memory()
        print(base, preprocess.peak, kept, rss(), int(released))
    """)
    base, peak, kept, after, released = map(int, out)
    mib = 1 << 20
    assert peak - base > 190 * mib
    assert kept - base > 150 * mib  # the problem: freed, yet kept in the process
    assert released == 1
    assert after - base < 0.2 * (peak - base), (base / mib, peak / mib, after / mib)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable peak RSS (/proc/self/clear_refs)")
def test_preprocess_peak_estimate_is_near_the_measured_peak(tmp_path) -> None:
    path = tmp_path / "photo.png"
    w, h = 3000, 2000
    rgb = np.zeros((h, w, 3), np.uint8)
    rgb[..., 0] = (np.arange(w) % 251)[None, :]
    rgb[..., 1] = (np.arange(h) % 241)[:, None]
    Image.fromarray(rgb).save(path)
    out = _run_script("""
        import sys
        from PIL import Image
        from transformers import AutoConfig
        from mmserve.processing.processor import InputProcessor

        model, path = sys.argv[1:3]
        proc = InputProcessor(model, AutoConfig.from_pretrained(model), 50_000_000)
        proc.process({"prompt": "<image>", "images": [Image.new("RGB", (300, 200))]})
        data = open(path, "rb").read()

        def status(field):  # in bytes
            line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
            return int(line.split()[1]) * 1024

        open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        base = status("VmHWM")
        out = proc.process({"prompt": "<image>", "images": [data]})
        peak = status("VmHWM")
        print(peak - base, out.preprocess_peak_bytes)
    """, str(demo_model_path()), str(path))
    measured, estimated = map(int, out)
    assert 0.7 < estimated / measured < 1.4, (measured, estimated)


ENGINE_RSS_SCRIPT = """
import sys, threading
from PIL import Image
from mmserve import LLM

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_model_len=96, max_num_seqs=2)
big = Image.new("RGB", (4000, 3000), (200, 30, 60))
prompt = {"messages": [{"role": "user", "content": [{"type": "image"},
          {"type": "text", "text": "x"}]}], "images": [big]}
llm.engine.process_request(prompt)  # warm-up: imports, first allocations
before = rss_mb()

def work():
    for _ in range(3):
        llm.engine.process_request(prompt)

threads = [threading.Thread(target=work) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
stats = llm.stats()
print(before, rss_mb(), stats["preprocess_peak_bytes"], stats["num_memory_releases"])
"""


def test_engine_gives_preprocessing_memory_back(clip_llama: str, tmp_path) -> None:
    """Finding 9: after heavy preprocessing on server threads, RSS stayed high for good (the
    CPU runner tells glibc to keep freed memory). The engine now returns it after requests
    whose preprocessing peak is large, and reports the peak in its stats (``/metrics``)."""
    import subprocess
    import sys

    script = tmp_path / "rss.py"
    script.write_text(ENGINE_RSS_SCRIPT)
    out = subprocess.run([sys.executable, str(script), clip_llama], capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    before, after, peak, releases = float(out[0]), float(out[1]), int(out[2]), int(out[3])
    assert releases >= 6 and peak > 100 << 20
    # Two threads each preprocessed 12-megapixel images (~180 MB peaks); what stays is at
    # most a small remainder, not a peak per thread.
    assert after - before < 60, (before, after)


def test_a_side_over_the_limit_is_refused_from_the_header() -> None:
    """Each side is bounded too: 40,000 x 1,000 is under the pixel cap and 40:1."""
    from mmserve.processing.images import MAX_IMAGE_SIDE

    with pytest.raises(InvalidInputError, match="MAX_IMAGE_SIDE"):
        load_image(_png_header(MAX_IMAGE_SIDE + 1, 1_000), 50_000_000)
    assert load_image(Image.new("L", (MAX_IMAGE_SIDE, 200)), 50_000_000).size == (
        MAX_IMAGE_SIDE, 200)


def test_one_lazily_opened_image_loads_from_many_threads_at_once(tmp_path: Path) -> None:
    """The same PIL image passed in several prompts, opened but not yet decoded (what
    ``Image.open`` gives), is preprocessed by several threads at once beside a GPU engine:
    Pillow's lazy load is not safe from two threads, so each must get the whole image."""
    path = tmp_path / "lazy.png"
    make_image(3, (256, 256)).save(path)
    expected = Image.open(path).convert("RGB").tobytes()
    def load(image: Image.Image, start: threading.Barrier) -> bytes:
        start.wait()
        return load_image(image, 10**7).tobytes()

    for _ in range(20):
        image = Image.open(path)  # header read, pixels not yet
        start = threading.Barrier(8)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(load, [image] * 8, [start] * 8))
        assert all(r == expected for r in results)


@pytest.mark.parametrize("data, fragment", [
    (b"definitely not an image", "its format is not one that can be read"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "cannot decode the image bytes as an image"),
])
def test_an_undecodable_image_says_why_without_python_objects(data: bytes,
                                                               fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=fragment) as e:
        load_image(data, 1_000_000)
    assert "object at 0x" not in str(e.value)
