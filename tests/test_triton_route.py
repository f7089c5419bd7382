"""The torch face reaches the GPU kernels: with the route a CUDA device takes (`uses_triton`),
run on the CPU under Triton's interpreter, the model's steps call the Triton extend kernel for
prefill and the Triton paged kernel for decode, and give numba's greedy tokens."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run as numpy on the CPU

import pytest  # noqa: E402

from infra_lab import backend, model  # noqa: E402
from infra_lab.kernels import extend_attention_triton, paged_attention, paged_attention_triton  # noqa: E402
from infra_lab.model.generate import generate_many  # noqa: E402


@pytest.fixture
def triton_route(monkeypatch):
    """Count the calls of both Triton kernels, and send the torch face to them as on CUDA."""
    calls = {"extend": 0, "decode": 0}

    def counted(name, kernel):
        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(paged_attention, "uses_triton", lambda device: True)
    monkeypatch.setattr(extend_attention_triton, "extend_attention_triton",
                        counted("extend", extend_attention_triton.extend_attention_triton))
    monkeypatch.setattr(paged_attention_triton, "paged_decode_triton",
                        counted("decode", paged_attention_triton.paged_decode_triton))
    return calls


@pytest.mark.parametrize("block_size", [1, 16])
def test_the_models_torch_steps_call_the_triton_kernels_and_match_numba(triton_route, block_size):
    target = model.load("target")
    prompts = [b"def add(a, b):\n", b"import sys\nimport os\n"]
    expected = generate_many(target, prompts, 6, backend=backend.resolve("numba"))
    torch_cpu = backend.resolve("torch", "cpu")
    pool = target.new_paged_cache(96 // block_size + 4, block_size, backend=torch_cpu)
    assert generate_many(target, prompts, 6, paged=pool, backend=torch_cpu) == expected
    layers = target.config.n_layers
    assert triton_route == {"extend": 2 * layers, "decode": 5 * layers}  # 2 prefills, 5 batched decode steps
