"""A reader for GGUF files, the model format of ggml / llama.cpp (ggml's docs/gguf.md):

    magic "GGUF" | version u32 (2 or 3) | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type: u32, value)
    tensor_count x (name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data

Little-endian unless the version field reveals a big-endian file. The file is memory-mapped:
metadata is decoded from the mapping and tensor data are zero-copy numpy views. Every
malformation raises `ModelFileError` naming the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, NamedTuple

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAX_ARRAY_NESTING = 16
# Bounds on what a crafted count makes us build before the file's end is reached, far above
# real files' largest (a tokenizer's arrays; an embedded tokenizer.json): elements of one
# metadata array with its nested arrays, and bytes of one string.
MAX_ARRAY_ELEMENTS = 2**24
MAX_STRING_BYTES = 2**27


class ModelFileError(ValueError):
    """A model file is missing, empty, truncated, corrupt or of an unsupported kind."""


# The format's enums and block table are gguf-py's (the package that writes GGUF files).
ValueType = gguf.GGUFValueType        # metadata value types
GGMLType = gguf.GGMLQuantizationType  # ggml tensor types (ggml.h's enum ggml_type)
# (elements per block, bytes per block) of each type.
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = gguf.GGML_QUANT_SIZES


# Fixed-size value types: struct format (without byte order) and numpy dtype character code.
_SCALAR_FORMATS = {
    ValueType.UINT8: ("B", "u1"), ValueType.INT8: ("b", "i1"),
    ValueType.UINT16: ("H", "u2"), ValueType.INT16: ("h", "i2"),
    ValueType.UINT32: ("I", "u4"), ValueType.INT32: ("i", "i4"),
    ValueType.UINT64: ("Q", "u8"), ValueType.INT64: ("q", "i8"),
    ValueType.FLOAT32: ("f", "f4"), ValueType.FLOAT64: ("d", "f8"),
    ValueType.BOOL: ("?", "b1"),
}


def _block_sizes(type_id: int) -> tuple[int, int] | None:
    """(elements, bytes) per block of a ggml type, None for a type gguf-py does not know."""
    try:
        return GGML_BLOCK_SIZES.get(GGMLType(type_id))
    except ValueError:
        return None


# Types whose elements are plain numbers: numpy dtype character code.
_PLAIN_DTYPES = {GGMLType.F32: "f4", GGMLType.F16: "f2", GGMLType.F64: "f8", GGMLType.I8: "i1",
                 GGMLType.I16: "i2", GGMLType.I32: "i4", GGMLType.I64: "i8"}


def ggml_type_name(type_id: int) -> str:
    try:
        return GGMLType(type_id).name
    except ValueError:
        return f"type {type_id}"


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    type: int              # ggml type id (GGMLType)
    offset: int            # as stored: bytes from the start of the data section
    data_offset: int       # absolute byte offset in the file
    n_elements: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape, outermost first (numpy order): the reverse of `dims`."""
        return self.dims[::-1]


class _Truncated(Exception):
    def __init__(self, what: str, pos: int):
        self.what, self.pos = what, pos


class _Corrupt(Exception):
    pass


class GGUFFile:
    """A parsed, memory-mapped GGUF file. metadata: key -> plain Python value, in file order;
    value_types: key -> (type,) or (ARRAY, element type); tensors: name -> TensorInfo."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.path = path
        if not os.path.exists(path):
            raise ModelFileError(f"model file {path!r} does not exist")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise ModelFileError(f"model file {path!r} is empty (0 bytes)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(f"model file {path!r} cannot be read: {e}") from e
        self.size = size
        try:
            magic = self._mm[:4]
            if magic != GGUF_MAGIC:
                raise ModelFileError(f"model file {path!r} is not a GGUF file (magic {magic!r}, "
                                     "expected b'GGUF')")
            self._parse()
            self._check_tensor_bounds()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmaps the file unless tensor views still use it."""
        try:
            self._mm.close()
        except BufferError:
            pass

    def _check_tensor_bounds(self) -> None:
        # A truncated file can still have a complete header: every tensor must lie in the file.
        for t in self.tensors.values():
            end = t.data_offset + t.n_bytes
            if end > self.size:
                raise ModelFileError(
                    f"model file {self.path!r} is truncated: tensor {t.name!r} ends at byte "
                    f"{end}, file has {self.size} bytes")

    # -- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        try:
            self._parse_sections()
        except _Truncated as e:
            raise ModelFileError(
                f"model file {self.path!r} is truncated: {e.what} at byte {e.pos} runs past the "
                f"end of the file ({self.size} bytes)") from None
        except _Corrupt as e:
            raise ModelFileError(f"model file {self.path!r} is corrupt: {e}") from None

    def _parse_sections(self) -> None:
        mm, size = self._mm, self.size
        if size < 8:
            raise _Truncated("the version", 4)
        version = struct.unpack_from("<I", mm, 4)[0]
        self.byte_order = "<"
        if version not in SUPPORTED_VERSIONS:
            big = struct.unpack_from(">I", mm, 4)[0]
            if big not in SUPPORTED_VERSIONS:
                raise ModelFileError(
                    f"model file {self.path!r} has unsupported GGUF version {version} "
                    f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); the file is "
                    "corrupt or from an incompatible writer")
            version, self.byte_order = big, ">"
        self.version = version
        bo = self.byte_order
        self._u32 = struct.Struct(bo + "I").unpack_from
        self._u64 = struct.Struct(bo + "Q").unpack_from
        self._scalars = {t: struct.Struct(bo + fmt) for t, (fmt, _) in _SCALAR_FORMATS.items()}
        if size < 24:
            raise _Truncated("the header", 8)
        tensor_count, kv_count = struct.unpack_from(bo + "QQ", mm, 8)
        pos = 24

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, tuple[ValueType, ...]] = {}
        for i in range(kv_count):
            key_pos = pos
            key, pos = self._read_name(pos, f"metadata key #{i}")
            if key in self.metadata:
                raise _Corrupt(f"duplicate metadata key {key!r} at byte {key_pos}")
            vtype, pos = self._read_type(pos, f"the value type of {key!r}")
            if vtype == ValueType.ARRAY:
                item_type, pos = self._read_type(pos, f"the element type of {key!r}")
                value, pos = self._read_array(pos, item_type, key, 0)
                self.value_types[key] = (vtype, item_type)
            else:
                value, pos = self._read_value(pos, vtype, key)
                self.value_types[key] = (vtype,)
            self.metadata[key] = value

        infos = []
        for i in range(tensor_count):
            name, pos = self._read_name(pos, f"the name of tensor #{i}")
            n_dims, pos = self._read_u32(pos, f"the dimension count of tensor {name!r}")
            end = pos + 8 * n_dims
            if end > size:
                raise _Truncated(f"the dimensions of tensor {name!r}", pos)
            dims = tuple(int(d) for d in np.frombuffer(mm, bo + "u8", n_dims, pos))
            pos = end
            type_id, pos = self._read_u32(pos, f"the type of tensor {name!r}")
            offset, pos = self._read_u64(pos, f"the data offset of tensor {name!r}")
            infos.append((name, dims, type_id, offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in self.metadata and (
                self.value_types["general.alignment"] != (ValueType.UINT32,)
                or alignment == 0 or alignment & (alignment - 1)):
            raise _Corrupt(f"general.alignment must be a power of two of type UINT32, got "
                           f"{alignment!r} of type {self.value_types['general.alignment']}")
        self.alignment = alignment
        self.data_start = -(-pos // alignment) * alignment

        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise _Corrupt(f"duplicate tensor name {name!r}")
            sizes = _block_sizes(type_id)
            if sizes is None:
                raise _Corrupt(f"tensor {name!r} has unknown ggml type {type_id}")
            block, type_size = sizes
            n_elements = 1
            for d in dims:
                n_elements *= d
            if dims and dims[0] % block:
                raise _Corrupt(f"tensor {name!r} of type {ggml_type_name(type_id)} has "
                               f"{dims[0]} elements per row, not a multiple of its block size "
                               f"{block}")
            self.tensors[name] = TensorInfo(name, dims, type_id, offset, self.data_start + offset,
                                            n_elements, n_elements // block * type_size)

    def _read_u32(self, pos: int, what: str) -> tuple[int, int]:
        if pos + 4 > self.size:
            raise _Truncated(what, pos)
        return self._u32(self._mm, pos)[0], pos + 4

    def _read_u64(self, pos: int, what: str) -> tuple[int, int]:
        if pos + 8 > self.size:
            raise _Truncated(what, pos)
        return self._u64(self._mm, pos)[0], pos + 8

    def _read_type(self, pos: int, what: str) -> tuple[ValueType, int]:
        raw, end = self._read_u32(pos, what)
        try:
            return ValueType(raw), end
        except ValueError:
            raise _Corrupt(f"{what} at byte {pos} is {raw}, not a GGUF value type") from None

    def _read_string_bytes(self, pos: int, what: str) -> tuple[bytes, int]:
        n, start = self._read_u64(pos, what)
        if n > MAX_STRING_BYTES:
            raise _Corrupt(f"{what} at byte {pos} is a string of {n} bytes, more than the limit "
                           f"of {MAX_STRING_BYTES} (MAX_STRING_BYTES)")
        end = start + n
        if end > self.size:
            raise _Truncated(f"{what} ({n} bytes)", pos)
        return self._mm[start:end], end

    def _read_name(self, pos: int, what: str) -> tuple[str, int]:
        raw, end = self._read_string_bytes(pos, what)
        try:
            return raw.decode("utf-8"), end
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} at byte {pos} is not valid UTF-8: {raw[:64]!r}") from None

    def _read_value(self, pos: int, vtype: ValueType, key: str) -> tuple[Any, int]:
        """A scalar or string value."""
        if vtype == ValueType.STRING:
            raw, end = self._read_string_bytes(pos, f"the value of {key!r}")
            return raw.decode("utf-8", errors="replace"), end
        s = self._scalars[vtype]
        if pos + s.size > self.size:
            raise _Truncated(f"the value of {key!r}", pos)
        return s.unpack_from(self._mm, pos)[0], pos + s.size

    def _read_array(self, pos: int, item_type: ValueType, key: str,
                    depth: int) -> tuple[list, int]:
        """The elements of an array whose element type has been read; `pos` is at the count."""
        if depth > _MAX_ARRAY_NESTING:
            raise _Corrupt(f"{key!r} nests arrays more than {_MAX_ARRAY_NESTING} deep")
        count_pos = pos
        count, pos = self._read_u64(pos, f"the length of array {key!r}")
        if depth == 0:
            self._elements_left = MAX_ARRAY_ELEMENTS
        if count > self._elements_left:
            raise _Corrupt(f"array {key!r} at byte {count_pos} has {count} elements"
                           f"{' (with the arrays around it)' if depth else ''}, more than the "
                           f"limit of {MAX_ARRAY_ELEMENTS} (MAX_ARRAY_ELEMENTS)")
        self._elements_left -= count
        mm, size = self._mm, self.size
        # The fewest bytes an element takes: a string's length, an array's type and count.
        least = {ValueType.STRING: 8, ValueType.ARRAY: 12}.get(item_type) or \
            struct.calcsize(_SCALAR_FORMATS[item_type][0])
        if pos + count * least > size:
            raise _Truncated(f"array {key!r} of {count} {item_type.name} values (at least "
                             f"{count * least} bytes)", count_pos)
        if item_type == ValueType.STRING:
            out: list = []
            append = out.append
            u64 = self._u64
            try:
                for _ in range(count):
                    n = u64(mm, pos)[0]
                    if n > MAX_STRING_BYTES:
                        raise _Corrupt(f"a string in array {key!r} at byte {pos} has {n} "
                                       f"bytes, more than the limit of {MAX_STRING_BYTES} "
                                       "(MAX_STRING_BYTES)")
                    start = pos + 8
                    pos = start + n
                    if pos > size:
                        raise _Truncated(f"a string of {n} bytes in array {key!r}", start - 8)
                    append(mm[start:pos].decode("utf-8", errors="replace"))
            except struct.error:  # not even 8 bytes left for a length
                raise _Truncated(f"a string length in array {key!r}", pos) from None
            return out, pos
        if item_type == ValueType.ARRAY:
            out = []
            for _ in range(count):
                sub_type, pos = self._read_type(pos, f"an element type in {key!r}")
                value, pos = self._read_array(pos, sub_type, key, depth + 1)
                out.append(value)
            return out, pos
        dtype = np.dtype(self.byte_order + _SCALAR_FORMATS[item_type][1])
        end = pos + count * dtype.itemsize
        if end > size:
            raise _Truncated(f"array {key!r} of {count} {item_type.name} values", pos)
        return np.frombuffer(mm, dtype, count, pos).tolist(), end

    # -- tensor data ---------------------------------------------------------------------------

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor: a read-only uint8 view of the mapped file."""
        t = self.tensors[name]
        return np.frombuffer(self._mm, np.uint8, t.n_bytes, t.data_offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """A read-only view of a tensor's data: plain types with their logical shape and dtype,
        block types as uint8 (*shape[:-1], bytes per row)."""
        t = self.tensors[name]
        raw = self.tensor_bytes(name)
        plain = _PLAIN_DTYPES.get(t.type)
        if plain is not None:
            return raw.view(self.byte_order + plain).reshape(t.shape)
        if not t.dims:
            return raw
        block, type_size = _block_sizes(t.type)
        return raw.reshape(*t.shape[:-1], t.dims[0] // block * type_size)
