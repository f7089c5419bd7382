"""Chapter 08, low precision: the chapter's kernel verdicts, the articles' sizes and compute, and the
published quantization methods beside ours on the target model."""
from __future__ import annotations

import math

from infra_lab import hardware, measured, roofline, verdict
from infra_lab.claims.entry import Entry, Figure, committed, computed, judged, section_of
from infra_lab.kv import quant as kv_quant
from infra_lab.quant import formats

GPTQ = "https://arxiv.org/abs/2210.17323"
AWQ = "https://arxiv.org/abs/2306.00978"
SMOOTHQUANT = "https://arxiv.org/abs/2211.10438"
FP8 = "https://arxiv.org/abs/2209.05433"
KERNELS = "this book's target for its kernels"
INT8_DECODE = verdict.Claim(
    "int8 weights decode at least 1.8× as fast as transformers in float32, at batch 1", KERNELS, 1.8, "at least")
INT4_DECODE = verdict.Claim(
    "int4 weights decode at least 0.7× as fast as llama.cpp reading the file's Q4_1, at batch 1",
    KERNELS, 0.7, "at least")


def gemv_claim(name: str, need: int) -> verdict.Claim:
    return verdict.Claim(f"the {name} GEMV runs at least {need}× as fast as fp32 BLAS on matrices "
                         "streamed from memory", KERNELS, need, "at least")


def gemv(name: str, need: int):
    def figure() -> Figure | None:
        found = section_of("quant", "gemv")
        if found is None:
            return None
        speedup = found[1][name]["streamed"]["speedup_over_fp32"]
        return judged(gemv_claim(name, need), verdict.evidence(found[0], speedup, "gemv"))
    return figure


def decode(claim: verdict.Claim, key: str):
    def figure() -> Figure | None:
        found = section_of("pretrained", "decode")
        if found is None or "ratio_intervals" not in found[1]:
            return None
        return judged(claim, verdict.evidence(found[0], found[1]["ratio_intervals"][key], "decode"))
    return figure


def quality() -> tuple[dict, dict] | None:
    """(the results, {(method, bits, group): row}) of the committed quality section."""
    found = section_of("quant", "quality")
    return found and (found[0], {(r["method"], r["bits"], r["group"]): r for r in found[1]["rows"]})


def gptq_share() -> Figure | None:
    found = quality()
    if found is None:
        return None
    results, cell = found
    share = {bits: cell[("gptq", bits, None)]["loss_bits_per_byte"] / cell[("rtn", bits, None)]["loss_bits_per_byte"]
             for bits in (4, 3)}
    paper = {4: math.log(6.09 / 5.68) / math.log(6.29 / 5.68), 3: math.log(8.07 / 5.68) / math.log(25.54 / 5.68)}
    return committed(results, "quality", f"on the target model GPTQ keeps {share[4]:.0%} of round-to-nearest's loss "
                     f"in bits per byte at 4 bits and {share[3]:.0%} at 3 (per channel); the README's figures, in "
                     f"log-perplexity, {paper[4]:.0%} and {paper[3]:.0%}")


def awq_loss() -> Figure | None:
    found = quality()
    if found is None:
        return None
    results, cell = found
    awq, rtn = cell[("awq", 4, None)], cell[("rtn", 4, None)]
    return committed(results, "quality", f"AWQ at 4 bits per channel loses {awq['loss_bits_per_byte']:+.4f} bits "
                     f"per byte against round-to-nearest's {rtn['loss_bits_per_byte']:+.4f}, for "
                     f"{awq['bytes'] - rtn['bytes']:,.0f} more bytes of input scales")


def smoothquant_loss() -> Figure | None:
    found = quality()
    if found is None or ("smoothquant", 8, None) not in found[1]:
        return None
    results, cell = found
    sq, rtn = cell[("smoothquant", 8, None)], cell[("rtn", 8, None)]
    return committed(results, "quality", f"W8A8 loses {sq['loss_bits_per_byte']:+.4f} bits per byte on the target "
                     f"model (int8 weights alone: {rtn['loss_bits_per_byte']:+.4f}); no int8 GEMM is timed here")


def fp8_limits() -> Figure | None:
    found = section_of("quant", "formats")
    if found is None:
        return None
    results, checked = found
    same = all(checked[f.name]["codes_equal"] and checked[f.name]["floats_equal"] for f in (formats.E4M3, formats.E5M2))
    return committed(results, "formats", f"e4m3 {formats.E4M3.max_value:,.0f} (saturating), e5m2 "
                     f"{formats.E5M2.max_value:,.0f}; our rounding {'equals' if same else 'differs from'} torch's "
                     f"float8_e4m3fn and float8_e5m2 on {checked['floats']:,} floats")


def shrink() -> Figure:
    d_model = roofline.preset("llama-3-8b").d_model
    int8 = formats.IntFormat(8, None).bytes_per_value(d_model)
    int4 = formats.IntFormat(4, 128).bytes_per_value(d_model)
    return computed(f"against fp16, int8 per channel saves {1 - int8 / 2:.1%} and int4 in groups of 128 "
                    f"{1 - int4 / 2:.1%} (the group scales cost the rest); against fp32, {1 - int8 / 4:.1%} and "
                    f"{1 - int4 / 4:.1%}")


def kv_200_to_50() -> Figure:
    int4 = kv_quant.FORMATS["int4"]
    return computed(f"{200 * int4.bytes_per_value / 2:.1f} GB with int4 groups of {int4.group} and an fp16 scale "
                    "each, not 50: the scales add the rest")


def fp8_compute() -> Figure | None:
    gpu = measured.load("gpu_check_h200")
    if gpu is None:
        return None
    tflops = gpu["measure_cuda"]["TFLOPs"]
    h200 = hardware.get("H200")
    return committed(gpu, None, f"{tflops['fp8'] / tflops['bf16']:.2f}× bf16 measured on an H200 "
                     f"({tflops['fp8']:,.0f} against {tflops['bf16']:,.0f} TFLOP/s); the datasheet's ratio is "
                     f"{h200.flops('fp8') / h200.flops('bf16'):.0f}×")


ENTRIES = [
    Entry("08.gemv-int4", "08", gemv_claim("int4 g128", 3).statement, KERNELS, "3× (a target)", gemv("int4 g128", 3)),
    Entry("08.gemv-int8", "08", gemv_claim("int8 per channel", 2).statement, KERNELS, "2× (a target)",
          gemv("int8 per channel", 2)),
    Entry("08.int8-decode", "08", INT8_DECODE.statement, KERNELS, "1.8× (a target)",
          decode(INT8_DECODE, "int8_over_transformers")),
    Entry("08.int4-decode", "08", INT4_DECODE.statement, KERNELS, "0.7× (a target)",
          decode(INT4_DECODE, "int4_g32_over_llama_cpp")),
    Entry("08.shrink-50-75", "08", "int8 and int4 shrink a model by 50 to 75%", "B", "50 to 75%", shrink),
    Entry("08.kv-200-to-50", "08", "4-bit quantization shrinks a 200 GB KV cache to 50 GB", "A", "50 GB",
          kv_200_to_50),
    Entry("08.twice-the-compute", "08", "low precision releases up to twice the compute", "C", "up to 2×",
          fp8_compute),
    Entry("08.gptq", "08",
          "LLaMA-7B's WikiText-2 perplexity, one scale per output channel: fp16 5.68; at 4 bits round-to-nearest "
          "6.29 against GPTQ 6.09; at 3 bits 25.54 against 8.07",
          "Frantar et al., ICLR 2023: its repository's README (IST-DASLab/gptq)",
          "4 bits: 6.29 vs 6.09; 3 bits: 25.54 vs 8.07", gptq_share, links=(GPTQ,)),
    Entry("08.awq", "08",
          "keeping 1% of the salient weight channels in fp16 recovers much of round-to-nearest's loss; scaling them "
          "up before rounding does as well without mixed-precision storage", "Lin et al., MLSys 2024, Section 3",
          "1% of the channels", awq_loss, links=(AWQ,)),
    Entry("08.smoothquant", "08",
          "SmoothQuant's W8A8 gives up to 1.56× speedup and 2× memory reduction for LLMs with negligible loss in "
          "accuracy", "Xiao et al., ICML 2023, abstract", "up to 1.56×; 2× memory", smoothquant_loss,
          links=(SMOOTHQUANT,)),
    Entry("08.fp8-formats", "08",
          "two fp8 formats: e4m3 for weights and activations, e5m2 for gradients, whose largest finite values are "
          "448 and 57,344", "Micikevicius et al., 2022, Table 1", "448 and 57,344", fp8_limits, links=(FP8,)),
    Entry("08.marlin", "08", "the FP16×INT4 kernel reaches close to ideal (4×) speedups up to batch sizes of 16-32 "
          "tokens", "the Marlin kernel's README (IST-DASLab/marlin)", "close to 4×",
          not_here="needs a GPU; the committed runs hold no Marlin timing"),
]
