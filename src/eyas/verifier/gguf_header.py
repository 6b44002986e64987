"""A GGUF file's metadata and tensor table, read without its arrays, and one tensor's values from it.

Why not ``gguf.GGUFReader`` (the gguf package's reader, which eyas used before): it builds a numpy view for every
element of every array field, and a GGUF carries its tokenizer as arrays (SmolLM2-135M: 49,152 token strings,
48,900 merges, their scores and types), so reading SmolLM2's metadata took 3.8 s of a 2-core CPU in every
process that resolved the verifier. What resolve needs are the scalar fields and the tensor table, which this
walks past the arrays in about a tenth of a second (the layout: ggml's docs/gguf.md, "File Structure"). The
values of a tensor are dequantized by the gguf package itself (``gguf.quants``). A file this reader does not
expect (a big-endian GGUF, a version before 2) is read by ``gguf.GGUFReader`` instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eyas.core.errors import EyasError

_MAGIC = b"GGUF"
# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF's order: innermost first
    ggml_type: int  # gguf.GGMLQuantizationType
    offset: int  # of its first byte in the file


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    fields: dict[str, Any]  # scalar and string fields; an array field's value is None (not read)
    tensors: dict[str, GGUFTensor]
    reader: Any = None  # the gguf.GGUFReader that read a file this module leaves to it


_HEADERS: dict[tuple[str, int], GGUFHeader] = {}


def gguf_header(path: str | Path) -> GGUFHeader:
    """:func:`read_gguf_header` of ``path``, once per file and process (a file it leaves to gguf.GGUFReader is
    read by that)."""
    path = Path(path)
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    if key not in _HEADERS:
        header = read_gguf_header(path)
        _HEADERS[key] = header if header is not None else _read_with_gguf_reader(path)
    return _HEADERS[key]


def _read_with_gguf_reader(path: Path) -> GGUFHeader:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise EyasError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    array = gguf.GGUFValueType.ARRAY
    fields = {k: None if f.types and f.types[0] == array else f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: GGUFTensor(t.name, tuple(int(x) for x in t.shape.tolist()), int(t.tensor_type),
                                  int(t.data_offset)) for t in reader.tensors}  # fmt: skip
    return GGUFHeader(path, fields, tensors, reader)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, pos = self.buf, self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:  # walked past, not read: its elements are what makes GGUFReader slow
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                self.skip_strings(count)
            elif etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            else:  # an array of arrays: each read in turn
                for _ in range(count):
                    self.value(etype)
            return None
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_gguf_header(path: str | Path) -> GGUFHeader | None:
    """The fields and the tensor table of the GGUF file ``path``; None for a file to leave to ``gguf.GGUFReader``
    (big-endian, or a version before 2). Raises :class:`EyasError` naming the file for one that is not GGUF."""
    path = Path(path)
    with open(path, "rb") as f:  # before mapping it: an empty file cannot be mapped
        if f.read(len(_MAGIC)) != _MAGIC:
            raise EyasError(f"{path} is not a GGUF file (it does not begin with b'GGUF')")
    buf = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
    try:
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.scalar("<I")
        if not 2 <= version <= 3:  # 0x03000000 and the like: a big-endian file; 1: an early format
            return None
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        # the header's counts under the names gguf.GGUFReader gives them
        fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_fields}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(fields.get("general.alignment") or 32)
        start = -(-cur.pos // align) * align  # the tensor data begins at the next multiple of the alignment
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise EyasError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    finally:
        del buf
    tensors = {name: GGUFTensor(name, dims, ggml_type, start + offset) for name, dims, ggml_type, offset in infos}
    return GGUFHeader(path, fields, tensors)


def read_gguf_tensor(header: GGUFHeader, name: str) -> np.ndarray:
    """Tensor ``name`` of the file, dequantized to float32 by the gguf package, in numpy's order (outermost
    first)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    t = header.tensors[name]
    qtype = GGMLQuantizationType(t.ggml_type)
    shape = tuple(reversed(t.dims))
    if header.reader is not None:
        data = next(x for x in header.reader.tensors if x.name == name).data
    else:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape)) * type_size // block_size
        raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(n_bytes,))
        floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        if qtype in floats:
            data = raw.view(floats[qtype]).reshape(shape)
        elif qtype.name.startswith(("I", "F64")):
            raise EyasError(f"{header.path}: tensor {name} holds {qtype.name} values, not weights eyas reads")
        else:  # block-quantized (and BF16): rows of bytes, as gguf.GGUFReader shapes them
            data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
    return np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(shape)
