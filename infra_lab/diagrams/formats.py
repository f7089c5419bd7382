"""Chapter 08's number-format diagrams, drawn from `infra_lab.quant`.

`draw_bit_layouts`: fp32, bf16, fp16 and the two fp8 formats as rows of bits at one width per
bit, so a weight's bytes read off as lengths (fp32 four times fp8), each row with the range its
bits allow: largest finite value, smallest normal and subnormal, the step at 1.0, and what a
value beyond the largest becomes (fp8 e4m3 saturates; Micikevicius et al., "FP8 Formats for
Deep Learning", 2022). fp32's numbers come from numpy's finfo, the others from the
`quant.formats` FloatFormats and their rounding.

`draw_int4_packing`: one group of an output row's weights quantized to int4 by
`quant.matmul.QuantizedMatrix`: the fp16 scale max|w| / 7 (rounded up), the values q in
[-8, 7], their nibbles q + 8, and the bytes the matrix stores, byte j holding value j in its low
nibble and value j + g/2 in its high one; then what the group costs in memory, its scale included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from infra_lab.figures import MAX_WIDTH_IN
from infra_lab.model import weights as weight_files
from infra_lab.quant import formats
from infra_lab.quant.matmul import QuantizedMatrix

FONT_PT, TABLE_PT, TITLE_PT = 9.0, 10.0, 10.5  # TABLE_PT: the numbers, whose exponents are superscripts
# Okabe and Ito's colour-blind-safe palette, each field also told apart by its count and place
FIELD_COLORS = {"sign": "#cc79a7", "exponent": "#56b4e9", "mantissa": "#e69f00"}
LOW, HIGH = "#0072b2", "#d55e00"  # the first half of an int4 group (low nibbles) and the second (high)
SCALE_COLOR = "#009e73"
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


# ---- bit layouts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BitLayout:
    """One format's bits and the numbers they allow."""
    name: str  # as the figure labels it: "fp32", "fp8 e4m3"
    exponent_bits: int
    mantissa_bits: int
    largest: float  # the largest finite value
    smallest_normal: float
    smallest_subnormal: float
    epsilon: float  # the step from 1.0 to the next value up, 2^-mantissa_bits
    overflow: float  # what a value twice the largest becomes: inf (IEEE) or the largest (saturating)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


def largest_finite(fmt: formats.FloatFormat) -> float:
    """The largest finite value of `fmt`. fp8's comes from its code table; in the IEEE formats the
    top exponent is kept for inf and NaN, so the largest is (2 - 2^-m) 2^(top - 1 - bias). (bf16's
    FloatFormat.max_value is fp32's, the threshold its rounding overflows at, not a bf16 value.)"""
    if fmt.name in formats.TABLES:
        table = formats.TABLES[fmt.name]
        return float(table[np.isfinite(table)].max())
    top = 2 ** fmt.exponent_bits - 1
    return (2 - 2.0 ** -fmt.mantissa_bits) * 2.0 ** (top - 1 - fmt.bias)


def bit_layouts() -> list[BitLayout]:
    """fp32 (from numpy's finfo), bf16, fp16, fp8 e4m3 and e5m2 (from quant.formats), widest first."""
    fp32 = np.finfo(np.float32)
    with np.errstate(over="ignore"):
        found = [BitLayout("fp32", fp32.nexp, fp32.nmant, float(fp32.max), float(fp32.smallest_normal),
                           float(fp32.smallest_subnormal), float(fp32.eps), float(fp32.max * np.float32(2)))]
        for fmt in (formats.BF16, formats.FP16, formats.E4M3, formats.E5M2):
            largest = largest_finite(fmt)
            found.append(BitLayout(fmt.name.replace("-", " "), fmt.exponent_bits, fmt.mantissa_bits, largest,
                                   fmt.min_normal, fmt.min_subnormal, 2.0 ** -fmt.mantissa_bits,
                                   float(formats.round_float(np.float32(largest) * np.float32(2), fmt))))
    return found


def power_of_two(value: float) -> str:
    """2 to its exponent, as `value` is an exact power of two: "2⁻¹²⁶"."""
    exponent = math.log2(value)
    if exponent != int(exponent):
        raise ValueError(f"{value} is not a power of two")
    return "2" + str(int(exponent)).translate(SUPERSCRIPT)


def magnitude(value: float) -> str:
    """Whole numbers up to a million with separators ("57,344"), larger ones as 3.40×10³⁸."""
    if value < 1e6 and value == int(value):
        return f"{value:,.0f}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}×10{str(int(exponent)).translate(SUPERSCRIPT)}"


def overflow_text(layout: BitLayout) -> str:
    return "±inf" if math.isinf(layout.overflow) else f"±{magnitude(layout.overflow)}"


# the table beside the bits: a BitLayout field, its header, how it is written, the column's width in inches
COLUMNS = (("largest", "largest", lambda r: magnitude(r.largest), 0.78),
           ("smallest_normal", "smallest\nnormal", lambda r: power_of_two(r.smallest_normal), 0.64),
           ("smallest_subnormal", "smallest\nsubnormal", lambda r: power_of_two(r.smallest_subnormal), 0.72),
           ("epsilon", "step\nat 1.0", lambda r: power_of_two(r.epsilon), 0.5),
           ("overflow", "overflow\nbecomes", overflow_text, 0.66))
BIT_IN, LABEL_IN, ROW_IN, BOX_IN = 0.085, 0.74, 0.42, 0.26  # one bit's width; row labels; a row's pitch; box height
TOP_IN, NOTE_IN = 1.0, 0.62  # the title, key and column headers above the rows; the note below them


def draw_bit_layouts() -> Figure:
    """One row per format: its bits as boxes at one width per bit (sign, exponent and mantissa
    coloured, with their counts; a dark frame per byte) and, in a table beside them, the numbers
    those bits allow."""
    rows = bit_layouts()
    most_bits = max(r.bits for r in rows)
    table_x = LABEL_IN + most_bits * BIT_IN + 0.12
    width = MAX_WIDTH_IN  # the table ends at table_x + its columns' widths, 6.88 in
    height = TOP_IN + len(rows) * ROW_IN + NOTE_IN
    figure = Figure(figsize=(width, height))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    smallest = min(rows, key=lambda r: r.bits)
    ax.text(0.05, height - 0.2, f"Bits per number at one width per bit: {rows[0].name} takes "
            f"{rows[0].bits // smallest.bits}× the memory of {smallest.name.split()[0]}", ha="left", va="center",
            fontsize=TITLE_PT, gid="title")

    key_x, key_y = LABEL_IN, height - 0.55  # the key to the colours, over the bits
    for field, color in FIELD_COLORS.items():
        ax.add_patch(Rectangle((key_x, key_y - 0.08), 0.16, 0.16, facecolor=color, edgecolor="0.3",
                               linewidth=0.6))
        ax.text(key_x + 0.22, key_y, field, ha="left", va="center", fontsize=FONT_PT, gid=f"key:{field}")
        key_x += 0.3 + 0.075 * len(field)
    ax.text(LABEL_IN, key_y - 0.25, "in the boxes: bits per field; frames: bytes", ha="left",
            va="center", fontsize=FONT_PT, color="0.25", gid="key:bytes")

    x = table_x
    for key, header, _, column_w in COLUMNS:
        ax.text(x + column_w / 2, key_y - 0.1, header, ha="center", va="center", fontsize=FONT_PT,
                gid=f"header:{key}", linespacing=1.1)
        x += column_w

    for index, row in enumerate(rows):
        y = height - TOP_IN - (index + 1) * ROW_IN + (ROW_IN - BOX_IN) / 2  # the boxes' bottom
        mid = y + BOX_IN / 2
        ax.text(0.05, mid, f"{row.name}\n{row.bits // 8} byte{'s' if row.bits > 8 else ''}", ha="left",
                va="center", fontsize=FONT_PT, linespacing=1.05, gid=f"label:{row.name}")
        fields = [("sign", 1), ("exponent", row.exponent_bits), ("mantissa", row.mantissa_bits)]
        bit = 0
        for field, count in fields:
            for _ in range(count):
                ax.add_patch(Rectangle((LABEL_IN + bit * BIT_IN, y), BIT_IN, BOX_IN, facecolor=FIELD_COLORS[field],
                                       edgecolor="white", linewidth=0.5, gid=f"bit:{row.name}:{bit}:{field}"))
                bit += 1
            ax.text(LABEL_IN + (bit - count / 2) * BIT_IN, mid, str(count), ha="center", va="center",
                    fontsize=FONT_PT, gid=f"count:{row.name}:{field}")
        for byte in range(row.bits // 8):
            ax.add_patch(Rectangle((LABEL_IN + byte * 8 * BIT_IN, y), 8 * BIT_IN, BOX_IN, facecolor="none",
                                   edgecolor="0.15", linewidth=1.2, gid=f"byte:{row.name}:{byte}"))
        x = table_x
        for key, _, number, column_w in COLUMNS:
            ax.text(x + column_w / 2, mid, number(row), ha="center", va="center", fontsize=TABLE_PT,
                    gid=f"{key}:{row.name}")
            x += column_w

    e4m3 = next(r for r in rows if r.name.endswith("e4m3"))
    nan_bits = f"{formats.NAN_CODE[formats.E4M3.name] & 0x7F:07b}"
    note = (f"{e4m3.name} has no infinity: its top exponent holds numbers up to {magnitude(e4m3.largest)}, "
            f"and S.{nan_bits[:e4m3.exponent_bits]}.{nan_bits[e4m3.exponent_bits:]} is its only NaN.\n"
            f"Beyond the largest it saturates to ±{magnitude(e4m3.overflow)}, as torch's float8_e4m3fn does. "
            "The others are IEEE:\nan exponent of all ones is inf or NaN, and values beyond the largest overflow "
            "to inf.")
    ax.text(0.05, NOTE_IN / 2 - 0.04, note, ha="left", va="center", fontsize=FONT_PT, color="0.2",
            linespacing=1.2, gid="note")
    return figure


# ---- int4 packing --------------------------------------------------------------------------------


MAX_GROUP = 8  # columns narrower than a 9-pt weight would not fit the page
EXAMPLE = ("target", "layers.0.wq", 0)  # the default group: the first inputs of this output of the shipped model


def example_weights(group: int = 8) -> np.ndarray:
    """The first `group` weights of output 0 of the shipped target model's layer-0 query projection."""
    size, name, output = EXAMPLE
    weights, _, _ = weight_files.load(weight_files.path_for(size))
    return np.ascontiguousarray(weights[name][:group, output], np.float32)


def short(value: float) -> str:
    """Three significant digits, the exponent, if any, without its plus and zeros: "-0.0186", "1.23e4"."""
    text = f"{value:.3g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def check_group(values, group) -> np.ndarray:
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group % 2 or not 2 <= group <= MAX_GROUP:
        raise ValueError(f"the diagram draws one int4 group of 2 to {MAX_GROUP} values, an even count (two "
                         f"to a byte); got group={group!r}")
    values = np.asarray(values, np.float32)
    if values.shape != (group,):
        raise ValueError(f"need the group's {group} weights, shape ({group},); got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError(f"weights must be finite; got {values.tolist()}")
    return values


def draw_int4_packing(values=None, group: int = 8) -> Figure:
    """One output row's group of `group` weights (default: real ones, see `example_weights`)
    quantized by QuantizedMatrix.quantize(w[:, None], 4, group), column by column: w, w / s, q,
    the nibble q + 8, then arrows into the bytes the matrix stores (value j in byte j's low nibble,
    value j + group/2 in its high one) and the group in memory, codes and fp16 scale."""
    values = check_group(example_weights(group) if values is None else values, group)
    matrix = QuantizedMatrix.quantize(values[:, None], 4, group)  # n_in = group, n_out = 1
    q = matrix.values()[0]  # (group,) int8 in [-8, 7]
    codes = matrix.codes[0]  # (group / 2,) uint8
    scale = matrix.scales[0, 0]  # fp16
    q_max = formats.IntFormat(4, group).q_max  # 7
    exact = float(np.abs(values).max() / np.float32(q_max))  # the scale before fp16
    half = group // 2
    ratios = values / np.float32(scale) if scale > 0 else np.zeros_like(values)  # an all-zero group keeps s = 0

    width = MAX_WIDTH_IN
    left, right = 1.3, 0.1
    column = min(0.7, (width - left - right) / group)
    box_h, height = 0.3, 4.75
    y_index, y_w, y_scale, y_ratio, y_q, y_nibble, y_byte, y_memory = 4.03, 3.64, 3.28, 2.88, 2.46, 1.92, 1.04, 0.36
    figure = Figure(figsize=(width, height))
    ax = figure.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.text(0.05, height - 0.2, f"One group of {group} weights packed into int4: {half} byte{'s' if half > 1 else ''} "
            f"of codes and a {formats.SCALE_BYTES}-byte fp16 scale", ha="left", va="center", fontsize=TITLE_PT,
            gid="title")

    def col(i):
        return left + i * column

    def cell(x, y, w, text, gid, edge="0.4", face="white", h=box_h):
        ax.add_patch(Rectangle((x + 0.03, y), w - 0.06, h, facecolor=face, edgecolor=edge, linewidth=1.0, gid=gid))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=FONT_PT, gid=gid,
                linespacing=1.1)

    rows = {"index": (y_index + box_h / 2, "value j"), "w": (y_w + box_h / 2, "weights w (fp32)"),
            "ratio": (y_ratio + box_h / 2, "w / s"), "q": (y_q + box_h / 2, "q = round(w / s)"),
            "nibble": (y_nibble + 0.2, "nibble q + 8\n(4 bits)"),
            "byte": (y_byte + box_h / 2, "bytes\n(high | low)"),
            "memory": (y_memory + box_h / 2, "the group\nin memory")}
    for name, (y, label) in rows.items():
        ax.text(0.05, y, label, ha="left", va="center", fontsize=FONT_PT, gid=f"row:{name}", linespacing=1.05)
    ax.text(left + 0.03, y_scale + box_h / 2, f"s = max|w| / {q_max} = {exact:.6g}, rounded up to fp16: s = "
            f"{float(scale):.6g} (bits 0x{int(scale.view(np.uint16)):04X})", ha="left", va="center",
            fontsize=FONT_PT, gid="scale")

    for i in range(group):
        color = LOW if i < half else HIGH
        ax.text(col(i) + column / 2, y_index + box_h / 2, str(i), ha="center", va="center", fontsize=FONT_PT,
                color=color, gid=f"index:{i}")
        cell(col(i), y_w, column, short(values[i]), f"weight:{i}")
        cell(col(i), y_ratio, column, f"{ratios[i]:.3f}", f"ratio:{i}", edge="0.7")
        cell(col(i), y_q, column, str(int(q[i])), f"q:{i}")
        nibble = int(q[i]) + 8
        cell(col(i), y_nibble, column, f"{nibble}\n{nibble:04b}", f"nibble:{i}", edge=color, h=0.4)

    for j, code in enumerate(codes):  # byte j: high nibble (value j + half) left, low nibble (value j) right
        x = col(2 * j)
        for part, (bits, color, source) in enumerate(((int(code) >> 4, HIGH, j + half), (int(code) & 15, LOW, j))):
            xp = x + part * column
            ax.add_patch(Rectangle((xp + 0.03, y_byte), column - 0.06, box_h, facecolor="white", edgecolor=color,
                                   linewidth=1.4, gid=f"half:{j}:{'high' if part == 0 else 'low'}"))
            ax.text(xp + column / 2, y_byte + box_h / 2, f"{bits:04b}", ha="center", va="center", fontsize=FONT_PT,
                    family="monospace", color=color, gid=f"nibblebits:{j}:{'high' if part == 0 else 'low'}")
            ax.add_patch(FancyArrowPatch((col(source) + column / 2, y_nibble - 0.02),
                                         (xp + column / 2, y_byte + box_h + 0.02), arrowstyle="-|>",
                                         mutation_scale=9, shrinkA=0, shrinkB=0, color=color, linewidth=1.0,
                                         gid=f"arrow:{source}"))
        ax.add_patch(Rectangle((x + 0.01, y_byte - 0.02), 2 * column - 0.02, box_h + 0.04, facecolor="none",
                               edgecolor="0.15", linewidth=1.2, gid=f"byte:{j}"))
        ax.text(x + column, y_byte - 0.16, f"byte {j} = 0x{int(code):02X}", ha="center", va="center",
                fontsize=FONT_PT, gid=f"bytevalue:{j}")

    stored = matrix.codes.tobytes() + matrix.scales.tobytes()  # the group's bytes: codes, then the scale
    byte_w = min(0.45, group * column / len(stored))
    for k, value in enumerate(stored):
        is_scale = k >= len(codes)
        cell(left + k * byte_w, y_memory, byte_w, f"{value:02X}", f"memory:{k}",
             edge=SCALE_COLOR if is_scale else "0.15", face="#d5efe6" if is_scale else "#eeeeee")
    for k0, k1, label in ((0, len(codes), "codes"), (len(codes), len(stored), "scale")):
        ax.text(left + (k0 + k1) / 2 * byte_w, y_memory - 0.14, label, ha="center", va="center",
                fontsize=FONT_PT, color=SCALE_COLOR if label == "scale" else "0.25", gid=f"memory:{label}")
    bits_per_weight = 8 * matrix.packed_nbytes / group
    large = formats.IntFormat(4, 128)
    ax.text(left + len(stored) * byte_w + 0.12, y_memory + box_h / 2,
            f"{len(codes)} + {matrix.scales.nbytes} bytes for {group} weights:\n"
            f"{bits_per_weight:g} bits per weight (fp32: {8 * np.dtype(np.float32).itemsize};\n"
            f"groups of {large.group}: {8 * large.bytes_per_value(large.group):g})", ha="left", va="center",
            fontsize=FONT_PT, gid="cost", linespacing=1.15)
    return figure
