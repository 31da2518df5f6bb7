"""The GGUF parser (jaxinfer.loading.gguf_file) and the numpy dequantization of
jaxinfer.loading.gguf, checked against gguf-py: metadata and tensor infos against
gguf.GGUFReader, dequantized values against gguf.quants.dequantize (bit for bit), on the real
SmolLM2 file and on files written with gguf.GGUFWriter. Damaged files (cut at every byte of the
header, metadata and tensor infos and at many bytes of the data, bytes flipped at random, crafted
malformations) must raise ModelFileError and nothing else."""

import struct

import gguf
import numpy as np
import pytest

from jaxinfer.loading.gguf import ModelFileError, load_gguf, read_metadata
from jaxinfer.loading.gguf_file import GGML_BLOCK_SIZES, GGMLType, GGUFFile, ValueType
from jaxinfer.quant.gguf_blocks import to_float

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


# -- reference values from gguf.GGUFReader --------------------------------------------------------



def dequantize(data: np.ndarray, type_id: int) -> np.ndarray:
    """Float32 values of one tensor's data of ggml type `type_id`, flat (the loader's decoder)."""
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    block, size = GGML_BLOCK_SIZES[GGMLType(type_id)]
    return to_float(raw, type_id, (raw.size // size * block,))


def dequantize_transposed(data: np.ndarray, type_id: int, shape: tuple[int, int]) -> np.ndarray:
    """dequantize(data, type_id).reshape(shape).T, as the loader decodes a matrix."""
    return to_float(data, type_id, tuple(shape), transposed=True)

def reader_value(field):
    """A GGUFReader field as a plain Python value. GGUFReader flattens nested arrays, so for those
    this is the flat list of the innermost elements."""
    if field.types[0] == VT.ARRAY:
        if field.types[-1] == VT.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == VT.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


def flatten(value):
    if isinstance(value, list):
        return [x for v in value for x in flatten(v)]
    return [value]


def assert_same_as_reader(path, reader=None):
    """Metadata, value types, tensor infos and raw tensor bytes equal GGUFReader's."""
    gf = GGUFFile(path)
    reader = reader or gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(gf.metadata) == list(fields)
    for key, field in fields.items():
        ours = gf.metadata[key]
        expected = reader_value(field)
        assert flatten(ours) == expected if isinstance(ours, list) else ours == expected, key
        assert type(flatten(ours)[0] if isinstance(ours, list) and flatten(ours) else ours) is \
            type(expected[0] if isinstance(expected, list) and expected else expected), key
        assert gf.value_types[key] == tuple(field.types[:len(gf.value_types[key])]), key
    assert gf.version == reader.fields["GGUF.version"].parts[0][0]
    assert gf.data_start == reader.data_offset and gf.alignment == reader.alignment
    assert list(gf.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = gf.tensors[t.name]
        assert info.dims == tuple(t.shape.tolist()), t.name
        assert info.type == int(t.tensor_type), t.name
        assert info.data_offset == t.data_offset and info.n_bytes == t.n_bytes, t.name
        assert info.offset == t.field.parts[-1][0], t.name
        assert info.n_elements == t.n_elements, t.name
        assert np.array_equal(gf.tensor_bytes(t.name), t.data.reshape(-1).view(np.uint8))
        ours = gf.tensor_array(t.name)
        assert ours.shape == t.data.shape and ours.dtype == t.data.dtype, t.name
    return gf, reader


def assert_bitwise_equal(ours, expected, what=""):
    expected = np.asarray(expected, dtype=np.float32)
    assert ours.dtype == np.float32 and ours.shape == expected.shape, what
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32), err_msg=what)


# -- writing test files ---------------------------------------------------------------------------

# Every value type, as scalars and as arrays (typed with sub_type), and nested arrays.
METADATA = [
    ("test.u8", 255, VT.UINT8, None), ("test.i8", -128, VT.INT8, None),
    ("test.u16", 65535, VT.UINT16, None), ("test.i16", -32768, VT.INT16, None),
    ("test.u32", 2**32 - 1, VT.UINT32, None), ("test.i32", -2**31, VT.INT32, None),
    ("test.u64", 2**64 - 1, VT.UINT64, None), ("test.i64", -2**63, VT.INT64, None),
    ("test.f32", 0.1, VT.FLOAT32, None), ("test.f64", 0.1, VT.FLOAT64, None),
    ("test.bool_true", True, VT.BOOL, None), ("test.bool_false", False, VT.BOOL, None),
    ("test.str", "héllo wörld ✓ \U0001f600", VT.STRING, None),
    ("test.str_empty", "", VT.STRING, None),
    ("test.arr_u8", [0, 1, 255], VT.ARRAY, VT.UINT8),
    ("test.arr_i8", [-128, 0, 127], VT.ARRAY, VT.INT8),
    ("test.arr_u16", [0, 65535], VT.ARRAY, VT.UINT16),
    ("test.arr_i16", [-32768, 32767], VT.ARRAY, VT.INT16),
    ("test.arr_u32", [0, 2**32 - 1], VT.ARRAY, VT.UINT32),
    ("test.arr_i32", [-2**31, 2**31 - 1, 5], VT.ARRAY, VT.INT32),
    ("test.arr_u64", [0, 2**64 - 1], VT.ARRAY, VT.UINT64),
    ("test.arr_i64", [-2**63, 2**63 - 1], VT.ARRAY, VT.INT64),
    ("test.arr_f32", [0.1, -2.5, 1e30], VT.ARRAY, VT.FLOAT32),
    ("test.arr_f64", [0.1, -2.5, 1e300], VT.ARRAY, VT.FLOAT64),
    ("test.arr_bool", [True, False, True], VT.ARRAY, VT.BOOL),
    ("test.arr_str", ["a", "", "ü✓", "x" * 300], VT.ARRAY, VT.STRING),
    ("test.arr_nested_int", [[1, 2, 3], [4], [5, 6]], VT.ARRAY, None),
    ("test.arr_nested_str", [["a", "bc"], ["d"]], VT.ARRAY, None),
    ("test.arr_nested_deep", [[[1.5, 2.5], [3.5]], [[4.5]]], VT.ARRAY, None),
]


def expected_value(value, vtype, sub_type):
    """A written value as it reads back: float32 values rounded to float32."""
    if vtype == VT.FLOAT32:
        return float(np.float32(value))
    if vtype == VT.ARRAY and sub_type == VT.FLOAT32:
        return [float(np.float32(v)) for v in value]
    if vtype == VT.ARRAY and sub_type is None and flatten(value) and \
            isinstance(flatten(value)[0], float):  # nested float lists are written as FLOAT32
        return [expected_value(v, VT.ARRAY, None) if isinstance(v, list) else
                float(np.float32(v)) for v in value]
    return value


def write_gguf(path, *, tensors=(), metadata=METADATA, alignment=None,
               endianess=gguf.GGUFEndian.LITTLE, tokens=None):
    """tensors: (name, float32 array, ggml type) with logical shapes; quantized types go through
    gguf.quants.quantize."""
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in metadata:
        w.add_key_value(key, value, vtype, sub_type)
    if tokens is not None:
        w.add_token_list(tokens)
    for name, arr, qtype in tensors:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype == QT.F32:
            w.add_tensor(name, arr)
        elif qtype == QT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def some_tensors(rng):
    return [
        ("q8.weight", rng.normal(size=(48, 64)), QT.Q8_0),
        ("q4_0.weight", rng.normal(size=(40, 96)), QT.Q4_0),
        ("q4_1.weight", rng.normal(size=(24, 128)), QT.Q4_1),
        ("f16.weight", rng.normal(size=(8, 3, 10)), QT.F16),
        ("f32.weight", rng.normal(size=(7,)), QT.F32),
        ("q4_1_3d.weight", rng.normal(size=(2, 5, 64)), QT.Q4_1),
        ("q5_0.weight", rng.normal(size=(6, 64)), QT.Q5_0),  # decoded by gguf-py
        ("bf16.weight", rng.normal(size=(6, 32)), QT.BF16),
    ]


@pytest.fixture(scope="module")
def real_reader(smollm2_gguf):
    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_file") / "all_types.gguf"
    return write_gguf(path, tensors=some_tensors(np.random.default_rng(0)))


# -- metadata and tensor infos --------------------------------------------------------------------

def test_real_file_equals_gguf_reader(smollm2_gguf, real_reader):
    gf, reader = assert_same_as_reader(smollm2_gguf, real_reader)
    meta = gf.metadata
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert gf.version == 3 and gf.byte_order == "<"
    assert read_metadata(smollm2_gguf) == meta


def test_written_file_all_value_types(written):
    gf, reader = assert_same_as_reader(written)
    for key, value, vtype, sub_type in METADATA:
        got = gf.metadata[key]
        assert got == expected_value(value, vtype, sub_type), key
        assert type(got) is type(value), key
        if vtype == VT.ARRAY:
            elem = sub_type if sub_type is not None else ValueType.ARRAY
            assert gf.value_types[key] == (ValueType.ARRAY, elem), key
        else:
            assert gf.value_types[key] == (ValueType(int(vtype)),), key
    assert gf.metadata["general.architecture"] == "llama"


def test_big_endian_file(tmp_path):
    path = write_gguf(tmp_path / "be.gguf", endianess=gguf.GGUFEndian.BIG,
                      tensors=[("f32.weight", np.arange(12).reshape(3, 4), QT.F32),
                               ("f16.weight", np.arange(8), QT.F16)])
    gf = GGUFFile(path)
    assert gf.byte_order == ">" and gf.version == 3
    for key, value, vtype, sub_type in METADATA:
        assert gf.metadata[key] == expected_value(value, vtype, sub_type), key
    np.testing.assert_array_equal(gf.tensor_array("f32.weight"), np.arange(12).reshape(3, 4))
    np.testing.assert_array_equal(gf.tensor_array("f16.weight"), np.arange(8))


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_custom_alignment(tmp_path, alignment):
    rng = np.random.default_rng(1)
    path = write_gguf(tmp_path / "aligned.gguf", alignment=alignment, metadata=METADATA[:3],
                      tensors=some_tensors(rng)[:3])
    gf, _ = assert_same_as_reader(path)
    assert gf.alignment == alignment and gf.data_start % alignment == 0


def test_the_format_tables_are_gguf_pys():
    """The reader declares no enum or block table of its own: a type gguf-py knows is sized
    by gguf-py's table (an unknown one is refused: test_corrupt_files), and the block layouts
    the quantized loader reads field by field have gguf-py's block sizes."""
    from jaxinfer.quant import gguf_blocks

    assert GGMLType is gguf.GGMLQuantizationType and ValueType is gguf.GGUFValueType
    assert GGML_BLOCK_SIZES is gguf.GGML_QUANT_SIZES
    for qtype, layout in gguf_blocks.BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[qtype][1] == layout.itemsize, qtype.name


def test_tensor_views_are_zero_copy(written):
    gf = GGUFFile(written)
    raw = gf.tensor_bytes("q8.weight")
    assert not raw.flags.writeable and not raw.flags.owndata
    f32 = gf.tensor_array("f32.weight")
    assert f32.dtype == np.dtype("<f4") and f32.shape == (7,) and not f32.flags.owndata
    assert gf.tensor_array("q4_1_3d.weight").shape == (2, 5, 64 // 32 * 20)


# -- dequantization -------------------------------------------------------------------------------

def test_real_file_dequantization(smollm2_gguf, real_reader):
    gf, reader = GGUFFile(smollm2_gguf), real_reader
    seen = set()
    for t in reader.tensors:
        qtype = t.tensor_type
        if qtype in seen and t.n_elements < 1_000_000 and not t.name.startswith("blk.0."):
            continue  # every type, every tensor of layer 0 and the large ones
        seen.add(qtype)
        expected = gguf.quants.dequantize(t.data, qtype).reshape(gf.tensors[t.name].shape)
        ours = dequantize(gf.tensor_bytes(t.name), int(qtype))
        assert_bitwise_equal(ours.reshape(expected.shape), expected, t.name)
        if expected.ndim == 2:
            ours_t = dequantize_transposed(gf.tensor_bytes(t.name), int(qtype), expected.shape)
            assert ours_t.flags.c_contiguous
            assert_bitwise_equal(ours_t, expected.T, t.name)
    assert seen == {QT.Q8_0, QT.Q4_1, QT.F32}


def test_written_file_dequantization(written):
    gf = GGUFFile(written)
    reader = gguf.GGUFReader(written)
    for t in reader.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            gf.tensors[t.name].shape)
        ours = dequantize(gf.tensor_bytes(t.name), int(t.tensor_type))
        assert_bitwise_equal(ours.reshape(expected.shape), expected, t.name)
        if expected.ndim == 2:
            ours_t = dequantize_transposed(gf.tensor_bytes(t.name), int(t.tensor_type),
                                           expected.shape)
            assert_bitwise_equal(ours_t, expected.T, t.name)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
@pytest.mark.parametrize("finite", [True, False])
def test_random_blocks(qtype, finite):
    """Random block bytes: with random finite f16 scales, and fully random (inf/NaN scales)."""
    rng = np.random.default_rng(int(qtype) * 2 + finite)
    block, type_size = GGML_BLOCK_SIZES[qtype]
    for rows, cols in [(1, 32), (3, 64), (17, 96), (300, 32), (5, 8192), (9000, 64)]:
        raw = rng.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
        if finite:
            blocks = raw.reshape(rows, cols // block, type_size)
            n_scales = 2 if qtype == QT.Q4_1 else 1
            scales = rng.normal(scale=0.1, size=blocks.shape[:2] + (n_scales,))
            blocks[..., :2 * n_scales] = scales.astype("<f2").view(np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 with random scales
            expected = gguf.quants.dequantize(raw, qtype)
            ours = dequantize(raw, int(qtype)).reshape(rows, cols)
            ours_t = dequantize_transposed(raw, int(qtype), (rows, cols))
        np.testing.assert_array_equal(ours, expected)
        if finite:
            assert_bitwise_equal(ours, expected, f"{qtype.name} {rows}x{cols}")
        np.testing.assert_array_equal(ours_t, expected.T)
        assert ours_t.flags.c_contiguous


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16])
def test_float_types(qtype):
    x = np.random.default_rng(3).normal(size=(5, 7)).astype(np.float32)
    data = (x if qtype == QT.F32 else x.astype(np.float16)).view(np.uint8)
    assert_bitwise_equal(dequantize(data, int(qtype)).reshape(5, 7),
                         gguf.quants.dequantize(data, qtype).reshape(5, 7))
    assert_bitwise_equal(dequantize_transposed(data, int(qtype), (5, 7)),
                         gguf.quants.dequantize(data, qtype).reshape(5, 7).T)


def test_load_gguf_unchanged_weights(smollm2_gguf, real_reader):
    """load_gguf's weights: gguf-py's dequantization, Q/K un-permuted, linear weights [in, out]."""
    cfg, weights, meta = load_gguf(smollm2_gguf)
    tensors = {t.name: t for t in real_reader.tensors}

    def ref(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(reversed(t.shape.tolist())))

    assert_bitwise_equal(weights["embed"], ref("token_embd.weight"), "embed")
    assert_bitwise_equal(weights["final_norm"], ref("output_norm.weight"), "final_norm")
    last = cfg.num_layers - 1
    for i in (0, last):
        for gname, name in [("ffn_down.weight", "w_down"), ("attn_v.weight", "wv"),
                            ("ffn_gate.weight", "w_gate"), ("attn_norm.weight", "attn_norm")]:
            w = ref(f"blk.{i}.{gname}")
            assert_bitwise_equal(weights[f"layers.{i}.{name}"], w.T if w.ndim == 2 else w, name)
        for gname, name, heads in [("attn_q.weight", "wq", cfg.num_heads),
                                   ("attn_k.weight", "wk", cfg.num_kv_heads)]:
            w = ref(f"blk.{i}.{gname}")  # [heads * hd, D], pairs interleaved per head
            hd = w.shape[0] // heads
            w = w.reshape(heads, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
            assert_bitwise_equal(weights[f"layers.{i}.{name}"], w.T, name)
    assert all(w.dtype == np.float32 and w.flags.c_contiguous for w in weights.values())


# -- damaged files --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    """A small file: every value type, a 300-token vocabulary and 6 tensors."""
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("gguf_small") / "small.gguf"
    return write_gguf(path, tensors=some_tensors(rng)[:6],
                      tokens=[f"tok{i}" for i in range(300)])


def expect_error(path, *needles):
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    msg = str(e.value)
    assert str(path) in msg and any(n in msg for n in needles), msg
    return msg


def test_truncated_everywhere(small_file, tmp_path):
    """Cut at every byte up to the first tensor's data and at many bytes inside the data."""
    data = open(small_file, "rb").read()
    gf = GGUFFile(small_file)
    end = max(t.data_offset + t.n_bytes for t in gf.tensors.values())
    cuts = list(range(1, gf.data_start + 1)) + list(range(gf.data_start, end, 7)) + [end - 1]
    path = tmp_path / "cut.gguf"
    kinds = set()
    for cut in cuts:
        path.write_bytes(data[:cut])
        if cut < 4:
            expect_error(path, "not a GGUF file")
            continue
        msg = expect_error(path, "truncated")
        kinds.add(msg.split("truncated: ")[1].split(" ")[0])
    assert len(kinds) > 5, kinds  # the cuts hit many different parts of the file
    path.write_bytes(b"")
    expect_error(path, "empty")
    path.write_bytes(data[:end])
    GGUFFile(path)  # complete up to the last tensor's end: fine


def test_real_file_truncated(smollm2_gguf, tmp_path):
    with open(smollm2_gguf, "rb") as f:
        head = f.read(1 << 20)  # inside the vocabulary and merges
    path = tmp_path / "head.gguf"
    for cut in (30, 1000, 500_000, 1 << 20):
        path.write_bytes(head[:cut])
        for fn in (read_metadata, load_gguf, GGUFFile):
            with pytest.raises(ModelFileError, match="is truncated"):
                fn(str(path))


def test_random_corruption(small_file, tmp_path):
    """Random bytes overwritten in the header, metadata and tensor infos: the file parses or
    raises ModelFileError, never another exception (and never hangs)."""
    data = np.frombuffer(open(small_file, "rb").read(), np.uint8)
    head_end = GGUFFile(small_file).data_start
    rng = np.random.default_rng(7)
    path = tmp_path / "corrupt.gguf"
    errors = 0
    for _ in range(1500):
        damaged = data.copy()
        n = int(rng.integers(1, 4))
        pos = rng.integers(4, head_end, size=n)
        damaged[pos] = rng.integers(0, 256, size=n)
        if rng.random() < 0.3:  # sometimes a whole 8-byte field (a length or a count)
            p = int(rng.integers(4, head_end - 8))
            damaged[p:p + 8] = rng.integers(0, 256, size=8)
        path.write_bytes(damaged.tobytes())
        try:
            GGUFFile(path)
        except ModelFileError:
            errors += 1
    assert errors > 100


def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    return data[:pos] + struct.pack(fmt, value) + data[pos + struct.calcsize(fmt):]


def test_crafted_errors(small_file, tmp_path):
    data = open(small_file, "rb").read()
    path = tmp_path / "bad.gguf"
    gf = GGUFFile(small_file)

    path.write_bytes(b"GGML" + data[4:])
    expect_error(path, "not a GGUF file")
    for version in (1, 4, 12345):
        path.write_bytes(patch(data, 4, "<I", version))
        msg = expect_error(path, f"unsupported GGUF version {version}")
        assert "corrupt" in msg  # test_llm.py's random-bytes file matches "corrupt|truncated"
    path.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    expect_error(path, "corrupt", "truncated")

    # The first key is general.architecture: length u64 at 24, key, then its value type.
    first_key_len = struct.unpack_from("<Q", data, 24)[0]
    type_pos = 32 + first_key_len
    assert data[32:type_pos] == b"general.architecture"
    path.write_bytes(patch(data, type_pos, "<I", 13))
    expect_error(path, "corrupt: the value type of 'general.architecture'")
    path.write_bytes(patch(data, type_pos + 4, "<Q", 2**20))  # string length past the end
    expect_error(path, "truncated: the value of 'general.architecture'")
    path.write_bytes(patch(data, type_pos + 4, "<Q", 2**40))  # past the limit
    expect_error(path, "the value of 'general.architecture' at byte 56 is a string of "
                 f"{2**40} bytes, more than the limit of {2**27} (MAX_STRING_BYTES)")
    path.write_bytes(patch(data, 24, "<Q", 2**20))  # key length past the end
    expect_error(path, "truncated: metadata key #0")
    path.write_bytes(patch(data, 24, "<Q", 2**63))
    expect_error(path, f"metadata key #0 at byte 24 is a string of {2**63} bytes")
    path.write_bytes(patch(data, 24 + 8 + 8, "<I", 0xFF))  # invalid UTF-8 in a key
    expect_error(path, "not valid UTF-8")
    path.write_bytes(patch(data, 16, "<Q", 2**64 - 1))  # kv count: reads past the metadata
    expect_error(path, "truncated", "more than the limit")
    path.write_bytes(patch(data, 8, "<Q", 2**60))  # tensor count: reads past the infos
    expect_error(path, "truncated", "more than the limit")

    # Array counts past the end, for a string array and a numeric array.
    def array_count_pos(key):
        i = data.index(key.encode())
        return i + len(key) + 4 + 4  # key, value type ARRAY, element type
    path.write_bytes(patch(data, array_count_pos("tokenizer.ggml.tokens"), "<Q", 2**20))
    expect_error(path, f"truncated: array 'tokenizer.ggml.tokens' of {2**20} STRING values")
    path.write_bytes(patch(data, array_count_pos("test.arr_i32"), "<Q", 2**20))
    expect_error(path, f"truncated: array 'test.arr_i32' of {2**20} INT32 values")
    for key in ("tokenizer.ggml.tokens", "test.arr_i32"):  # past the limit
        path.write_bytes(patch(data, array_count_pos(key), "<Q", 2**62))
        expect_error(path, f"array {key!r} at byte {array_count_pos(key)} has {2**62} "
                     f"elements, more than the limit of {2**24} (MAX_ARRAY_ELEMENTS)")
    path.write_bytes(patch(data, array_count_pos("test.arr_nested_int") - 4, "<I", 99))
    expect_error(path, "corrupt: the element type of 'test.arr_nested_int'")

    # Tensor infos: the last tensor's type and first dimension, and its data offset.
    name = list(gf.tensors)[-1]
    info_pos = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, info_pos)[0]
    type_pos = info_pos + 4 + 8 * n_dims
    path.write_bytes(patch(data, type_pos, "<I", 1000))
    expect_error(path, "corrupt: tensor", "unknown ggml type 1000")
    path.write_bytes(patch(data, info_pos + 4, "<Q", 33))  # not a whole number of blocks
    expect_error(path, "not a multiple of its block size")
    path.write_bytes(patch(data, type_pos + 4, "<Q", len(data)))
    expect_error(path, f"truncated: tensor {name!r} ends at byte")
    path.write_bytes(patch(data, info_pos, "<I", 2**31))  # n_dims
    expect_error(path, "truncated: the dimensions of tensor")


def test_crafted_metadata_errors(tmp_path):
    def build(kvs: bytes, n_kv: int) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + kvs

    def kv(key: str, vtype: int, payload: bytes) -> bytes:
        k = key.encode()
        return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload

    path = tmp_path / "meta.gguf"
    one = kv("a", ValueType.UINT32, struct.pack("<I", 7))
    path.write_bytes(build(one + one, 2))
    expect_error(path, "corrupt: duplicate metadata key 'a'")
    for value, vtype in [(64, ValueType.UINT64), (48, ValueType.UINT32), (0, ValueType.UINT32)]:
        fmt = "<Q" if vtype == ValueType.UINT64 else "<I"
        path.write_bytes(build(kv("general.alignment", vtype, struct.pack(fmt, value)), 1))
        expect_error(path, "corrupt: general.alignment")
    # Arrays nested far too deep.
    deep = struct.pack("<I", ValueType.ARRAY) + (struct.pack("<QI", 1, ValueType.ARRAY) * 100)
    path.write_bytes(build(kv("deep", ValueType.ARRAY, deep + struct.pack("<Q", 0)), 1))
    expect_error(path, "nests arrays")
    # Nesting that fits: an empty inner array, and an empty outer one.
    nested = struct.pack("<IQ", ValueType.ARRAY, 2) + struct.pack("<IQ", ValueType.INT8, 0) + \
        struct.pack("<IQb", ValueType.INT8, 1, -3)
    path.write_bytes(build(kv("n", ValueType.ARRAY, nested) +
                           kv("e", ValueType.ARRAY, struct.pack("<IQ", ValueType.STRING, 0)), 2))
    gf = GGUFFile(path)
    assert gf.metadata == {"n": [[], [-3]], "e": []} and not gf.tensors
    # Invalid UTF-8 in a string value is replaced, as gguf-py's reading of string arrays does.
    path.write_bytes(build(kv("s", ValueType.STRING, struct.pack("<Q", 2) + b"\xff\xfe"), 1))
    assert GGUFFile(path).metadata == {"s": "\ufffd\ufffd"}
    # A string value cut short, and a scalar cut short.
    path.write_bytes(build(kv("s", ValueType.STRING, struct.pack("<Q", 5) + b"ab"), 1))
    expect_error(path, "truncated: the value of 's' (5 bytes)")
    path.write_bytes(build(kv("x", ValueType.FLOAT64, b"\0" * 7), 1))
    expect_error(path, "truncated: the value of 'x'")


def test_counts_past_the_limits_allocate_nothing(tmp_path):
    """Counts and lengths past MAX_ARRAY_ELEMENTS and MAX_STRING_BYTES in a file of a few
    bytes: a ModelFileError naming the key, the count and the limit, with nothing of that size
    allocated (the peak of Python's allocations stays under 1 MB)."""
    import tracemalloc

    def one_array(payload: bytes) -> bytes:
        return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"arr" +
                struct.pack("<I", ValueType.ARRAY) + payload)

    cases = [  # (element type and count, then elements; the error's words)
        (struct.pack("<IQ", ValueType.UINT8, 2**40), f"has {2**40} elements"),
        (struct.pack("<IQ", ValueType.STRING, 2**40), f"has {2**40} elements"),
        (struct.pack("<IQ", ValueType.ARRAY, 2**40), f"has {2**40} elements"),
        # Two arrays of 2**24 - 1 elements: each under the limit, together over it.
        (struct.pack("<IQ", ValueType.ARRAY, 2) + struct.pack("<IQ", ValueType.UINT8, 2**24 - 1)
         + bytes(12), f"has {2**24 - 1} elements (with the arrays around it)"),
        (struct.pack("<IQQ", ValueType.STRING, 1, 2**40), f"has {2**40} bytes"),
    ]
    path = tmp_path / "counts.gguf"
    for payload, words in cases:
        path.write_bytes(one_array(payload))
        tracemalloc.start()
        try:
            msg = expect_error(path, words)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert "'arr'" in msg and "more than the limit of" in msg and peak < 1 << 20, (msg, peak)


def test_missing_and_directory(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        GGUFFile(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelFileError, match="cannot be read"):
        GGUFFile(str(tmp_path))
    assert issubclass(ModelFileError, ValueError)
