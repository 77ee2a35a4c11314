"""kfrl's own safetensors writer: files the reference reader and ``from_pretrained`` take as written."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kfrl.models.hf_io import save_hf, unique_state, write_safetensors


@pytest.fixture(scope="module")
def tiny_model_dir():
    from kfrl.models.tiny import materialize_builtin

    return materialize_builtin("builtin:tiny-qwen2-arith")


def _read_all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            out.update({key: fh.get_tensor(key) for key in fh.keys()})
    return out


def test_round_trip_every_dtype_and_empty_and_scalar(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(6).reshape(2, 3), "mask": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6)[:, ::2],
    }
    write_safetensors(tensors, tmp_path)
    back = _read_all(tmp_path)
    assert set(back) == set(tensors)
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_shards_with_an_index_beyond_the_shard_size(tmp_path):
    tensors = {f"layer{i}.weight": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    files = write_safetensors(tensors, tmp_path, max_shard_bytes=2048)
    assert [f.name for f in files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    assert index["weight_map"]["layer4.weight"] == "model-00003-of-00003.safetensors"
    assert all(torch.equal(t, tensors[k]) for k, t in _read_all(tmp_path).items())


def test_tied_weights_are_written_once_and_load_back(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tied = model.config.tie_word_embeddings
    save_hf(model, None, tmp_path, dtype=torch.bfloat16)
    stored = _read_all(tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in stored.values() if t.is_floating_point())
    assert ("lm_head.weight" in stored) == (not tied)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name
    assert len(unique_state(model.state_dict())) == len(model.state_dict()) - int(tied)


if __name__ == "__main__":
    pytest.main([__file__])


def test_host_buffers_are_reused_and_a_set_being_written_is_never_handed_out():
    from kfrl.models.host_memory import HostBuffers, on_host

    pool = HostBuffers()
    weight = torch.randn(3, 4)
    state = {"embed": weight, "head": weight, "bias": torch.randn(5), "step": torch.tensor(7)}
    first = pool.take()
    out = on_host(state, torch.bfloat16, first)
    assert torch.equal(out["embed"], weight.to(torch.bfloat16)) and out["head"] is out["embed"]
    assert out["step"].dtype == torch.int64 and out["step"].item() == 7
    assert len(first) == 3  # tied tensors once
    assert pool.take() == [] and pool.sets == 2  # the first set is still being written: a new one
    pool.give_back(first)
    again = pool.take()
    assert again is first
    weight.add_(1.0)
    second = on_host(state, torch.bfloat16, again)
    assert second["embed"].data_ptr() == out["embed"].data_ptr()  # the same memory, new values
    assert torch.equal(second["embed"], weight.to(torch.bfloat16))
    resized = on_host({**state, "bias": torch.randn(6)}, torch.bfloat16, again)
    assert resized["bias"].shape == (6,) and again[1].shape == (6,)  # a tensor that changed shape is replaced


def test_tokenizer_files_linked_from_one_copy_equal_the_written_ones(tmp_path, tiny_model_dir):
    import os

    from kfrl.models.hf_io import load_tokenizer, save_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    save_tokenizer(tokenizer, tmp_path / "written")
    for k in (1, 2):
        save_tokenizer(tokenizer, tmp_path / f"linked{k}", link_from=tmp_path / "shared")
    written = {p.relative_to(tmp_path / "written"): p.read_bytes() for p in (tmp_path / "written").rglob("*") if p.is_file()}
    assert written
    for k in (1, 2):
        folder = tmp_path / f"linked{k}"
        assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == written
        assert all(os.stat(folder / name).st_nlink == 3 for name in written)  # one copy, two links to it
    save_tokenizer(tokenizer, tmp_path / "linked1")  # writing a folder again never writes through a link
    assert all(os.stat(tmp_path / "linked2" / name).st_nlink == 2 for name in written)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "linked2").encode("1+2=") == tokenizer.encode("1+2=")


def _byte_level_bpe():
    """A byte-level BPE tokenizer (as Qwen's and Llama 3's are) with chat special tokens, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = ["The answer is 42.", "Ünïcödé café — naïve 東京 ✓", "x = 3 + 4\n#### 7", "  spaced   out  "] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("which", ["builtin", "byte-level-bpe"])
def test_decode_batch_gives_batch_decode_s_strings(tiny_model_dir, which):
    from kfrl.models.hf_io import decode_batch, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir) if which == "builtin" else _byte_level_bpe()
    texts = ["The answer is 42.", "Ünïcödé café — naïve 東京 ✓", "x = 3 + 4\n#### 7", "  spaced   out  ", ""]
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    sequences += [s + [tokenizer.eos_token_id] for s in sequences]  # a response that ends in EOS
    sequences.append(sequences[1][:3])  # a multi-byte character cut in the middle
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    sequences.append([special] + sequences[0])
    for skip in (True, False):
        expected = tokenizer.batch_decode(sequences, skip_special_tokens=skip)
        calls = []
        tokenizer.batch_decode = lambda *a, **k: calls.append(1)  # the straight path never calls it
        assert decode_batch(tokenizer, sequences, skip_special_tokens=skip) == expected
        assert not calls
        del tokenizer.batch_decode
    # Clean-up of tokenization spaces (a WordPiece habit) is left to transformers.
    tokenizer.clean_up_tokenization_spaces = True
    expected = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    through = type(tokenizer).batch_decode
    tokenizer.batch_decode = lambda *a, **k: calls.append(1) or through(tokenizer, *a, **k)
    assert decode_batch(tokenizer, sequences, skip_special_tokens=True) == expected
    assert calls == [1]
