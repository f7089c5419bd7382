"""A real pretrained model in the engine: SmolLM2-135M-Instruct from its GGUF file, token for token
against Hugging Face transformers reading the same file (its tokenizer, its greedy tokens, its
logits), a chat that answers, and bad files refused by name. The file is fetched once per machine
(`infra-lab models pull smollm2-135m`, which `make test` runs)."""
import numpy as np
import pytest
import torch

from infra_lab import backend as backends
from infra_lab.model import gguf_file, pretrained
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams

pytestmark = pytest.mark.slow
NAME = "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n", "The three primary colours are", "Q: What is 12 times 7?\nA:",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def path():
    return pretrained.pull(NAME, quiet=True)


@pytest.fixture(scope="module")
def ours(path):
    return pretrained.load(NAME)


@pytest.fixture(scope="module")
def theirs(path):
    """transformers' model and tokenizer from the same file, in float32 (its own GGUF reader)."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs).eval()
    return model, tokenizer


def corpus() -> list[str]:
    """Code, prose, numbers, Unicode, emoji and whitespace runs."""
    from infra_lab.model import corpus as stdlib

    _, validation = stdlib.load()
    code = bytes(validation[:20_000].tolist()).decode("utf-8", "replace")
    pieces = [code[i:i + 700] for i in range(0, len(code), 700)]
    return pieces + ["The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
                     "Grüße aus Köln! Ça va? ¿Qué tal? Привет, мир.", "こんにちは世界。 안녕하세요",
                     "emoji 🤗🚀👍🏽 and ZWJ 👨‍👩‍👧 and flags 🇫🇷", "   leading\t\ttabs\n\n\n   and   runs    ",
                     "12345678901234567890 +1-800-555-0199 0x1F 1e-9", "<|im_start|>user\nhi<|im_end|>\n", ""]


def test_the_tokenizer_gives_transformers_ids_on_every_string(ours, theirs):
    _, tokenizer = ours
    reference = theirs[1]
    for text in corpus():
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text[:60]
        assert tokenizer.decode(tokenizer.encode(text)) == text


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def test_greedy_tokens_and_logits_equal_transformers(ours, theirs):
    """Four prompts served together, chunked prefill (a budget of 16 tokens a step) and paged KV,
    on the numba and torch faces: each request's 16 greedy tokens are transformers' generate, and
    the logits of its prompt agree with transformers' as closely as transformers' own float32
    agrees with the same model in float64 (four times that: two float32 computations)."""
    model, tokenizer = ours
    hf_model, _ = theirs
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    for name in ("numba", "torch"):
        engine = Engine(model, EngineConfig(policy="chunked", token_budget=16, num_blocks=64, block_size=16),
                        backends.resolve(name, "cpu"))
        assert engine.generate(prompts, SamplingParams(max_tokens=16)) == expected, name
    exact = TorchTransformer(model.config, model.w).double().eval()
    ids = prompts[0]
    with torch.no_grad():
        in_float64 = exact(torch.tensor([ids])).numpy()[0]
    theirs32 = reference_logits(hf_model, ids)
    tolerance = 4 * np.abs(theirs32 - in_float64).max()
    pool = model.new_paged_cache(8, 16)
    seq = pool.new_sequence()
    ours32 = model.forward(ids, pool.view(seq), backends.resolve("numba", "cpu"))
    assert np.abs(ours32 - theirs32).max() <= tolerance and np.abs(ours32 - in_float64).max() <= tolerance


def test_the_chat_template_and_greedy_decoding_answer(ours, theirs):
    model, tokenizer = ours
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.chat(messages)
    assert text == theirs[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    engine = Engine(model, EngineConfig(policy="chunked", num_blocks=32, block_size=16), backends.resolve("numba"),
                    detokenize=tokenizer.decode)
    answer = engine.generate([tokenizer.encode(text)], SamplingParams(max_tokens=24,
                                                                      stop_tokens=tokenizer.end_of_turn))[0]
    assert "Paris" in tokenizer.decode(answer, skip_special=True) and answer[-1] in tokenizer.end_of_turn


def test_bad_files_and_messages_are_refused_by_name(ours, path, tmp_path):
    model, tokenizer = ours
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:5_000_000])
    with pytest.raises(ValueError, match="cut.gguf (is not a readable GGUF file|.*may be cut short)"):
        gguf_file.read(cut)
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        gguf_file.read(tmp_path / "nothing.gguf")
    import gguf

    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(other, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="holds a 'gpt2' model; this reader knows the 'llama' architecture"):
        gguf_file.read(other)
    with pytest.raises(ValueError, match="message 0 has role 'robot'; allowed: system, user, assistant"):
        tokenizer.chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="no pretrained model 'gpt-5'"):
        pretrained.load("gpt-5")
    engine = Engine(model, EngineConfig(policy="chunked", num_blocks=8, block_size=16), backends.resolve("numba"))
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens"):
        engine.add_request([1] * 8190, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="token 49152 is outside the vocabulary \\[0, 49152\\)"):
        engine.add_request([49152])
    assert not engine.requests


def test_the_engine_serves_it_with_prefix_caches_preemption_and_speculation(ours):
    """The same greedy tokens from the plain engine, from the radix and block-hash prefix caches
    (prompts that share a prefix, served twice), from a pool small enough to preempt, and with
    prompt-lookup speculative decoding."""
    from infra_lab.serving.drafters import PromptLookupDrafter

    model, tokenizer = ours
    shared = "def area(radius):\n    return 3.14159 * radius * radius\n\n\n"
    prompts = [tokenizer.encode(shared + tail) for tail in ("def perimeter(radius):\n", "def volume(radius):\n",
                                                            "print(area(2))\nprint(area(")]
    params = SamplingParams(max_tokens=10)
    numba = backends.resolve("numba", "cpu")
    plain = Engine(model, EngineConfig(policy="chunked", num_blocks=32), numba).generate(prompts, params)
    need = max(-(-(len(p) + 10) // 16) for p in prompts)
    variants = {
        "radix": Engine(model, EngineConfig(policy="chunked", block_size=1, num_blocks=400, prefix_cache="radix"), numba),
        "hash": Engine(model, EngineConfig(policy="chunked", num_blocks=32, prefix_cache="hash"), numba),
        "preempting": Engine(model, EngineConfig(policy="chunked", num_blocks=need + 2), numba),
        "speculative": Engine(model, EngineConfig(policy="chunked", num_blocks=32, num_speculative_tokens=3), numba,
                              drafter=PromptLookupDrafter(model.config.vocab)),
    }
    for name, engine in variants.items():
        rounds = 2 if engine.config.prefix_cache else 1  # the second time, the caches hold the prompts
        for _ in range(rounds):
            assert engine.generate(prompts, params) == plain, name
    assert sum(len(r.preempted) for r in variants["preempting"].log) > 0
    assert all(sum(r.cached_tokens for r in variants[name].requests.values()) > 0 for name in ("radix", "hash"))
    assert variants["speculative"].runner.tally.kept.sum() > 0


def test_the_model_holds_each_weight_once(ours):
    """The fused matrices and the named weights share memory, and the tied LM head is the
    embedding table transposed: the arrays held add up to the parameters' own float32 bytes."""
    model, _ = ours

    def root(array):
        while isinstance(array.base, np.ndarray):
            array = array.base
        return array

    held = {id(root(a)): root(a).nbytes for a in [*model.w.values(), *model.matrices.values()]}
    norms = sum(v.size for n, v in model.w.items() if "norm" in n)
    assert sum(held.values()) == 4 * (model.config.total_params + norms)
    assert np.shares_memory(model.w["lm_head"], model.w["embed"])


def test_the_roofline_preset_is_the_files_config(ours):
    from dataclasses import replace

    from infra_lab import roofline

    config = ours[0].config
    preset = roofline.preset(NAME)
    assert preset.norm_eps == pytest.approx(config.norm_eps, rel=1e-6)  # the file keeps it in float32
    assert replace(preset, source="", norm_eps=0) == replace(config, source="", norm_eps=0)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)], ids=["int8", "int4-g32"])
def test_chapter_08s_int8_and_int4_weights_still_answer(ours, bits, group):
    """Chapter 08's round-to-nearest weights (int8 per channel, int4 in groups of 32) served by the
    engine: the chat still answers. (The file's weights already sit on a Q4_1 grid, so they are no
    full-precision reference for comparing quantization methods.)"""
    from infra_lab.model.quantized import quantize_model

    model, tokenizer = ours
    quantized = quantize_model(model, "rtn", bits, group)
    ids = tokenizer.encode(tokenizer.chat([{"role": "user", "content": "What is the capital of France?"}]))
    engine = Engine(quantized, EngineConfig(policy="chunked", num_blocks=32), backends.resolve("numba", "cpu"))
    answer = engine.generate([ids], SamplingParams(max_tokens=16, stop_tokens=tokenizer.end_of_turn))[0]
    assert "Paris" in tokenizer.decode(answer, skip_special=True)
