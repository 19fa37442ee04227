"""Loading the images a request names by URL: what is allowed, and decoding without surprises.

Three kinds of URL, each refused unless allowed:

- ``data:image/...;base64,...`` data URLs: always allowed (the bytes are in the request);
- ``file:///abs/path``: only under `allowed_local_media_path` (off when unset). The path is
  resolved (symlinks, ``..``) and must stay inside that folder; the file opened is checked again
  (a symlink swapped in after the check is caught) and must be a regular file;
- ``http(s)://host/...``: only when `host` is one of `allowed_media_domains` (off by default),
  fetched with a size limit enforced while streaming, a total timeout, no proxy or .netrc from the
  environment, and redirects followed only within the same host.

Decoding: `PIL.Image.open` on a few common formats, a pixel-count limit checked before any pixel
is decoded (decompression bombs), `load()` (truncated data fails here, not later), the first frame
of an animation, then RGB as transformers' image processors make it (`convert_to_rgb`:
transparency composited onto white). Every refusal is a ValueError naming the problem.

`MediaConnector.load_images` is the async entry point of the server: network reads are awaited,
while reading files, base64 and decoding run in a worker thread (`asyncio.to_thread`), so neither
the event loop nor the engine thread ever decodes an image. `load_image` is the blocking form
(`LLM.chat`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import re
import stat
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_FETCH_TIMEOUT_S",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "IMAGE_FORMATS",
    "ImageLoadError",
    "MediaConnector",
    "decode_image",
    "to_rgb",
]

DEFAULT_MAX_BYTES = 20 << 20  # 20 MiB: the largest encoded image accepted
DEFAULT_FETCH_TIMEOUT_S = 10.0  # a remote image's whole fetch
DEFAULT_MAX_PIXELS = 1 << 26  # ~67 megapixels (8192 x 8192; a 48 MP photo fits): past it, a decompression bomb
MAX_REDIRECTS = 5
# the formats decoded (PIL's names); PIL's rarer plugins never see request bytes
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # JPEG covers MPO (multi-picture) files
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)$", re.S)


class ImageLoadError(ValueError):
    """Image `index` of a `load_images` call could not be loaded, for `reason`."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index}: {reason}")
        self.index = index
        self.reason = reason


@dataclass(frozen=True)
class MediaConnector:
    """Where images may come from, and how much of them is accepted.

    `allowed_local_media_path`: a folder whose files `file://` URLs may name (None: none);
    `allowed_media_domains`: hosts `http(s)://` URLs may name (empty: none);
    `max_bytes`: the largest encoded image (data URL, file or download);
    `fetch_timeout_s`: the longest a remote image's whole fetch may take;
    `max_pixels`: the most pixels (width x height) a decoded image may have."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        root = self.allowed_local_media_path
        if root is not None:
            if not os.path.isabs(root):
                root = os.path.abspath(root)
            if not os.path.isdir(root):
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder")
            object.__setattr__(self, "allowed_local_media_path", os.path.realpath(root))
        if isinstance(self.allowed_media_domains, str):
            object.__setattr__(self, "allowed_media_domains", (self.allowed_media_domains,))
        domains = tuple(d.strip().lower().rstrip(".").strip("[]") for d in self.allowed_media_domains if d and d.strip())
        for d in domains:
            if not _is_host(d):
                raise ValueError(f"allowed_media_domains: {d!r} is not a host name (no scheme, port or path: "
                                 "e.g. images.example.com)")
        object.__setattr__(self, "allowed_media_domains", domains)
        if not (isinstance(self.max_bytes, int) and self.max_bytes >= 1):
            raise ValueError(f"media_max_bytes must be a positive number of bytes, got {self.max_bytes!r}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"media_fetch_timeout must be a positive number of seconds, got {self.fetch_timeout_s!r}")
        if not (isinstance(self.max_pixels, int) and self.max_pixels >= 1):
            raise ValueError(f"max_pixels must be a positive integer, got {self.max_pixels!r}")

    # ---- the entry points -------------------------------------------------------------------

    def load_image(self, url: str) -> Any:
        """The RGB PIL image `url` names (blocking: files, base64, downloads and decoding)."""
        kind = self._kind(url)
        if kind == "http":
            return self.decode(self._fetch_sync(url))
        return self.decode(self._read_local(url) if kind == "file" else self._read_data_url(url))

    async def load_images(self, urls: list[str]) -> list[Any]:
        """The RGB PIL images of `urls`, in order. Every URL is checked before anything is read;
        downloads are awaited (concurrently), reading and decoding run in worker threads."""
        for i, url in enumerate(urls):
            try:
                self._kind(url)
            except ValueError as e:
                raise ImageLoadError(i, str(e)) from None
        results = await asyncio.gather(*(self._load_async(u, self._kind(u)) for u in urls), return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, ValueError):
                raise ImageLoadError(i, str(r)) from None
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def _load_async(self, url: str, kind: str) -> Any:
        if kind == "http":
            return await asyncio.to_thread(self.decode, await self._fetch_async(url))
        return await asyncio.to_thread(self._load_local_or_data, url, kind)

    def _load_local_or_data(self, url: str, kind: str) -> Any:
        try:
            data = self._read_local(url) if kind == "file" else self._read_data_url(url)
        except OSError as e:  # a read error on an opened file
            raise ValueError(f"cannot read image file: {e.strerror or e}") from None
        return self.decode(data)

    def decode(self, data: bytes) -> Any:
        return decode_image(data, self.max_pixels)

    # ---- URL kinds ----------------------------------------------------------------------------

    def _kind(self, url: Any) -> str:
        """"data", "file" or "http", after the checks that need no I/O (ValueError otherwise)."""
        if not isinstance(url, str) or not url:
            raise ValueError("an image URL must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return "data"
        if scheme == "file":
            if self.allowed_local_media_path is None:
                raise ValueError("file:// image URLs are not allowed on this server (its operator can allow a folder "
                                 "with --allowed-local-media-path); send the image as a data:image/...;base64 URL")
            return "file"
        if scheme in ("http", "https"):
            host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
            if not host:
                raise ValueError(f"image URL {_short(url)!r} has no host")
            if host not in self.allowed_media_domains:
                if not self.allowed_media_domains:
                    raise ValueError(f"remote image URLs are not allowed on this server (host {host!r}); send the "
                                     "image as a data:image/...;base64 URL (the operator can allow hosts with "
                                     "--allowed-media-domains)")
                raise ValueError(f"image host {host!r} is not allowed on this server; allowed: "
                                 f"{', '.join(self.allowed_media_domains)} (--allowed-media-domains)")
            return "http"
        raise ValueError(f"unsupported image URL scheme {scheme + ':' if scheme else _short(url)!r}; use a "
                         "data:image/...;base64 URL (or, where the server allows them, http(s):// or file://)")

    def _read_data_url(self, url: str) -> bytes:
        m = _DATA_URL.match(url)
        if m is None:
            raise ValueError("malformed data URL; expected data:image/<format>;base64,<data>")
        mime = m.group("mime").strip().lower()
        if not mime.startswith("image/"):
            raise ValueError(f"data URL media type {mime or '(none)'!r} is not an image; expected data:image/<format>;base64,...")
        if "base64" not in [p.strip().lower() for p in m.group("params").split(";")]:
            raise ValueError("data URL is not base64-encoded; expected data:image/<format>;base64,<data>")
        text = re.sub(r"\s+", "", m.group("data"))
        if len(text) * 3 // 4 > self.max_bytes + 3:
            raise ValueError(f"image is larger than the {self.max_bytes}-byte limit (media_max_bytes)")
        if "-" in text or "_" in text:  # the URL-safe alphabet
            text = text.replace("-", "+").replace("_", "/")
        text += "=" * (-len(text) % 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("data URL holds invalid base64") from None
        if not data:
            raise ValueError("data URL holds no data")
        if len(data) > self.max_bytes:
            raise ValueError(f"image is larger than the {self.max_bytes}-byte limit (media_max_bytes)")
        return data

    def _read_local(self, url: str) -> bytes:
        root = self.allowed_local_media_path
        assert root is not None
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {_short(url)!r} names host {parts.netloc!r}; use file:///absolute/path")
        if parts.query or parts.fragment:
            raise ValueError("a file URL takes no query or fragment")
        path = urllib.parse.unquote(parts.path)
        if "\x00" in path or not os.path.isabs(path):
            raise ValueError(f"file URL {_short(url)!r} does not name an absolute path; use file:///absolute/path")
        real = os.path.realpath(path)
        if not _inside(real, root):
            raise ValueError(f"{path!r} is outside the folder this server allows images from (--allowed-local-media-path)")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise ValueError(f"cannot open image file {path!r}: {e.strerror or e}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ValueError(f"{path!r} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            opened = f"/proc/self/fd/{fd}"
            if os.path.exists(opened) and not _inside(os.path.realpath(opened), root):  # swapped after the check
                raise ValueError(f"{path!r} is outside the folder this server allows images from (--allowed-local-media-path)")
            if st.st_size > self.max_bytes:
                raise ValueError(f"image file {path!r} is larger than the {self.max_bytes}-byte limit (media_max_bytes)")
            data = f.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:
            raise ValueError(f"image file {path!r} is larger than the {self.max_bytes}-byte limit (media_max_bytes)")
        return data

    # ---- downloads ----------------------------------------------------------------------------

    def _redirect(self, url: str, response: Any, hops: int) -> str:
        """The URL a redirect response points to, when it stays on the same host."""
        location = response.headers.get("location")
        if not location:
            raise ValueError(f"image URL {_short(url)!r}: a redirect without a Location")
        if hops >= MAX_REDIRECTS:
            raise ValueError(f"image URL {_short(url)!r}: more than {MAX_REDIRECTS} redirects")
        target = urllib.parse.urljoin(url, location)
        old, new = urllib.parse.urlsplit(url), urllib.parse.urlsplit(target)
        if new.scheme not in ("http", "https") or (new.hostname or "").lower() != (old.hostname or "").lower():
            raise ValueError(f"image URL {_short(url)!r} redirects to another host ({new.hostname or new.scheme!r}); "
                             "redirects are followed only within the same host")
        return target

    def _check_response(self, url: str, response: Any) -> None:
        if response.status_code != 200:
            raise ValueError(f"fetching image {_short(url)!r} failed: HTTP {response.status_code}")
        length = response.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_bytes:
            raise ValueError(f"image at {_short(url)!r} is larger than the {self.max_bytes}-byte limit (media_max_bytes)")

    def _too_large(self, url: str) -> ValueError:
        return ValueError(f"image at {_short(url)!r} is larger than the {self.max_bytes}-byte limit (media_max_bytes)")

    def _timeout(self, url: str) -> ValueError:
        return ValueError(f"fetching image {_short(url)!r} took longer than {self.fetch_timeout_s:g} s")

    async def _fetch_async(self, url: str) -> bytes:
        import httpx

        try:
            async with asyncio.timeout(self.fetch_timeout_s):
                async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=self.fetch_timeout_s) as client:
                    for hops in range(MAX_REDIRECTS + 1):
                        async with client.stream("GET", url) as r:
                            if r.is_redirect:
                                url = self._redirect(url, r, hops)
                                continue
                            self._check_response(url, r)
                            buf = bytearray()
                            async for chunk in r.aiter_bytes():
                                buf += chunk
                                if len(buf) > self.max_bytes:
                                    raise self._too_large(url)
                            return bytes(buf)
        except TimeoutError:
            raise self._timeout(url) from None
        except httpx.TimeoutException:
            raise self._timeout(url) from None
        except httpx.HTTPError as e:
            raise ValueError(f"fetching image {_short(url)!r} failed: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    def _fetch_sync(self, url: str) -> bytes:
        import httpx

        deadline = time.monotonic() + self.fetch_timeout_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(url)
            return remaining

        try:
            with httpx.Client(follow_redirects=False, trust_env=False) as client:
                for hops in range(MAX_REDIRECTS + 1):
                    with client.stream("GET", url, timeout=left()) as r:
                        if r.is_redirect:
                            url = self._redirect(url, r, hops)
                            continue
                        self._check_response(url, r)
                        buf = bytearray()
                        for chunk in r.iter_bytes():
                            buf += chunk
                            if len(buf) > self.max_bytes:
                                raise self._too_large(url)
                            left()
                        return bytes(buf)
        except httpx.TimeoutException:
            raise self._timeout(url) from None
        except httpx.HTTPError as e:
            raise ValueError(f"fetching image {_short(url)!r} failed: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """An RGB PIL image from encoded bytes (ValueError: not an image, truncated, too many pixels)."""
    from PIL import Image, UnidentifiedImageError

    Image.init()  # registers every plugin (WebP, TIFF, MPO are not among preinit's)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the limit below is ours
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise ValueError(f"the data is not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except Image.DecompressionBombError:
        raise ValueError(f"the image has too many pixels (more than {max_pixels}): refused as a possible "
                         "decompression bomb") from None
    except Exception as e:  # a malformed header
        raise ValueError(f"the image cannot be decoded: {e}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"the image is empty ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height}, {width * height} pixels, more than the {max_pixels} "
                         "allowed: refused as a possible decompression bomb; send a smaller image")
    try:
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)  # an animation: its first frame
        image.load()
    except Exception as e:  # truncated or corrupt pixel data
        raise ValueError(f"the image cannot be decoded (truncated or corrupt): {e}") from None
    try:
        return to_rgb(image)
    except Exception as e:
        raise ValueError(f"the image's mode {image.mode!r} cannot be converted to RGB: {e}") from None


def to_rgb(image: Any) -> Any:
    """RGB as transformers' `convert_to_rgb` makes it: transparency (an alpha band, or a palette or
    grey image's transparent colour) composited onto white, any other mode converted."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):  # high bit depth grey: scale to 8 bits
        import numpy as np

        a = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or (image.mode == "I" and a.max(initial=0) > 255) else 255.0
        if image.mode == "F":
            top = 1.0 if a.max(initial=0) <= 1.0 else 255.0
        grey = Image.fromarray(np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
        return grey.convert("RGB")
    return image.convert("RGB")


def _is_host(name: str) -> bool:
    import ipaddress

    if ":" in name:  # an IPv6 address, or a host with a port
        try:
            ipaddress.IPv6Address(name)
            return True
        except ValueError:
            return False
    return bool(re.fullmatch(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?", name))


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:
        return False


def _short(url: str, n: int = 80) -> str:
    return url if len(url) <= n else url[: n - 3] + "..."
