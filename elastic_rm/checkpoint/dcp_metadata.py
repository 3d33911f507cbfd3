"""Read DCP's `.metadata` without letting its bytes run code.

torch's DCP stores a checkpoint's metadata as a pickle and its FileSystemReader reads it with
`pickle.load`, which calls whatever the file names. A restore can take that file from a peer node over
HTTP, with a manifest from the same peer, so its checksum proves nothing about who wrote it. This reader
unpickles it the way `torch.load(weights_only=True)` treats a tensor file: only the classes DCP's
metadata is made of (and the few torch values inside them) can be named; anything else, such as
`os.system` in a reduce, is refused before it is called. Then the shape of the result is checked.
"""

from __future__ import annotations

import io
import pathlib
import pickle  # only the Unpickler, restricted by find_class below; nothing else here unpickles
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from elastic_rm.checkpoint.manifest import CorruptCheckpointError

MAX_METADATA_BYTES = 256 << 20  # far above a real one (a few KiB per tensor); bounds what is parsed

_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): dcp_md.Metadata,
    (_DCP, "StorageMeta"): dcp_md.StorageMeta,
    (_DCP, "MetadataIndex"): dcp_md.MetadataIndex,
    (_DCP, "TensorStorageMetadata"): dcp_md.TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): dcp_md.BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): dcp_md.ChunkStorageMetadata,
    (_DCP, "TensorProperties"): dcp_md.TensorProperties,
    (_DCP, "_MEM_FORMAT_ENCODING"): dcp_md._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # name -> torch.strided ...
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id: the directory it was saved in
}


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint's `.metadata` names something other than DCP's metadata classes (it would run code
    if unpickled), or is not DCP metadata at all. The step is not used."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        dtype = vars(torch).get(name) if module == "torch" else None  # vars: no lazy import by name
        if found is None and isinstance(dtype, torch.dtype):
            found = dtype  # e.g. torch.float32
        if found is None:
            raise UnsafeCheckpointError(
                f"refused: DCP .metadata names {module}.{name}, which is not a DCP metadata class "
                "(a forged or foreign checkpoint; nothing of it was run)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refused: DCP .metadata holds a persistent id (not DCP metadata)")


def loads_metadata(data: bytes, where: str) -> dcp_md.Metadata:
    """Unpickle `data` (a `.metadata` file's bytes) admitting only DCP metadata classes."""
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(f"{where}: .metadata of {len(data)} bytes is implausibly large")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where}: {e}") from None
    except Exception as e:  # truncated or malformed pickle, a bad argument to an admitted class
        raise UnsafeCheckpointError(f"{where}: .metadata does not parse ({type(e).__name__}: {e})") from None
    _check_shape(md, where)
    return md


def _check_shape(md: Any, where: str) -> None:
    """The fields DCP's load reads, with their types, so that a well-formed but foreign or edited
    pickle (an admitted class built without its fields) fails here, clearly, not deep inside DCP."""
    if not (
        type(md) is dcp_md.Metadata
        and _is_dict(getattr(md, "state_dict_metadata", None), str, _storage_ok)
        and _is_dict(getattr(md, "storage_data", None), dcp_md.MetadataIndex, _storage_info_ok)
        and isinstance(getattr(md, "storage_meta", None), (dcp_md.StorageMeta, type(None)))
    ):
        raise UnsafeCheckpointError(f"{where}: .metadata is not DCP checkpoint metadata")


def _is_dict(d: Any, key_type: type, value_ok: Any) -> bool:
    return isinstance(d, dict) and all(isinstance(k, key_type) and value_ok(v) for k, v in d.items())


def _storage_ok(v: Any) -> bool:
    if type(v) is dcp_md.BytesStorageMetadata:
        return True
    props, chunks = getattr(v, "properties", None), getattr(v, "chunks", None)
    return (
        type(v) is dcp_md.TensorStorageMetadata
        and type(props) is dcp_md.TensorProperties
        and isinstance(getattr(props, "dtype", None), torch.dtype)
        and isinstance(getattr(v, "size", None), torch.Size)
        and isinstance(chunks, list)
        and all(
            type(c) is dcp_md.ChunkStorageMetadata
            and isinstance(getattr(c, "offsets", None), torch.Size)
            and isinstance(getattr(c, "sizes", None), torch.Size)
            for c in chunks
        )
    )


def _storage_info_ok(v: Any) -> bool:
    return (
        type(v) is _StorageInfo
        and isinstance(getattr(v, "relative_path", None), str)
        and type(getattr(v, "offset", None)) is int
        and type(getattr(v, "length", None)) is int
    )


class SafeMetadataReader(FileSystemReader):
    """FileSystemReader that reads `.metadata` with the restricted unpickler, and refuses byte items:
    DCP loads those with `torch.load(weights_only=False)`, and elastic-rm's checkpoints hold tensors
    only (a `.metadata` that declares a byte item is forged or foreign)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
        md = loads_metadata(data, str(path))
        if md.storage_meta is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        refuse_byte_items(plan)
        return super().prepare_local_plan(plan)


def refuse_byte_items(plan: LoadPlan) -> None:
    """Byte items are read with `torch.load(weights_only=False)`: refuse them before anything is read."""
    for item in plan.items:
        if item.type == LoadItemType.BYTE_IO:
            raise UnsafeCheckpointError(
                f"refused: the checkpoint declares {item.storage_index.fqn!r} as pickled bytes; "
                "elastic-rm checkpoints hold tensors only"
            )
