"""The bytes of DILOCO's pseudo-gradients: one flat vector of float32 values, compressed, with
its layout in JSON ahead. numpy only, no torch and nothing pickled: the server averages the
workers' uploads with this module and never imports torch.

    b"ZWDXPG1\\n"  uint32 (little-endian): the JSON's length  JSON: {"compression", "numel", "block"}
    then the values:
      int8   per block of ``block`` values (the last may be shorter): its float32 scale, then its
             int8 codes; a value is its code times the scale
      fp16   float16, little-endian
      none   float32, little-endian

int8 (as INTELLECT-1 sends its pseudo-gradients): a block's scale is its largest magnitude / 127
and a code is the value / scale rounded, so a decoded value is within scale / 2 (the block's
largest magnitude / 254) of the one encoded; 4,096 values a block cost 4 bytes of scale.

    encode(values, compression) -> bytes            a worker's upload (and the server's average)
    decode(data) -> float32 values                  what a worker fetched
    check(stream) -> Layout                         a whole upload read once: layout, size, finite
    inspect(stream) -> (Layout, norm)               check, and the vector's L2 norm
    average(streams) -> (Layout, members, chunks)   the mean of several uploads, streamed: one frame
                                                    (``FRAME`` values) of each at a time in memory
"""
from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

import numpy as np

MAGIC = b"ZWDXPG1\n"
#: Values per int8 block (one float32 scale each).
BLOCK = 4096
#: Values decoded at a time when reading a stream: a multiple of every block size used.
FRAME = 256 * BLOCK
#: Most bytes a layout's JSON may take.
MAX_HEADER = 4096
#: Most values one vector may hold (2**40: far beyond any model a GPU holds).
MAX_NUMEL = 2**40
COMPRESSIONS = ("int8", "fp16", "none")


class CodecError(ValueError):
    """Bytes that are not a pseudo-gradient in this format, saying what is wrong."""


def _record(block: int) -> np.dtype:
    """One int8 block as stored: its scale, then its codes (packed, no padding)."""
    return np.dtype([("scale", "<f4"), ("codes", "i1", (block,))])


@dataclass(frozen=True)
class Layout:
    compression: str
    numel: int
    block: int = BLOCK

    def header(self) -> bytes:
        text = json.dumps({"compression": self.compression, "numel": self.numel, "block": self.block}).encode()
        return MAGIC + struct.pack("<I", len(text)) + text

    def body_bytes(self, numel: int | None = None) -> int:
        """Bytes that ``numel`` values (all of them by default) take after the header."""
        n = self.numel if numel is None else numel
        if self.compression == "int8":
            return n + 4 * -(-n // self.block)
        return n * (2 if self.compression == "fp16" else 4)

    def size(self) -> int:
        return len(self.header()) + self.body_bytes()

    @classmethod
    def read(cls, stream: BinaryIO) -> Layout:
        """The layout at the start of ``stream`` (which is left at the first value)."""
        head = _exactly(stream, len(MAGIC) + 4, "the header")
        if head[:len(MAGIC)] != MAGIC:
            raise CodecError("not a zwdx pseudo-gradient (its first bytes are not ZWDXPG1)")
        (length,) = struct.unpack("<I", head[len(MAGIC):])
        if length > MAX_HEADER:
            raise CodecError(f"its layout takes {length} bytes, more than {MAX_HEADER}")
        text = _exactly(stream, length, "the layout")  # outside the try: CodecError is a ValueError
        try:
            meta = json.loads(text)
        except ValueError:
            raise CodecError("its layout is not JSON") from None
        if not isinstance(meta, dict) or set(meta) != {"compression", "numel", "block"}:
            raise CodecError("its layout must be {\"compression\", \"numel\", \"block\"}")
        compression, numel, block = meta["compression"], meta["numel"], meta["block"]
        if compression not in COMPRESSIONS:
            raise CodecError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
        if type(numel) is not int or not 0 <= numel <= MAX_NUMEL:
            raise CodecError(f"numel must be a whole number from 0 to {MAX_NUMEL}, got {numel!r}")
        if type(block) is not int or not 1 <= block <= FRAME or FRAME % block:
            raise CodecError(f"block must divide {FRAME}, got {block!r}")
        return cls(compression, numel, block)

    def frames(self, stream: BinaryIO) -> Iterator[np.ndarray]:
        """The values after the header, ``FRAME`` at a time, as float32."""
        done = 0
        while done < self.numel:
            n = min(FRAME, self.numel - done)
            yield self._decode(_exactly(stream, self.body_bytes(n), f"values {done} to {done + n}"), n)
            done += n

    def _decode(self, data: bytes, n: int) -> np.ndarray:
        if self.compression == "fp16":
            return np.frombuffer(data, "<f2").astype(np.float32)
        if self.compression == "none":
            return np.frombuffer(data, "<f4").astype(np.float32)
        full, tail = divmod(n, self.block)
        out = np.empty(n, np.float32)
        if full:
            records = np.frombuffer(data, _record(self.block), count=full)
            out[:full * self.block] = (records["codes"] * records["scale"][:, None]).reshape(-1)
        if tail:
            last = np.frombuffer(data, _record(tail), offset=full * (4 + self.block), count=1)
            out[full * self.block:] = last["codes"][0] * last["scale"][0]
        return out

    def encode_frame(self, values: np.ndarray) -> bytes:
        """``values`` (float32, at most ``FRAME`` of them, a whole number of blocks but for the
        last frame) as this layout's bytes."""
        if self.compression == "fp16":
            return values.astype("<f2").tobytes()
        if self.compression == "none":
            return values.astype("<f4").tobytes()
        full, tail = divmod(values.size, self.block)
        parts = []
        for count, size, part in ((full, self.block, values[:full * self.block]), (1 if tail else 0, tail,
                                                                                   values[full * self.block:])):
            if not count:
                continue
            blocks = part.reshape(count, size)
            scale = (np.abs(blocks).max(axis=1) / 127).astype(np.float32)
            records = np.empty(count, _record(size))
            records["scale"] = scale
            records["codes"] = np.rint(blocks / np.where(scale > 0, scale, 1)[:, None]).clip(-127, 127)
            parts.append(records.tobytes())
        return b"".join(parts)


def _exactly(stream: BinaryIO, n: int, what: str) -> bytes:
    data = stream.read(n)
    while len(data) < n:
        more = stream.read(n - len(data))
        if not more:
            raise CodecError(f"it ends within {what}")
        data += more
    return data


def encode(values: np.ndarray, compression: str) -> bytes:
    """A flat vector of float32 values as the bytes of a pseudo-gradient."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    layout = Layout(compression, values.size)
    if compression not in COMPRESSIONS:
        raise CodecError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    return layout.header() + b"".join(layout.encode_frame(values[i:i + FRAME])
                                      for i in range(0, values.size, FRAME))


def decode(data: bytes) -> np.ndarray:
    """The float32 values of a pseudo-gradient's bytes."""
    stream = io.BytesIO(data)
    layout = Layout.read(stream)
    out = np.empty(layout.numel, np.float32)
    done = 0
    for frame in layout.frames(stream):
        out[done:done + frame.size] = frame
        done += frame.size
    if stream.read(1):
        raise CodecError(f"it holds more bytes than its {layout.numel} values take")
    return out


def check(stream: BinaryIO) -> Layout:
    """Read a whole pseudo-gradient: its layout, if its size is right and its values finite."""
    return inspect(stream)[0]


def inspect(stream: BinaryIO) -> tuple[Layout, float]:
    """``check``, and the vector's (L2) norm."""
    layout, squares = Layout.read(stream), 0.0
    for frame in layout.frames(stream):
        if not np.isfinite(frame).all():
            raise CodecError("it holds NaN or infinite values")
        wide = frame.astype(np.float64)
        squares += float(wide @ wide)
    if stream.read(1):
        raise CodecError(f"it holds more bytes than its {layout.numel} values take")
    return layout, squares ** 0.5


def _mean(frames: list[np.ndarray]) -> np.ndarray:
    total = frames[0].copy()
    for frame in frames[1:]:
        total += frame
    return total / np.float32(len(frames))


def average(streams: dict[int, BinaryIO], combine: Callable[[list[np.ndarray]], np.ndarray] = _mean,
            ) -> tuple[Layout, list[int], Iterator[bytes]]:
    """The mean of the pseudo-gradients ``streams`` holds (rank -> its bytes, each ``check``-ed),
    in their compression: its layout, the ranks it holds (an upload of no values adds nothing),
    and its bytes, made as they are read, one frame of every input at a time. ``combine``: how a
    frame of every member (in the order of the members) becomes the frame out (``zwdx.robust``'s
    rule in place of the mean)."""
    layouts = {rank: Layout.read(stream) for rank, stream in streams.items()}
    members = sorted(rank for rank, layout in layouts.items() if layout.numel)
    kinds = {(layouts[r].compression, layouts[r].numel) for r in members} or {(next(
        (lay.compression for lay in layouts.values()), "none"), 0)}
    if len(kinds) > 1:
        raise CodecError(f"the uploads differ in compression or size: {sorted(kinds)}")
    compression, numel = kinds.pop()
    out = Layout(compression, numel)

    def chunks() -> Iterator[bytes]:
        yield out.header()
        readers = [layouts[r].frames(streams[r]) for r in members]
        for frames in zip(*readers):
            yield out.encode_frame(combine(list(frames)))
    return out, members, chunks()


class ChunkReader(io.RawIOBase):
    """A readable stream over an iterator of byte chunks (an artifact's, or ``average``'s)."""

    def __init__(self, chunks: Iterable[bytes]):
        self._chunks, self._held = iter(chunks), b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._held) < n:
            block = next(self._chunks, None)
            if block is None:
                break
            self._held += block
        if n < 0:
            out, self._held = self._held, b""
        else:
            out, self._held = self._held[:n], self._held[n:]
        return out

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


__all__ = ["MAGIC", "BLOCK", "FRAME", "COMPRESSIONS", "CodecError", "Layout", "encode", "decode", "check",
           "inspect", "average", "ChunkReader"]
