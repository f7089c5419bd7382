"""The roofline pieces chapter 00 uses, against published figures."""
import pytest

from infra_lab import hardware, roofline


def test_kv_cache_per_token_matches_the_published_sizes():
    # 512 KiB for LLaMA-2-7B and 128 KiB for LLaMA-3-8B (grouped-query attention), in fp16
    assert roofline.kv_bytes_per_token(roofline.PRESETS["llama-2-7b"], "fp16") == 512 * 1024
    assert roofline.kv_bytes_per_token(roofline.PRESETS["llama-3-8b"], "fp16") == 128 * 1024


def test_llama_3_8b_has_about_eight_billion_parameters():
    config = roofline.PRESETS["llama-3-8b"]
    embedding = config.vocab * config.d_model
    assert (config.matmul_params + embedding) / 1e9 == pytest.approx(8.03, abs=0.01)


def test_h100_ridge_is_about_295_flop_per_byte():
    assert roofline.ridge_point(hardware.get("H100 SXM"), "bf16") == pytest.approx(295.3, abs=0.1)


def test_batch_one_decode_is_memory_bound_near_one_flop_per_byte():
    step = roofline.step_cost(roofline.LLAMA_3_8B, 1, 1, 0, "bf16")
    assert step.intensity == pytest.approx(1.0, rel=0.01)
    _, bound = roofline.time_lower_bound(step, hardware.get("H100 SXM"), "bf16")
    assert bound == "memory"
    long_prefill = roofline.step_cost(roofline.LLAMA_3_8B, 1, 4096, 0, "bf16")
    assert roofline.time_lower_bound(long_prefill, hardware.get("H100 SXM"), "bf16")[1] == "compute"


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="batch must be >= 1; got 0"):
        roofline.step_cost(roofline.LLAMA_3_8B, 0, 1, 0, "bf16")
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        roofline.step_cost(roofline.LLAMA_3_8B, 1, 1, 0, "fp7")
    with pytest.raises(ValueError, match="T4 has no 'fp8' peak"):
        roofline.ridge_point(hardware.get("T4"), "fp8")
    with pytest.raises(KeyError, match="known devices: H100 SXM, T4"):
        hardware.get("B200")
