"""portside.multimodal.media: images from data URLs, allowed local files and allowed hosts; every
refusal a ValueError naming the problem; decoding to RGB as transformers' processors do."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from portside.multimodal.media import ImageLoadError, MediaConnector, decode_image


def png(image: Image.Image, fmt: str = "PNG", **save: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


RED = Image.new("RGB", (6, 4), (200, 10, 10))


# ---- data URLs ------------------------------------------------------------------------------


def test_data_url_roundtrip():
    out = MediaConnector().load_image(data_url(png(RED)))
    assert out.mode == "RGB" and out.size == (6, 4) and out.getpixel((0, 0)) == (200, 10, 10)


def test_data_url_jpeg_and_urlsafe_unpadded_base64():
    raw = png(RED, "JPEG")
    text = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    out = MediaConnector().load_image(f"data:image/jpeg;base64,{text}")
    assert out.size == (6, 4) and out.mode == "RGB"


@pytest.mark.parametrize("url, needle", [
    ("data:image/png;base64,@@@not*base64", "invalid base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "not base64"),
    ("data:image/png;base64", "malformed data URL"),
    ("data:image/png;base64,", "no data"),
    ("data:image/png;base64," + base64.b64encode(b"definitely not an image").decode(), "not an image in a supported format"),
])  # fmt: skip
def test_bad_data_urls(url: str, needle: str):
    with pytest.raises(ValueError, match=needle):
        MediaConnector().load_image(url)


def test_data_url_size_limit():
    url = data_url(png(RED))
    with pytest.raises(ValueError, match="larger than the 50-byte limit"):
        MediaConnector(max_bytes=50).load_image(url)


@pytest.mark.parametrize("url, needle", [
    ("ftp://example.com/a.png", "unsupported image URL scheme"),
    ("/etc/passwd", "unsupported image URL scheme"),
    ("", "non-empty string"),
    ("https://example.com/cat.png", "remote image URLs are not allowed"),
    ("http://169.254.169.254/latest", "remote image URLs are not allowed"),
    ("file:///etc/passwd", "file:// image URLs are not allowed"),
])  # fmt: skip
def test_refused_by_default(url: str, needle: str):
    with pytest.raises(ValueError, match=needle):
        MediaConnector().load_image(url)


# ---- decoding -------------------------------------------------------------------------------


def test_truncated_and_garbage():
    data = png(Image.effect_noise((64, 64), 50).convert("RGB"))
    with pytest.raises(ValueError, match="truncated or corrupt|cannot be decoded"):
        decode_image(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"\x00" * 100)
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"")


def test_decompression_bomb_refused_before_decoding():
    bomb = png(Image.new("1", (9000, 9000)))  # 81 M pixels in a few kB
    assert len(bomb) < 100_000
    with pytest.raises(ValueError, match="decompression bomb"):
        decode_image(bomb)
    with pytest.raises(ValueError, match="decompression bomb"):
        decode_image(png(RED), max_pixels=10)
    assert decode_image(png(RED), max_pixels=24).size == (6, 4)


def test_format_outside_the_allowed_list_refused():
    data = png(RED, "PPM")  # PIL decodes PPM, but request bytes only reach the common formats
    with pytest.raises(ValueError, match="not an image in a supported format"):
        decode_image(data)


@pytest.mark.parametrize("mode, expected", [
    ("RGBA", (255, 255, 255)),  # transparent: composited onto white, as transformers' convert_to_rgb
    ("LA", (255, 255, 255)),
    ("L", (0, 0, 0)),
    ("1", (0, 0, 0)),
    ("RGB", (0, 0, 0)),
])  # fmt: skip
def test_modes_become_rgb(mode: str, expected: tuple[int, int, int]):
    out = decode_image(png(Image.new(mode, (3, 3))))
    assert out.mode == "RGB" and out.getpixel((1, 1)) == expected


def test_rgba_half_transparent_matches_transformers():
    from transformers.image_transforms import convert_to_rgb

    im = Image.new("RGBA", (2, 2), (100, 0, 200, 128))
    ours = decode_image(png(im))
    theirs = convert_to_rgb(im, return_numpy=False) if "return_numpy" in convert_to_rgb.__code__.co_varnames else convert_to_rgb(im)
    assert ours.tobytes() == theirs.tobytes()


def test_palette_with_transparency_and_grey_16_bit():
    p = Image.new("P", (2, 2), 1)
    p.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert decode_image(png(p)).getpixel((0, 0)) == (10, 20, 30)
    assert decode_image(png(p, transparency=1)).getpixel((0, 0)) == (255, 255, 255)
    grey16 = Image.new("I;16", (2, 2), 65535)
    assert decode_image(png(grey16)).getpixel((0, 0)) == (255, 255, 255)


def test_animation_first_frame_and_cmyk_jpeg():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    r, g, b = decode_image(buf.getvalue()).getpixel((0, 0))
    assert r > 200 and b < 50
    assert decode_image(png(Image.new("CMYK", (3, 3)), "JPEG")).mode == "RGB"


# ---- local files ----------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "media", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "cat.png").write_bytes(png(RED))
    (root / "sub").mkdir()
    (root / "sub" / "with space.png").write_bytes(png(RED))
    (outside / "secret.png").write_bytes(png(RED))
    return root, outside


def test_local_file_allowed(media_dir: tuple[Path, Path]):
    root, _ = media_dir
    m = MediaConnector(allowed_local_media_path=str(root))
    assert m.load_image(f"file://{root}/cat.png").size == (6, 4)
    assert m.load_image(f"file://{root}/sub/with%20space.png").size == (6, 4)
    assert m.load_image(f"file://localhost{root}/cat.png").size == (6, 4)
    inner = root / "sub" / "link.png"  # a symlink that stays inside is fine
    inner.symlink_to(root / "cat.png")
    assert m.load_image(f"file://{inner}").size == (6, 4)


def test_local_file_escapes_refused(media_dir: tuple[Path, Path]):
    root, outside = media_dir
    m = MediaConnector(allowed_local_media_path=str(root))
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "dirlink").symlink_to(outside)
    for url in (f"file://{outside}/secret.png", f"file://{root}/../outside/secret.png", f"file://{root}/escape.png",
                f"file://{root}/dirlink/secret.png", f"file://{root}/%2e%2e/outside/secret.png", f"file://{root}x/cat.png",
                "file:///etc/passwd"):
        with pytest.raises(ValueError, match="outside the folder"):
            m.load_image(url)
    with pytest.raises(ValueError, match="names host"):
        m.load_image(f"file://evil.example{root}/cat.png")
    with pytest.raises(ValueError, match="absolute path"):
        m.load_image("file:cat.png")
    with pytest.raises(ValueError, match="cannot open"):
        m.load_image(f"file://{root}/missing.png")
    with pytest.raises(ValueError, match="not a regular file"):
        m.load_image(f"file://{root}/sub")
    os.mkfifo(root / "fifo")  # would block a plain open
    with pytest.raises(ValueError, match="not a regular file"):
        m.load_image(f"file://{root}/fifo")


def test_allowed_root_itself_behind_a_symlink(media_dir: tuple[Path, Path], tmp_path: Path):
    root, _ = media_dir
    (tmp_path / "alias").symlink_to(root)
    m = MediaConnector(allowed_local_media_path=str(tmp_path / "alias"))
    assert m.load_image(f"file://{tmp_path}/alias/cat.png").size == (6, 4)
    assert m.load_image(f"file://{root}/cat.png").size == (6, 4)


def test_local_file_size_limit(media_dir: tuple[Path, Path]):
    root, _ = media_dir
    with pytest.raises(ValueError, match="larger than the 20-byte limit"):
        MediaConnector(allowed_local_media_path=str(root), max_bytes=20).load_image(f"file://{root}/cat.png")


def test_bad_settings():
    with pytest.raises(ValueError, match="not a folder"):
        MediaConnector(allowed_local_media_path="/no/such/folder")
    with pytest.raises(ValueError, match="not a host name"):
        MediaConnector(allowed_media_domains=("https://example.com",))
    with pytest.raises(ValueError, match="media_max_bytes"):
        MediaConnector(max_bytes=0)
    with pytest.raises(ValueError, match="media_fetch_timeout"):
        MediaConnector(fetch_timeout_s=0)
    assert MediaConnector(allowed_media_domains=("Images.Example.COM.", "[::1]")).allowed_media_domains == \
        ("images.example.com", "::1")


# ---- remote images --------------------------------------------------------------------------

IMAGE = png(RED)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/cat.png":
            self._send(200, IMAGE)
        elif self.path == "/big":  # no Content-Length: the limit holds while streaming
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\x00" * 1024)
        elif self.path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(10 << 20))
            self.end_headers()
        elif self.path == "/slow":  # a trickle that never ends within the timeout
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"\x00")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        elif self.path == "/same-host":
            self._redirect(f"http://127.0.0.1:{port}/cat.png")
        elif self.path == "/other-host":
            self._redirect(f"http://localhost:{port}/cat.png")
        elif self.path == "/loop":
            self._redirect("/loop")
        elif self.path == "/garbage":
            self._send(200, b"<html>not an image</html>")
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _remote(**kw: Any) -> MediaConnector:
    return MediaConnector(allowed_media_domains=("127.0.0.1",), **kw)


def _load_both(m: MediaConnector, url: str) -> list[Any]:
    """The blocking and the async loader on one URL: results (or their ValueErrors)."""
    out: list[Any] = []
    for load in (m.load_image, lambda u: asyncio.run(m.load_images([u]))[0]):
        try:
            out.append(load(url))
        except ValueError as e:
            out.append(e)
    return out


def test_remote_allowed_domain(http_base: str):
    for out in _load_both(_remote(), f"{http_base}/cat.png") + _load_both(_remote(), f"{http_base}/same-host"):
        assert isinstance(out, Image.Image) and out.size == (6, 4)


@pytest.mark.parametrize("path, needle", [
    ("/other-host", "redirects to another host"),
    ("/loop", "more than 5 redirects"),
    ("/missing", "HTTP 404"),
    ("/garbage", "not an image"),
    ("/big", "larger than the 10000-byte limit"),
    ("/big-declared", "larger than the 10000-byte limit"),
])  # fmt: skip
def test_remote_refusals(http_base: str, path: str, needle: str):
    for out in _load_both(_remote(max_bytes=10_000), http_base + path):
        assert isinstance(out, ValueError) and needle in str(out), out


def test_remote_timeout(http_base: str):
    t0 = time.monotonic()
    for out in _load_both(_remote(fetch_timeout_s=0.5), f"{http_base}/slow"):
        assert isinstance(out, ValueError) and "took longer than 0.5 s" in str(out), out
    assert time.monotonic() - t0 < 4


def test_remote_host_not_in_the_list(http_base: str):
    url = f"{http_base}/cat.png".replace("127.0.0.1", "localhost")
    with pytest.raises(ValueError, match="host 'localhost' is not allowed"):
        _remote().load_image(url)


# ---- the async loader -----------------------------------------------------------------------


def test_load_images_in_order_off_the_loop(media_dir: tuple[Path, Path]):
    root, _ = media_dir
    threads: list[str] = []

    class Recording(MediaConnector):
        def decode(self, data: bytes) -> Any:
            threads.append(threading.current_thread().name)
            return super().decode(data)

    m = Recording(allowed_local_media_path=str(root))
    blue = data_url(png(Image.new("RGB", (2, 3), (0, 0, 255))))

    async def main() -> tuple[list[Any], str]:
        return await m.load_images([blue, f"file://{root}/cat.png"]), threading.current_thread().name

    images, loop_thread = asyncio.run(main())
    assert [im.size for im in images] == [(2, 3), (6, 4)]
    assert len(threads) == 2 and loop_thread not in threads


def test_load_images_names_the_failing_image():
    with pytest.raises(ImageLoadError) as info:
        asyncio.run(MediaConnector().load_images([data_url(IMAGE), "https://example.com/x.png"]))
    assert info.value.index == 1 and "remote image URLs are not allowed" in info.value.reason
    with pytest.raises(ImageLoadError) as info:
        asyncio.run(MediaConnector().load_images([data_url(IMAGE), data_url(b"garbage")]))
    assert info.value.index == 1 and str(info.value).startswith("image 1: ")
