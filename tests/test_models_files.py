"""Damaged or hostile Hugging Face files: `from_pretrained` refuses each one
with an error naming the file (and the tensor or field at fault) instead of
loading wrong weights, reading outside the directory or running for minutes;
`save_pretrained` leaves exactly one model in its directory."""

import json
import shutil
import struct
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import redeqx
from redeqx.models import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    _pretrained,
    from_pretrained,
    save_pretrained,
)

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, scan_layers=False)


def _model(seed):
    return LlamaForCausalLM(CONFIG, key=jax.random.key(seed))


def _load(d):
    return from_pretrained(d, redeqx.make_mesh(1, devices=jax.devices()[:1]), scan_layers=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama") / "model"
    save_pretrained(_model(0), d)
    return d


def _copy(saved, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(saved, d)
    return d


def _read(d):
    """The header (name -> dtype, shape, offsets) and data bytes of ``d``'s model.safetensors."""
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def _write(d, header, data):
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + data)


def _leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _refused(d, *words, error=ValueError):
    with pytest.raises(error) as err:
        _load(d)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    return str(err.value)


def test_the_saved_model_loads(saved):
    assert _leaves_equal(_load(saved), _model(0))


def test_truncated_tensor_bytes_are_refused(saved, tmp_path):
    """The last tensor's bytes cut short (a partial download): today it loads with zeros at the end."""
    d = _copy(saved, tmp_path)
    header, data = _read(d)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    _write(d, header, data[:-1024])
    _refused(d, "model.safetensors", last)


def test_overlapping_offsets_are_refused(saved, tmp_path):
    """o_proj's byte range pointed at q_proj's (same shape): today o_proj loads q_proj's values."""
    d = _copy(saved, tmp_path)
    header, data = _read(d)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert header[q]["shape"] == header[o]["shape"]
    header[o]["data_offsets"] = header[q]["data_offsets"]
    _write(d, header, data)
    _refused(d, "model.safetensors", o)


@pytest.mark.parametrize("damage,words", [
    (lambda h: h["lm_head.weight"].update(shape=[64, 16]), ["lm_head.weight"]),  # 2048 values in 4096's bytes
    (lambda h: h["lm_head.weight"].update(dtype="Q7"), ["lm_head.weight"]),  # a dtype nobody knows
    (lambda h: h["lm_head.weight"].update(dtype="C64", shape=[64, 16]), ["lm_head.weight", "C64"]),  # one we don't read
    (lambda h: h["lm_head.weight"].update(data_offsets=[9, 3]), ["lm_head.weight"]),  # a negative count
])
def test_damaged_headers_are_refused(saved, tmp_path, damage, words):
    d = _copy(saved, tmp_path)
    header, data = _read(d)
    damage(header)
    _write(d, header, data)
    _refused(d, "model.safetensors", *words)


@pytest.mark.parametrize("head", [
    struct.pack("<Q", 2**62) + b"{}",  # a header longer than any file: a MemoryError with no text today
    struct.pack("<Q", 4) + b"\xff\xfe{}",  # not UTF-8
    struct.pack("<Q", 6) + b'{"a": ',  # not JSON
    struct.pack("<Q", 5) + b"[1,2]",  # JSON, not an object
    b"abc",  # shorter than the length field
])
def test_unreadable_headers_are_refused(saved, tmp_path, head):
    d = _copy(saved, tmp_path)
    (d / "model.safetensors").write_bytes(head)
    _refused(d, "model.safetensors")


@pytest.mark.parametrize("text", [b'{"model_type": "llama", ', b"\xff\xfe", b"[1, 2]"])
def test_unreadable_config_json_is_refused(saved, tmp_path, text):
    d = _copy(saved, tmp_path)
    (d / "config.json").write_bytes(text)
    _refused(d, "config.json")


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(num_hidden_layers="2"), ["num_hidden_layers"]),
    (lambda c: c.update(hidden_size=None), ["hidden_size"]),
    (lambda c: c.pop("vocab_size"), ["vocab_size"]),
    (lambda c: c.update(rope_parameters=[1, 2]), []),  # a list where a dict belongs
])
def test_config_json_of_wrong_types_is_refused(saved, tmp_path, edit, words):
    d = _copy(saved, tmp_path)
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))
    _refused(d, "config.json", *words)


@pytest.mark.parametrize("edit,field", [
    ({"num_hidden_layers": 10_000}, "num_hidden_layers=10000"),  # 68 s and 938 MiB to build today
    ({"num_hidden_layers": 3}, "num_hidden_layers=3"),
    ({"hidden_size": 2**20, "head_dim": 8}, "hidden_size=1048576"),
    ({"vocab_size": 10**9}, "vocab_size=1000000000"),
    ({"intermediate_size": 2**30}, "intermediate_size=1073741824"),
])
def test_config_sizes_are_checked_before_building(saved, tmp_path, edit, field):
    d = _copy(saved, tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **edit}))
    start = time.perf_counter()
    _refused(d, "config.json", field)
    assert time.perf_counter() - start < 5


def test_layers_that_cannot_be_stacked_are_counted_before_building(tmp_path):
    """A Qwen3-MoE whose dense layer sits among sparse ones has no stacked layout to read sizes from."""
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=(1,), scan_layers=False)
    d = tmp_path / "moe"
    save_pretrained(Qwen3MoeForCausalLM(config, key=jax.random.key(0)), d)
    assert jax.tree.leaves(_load(d))  # loads as it is
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 10_000}))
    start = time.perf_counter()
    _refused(d, "config.json", "num_hidden_layers=10000")
    assert time.perf_counter() - start < 5


def test_an_index_may_not_name_a_file_outside_the_directory(saved, tmp_path):
    d = _copy(saved, tmp_path)
    shutil.copy(d / "model.safetensors", tmp_path / "outside.safetensors")
    header, _ = _read(d)
    (d / "model.safetensors").unlink()
    weight_map = {name: "../outside.safetensors" for name in header}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _refused(d, "model.safetensors.index.json", "../outside.safetensors", "outside the checkpoint's directory")


def test_an_index_that_misplaces_a_tensor_is_refused(saved, tmp_path):
    d = tmp_path / "sharded"
    save_pretrained(_model(0), d, max_shard_bytes=20_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][name] = files[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(d, name, files[0])
    (d / "model.safetensors.index.json").write_text("{not json")
    _refused(d, "model.safetensors.index.json")


def test_saving_again_leaves_one_model(tmp_path):
    """Model A in 7 files, then model B in one: today A's files and index stay, and A is what loads."""
    d = tmp_path / "out"
    save_pretrained(_model(0), d, max_shard_bytes=13_000)
    assert len(list(d.glob("*.safetensors"))) == 7
    (d / "tokenizer.json").write_text("{}")  # what else a model directory holds stays
    save_pretrained(_model(1), d)
    assert sorted(p.name for p in d.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert _leaves_equal(_load(d), _model(1))
    # and back to several files: no model.safetensors left to shadow the index
    save_pretrained(_model(2), d, max_shard_bytes=13_000)
    assert not (d / "model.safetensors").exists() and len(list(d.glob("*.safetensors"))) == 7
    assert _leaves_equal(_load(d), _model(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left beside it


@pytest.mark.slow
def test_transformers_reads_the_model_saved_last(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, fresh = tmp_path / "out", tmp_path / "fresh"
    save_pretrained(_model(0), d, max_shard_bytes=13_000)
    save_pretrained(_model(1), d)
    save_pretrained(_model(1), fresh)
    got = transformers.AutoModelForCausalLM.from_pretrained(d).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(fresh).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=name)


def test_a_failed_save_leaves_the_old_model(tmp_path, monkeypatch):
    """A save that fails half-way (at its fifth tensor, in its second file) leaves the last model whole, and
    nothing beside it: today the first file is already the new model's."""
    d = tmp_path / "out"
    save_pretrained(_model(0), d, max_shard_bytes=13_000)
    to_host, calls = _pretrained._to_host, []

    def failing(x):
        calls.append(x)
        if len(calls) == 5:
            raise OSError("disk full")
        return to_host(x)

    monkeypatch.setattr(_pretrained, "_to_host", failing)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(_model(1), d, max_shard_bytes=13_000)
    monkeypatch.undo()
    assert _leaves_equal(_load(d), _model(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_refuses_a_directory_with_subdirectories(tmp_path):
    d = tmp_path / "out"
    (d / "runs").mkdir(parents=True)
    with pytest.raises(ValueError, match="runs"):
        save_pretrained(_model(0), d)
    assert sorted(p.name for p in d.iterdir()) == ["runs"]


def test_a_tensor_named_twice_in_a_header_is_refused(saved, tmp_path):
    """Before: a header that names one tensor twice (the second entry pointing at other bytes) loaded,
    one of the two read and the other's bytes ignored, without a word."""
    d = _copy(saved, tmp_path)
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8:8 + n].decode()
    name = "lm_head.weight"
    entry = json.dumps({name: _read(d)[0][name]})[1:-1]
    doubled = text.rstrip()[:-1] + "," + entry + "}"  # the same key again (its same bytes), at the end
    h = doubled.encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    _refused(d, "model.safetensors", f"'{name}' twice")


def test_one_float16_tensor_in_a_float32_checkpoint_comes_back_float32(saved, tmp_path):
    """Before: a mixed-dtype model (that tensor float16, the rest float32); Transformers casts to its
    model's dtype."""
    import ml_dtypes  # noqa: F401
    d = _copy(saved, tmp_path)
    header, data = _read(d)
    name = "model.norm.weight"
    begin, end = header[name]["data_offsets"]
    values = np.frombuffer(data[begin:end], np.float32)
    header[name] = {**header[name], "dtype": "F16"}
    pieces, offset, new = [], 0, {}
    for key in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        b, e = _read(d)[0][key]["data_offsets"]
        chunk = values.astype(np.float16).tobytes() if key == name else data[b:e]
        new[key] = {**header[key], "data_offsets": [offset, offset + len(chunk)]}
        pieces.append(chunk)
        offset += len(chunk)
    _write(d, new, b"".join(pieces))
    model = _load(d)
    assert {np.dtype(x.dtype) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {np.dtype(np.float32)}
    np.testing.assert_allclose(np.asarray(model.model.norm.weight), values.astype(np.float16).astype(np.float32))


def test_a_save_after_an_interrupted_one_removes_its_staging_directory(tmp_path):
    """Before: an interrupted save_pretrained left its hidden staging directory (up to a whole model)
    beside the target, and later saves never removed it."""
    target = tmp_path / "model"
    left = tmp_path / ".model.saving-deadbeef"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 1024)
    with pytest.warns(UserWarning, match="removing .*saving-deadbeef, left by an interrupted save"):
        save_pretrained(_model(0), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
