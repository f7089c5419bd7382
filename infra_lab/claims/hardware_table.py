"""The appendix's hardware table: datasheet figures of the accelerators the book prices, beside what the
book's probes measured on an H200 and on the CPUs of its committed runs, each with its machine and date."""
from __future__ import annotations

from dataclasses import dataclass

from infra_lab import hardware, measured

DATASHEETS = ("A100 SXM 80GB", "H100 SXM", "H200", "MI300X")
NO_CPU_DATASHEET = ("no datasheet applies: the cloud machines' CPUs name no model (\"AMD EPYC\", \"Intel(R) "
                    "Xeon(R) Processor\") and are lent 2 threads, so their peaks are what the probes measure")


@dataclass(frozen=True)
class Row:
    device: str
    flops: dict[str, float]  # dtype -> FLOP/s, dense
    bandwidth: float | None  # bytes/s: the datasheet's memory bandwidth, or a measured roof
    roof: str  # which bandwidth: "datasheet", "copy", "read"
    memory_bytes: float | None
    source: str  # the datasheet, or the run: machine, date and command


def datasheet_rows() -> list[Row]:
    return [Row(device.name, dict(device.peak_flops), device.memory_bandwidth, "datasheet", device.memory_bytes,
                device.source) for device in map(hardware.get, DATASHEETS)]


def gpu_rows() -> list[Row]:
    """What the book's probes measured on an H200 (benchmarks/gpu_check.py, benchmarks/paged_gpu.py)."""
    rows = []
    check = measured.load("gpu_check_h200")
    if check is not None:
        roof = check["measure_cuda"]
        rows.append(Row(f"{roof['name']}, measured", {d: tf * 1e12 for d, tf in roof["TFLOPs"].items()},
                        roof["copy_TBps"] * 1e12, "copy", None, measured.label(check)))
    paged = measured.load("paged_gpu_h200")
    if paged is not None:
        rows.append(Row(f"{paged['machine']}, measured", {}, paged["copy_bandwidth_TBps"] * 1e12,
                        "copy", None, measured.label(paged)))
    return rows


def cpu_rows() -> list[Row]:
    """What the committed CPU runs measured: their BLAS matmul peaks and memory roofs."""
    rows = []
    weight_bound = (measured.load("serving") or {}).get("sections", {}).get("weight_bound")
    if weight_bound and "cpu_flops_fp32" in weight_bound:
        results = measured.load("serving")
        rows.append(Row(measured.run_of(results, "weight_bound")["machine"], {"fp32": weight_bound["cpu_flops_fp32"]},
                        weight_bound["cpu_bandwidth"], "copy", None,
                        measured.label(results, "weight_bound")))
    moe = measured.load("moe")
    layer = (moe or {}).get("sections", {}).get("layer")
    if layer and "blas_peak_GFLOPs" in layer:
        rows.append(Row(measured.run_of(moe, "layer")["machine"], {"fp32": layer["blas_peak_GFLOPs"]["median"] * 1e9},
                        None, "", None, measured.label(moe, "layer")))
    quant = measured.load("quant")
    gemv = (quant or {}).get("sections", {}).get("gemv")
    if gemv and "read_roof_GBps" in gemv:
        rows.append(Row(measured.run_of(quant, "gemv")["machine"], {}, gemv["read_roof_GBps"]["median"] * 1e9,
                        "read", None, measured.label(quant, "gemv")))
    return rows


def this_machine() -> Row:
    """This machine's CPU, measured by hardware.measure() (cached per machine; about 10 s when not)."""
    here = hardware.measure("cpu", progress=False)
    return Row(f"{here.name}, this page's build", dict(here.peak_flops), here.memory_bandwidth,
               "copy", here.memory_bytes, "hardware.measure(), when this page was built")
