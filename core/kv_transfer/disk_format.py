"""The disk tier's file format: one KV block per file, checksummed (pure Python; both halves use it).

    bytes 0..7    magic b"PSKVBLK1"
    bytes 8..11   header length N, little-endian uint32
    bytes 12..    the header: N bytes of UTF-8 JSON
                  {"fingerprint": str, "hash": int, "parent": int | null, "tokens": [int, ...],
                   "payload_bytes": int, "blake2b": hex digest (16 bytes) of the payload}
    then          the payload: the block in the neutral layout (`portside.contract.kv_transfer`)

A file is written under a temporary name and renamed, so a crash never leaves a half-written
file under a block's name; a file damaged later (truncated, flipped bits, another model's) fails
`read_payload` with `CorruptBlock` and is never used. Files are named by their block hash in a
folder named by the fingerprint (`folder`), so an engine only ever scans its own model's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct

__all__ = ["CorruptBlock", "MAGIC", "folder", "file_bytes", "path_of", "write", "read_header", "read_payload",
           "scan", "remove"]

MAGIC = b"PSKVBLK1"
_SUFFIX = ".kvb"


class CorruptBlock(Exception):
    """A block file that must not be used (its reason in the message)."""


def folder(root: str, fingerprint: str) -> str:
    """The folder (created) holding this model's block files under `root`."""
    path = os.path.join(root, f"portside-kv-{fingerprint}")
    os.makedirs(path, exist_ok=True)
    return path


def file_bytes(block_bytes: int, block_size: int) -> int:
    """A generous estimate of one file's size (the disk tier's capacity is counted in these)."""
    return len(MAGIC) + 4 + 200 + 12 * block_size + block_bytes


def path_of(folder_path: str, block_hash: int) -> str:
    return os.path.join(folder_path, f"{block_hash & (2**64 - 1):016x}{_SUFFIX}")


def write(path: str, fingerprint: str, block_hash: int, parent: int | None, tokens: tuple[int, ...],
          payload: bytes | memoryview) -> None:
    header = json.dumps({"fingerprint": fingerprint, "hash": block_hash, "parent": parent, "tokens": list(tokens),
                         "payload_bytes": len(payload),
                         "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(payload)
    os.replace(tmp, path)


def _header(f: object) -> dict:
    raw = f.read(len(MAGIC) + 4)  # type: ignore[attr-defined]
    if len(raw) < len(MAGIC) + 4 or raw[: len(MAGIC)] != MAGIC:
        raise CorruptBlock("not a portside KV block file (bad magic)")
    (n,) = struct.unpack("<I", raw[len(MAGIC) :])
    body = f.read(n)  # type: ignore[attr-defined]
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptBlock(f"unreadable header ({e})") from None
    if not isinstance(header, dict) or not {"fingerprint", "hash", "parent", "tokens", "payload_bytes", "blake2b"} <= set(header):
        raise CorruptBlock("header lacks fields")
    return header


def read_header(path: str) -> dict:
    with open(path, "rb") as f:
        return _header(f)


def read_payload(path: str, fingerprint: str, block_hash: int, parent: int | None, tokens: tuple[int, ...],
                 payload_bytes: int) -> bytes:
    """The payload of the file, verified against everything the caller expects; `CorruptBlock` otherwise."""
    try:
        with open(path, "rb") as f:
            header = _header(f)
            payload = f.read(payload_bytes + 1)
    except OSError as e:
        raise CorruptBlock(f"unreadable ({e.strerror})") from None
    if header["fingerprint"] != fingerprint:
        raise CorruptBlock("written by another model or layout")
    if header["hash"] != block_hash or header["parent"] != parent or tuple(header["tokens"]) != tuple(tokens):
        raise CorruptBlock("holds another block")
    if header["payload_bytes"] != payload_bytes or len(payload) != payload_bytes:
        raise CorruptBlock(f"payload is {len(payload)} bytes, expected {payload_bytes} (truncated?)")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
        raise CorruptBlock("checksum mismatch")
    return payload


def scan(folder_path: str, fingerprint: str) -> tuple[list[tuple[str, int, int | None, tuple[int, ...]]], int]:
    """Every block file in the folder with this fingerprint, as (path, hash, parent, tokens),
    least recently written first, and how many unreadable files were deleted (leftovers of
    interrupted writes are deleted too, uncounted)."""
    found = []
    num_corrupt = 0
    for name in os.listdir(folder_path):
        path = os.path.join(folder_path, name)
        if not name.endswith(_SUFFIX):
            remove(path)  # an interrupted write's temporary file
            continue
        try:
            header = read_header(path)
            mtime = os.stat(path).st_mtime_ns
        except (OSError, CorruptBlock):
            remove(path)
            num_corrupt += 1
            continue
        if header["fingerprint"] != fingerprint:
            continue
        found.append((mtime, path, int(header["hash"]), header["parent"], tuple(header["tokens"])))
    found.sort(key=lambda x: (x[0], x[1]))
    return [(path, h, parent, tokens) for _, path, h, parent, tokens in found], num_corrupt


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
