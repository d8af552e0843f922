#!/usr/bin/python3
"""Writes the seed frames of ps_frame_fuzz into fuzz/frame_corpus (or the directory given).

Each seed is one byte (below 128: a frame follows; 128 and up: a stream's chunk messages; its low
7 bits the chunk size - 1 the fuzz target cuts the messages into) and then either a frame
(src/ps/frame.h): "CPSF", the header's length, a PushRequest (protocol 3, samples 8, want_values,
the fuzz shard's pieces bias 1, small 7, weight 300 as key/numel/FLOAT32), then the payload; or
the chunk messages of a streamed push (PushStream), each a u16 little-endian length and a frame
whose header is a PushChunk (first_piece, pieces) and whose payload is those pieces' floats.
The headers are protobuf's wire format written by hand, as fuzz/codec_seeds.cpp does.

    /usr/bin/python3 fuzz/ps_frame_seeds.py [DIR]
"""
import math
import pathlib
import struct
import sys

PIECES = [(0, 1), (1, 7), (2, 300)]


def varint(n):
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tensor(key, numel):
    body = b"\x08" + varint(key) + b"\x10" + varint(numel) + b"\x18\x01"  # key, numel, dtype FLOAT32
    return b"\x32" + varint(len(body)) + body  # PushRequest.values (field 6)


def header(pieces, protocol=3):
    # protocol 1, samples 5, want_values 7, values 6
    return b"\x08" + varint(protocol) + b"\x28\x08" + b"\x38\x01" + b"".join(tensor(k, n) for k, n in pieces)


def chunk_header(first, count):
    return b"\x08" + varint(first) + b"\x10" + varint(count)  # PushChunk.first_piece 1, pieces 2


def message(head, floats):
    body = frame(head, floats)
    return struct.pack("<H", len(body)) + body


def frame(head, floats):
    return b"CPSF" + struct.pack("<I", len(head)) + head + struct.pack("<%df" % len(floats), *floats)


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "frame_corpus")
    out.mkdir(parents=True, exist_ok=True)
    total = sum(n for _, n in PIECES)
    values = [math.sin(i * 0.37) for i in range(total)]
    first, rest = values[:8], values[8:]  # pieces 0 and 1; piece 2
    seeds = {
        "valid_one_chunk": bytes([127]) + frame(header(PIECES), values),
        "valid_small_chunks": bytes([6]) + frame(header(PIECES), values),
        "truncated_payload": bytes([63]) + frame(header(PIECES), values)[:-5],
        "wrong_key": bytes([31]) + frame(header([(0, 1), (4, 7), (2, 300)]), values),
        "nan": bytes([126]) + frame(header(PIECES), values[:-1] + [float("nan")]),
        "stream_valid": bytes([255]) + message(chunk_header(0, 2), first) + message(chunk_header(2, 1), rest),
        "stream_small_chunks": bytes([128 + 6]) + message(chunk_header(0, 1), values[:1])
        + message(chunk_header(1, 1), values[1:8]) + message(chunk_header(2, 1), rest),
        "stream_nan_in_second": bytes([255]) + message(chunk_header(0, 2), first)
        + message(chunk_header(2, 1), rest[:-1] + [float("nan")]),
        "stream_out_of_order": bytes([255]) + message(chunk_header(2, 1), rest) + message(chunk_header(0, 2), first),
        "stream_truncated": bytes([255]) + message(chunk_header(0, 2), first),
    }
    for name, data in seeds.items():
        (out / name).write_bytes(data)


if __name__ == "__main__":
    main()
