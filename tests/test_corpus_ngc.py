"""The persisted array format: round trips; every kind of damage is refused with a clear error."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.corpus import ngc as persist
from ngramspec.corpus.ngc import CorruptFileError


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(-(2**31), 2**31 - 1, size=37, dtype=np.int32),
        "link": rng.integers(0, 100, size=(5, 3)).astype(np.int64),
        "probs": rng.random(4).astype(np.float32),
        "empty": np.zeros(0, dtype=np.uint8),
        "scalar": np.array(7, dtype=np.int16),
    }


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(a[name], b[name])


def test_round_trip(tmp_path):
    path = tmp_path / "x.ngc"
    arrays = sample_arrays()
    meta = {"num_tokens": 37, "name": "héllo", "nested": {"a": [1, 2]}}
    size = persist.save(path, "sam", meta, arrays)
    assert size == path.stat().st_size
    meta2, arrays2 = persist.load(path, "sam")
    assert meta2 == meta
    assert_same(arrays, arrays2)
    assert persist.read_kind(path) == "sam"
    # Views, not copies, and 8-byte aligned so the native and numpy kernels get aligned data.
    assert all(not a.flags.writeable for a in arrays2.values())
    assert all(a.flags.aligned for a in arrays2.values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=50),
       st.text(min_size=1, max_size=5), st.dictionaries(st.text(max_size=4), st.integers()))
def test_round_trip_property(tmp_path_factory, values, kind, meta):
    path = tmp_path_factory.mktemp("p") / "f.bin"
    arrays = {"v": np.array(values, dtype=np.int64), "w": np.array(values[::2], dtype="<u8")
              if all(v >= 0 for v in values) else np.zeros(1)}
    persist.save(path, kind, meta, arrays)
    meta2, arrays2 = persist.load(path, kind)
    assert meta2 == meta
    assert_same(arrays, arrays2)


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "x.ngc"
    persist.save(path, "trie", {"v": 1}, {"a": np.arange(3)})
    with pytest.raises(TypeError):
        persist.save(path, "trie", {"v": 2}, {"a": np.array([object()])})
    # The failed save left the old file whole and no temp file behind.
    assert persist.load(path, "trie")[0] == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.ngc"]


def test_every_truncation_is_refused(tmp_path):
    path = tmp_path / "x.ngc"
    persist.save(path, "sam", {"k": "v"}, sample_arrays())
    data = path.read_bytes()
    cut = tmp_path / "cut.ngc"
    # Every prefix: inside the magic, the version, the kind, the lengths, the body and each array.
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(CorruptFileError) as e:
            persist.load(cut, "sam")
        assert str(cut) in str(e.value)


def test_trailing_garbage_is_refused(tmp_path):
    path = tmp_path / "x.ngc"
    persist.save(path, "sam", {}, sample_arrays())
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(CorruptFileError, match="truncated or padded"):
        persist.load(path, "sam")


def test_every_bit_flip_is_refused(tmp_path):
    path = tmp_path / "x.ngc"
    persist.save(path, "sam", {"k": 1}, {"a": np.arange(6, dtype=np.int32)})
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.ngc"
    for i in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            bad.write_bytes(bytes(flipped))
            with pytest.raises(CorruptFileError):
                persist.load(bad, "sam")


def test_wrong_magic_version_kind(tmp_path):
    path = tmp_path / "x.ngc"
    persist.save(path, "trie", {}, {"a": np.arange(3)})
    data = path.read_bytes()
    with pytest.raises(CorruptFileError, match="holds a 'trie', expected a 'sam'"):
        persist.load(path, "sam")
    path.write_bytes(b"NOTMAGIC" + data[8:])
    with pytest.raises(CorruptFileError, match="not an ngramspec file"):
        persist.load(path, "trie")
    newer = data[:8] + struct.pack("<I", persist.FORMAT_VERSION + 1) + data[12:]
    path.write_bytes(newer)
    with pytest.raises(CorruptFileError, match="newer than supported"):
        persist.load(path, "trie")
    with pytest.raises(CorruptFileError, match="cannot read"):
        persist.load(tmp_path / "missing.ngc", "trie")


def test_corrupt_file_error_is_a_value_error():
    err = CorruptFileError("f.ngc", "bad")
    assert isinstance(err, ValueError)
    assert str(err) == "f.ngc: bad"
