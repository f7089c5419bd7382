"""The small GPT: backends agree, the cache changes nothing but speed, generation validates its
input, weight files fail loudly, and training is deterministic."""
import numpy as np
import pytest

from infra_lab import backend, model
from infra_lab.model import corpus, tokenizer, train, weights
from infra_lab.model.torch_model import TorchTransformer


@pytest.fixture(scope="module")
def untrained():
    config = model.CONFIGS["target"]
    return model.Transformer(config, TorchTransformer(config, seed=3).numpy_weights())


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, 300)


@pytest.mark.numerics
def test_backends_give_the_same_logits(untrained, tokens):
    reference = untrained.forward(tokens, backend=backend.resolve("torch", "cpu"))
    assert reference.shape == (300, 256)
    for name in ("numba", "numpy"):
        assert np.abs(untrained.forward(tokens, backend=backend.resolve(name)) - reference).max() <= 1e-4


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["numba", "numpy", "torch"])
def test_cached_steps_equal_one_full_pass(untrained, tokens, name):
    chosen = backend.resolve(name, "cpu")
    full = untrained.forward(tokens, backend=chosen)
    cache = untrained.new_cache(backend=chosen)
    pieces = [untrained.forward(tokens[:200], cache, chosen), untrained.forward(tokens[200:260], cache, chosen)]
    pieces += [untrained.forward([t], cache, chosen) for t in tokens[260:]]
    assert cache.length == 300
    assert np.abs(np.concatenate(pieces) - full).max() <= 1e-4


@pytest.mark.numerics
def test_greedy_generation_is_the_same_with_and_without_the_cache(untrained):
    cached = model.generate(untrained, "def f(x):", 40, temperature=0)
    recomputed = model.generate(untrained, "def f(x):", 40, temperature=0, use_cache=False)
    assert cached.new_tokens == recomputed.new_tokens and len(cached.new_tokens) == 40


def test_sampling_is_seeded_and_respects_top_k(untrained):
    first = model.generate(untrained, "x", 30, temperature=1.0, top_k=3, seed=7)
    assert first.new_tokens == model.generate(untrained, "x", 30, temperature=1.0, top_k=3, seed=7).new_tokens
    logits = np.arange(256, dtype=np.float32)
    rng = np.random.default_rng(0)
    draws = {model.generate.__globals__["sample"](logits, 1.0, 3, 1.0, rng) for _ in range(200)}
    assert draws <= {253, 254, 255}
    assert {model.generate.__globals__["sample"](logits, 5.0, 0, 1e-9, rng) for _ in range(50)} == {255}


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "x" * 513}, "prompt of 513 tokens is longer than the context of 512"),
    ({"prompt": "x" * 500, "max_new_tokens": 13}, r"max_new_tokens must be in \[0, 12\]"),
    ({"prompt": ""}, "at least one token"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]; got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]; got 1.5"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0 and finite .*got nan"),
    ({"top_k": 2.5}, "top_k must be >= 0 and a whole number .*got 2.5"),
    ({"seed": -1}, "seed must be >= 0 and a whole number; got -1"),
])
def test_bad_generation_input_is_named(untrained, kwargs, message):
    arguments = {"prompt": "hello", "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        model.generate(untrained, **arguments)


def test_forward_refuses_what_does_not_fit(untrained):
    cache = untrained.new_cache()
    untrained.forward(np.zeros(500, np.int64), cache)
    with pytest.raises(ValueError, match="500 cached \\+ 13 new tokens exceed the context of 512"):
        untrained.forward(np.zeros(13, np.int64), cache)
    assert cache.length == 500  # unchanged
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        untrained.forward([3, 256])


def test_tokenizer_round_trips_text():
    text = "def naïve(x):\n    return x  # ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode(b"\x00\xff").tolist() == [0, 255]


def test_missing_and_corrupt_weight_files_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no weight file at .*target.npz; run `infra-lab train --size target`"):
        weights.load(tmp_path / "target.npz")
    broken = tmp_path / "draft.npz"
    broken.write_bytes(b"not a zip archive")
    with pytest.raises(ValueError, match=r"draft.npz is corrupt \(.*\); run `infra-lab train --size draft`"):
        weights.load(broken)
    config = model.CONFIGS["draft"]
    good = TorchTransformer(config).numpy_weights()
    good["lm_head"] = good["lm_head"][:, :10]
    weights.save(good, config, broken, {})
    with pytest.raises(ValueError, match=r"lm_head is \(64, 10\), expected \(64, 256\)"):
        weights.load(broken)


def test_shipped_weights_are_small_and_trained():
    total = sum(weights.path_for(size).stat().st_size for size in ("target", "draft"))
    assert total <= 10 * 2**20
    target, draft = model.load("target"), model.load("draft")
    assert 0.8e6 <= target.n_params <= 1.3e6 and 0.1e6 <= draft.n_params <= 0.3e6
    for m in (target, draft):
        assert m.figures["validation_bits_per_byte"] < 0.6 * m.figures["unigram_bits_per_byte"]
        assert m.figures["train_seconds"] <= 20 * 60


def test_training_is_deterministic_under_a_seed(tmp_path):
    runs = []
    for name in ("a", "b"):
        figures = train.train("draft", tmp_path / f"{name}.npz", seed=5, steps=3, progress=False, eval_windows=2)
        runs.append((weights.load(tmp_path / f"{name}.npz")[0], figures["validation_bits_per_byte"]))
    assert runs[0][1] == runs[1][1]
    for key, value in runs[0][0].items():
        np.testing.assert_array_equal(value, runs[1][0][key])
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        train.train("huge", tmp_path / "x.npz")


def test_validation_files_are_held_out():
    files = [p.relative_to(corpus.stdlib_root()).as_posix() for p in corpus.source_files()]
    assert set(corpus.VALIDATION) <= set(files)
    train_bytes, validation = corpus.load()
    assert len(validation) > 100_000 and len(train_bytes) > 20 * len(validation)
    assert 4 < corpus.unigram_bits_per_byte(train_bytes, validation) < 6


def test_training_leaves_torchs_deterministic_setting_as_it_found_it(tmp_path):
    import torch

    from infra_lab.model.train import train

    assert not torch.are_deterministic_algorithms_enabled()
    train("draft", tmp_path / "w.npz", steps=1, progress=False, eval_windows=1)
    assert not torch.are_deterministic_algorithms_enabled()
