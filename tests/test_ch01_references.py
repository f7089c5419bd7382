"""Chapter 01's exercise references agree with the package they teach."""
import pytest
from hypothesis import given, strategies as st

from infra_lab import hardware, roofline
from infra_lab.grading import ch01


@given(m=st.integers(1, 5000), n=st.integers(1, 5000), k=st.integers(1, 5000),
       dtype=st.sampled_from(["fp32", "bf16", "fp8", "int4"]))
def test_gemm_intensity_is_the_roofline_gemm(m, n, k, dtype):
    assert ch01.gemm_intensity(m, n, k, roofline.bytes_per_element(dtype)) == \
        pytest.approx(roofline.gemm(m, n, k, dtype).intensity)


@pytest.mark.parametrize("device", list(hardware.CATALOG))
def test_weights_only_critical_batch_is_within_a_few_of_the_full_model(device):
    device = hardware.get(device)
    dtype = "bf16" if "bf16" in device.peak_flops else "fp16"
    simple = ch01.critical_batch(device.flops(dtype), device.memory_bandwidth, 2)
    full = roofline.critical_batch(roofline.LLAMA_3_8B, device, dtype)
    assert abs(full - simple) <= 0.02 * simple + 2


def test_decode_bound_matches_the_step_model_without_attention_flops():
    config, h100 = roofline.LLAMA_3_8B, hardware.get("H100 SXM")
    step = roofline.step_cost(config, 1, 1, 0, "bf16")
    seconds, _ = roofline.time_lower_bound(step, h100, "bf16")
    simple = ch01.decode_step_seconds(config.total_params - config.vocab * config.d_model, 2, 1,
                                      roofline.kv_bytes_per_token(config, "bf16"),
                                      h100.flops("bf16"), h100.memory_bandwidth)
    assert simple == pytest.approx(seconds, rel=1e-9)


def test_nothing_fits_when_the_weights_do_not():
    assert ch01.max_sequences(16e9, 70e9, 2, 327680, 4096) == 0
    assert ch01.max_sequences(80e9, 8e9, 2, 131072, 8192) == 59
