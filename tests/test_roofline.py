"""Roofline arithmetic against brute-force counts and published figures."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from infra_lab import hardware, roofline, roofline_kernels
from infra_lab.model.cost import batch_cost, forward_cost

H100 = hardware.get("H100 SXM")
sizes = st.integers(1, 4096)
dtypes = st.sampled_from(sorted(roofline.BYTES_PER_ELEMENT))


def test_catalog_has_every_part_with_a_source_and_positive_figures():
    names = {"A100 SXM 80GB", "H100 SXM", "H200", "L4", "T4", "MI300X", "TPU v5e"}
    assert names <= set(hardware.CATALOG)
    for device in hardware.CATALOG.values():
        assert device.source and device.memory_bandwidth > 0 and device.memory_bytes > 0
        assert all(v > 0 for v in device.peak_flops.values())
        assert ("bf16" in device.peak_flops) or ("fp16" in device.peak_flops)


def test_an_unknown_device_lists_the_known_ones():
    with pytest.raises(KeyError, match="unknown device 'B200'; known devices: A100 SXM 80GB, H100 SXM, H200"):
        hardware.get("B200")


def test_a_dtype_the_device_lacks_is_named():
    with pytest.raises(ValueError, match="T4 has no 'fp8' peak; it has fp32, fp16, int8"):
        roofline.ridge_point(hardware.get("T4"), "fp8")


@given(m=sizes, n=sizes, k=sizes, dtype=dtypes)
def test_gemm_counts_match_a_brute_force_tally(m, n, k, dtype):
    cost = roofline.gemm(m, n, k, dtype)
    multiply_adds = m * n * k  # one per (i, j, l)
    assert cost.flops == 2 * multiply_adds
    assert cost.bytes == pytest.approx((m * k + k * n + m * n) * roofline.bytes_per_element(dtype))


@given(n_out=sizes, n_in=sizes)
def test_gemv_does_about_two_flops_per_weight_byte_pair(n_out, n_in):
    cost = roofline.gemv(n_out, n_in, "fp32")
    assert cost.intensity <= 2 / 4 * (1 + 1e-12)  # 2 FLOPs per 4-byte weight, at most


@pytest.mark.parametrize("op, args", [
    (roofline.gemm, (0, 1, 1, "fp32")), (roofline.gemm, (1, -3, 1, "fp32")),
    (roofline.attention_prefill, (0, 8, 64, "bf16")), (roofline.attention_decode, (10, 0, 64, "bf16")),
    (roofline.elementwise, (0, "fp32")), (roofline.rmsnorm, (1, 0, "fp32")),
])
def test_zero_or_negative_sizes_are_refused(op, args):
    with pytest.raises(ValueError, match="must be > 0; got"):
        op(*args)


def test_attention_prefill_matches_a_loop_over_query_key_pairs():
    seq_len, heads, head_dim = 7, 3, 5
    pairs = sum(1 for i in range(seq_len) for j in range(seq_len) if j <= i)
    cost = roofline.attention_prefill(seq_len, heads, head_dim, "fp32")
    assert cost.flops == 4 * pairs * heads * head_dim
    assert cost.bytes == 4 * seq_len * head_dim * 4 * heads


def test_decode_attention_intensity_is_set_by_grouped_heads():
    mha = roofline.attention_decode(4096, 32, 128, "bf16")
    gqa = roofline.attention_decode(4096, 32, 128, "bf16", n_kv_heads=8)
    assert mha.intensity == pytest.approx(1.0, rel=0.01)  # 4 FLOPs per 2 K/V elements of 2 bytes
    assert gqa.intensity == pytest.approx(4.0, rel=0.01)  # 4 query heads share each KV head


@given(intensity=st.floats(1e-3, 1e5), dtype=st.sampled_from(["fp32", "bf16", "fp8"]))
def test_attainable_is_the_lower_roof_and_ridge_is_where_they_meet(intensity, dtype):
    attainable = roofline.attainable_flops(intensity, H100, dtype)
    assert attainable == min(H100.flops(dtype), intensity * H100.memory_bandwidth)
    ridge = roofline.ridge_point(H100, dtype)
    assert roofline.attainable_flops(ridge, H100, dtype) == pytest.approx(H100.flops(dtype))


def test_time_bound_names_the_binding_roof():
    step = roofline.step_cost(roofline.LLAMA_3_8B, 1, 1, 0, "bf16")
    seconds, bound = roofline.time_lower_bound(step, H100, "bf16")
    assert bound == "memory" and seconds == pytest.approx(step.bytes / H100.memory_bandwidth)
    prefill = roofline.step_cost(roofline.LLAMA_3_8B, 1, 4096, 0, "bf16")
    assert roofline.time_lower_bound(prefill, H100, "bf16")[1] == "compute"


def test_kv_cache_per_token_matches_the_published_sizes():
    # 512 KiB for LLaMA-2-7B and 128 KiB for LLaMA-3-8B (grouped-query attention), in fp16
    assert roofline.kv_bytes_per_token(roofline.preset("llama-2-7b"), "fp16") == 512 * 1024
    assert roofline.kv_bytes_per_token(roofline.preset("llama-3-8b"), "fp16") == 128 * 1024


@pytest.mark.parametrize("name, billions, active", [
    ("llama-2-7b", 6.74, None), ("llama-3-8b", 8.03, None), ("llama-3-70b", 70.55, None),
    ("mixtral-8x7b", 46.70, 12.9),
])
def test_parameter_counts_match_the_published_sizes(name, billions, active):
    config = roofline.preset(name)
    assert config.total_params / 1e9 == pytest.approx(billions, rel=0.01)
    if active:  # Mixtral: 47B in total, 13B used per token (Jiang et al., 2024)
        assert config.active_params / 1e9 == pytest.approx(active, rel=0.03)


def test_tiny_model_has_about_a_million_parameters():
    assert 0.8e6 < roofline.preset("infra-lab-tiny").total_params < 1.3e6


def test_the_shipped_model_config_is_the_tiny_preset_roofline_prices():
    from infra_lab import model

    target = roofline.step_cost(model.CONFIGS["target"], 1, 1, 10, "fp32")
    assert target == roofline.step_cost(roofline.preset("infra-lab-tiny"), 1, 1, 10, "fp32")
    assert roofline.preset("infra-lab-tiny").total_params == model.CONFIGS["target"].total_params


def test_an_unknown_preset_lists_the_known_ones():
    with pytest.raises(KeyError, match="presets: llama-2-7b, llama-3-8b"):
        roofline.preset("gpt-5")


@given(batch=st.integers(1, 512), new_tokens=st.integers(1, 64), context=st.integers(0, 4096))
def test_step_cost_matches_a_per_token_sum(batch, new_tokens, context):
    config = roofline.preset("infra-lab-tiny")
    cost = roofline.step_cost(config, batch, new_tokens, context, "fp32")
    flops = 0
    for _ in range(batch):
        for position in range(context, context + new_tokens):
            flops += 2 * config.active_params + 4 * config.n_layers * config.d_model * (position + 1)
    assert cost.flops == pytest.approx(flops)
    weights = config.total_params - config.vocab * config.d_model  # the embedding is indexed
    kv = batch * (context + new_tokens) * roofline.kv_bytes_per_token(config, "fp32")
    assert cost.bytes == pytest.approx(4 * weights + kv)
    assert cost == batch_cost(config, [(context, new_tokens)] * batch, "fp32")  # its closed form


def test_forward_cost_names_impossible_totals():
    config = roofline.preset("infra-lab-tiny")
    for tokens, attended, kv_tokens in ((0, 0, 0), (2, -1, 2), (4, 10, 3)):
        with pytest.raises(ValueError, match=f"got tokens={tokens}, attended={attended}"):
            forward_cost(config, tokens, attended, kv_tokens, "fp32")


def test_moe_decode_reads_more_experts_as_the_batch_grows():
    mixtral = roofline.preset("mixtral-8x7b")
    assert mixtral.experts_touched(1) == pytest.approx(2)
    assert mixtral.experts_touched(64) == pytest.approx(8, abs=1e-6)
    one = roofline.step_cost(mixtral, 1, 1, 0, "bf16")
    many = roofline.step_cost(mixtral, 64, 1, 0, "bf16")
    assert many.bytes > 2.5 * one.bytes


def test_critical_batch_reproduces_the_scaling_book_for_an_h100():
    # "How to Scale Your Model": about 298 for bf16 (989 TFLOP/s over 3.35 TB/s); ours ~295
    batch = roofline.critical_batch(roofline.LLAMA_3_8B, H100, "bf16")
    assert 290 <= batch <= 300
    step = roofline.step_cost(roofline.LLAMA_3_8B, batch, 1, 0, "bf16")
    below = roofline.step_cost(roofline.LLAMA_3_8B, batch - 1, 1, 0, "bf16")
    ridge = roofline.ridge_point(H100, "bf16")
    assert step.intensity >= ridge > below.intensity


@pytest.mark.slow
def test_long_contexts_can_keep_decode_memory_bound_at_any_batch():
    assert roofline.critical_batch(roofline.preset("llama-2-7b"), H100, "bf16", context=32768) == math.inf


@settings(max_examples=60)
@given(st.floats(1e10, 1e13), st.floats(1e9, 1e12), st.integers(0, 4096), st.sampled_from([2, 3, 16, 64, 100]))
def test_weight_bound_batch_is_the_largest_power_of_two_below_the_ridge(flops, bandwidth, context, largest):
    device = hardware.Device("cpu", {"fp32": flops}, bandwidth, 0, "t")
    config = roofline.preset("llama-3-8b")
    batch = roofline.weight_bound_batch(config, device, "fp32", context, largest)
    ridge = roofline.ridge_point(device, "fp32")

    def compute_bound(b):
        return roofline.step_cost(config, b, 1, context, "fp32").intensity >= ridge

    assert batch & (batch - 1) == 0 and 2 <= batch <= largest
    assert batch == 2 or not compute_bound(batch)
    assert 2 * batch > largest or compute_bound(2 * batch)  # brute force: the next power of two is not


def test_weight_bound_batch_names_a_bad_limit():
    with pytest.raises(ValueError, match="largest must be an integer >= 2; got 1"):
        roofline.weight_bound_batch(roofline.LLAMA_3_8B, H100, "bf16", 0, 1)


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        roofline.step_cost(roofline.LLAMA_3_8B, 1, 1, 0, "fp7")
    with pytest.raises(ValueError, match="batch must be >= 1; got 0"):
        roofline.step_cost(roofline.LLAMA_3_8B, 0, 1, 0, "bf16")


def test_plot_draws_a_roof_per_dtype_and_every_point():
    import matplotlib
    matplotlib.use("Agg")
    ax = roofline.plot([(H100, "bf16"), (H100, "fp32")],
                       [roofline.Point("decode", 1.0, 3e12), roofline.Point("prefill", 900, 9e14)])
    assert len(ax.get_legend().get_texts()) == 2
    assert {t.get_text() for t in ax.texts} == {"decode", "prefill"}
    assert ax.get_xscale() == ax.get_yscale() == "log"


def test_plot_joins_a_series_under_one_legend_entry():
    import matplotlib
    matplotlib.use("Agg")
    points = [roofline.Point(str(n), n / 6, 1e10 * n**0.3, series="matmul") for n in (64, 128, 256)]
    ax = roofline.plot([(H100, "fp32")], points + [roofline.Point("GEMV", 0.5, 4e9)])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["H100 SXM, fp32", "matmul"]
    assert {t.get_text() for t in ax.texts} == {"64", "128", "256", "GEMV"}
    colors = {t.get_text(): t.get_color() for t in ax.texts}
    assert colors["64"] == colors["256"] != colors["GEMV"]


# the chapter's measured matmuls crowd each other: their labels must not overlap or leave the axes
@settings(max_examples=10, deadline=None)
@given(rates=st.lists(st.floats(1e9, 6e10), min_size=3, max_size=6),
       cpu_like=st.booleans())
def test_point_labels_neither_overlap_nor_leave_the_axes(rates, cpu_like):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = hardware.Device("cpu", {"fp32": 6e10}, 1e10, 0, "t") if cpu_like else H100
    points = [roofline.Point(f"matmul {64 * 2**i}", 64 * 2**i / 6, rate)
              for i, rate in enumerate(rates)]
    points.append(roofline.Point("attention decode 16K", 0.5, 4e9))
    ax = roofline.plot([(device, "fp32")], points, intensity_range=(0.05, 1e4))
    renderer = ax.figure.canvas.get_renderer()
    boxes = []
    for text in ax.texts:
        text.update_positions(renderer)
        boxes.append(matplotlib.text.Text.get_window_extent(text, renderer))
    frame = ax.get_window_extent(renderer)
    for i, box in enumerate(boxes):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 <= box.y1 <= frame.y1
        assert not any(box.overlaps(other) for other in boxes[i + 1:]), [t.get_text() for t in ax.texts]
    plt.close(ax.figure)


def test_place_labels_needs_one_anchor_per_label():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="2 anchors for 1 labels"):
        roofline.place_labels(ax, [(1, 1), (2, 2)], ["one"])
    plt.close(ax.figure)


# ---- kernels held against roofs measured with them ----------------------------------------

def test_a_kernel_is_held_against_the_lower_of_its_measured_roofs():
    roofs = roofline_kernels.Roofs({"copy": 10e9, "read": 20e9}, {"fp32": 100e9})
    gemv = roofline_kernels.KernelRun("GEMV", roofline.gemv(1000, 1000, "fp32"), 1e-3,
                                      memory_roof="read", roofs=roofs)
    assert gemv.roof() == (pytest.approx(gemv.cost.intensity * 20e9), "read")
    assert gemv.fraction_of_roof() == pytest.approx(gemv.bytes_per_s / 20e9)
    matmul = roofline_kernels.KernelRun("matmul", roofline.gemm(512, 512, 512, "fp32"), 1e-2,
                                        roofs=roofs)
    assert matmul.roof() == (100e9, "fp32 compute")
    assert matmul.fraction_of_roof() == pytest.approx(matmul.flops_per_s / 100e9)
    # given a device, the old reading: its copy bandwidth and its peak
    assert gemv.fraction_of_roof(H100) == pytest.approx(gemv.bytes_per_s / H100.memory_bandwidth)


def test_a_run_without_its_roof_says_so():
    run = roofline_kernels.KernelRun("GEMV", roofline.gemv(8, 8, "fp32"), 1.0, memory_roof="read")
    with pytest.raises(ValueError, match="GEMV: no read or fp32 roof was measured"):
        run.roof()
    with pytest.raises(ValueError, match="no 'read' roof with a 'bf16' peak"):
        roofline_kernels.Roofs({"copy": 1e9}, {"fp32": 1e9}).device("read", "bf16")


def test_median_roofs_takes_each_roof_from_the_runs_that_measured_it():
    runs = [roofline_kernels.Roofs({"read": r}) for r in (1, 5, 3)]
    runs.append(roofline_kernels.Roofs({"copy": 2}, {"fp32": 7}))
    median = roofline_kernels.median_roofs(runs)
    assert median.bandwidth == {"copy": 2, "read": 3} and median.compute == {"fp32": 7}


def test_turns_alternate_and_keep_the_fastest():
    calls = []
    first = lambda: calls.append("a")  # noqa: E731
    second = lambda: calls.append("b")  # noqa: E731
    third = lambda: calls.append("c")  # noqa: E731
    seconds = roofline_kernels.best_in_turns([first, second, third], 3)
    assert "".join(calls) == "abc" * 4 and len(seconds) == 3 and min(seconds) >= 0
    with pytest.raises(ValueError, match="repeats must be >= 1; got 0"):
        roofline_kernels.best_in_turns([first], 0)


def test_memory_kernels_carry_the_roof_measured_beside_them():
    gemv = roofline_kernels.time_gemv(256, repeats=1)
    assert gemv.memory_roof == "read" and set(gemv.roofs.bandwidth) == {"read"}
    triad = roofline_kernels.time_triad(2**18, repeats=1)
    assert triad.memory_roof == "copy" and set(triad.roofs.bandwidth) == {"copy"}
    assert 0 < gemv.fraction_of_roof() and 0 < triad.fraction_of_roof()


def test_the_torch_kernels_run_with_their_roofs_on_any_device():
    pytest.importorskip("torch")
    plan = {"matmul": [16, 32], "gemv": 64, "triad_bytes": 2**16, "attention_context": 2048,
            "roof_bytes": 2**20, "roof_matmuls": (64,)}
    runs = roofline_kernels.run_all_torch(plan, "cpu", repeats=1)
    assert [r.label for r in runs] == ["matmul 16", "matmul 32", "GEMV 64x64", "triad 0 MiB",
                                       "attention decode 2K"]
    assert [r.memory_roof for r in runs] == ["copy", "copy", "read", "copy", "read"]
    for run in runs:
        assert set(run.roofs.bandwidth) == {"copy", "read"}
        assert set(run.roofs.compute) == {"bf16", "fp32"}
        assert run.fraction_of_roof() > 0


def test_run_all_holds_every_kernel_against_a_roof_of_its_run(monkeypatch):
    small = {"matmul": [16, 32], "gemv": 256, "triad_bytes": 2**18,
             "attention_context": 256, "roof_matmuls": (64,)}
    monkeypatch.setitem(roofline_kernels.SIZES, "small", small)
    runs = roofline_kernels.run_all("small", progress=False)
    assert [run.roof()[1] for run in runs] == ["fp32 compute"] * 2 + ["read", "copy", "read"]
    assert "64 cubes, just after the matmuls" in runs[0].roofs.how
    assert all(run.fraction_of_roof() > 0 for run in runs)


def test_matmuls_form_one_series_on_the_plot():
    run = roofline_kernels.KernelRun("matmul 256", roofline.gemm(256, 256, 256, "fp32"), 1e-3)
    assert run.point() == roofline.Point("256", run.cost.intensity, run.flops_per_s,
                                         series="matmul n x n x n")
    gemv = roofline_kernels.KernelRun("GEMV 8x8", roofline.gemv(8, 8, "fp32"), 1e-3)
    assert gemv.point().label == "GEMV 8x8" and gemv.point().series == ""
