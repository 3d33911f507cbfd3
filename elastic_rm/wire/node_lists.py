"""Long lists of node ids in a record, compressed: the round value at 1,000 nodes.

Why: the round record names every member, and etcd sends it to every node's watch on each change: its
size times the nodes, per round written, and twice its size of history per round. Node ids of one cluster
share most of their characters (host names, pids), so zlib takes the list to about a quarter. A list is
compressed only when long (COMPACT_AT ids): small runs keep a value that a person reads with etcdctl.
The text is base64 of zlib of the ids joined by newlines; decompression is bounded (a hostile value is a
clear error, never a memory blow-up).
"""

from __future__ import annotations

import base64
import binascii
import zlib

COMPACT_AT = 64  # ids in a list from which it is written compressed
MAX_BYTES = 4 * 2**20  # at most this much text from one compressed list (64k ids of 64 characters)


class NodeListError(ValueError):
    """A compressed list that does not decode; the message says why."""


def encode_ids(ids: tuple[str, ...] | list[str]) -> str:
    return base64.b64encode(zlib.compress("\n".join(ids).encode(), 9)).decode("ascii")


def decode_ids(text: str) -> tuple[str, ...]:
    try:
        packed = base64.b64decode(text.encode("ascii"), validate=True)
        unpacker = zlib.decompressobj()
        raw = unpacker.decompress(packed, MAX_BYTES)
    except (binascii.Error, UnicodeEncodeError, zlib.error) as exc:
        raise NodeListError(f"not base64 of zlib data ({exc})") from None
    if unpacker.unconsumed_tail:
        raise NodeListError(f"more than {MAX_BYTES} bytes of node ids")
    if not unpacker.eof:
        raise NodeListError("the zlib data is truncated")
    try:
        body = raw.decode()
    except UnicodeDecodeError:
        raise NodeListError("the node ids are not UTF-8") from None
    return tuple(body.split("\n")) if body else ()
