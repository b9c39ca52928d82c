"""zwdx/codec.py, checked where mutation testing (bench/mutation.py) found nothing looking: a
stream that trickles, every refusal's words, the bounds of a layout, int8's codes and scales byte
for byte, the norm, averaging uploads of no values, ChunkReader. In-process, fast lane."""
from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest

from zwdx import codec
from zwdx.codec import BLOCK, FRAME, MAGIC, MAX_HEADER, MAX_NUMEL, ChunkReader, CodecError, Layout


class Trickle(io.RawIOBase):
    """A stream that hands out at most ``step`` bytes a read (a socket's habit)."""
    def __init__(self, data: bytes, step: int = 3):
        self.data, self.step = data, step

    def readable(self):
        return True

    def read(self, n=-1):
        n = self.step if n < 0 else min(n, self.step)
        out, self.data = self.data[:n], self.data[n:]
        return out


@pytest.mark.parametrize("compression", codec.COMPRESSIONS)
def test_a_trickling_stream_reads_whole(compression):
    values = np.linspace(-2, 2, 5000, dtype=np.float32)
    data = codec.encode(values, compression)
    layout, norm = codec.inspect(Trickle(data, 7))
    assert layout == Layout(compression, 5000)
    again = np.concatenate(list(Layout.read(Trickle(data, 5)).frames(Trickle(data[len(layout.header()):], 5))))
    np.testing.assert_array_equal(again, codec.decode(data))
    assert codec.check(Trickle(data)) == layout
    assert norm == pytest.approx(float(np.linalg.norm(codec.decode(data).astype(np.float64))), rel=1e-12)


def test_the_norm_is_the_l2_norm_of_every_frame_together():
    values = np.zeros(FRAME + 10, np.float32)
    values[0], values[-1] = 3.0, 4.0  # one in each frame
    layout, norm = codec.inspect(io.BytesIO(codec.encode(values, "none")))
    assert norm == 5.0 and layout.numel == FRAME + 10
    assert codec.inspect(io.BytesIO(codec.encode(np.array([2.0], np.float32), "none")))[1] == 2.0
    assert codec.inspect(io.BytesIO(codec.encode(np.zeros(0, np.float32), "none")))[1] == 0.0


def test_a_short_stream_says_where_it_ends():
    data = codec.encode(np.ones(10, np.float32), "none")
    with pytest.raises(CodecError, match=r"^it ends within values 0 to 10$"):
        codec.decode(data[:-1])
    with pytest.raises(CodecError, match=r"^it ends within the layout$"):
        codec.decode(data[:len(MAGIC) + 6])


@pytest.mark.parametrize("reader", [codec.decode, lambda d: codec.check(io.BytesIO(d))])
def test_a_byte_past_the_values_is_refused(reader):
    data = codec.encode(np.ones(10, np.float32), "fp16")
    with pytest.raises(CodecError, match=r"^it holds more bytes than its 10 values take$"):
        reader(data + b"\0")


def test_non_finite_values_are_refused_in_words():
    with pytest.raises(CodecError, match=r"^it holds NaN or infinite values$"):
        codec.check(io.BytesIO(codec.encode(np.array([1, np.inf], np.float32), "none")))


def header(meta, length=None) -> bytes:
    text = json.dumps(meta).encode() if not isinstance(meta, bytes) else meta
    return MAGIC + struct.pack("<I", len(text) if length is None else length) + text


@pytest.mark.parametrize("data, message", [
    (b"ZWDXPG2\n" + b"\0" * 8, "not a zwdx pseudo-gradient (its first bytes are not ZWDXPG1)"),
    (MAGIC + struct.pack("<I", MAX_HEADER + 1), f"its layout takes {MAX_HEADER + 1} bytes, more than {MAX_HEADER}"),
    (header(b"{nope"), "its layout is not JSON"),
    (header([1, 2]), 'its layout must be {"compression", "numel", "block"}'),
    (header({"compression": "none", "numel": 1}), 'its layout must be {"compression", "numel", "block"}'),
    (header({"compression": "bf16", "numel": 1, "block": BLOCK}), "compression must be one of int8, fp16, none, got 'bf16'"),
    (header({"compression": "none", "numel": -1, "block": BLOCK}), f"numel must be a whole number from 0 to {MAX_NUMEL}, got -1"),
    (header({"compression": "none", "numel": MAX_NUMEL + 1, "block": BLOCK}),
     f"numel must be a whole number from 0 to {MAX_NUMEL}, got {MAX_NUMEL + 1}"),
    (header({"compression": "none", "numel": 1.0, "block": BLOCK}), f"numel must be a whole number from 0 to {MAX_NUMEL}, got 1.0"),
    (header({"compression": "int8", "numel": 1, "block": 0}), f"block must divide {FRAME}, got 0"),
    (header({"compression": "int8", "numel": 1, "block": 2 * FRAME}), f"block must divide {FRAME}, got {2 * FRAME}"),
    (header({"compression": "int8", "numel": 1, "block": 3}), f"block must divide {FRAME}, got 3"),
    (header({"compression": "int8", "numel": 1, "block": "8"}), f"block must divide {FRAME}, got '8'"),
])
def test_a_bad_layout_is_refused_saying_what_is_wrong(data, message):
    with pytest.raises(CodecError) as err:
        Layout.read(io.BytesIO(data))
    assert str(err.value) == message


@pytest.mark.parametrize("numel, block", [(0, 1), (MAX_NUMEL, 1), (5, FRAME), (5, 1)])
def test_the_layouts_bounds_are_taken(numel, block):
    assert Layout.read(io.BytesIO(header({"compression": "int8", "numel": numel, "block": block}))) == \
        Layout("int8", numel, block)


def test_a_header_of_exactly_the_most_bytes_is_read():
    meta = {"compression": "none", "numel": 0, "block": BLOCK}
    text = json.dumps(meta).encode()
    text += b" " * (MAX_HEADER - len(text))
    assert Layout.read(io.BytesIO(header(text))) == Layout("none", 0)
    assert Layout("none", 3).header()[len(MAGIC):len(MAGIC) + 4] == struct.pack("<I", len(
        json.dumps({"compression": "none", "numel": 3, "block": BLOCK}).encode()))


def test_int8_bytes_are_each_blocks_scale_then_its_codes():
    layout = Layout("int8", 6, block=4)
    values = np.array([1.0, -2.0, 0.5, 127.0, 0.0, 0.0], np.float32)  # a full block, and a tail of zeros
    data = layout.encode_frame(values)
    assert len(data) == layout.body_bytes() == 6 + 4 * 2
    scale = np.frombuffer(data[:4], "<f4")[0]
    assert scale == np.float32(1.0)
    assert list(np.frombuffer(data[4:8], "i1")) == [1, -2, 0, 127]  # rint(0.5) is 0 (to even)
    assert np.frombuffer(data[8:12], "<f4")[0] == 0.0 and list(np.frombuffer(data[12:14], "i1")) == [0, 0]
    np.testing.assert_array_equal(layout._decode(data, 6), [1.0, -2.0, 0.0, 127.0, 0.0, 0.0])
    assert layout._decode(data, 6).dtype == np.float32


def test_int8_codes_stay_within_127_and_round_to_nearest():
    layout = Layout("int8", 3, block=4)
    data = layout.encode_frame(np.array([-254.0, 254.0, 3.0], np.float32))  # scale 2: 3/2 rounds to 2
    assert np.frombuffer(data[:4], "<f4")[0] == 2.0
    assert list(np.frombuffer(data[4:], "i1")) == [-127, 127, 2]


def test_a_small_int8_block_keeps_its_precision():
    values = np.array([1e-30, -3e-30, 2e-30], np.float32)
    out = codec.decode(codec.encode(values, "int8"))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, values, rtol=0.01)


@pytest.mark.parametrize("compression, dtype", [("fp16", "<f2"), ("none", "<f4")])
def test_plain_compressions_decode_to_float32(compression, dtype):
    layout = Layout(compression, 3)
    data = np.array([1.5, -2.25, 3.0], dtype).tobytes()
    out = layout._decode(data, 3)
    assert out.dtype == np.float32 and list(out) == [1.5, -2.25, 3.0]
    assert codec.decode(codec.encode(np.array([1.5], np.float64), compression)).dtype == np.float32


def test_encode_flattens_any_shape_and_names_a_bad_compression():
    data = codec.encode(np.arange(6, dtype=np.float64).reshape(2, 3), "none")
    assert list(codec.decode(data)) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(CodecError) as err:
        codec.encode(np.ones(2, np.float32), "zip")
    assert str(err.value) == "compression must be one of int8, fp16, none, got 'zip'"


def test_average_of_uploads_of_no_values_is_empty_in_their_compression():
    empty = {0: io.BytesIO(codec.encode(np.zeros(0, np.float32), "fp16")),
             1: io.BytesIO(codec.encode(np.zeros(0, np.float32), "fp16"))}
    layout, members, chunks = codec.average(empty)
    assert (layout, members) == (Layout("fp16", 0), [])
    assert b"".join(chunks) == Layout("fp16", 0).header()
    layout, members, _ = codec.average({})
    assert (layout, members) == (Layout("none", 0), [])


def test_average_skips_an_empty_upload_and_refuses_mixed_ones():
    a, b = np.ones(4, np.float32), np.full(4, 3.0, np.float32)
    streams = {2: io.BytesIO(codec.encode(a, "none")), 0: io.BytesIO(codec.encode(np.zeros(0, np.float32), "int8")),
               1: io.BytesIO(codec.encode(b, "none"))}
    layout, members, chunks = codec.average(streams)
    assert (layout, members) == (Layout("none", 4), [1, 2])
    assert list(codec.decode(b"".join(chunks))) == [2.0] * 4
    mixed = {0: io.BytesIO(codec.encode(a, "none")), 1: io.BytesIO(codec.encode(b, "fp16"))}
    with pytest.raises(CodecError) as err:
        codec.average(mixed)
    assert str(err.value) == "the uploads differ in compression or size: [('fp16', 4), ('none', 4)]"


def test_chunk_reader_reads_exactly_what_is_asked():
    reader = ChunkReader([b"ab", b"", b"cde", b"f"])
    assert reader.readable()
    assert reader.read(0) == b""
    assert reader.read(1) == b"a"
    assert reader.read(3) == b"bcd"
    assert reader.read(-1) == b"ef"
    assert reader.read(5) == b""
    buffered = io.BufferedReader(ChunkReader([b"xyz", b"w"]), buffer_size=2)
    assert buffered.read() == b"xyzw"
    raw = ChunkReader([b"12345"])
    buf = bytearray(3)
    assert raw.readinto(buf) == 3 and buf == b"123"
