"""Chapter 08's diagrams are drawn from the formats: the numbers beside each row of bits are the
formats' own (checked here against their rounding and code tables, and numpy's and torch's finfo),
the bits are drawn at one width each, and the int4 bytes drawn are QuantizedMatrix's codes. Texts
keep 9 pt, stay on the page and never overlap one another or a box they do not belong to."""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.patches import FancyArrowPatch, Rectangle

from infra_lab.diagrams import formats as diagram
from infra_lab.figures import MAX_WIDTH_IN, MIN_FONT_PT
from infra_lab.quant import formats
from infra_lab.quant.matmul import QuantizedMatrix

SUPERSCRIPT = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")


def by_gid(figure, prefix):
    return {t.get_gid(): t.get_text() for t in figure.axes[0].texts if (t.get_gid() or "").startswith(prefix)}


def read_number(text):
    """A number as the table writes it: 57,344 / 3.40×10³⁸ / 2⁻¹²⁶ / ±inf / ±448."""
    text = text.removeprefix("±").translate(SUPERSCRIPT)
    if text == "inf":
        return np.inf
    if "×10" in text:
        mantissa, exponent = text.split("×10")
        return float(mantissa) * 10.0 ** int(exponent)
    if text.startswith("2-"):
        return 2.0 ** int(text[1:])
    return float(text.replace(",", ""))


def assert_legible(figure, free):
    """Every text at least 9 pt, on the page and clear of every other, inside the box of its gid
    if it has one; texts whose gid starts with one of `free` clear of every box."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = figure.axes[0]
    shown = [t for t in ax.texts if t.get_text()]
    extents = [t.get_window_extent(renderer) for t in shown]
    page = figure.bbox
    for text, box in zip(shown, extents):
        assert text.get_fontsize() >= MIN_FONT_PT, text
        assert page.x0 - 0.5 <= box.x0 and box.x1 <= page.x1 + 0.5, text
        assert page.y0 - 0.5 <= box.y0 and box.y1 <= page.y1 + 0.5, text
    clashes = [(shown[i].get_text(), shown[j].get_text()) for i in range(len(shown))
               for j in range(i + 1, len(shown)) if extents[i].overlaps(extents[j])]
    assert not clashes
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    for text, extent in zip(shown, extents):
        own = [p.get_window_extent(renderer) for p in boxes if p.get_gid() == text.get_gid()]
        if own:  # a value written in its box stays inside it
            assert min(b.x0 for b in own) <= extent.x0 and extent.x1 <= max(b.x1 for b in own), text
            assert min(b.y0 for b in own) <= extent.y0 and extent.y1 <= max(b.y1 for b in own), text
        if (text.get_gid() or "").startswith(free):
            hits = [p.get_gid() for p in boxes if p.get_window_extent(renderer).overlaps(extent)]
            assert not hits, (text.get_text(), hits)
    assert figure.get_figwidth() <= MAX_WIDTH_IN
    return renderer


# ---- bit layouts ----------------------------------------------------------------------------------


def layouts():
    return {row.name: row for row in diagram.bit_layouts()}


def test_the_layouts_are_the_formats_own():
    rows = layouts()
    assert list(rows) == ["fp32", "bf16", "fp16", "fp8 e4m3", "fp8 e5m2"]
    fp32, fp16 = np.finfo(np.float32), np.finfo(np.float16)
    assert (rows["fp32"].bits, rows["fp32"].largest, rows["fp32"].smallest_subnormal, rows["fp32"].epsilon) == \
        (32, float(fp32.max), float(fp32.smallest_subnormal), float(fp32.eps))
    assert (rows["fp16"].largest, rows["fp16"].smallest_normal, rows["fp16"].smallest_subnormal, rows["fp16"].epsilon) \
        == (formats.FP16.max_value, fp16.smallest_normal, fp16.smallest_subnormal, fp16.eps)
    assert rows["fp8 e4m3"].largest == formats.E4M3.max_value == 448
    assert rows["fp8 e5m2"].largest == formats.E5M2.max_value == 57344
    for name, fmt in (("fp8 e4m3", formats.E4M3), ("fp8 e5m2", formats.E5M2)):
        table = formats.decode(np.arange(256, dtype=np.uint8), fmt)
        assert rows[name].smallest_subnormal == table[1]  # code 0.0000.001
        assert rows[name].smallest_normal == table[1 << fmt.mantissa_bits]  # code 0.0001.000
    # bf16: its largest finite value is kept by its rounding; the midpoint to the next step overflows
    bf16 = rows["bf16"]
    top_step = 2.0 ** (np.log2(bf16.largest).astype(int) - bf16.mantissa_bits)
    assert formats.round_bf16(bf16.largest) == bf16.largest
    assert formats.round_bf16(bf16.largest + top_step / 2) == np.inf
    assert formats.round_bf16(bf16.largest + top_step / 4) == bf16.largest


def test_the_layouts_agree_with_torch():
    torch = pytest.importorskip("torch")
    rows = layouts()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp8 e4m3", torch.float8_e4m3fn), ("fp8 e5m2", torch.float8_e5m2)):
        info = torch.finfo(dtype)
        assert (rows[name].bits, rows[name].largest, rows[name].smallest_normal, rows[name].epsilon) == \
            (info.bits, info.max, info.smallest_normal, info.eps), name
        beyond = torch.tensor([rows[name].largest * 4], dtype=torch.float64).to(dtype).double().item()
        assert beyond == rows[name].overflow, name  # e4m3fn saturates to 448; the rest overflow to inf


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8 e4m3", "fp8 e5m2"])
def test_the_step_at_one_and_the_smallest_values_round_as_the_format_does(name):
    row = layouts()[name]
    if name == "fp32":
        def rounded(x):
            return np.float64(np.float32(x))
    else:
        fmt = {f.name.replace("-", " "): f for f in (formats.BF16, formats.FP16, formats.E4M3, formats.E5M2)}[name]

        def rounded(x):
            return float(formats.round_float(np.float64(x), fmt))
    assert rounded(1 + row.epsilon) == 1 + row.epsilon
    assert rounded(1 + row.epsilon / 2) == 1  # a tie, to even
    assert rounded(row.smallest_subnormal) == row.smallest_subnormal
    assert rounded(row.smallest_subnormal * 0.49) == 0
    assert row.smallest_normal == 2.0 ** row.mantissa_bits * row.smallest_subnormal
    assert row.overflow == (448 if name == "fp8 e4m3" else np.inf)


def test_the_table_shows_the_layouts_numbers():
    figure = diagram.draw_bit_layouts()
    rows = layouts()
    for key, _, write, _ in diagram.COLUMNS:
        shown = by_gid(figure, f"{key}:")
        assert set(shown) == {f"{key}:{name}" for name in rows}
        for name, row in rows.items():
            text = shown[f"{key}:{name}"]
            assert text == write(row)
            assert read_number(text) == pytest.approx(getattr(row, key), rel=5e-3), (key, name)
    assert by_gid(figure, "largest:fp8 e4m3") == {"largest:fp8 e4m3": "448"}
    assert by_gid(figure, "largest:fp8 e5m2") == {"largest:fp8 e5m2": "57,344"}
    assert by_gid(figure, "overflow:")["overflow:fp8 e4m3"] == "±448"
    assert by_gid(figure, "overflow:")["overflow:fp8 e5m2"] == "±inf"
    assert "S.1111.111 is its only NaN" in by_gid(figure, "note")["note"]
    assert "fp32 takes 4× the memory of fp8" in by_gid(figure, "title")["title"]


def test_the_bits_are_drawn_at_one_width_each():
    figure = diagram.draw_bit_layouts()
    renderer = FigureCanvasAgg(figure).get_renderer()
    counts = by_gid(figure, "count:")
    lengths = {}
    widths = set()
    for name, row in layouts().items():
        bits = [p for p in figure.axes[0].patches if (p.get_gid() or "").startswith(f"bit:{name}:")]
        fields = [p.get_gid().split(":")[-1] for p in sorted(bits, key=lambda p: p.get_x())]
        assert fields == ["sign"] + ["exponent"] * row.exponent_bits + ["mantissa"] * row.mantissa_bits
        assert len({p.get_facecolor() for p in bits}) == 3
        widths |= {round(p.get_width(), 9) for p in bits}
        extents = [p.get_window_extent(renderer) for p in bits]
        lengths[name] = max(e.x1 for e in extents) - min(e.x0 for e in extents)
        for field, count in (("sign", 1), ("exponent", row.exponent_bits), ("mantissa", row.mantissa_bits)):
            assert counts[f"count:{name}:{field}"] == str(count)
        frames = [p for p in figure.axes[0].patches if (p.get_gid() or "").startswith(f"byte:{name}:")]
        assert len(frames) == row.bits // 8
        assert by_gid(figure, f"label:{name}")[f"label:{name}"].endswith(f"{row.bits // 8} byte" +
                                                                       ("s" if row.bits > 8 else ""))
    assert len(widths) == 1
    assert lengths["fp32"] == pytest.approx(4 * lengths["fp8 e4m3"])
    assert lengths["bf16"] == pytest.approx(2 * lengths["fp8 e5m2"])


def test_the_bit_layouts_are_legible():
    figure = diagram.draw_bit_layouts()
    renderer = assert_legible(figure, free=("title", "key:", "header:", "label:", "largest:", "smallest",
                                            "epsilon:", "overflow:", "note"))
    for text in figure.axes[0].texts:  # each count inside its field's boxes
        if (text.get_gid() or "").startswith("count:"):
            _, name, field = text.get_gid().split(":")
            bits = [p.get_window_extent(renderer) for p in figure.axes[0].patches
                    if (p.get_gid() or "").startswith(f"bit:{name}:") and p.get_gid().endswith(field)]
            extent = text.get_window_extent(renderer)
            assert min(b.x0 for b in bits) - 0.5 <= extent.x0 and extent.x1 <= max(b.x1 for b in bits) + 0.5


# ---- int4 packing ---------------------------------------------------------------------------------


def check_packing(figure, values, group):
    matrix = QuantizedMatrix.quantize(np.asarray(values, np.float32)[:, None], 4, group)
    q, codes, half = matrix.values()[0], matrix.codes[0], group // 2
    assert [int(t) for _, t in sorted(by_gid(figure, "q:").items(), key=lambda kv: int(kv[0][2:]))] == q.tolist()
    nibbles = by_gid(figure, "nibble:")
    for i in range(group):
        assert nibbles[f"nibble:{i}"] == f"{q[i] + 8}\n{q[i] + 8:04b}"
    drawn = by_gid(figure, "bytevalue:")
    assert [int(re.fullmatch(rf"byte {j} = 0x([0-9A-F]{{2}})", drawn[f"bytevalue:{j}"]).group(1), 16)
            for j in range(half)] == codes.tolist()
    bits = by_gid(figure, "nibblebits:")
    for j, code in enumerate(codes):  # value j in the low nibble, value j + g/2 in the high one
        assert int(bits[f"nibblebits:{j}:low"], 2) == code & 15 == q[j] + 8
        assert int(bits[f"nibblebits:{j}:high"], 2) == code >> 4 == q[j + half] + 8
    memory = by_gid(figure, "memory:")
    stored = matrix.codes.tobytes() + matrix.scales.tobytes()
    assert [int(memory[f"memory:{k}"], 16) for k in range(len(stored))] == list(stored)
    assert f"{half} + 2 bytes for {group} weights:\n{8 * matrix.packed_nbytes / group:g} bits per weight" in \
        by_gid(figure, "cost")["cost"]
    scale = by_gid(figure, "scale")["scale"]
    assert f"s = {float(matrix.scales[0, 0]):.6g} (bits 0x{int(matrix.scales[0, 0].view(np.uint16)):04X})" in scale
    # each arrow runs from its value's nibble to the half of the byte that holds it
    ax = figure.axes[0]
    halves = {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("half:")}
    arrows = {p.get_gid(): p for p in ax.patches if isinstance(p, FancyArrowPatch)}
    assert len(arrows) == group
    nibble_boxes = {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("nibble:")}

    def distance(box, point):  # from the box's top middle, in inches
        return np.hypot(box.get_x() + box.get_width() / 2 - point[0], box.get_y() + box.get_height() - point[1])
    for i in range(group):
        vertices = arrows[f"arrow:{i}"].get_path().vertices[:-1]  # the last closes the head
        start, tip = vertices[0], vertices[vertices[:, 1].argmin()]
        source = nibble_boxes[f"nibble:{i}"]
        assert source.get_x() < start[0] < source.get_x() + source.get_width()
        assert start[1] == pytest.approx(source.get_y(), abs=0.05)
        nearest = min(halves, key=lambda gid: distance(halves[gid], tip))
        assert nearest == f"half:{i % half}:{'low' if i < half else 'high'}", i
        assert distance(halves[nearest], tip) < 0.1
    return matrix


def test_the_default_group_is_real_weights_packed_by_the_matrix():
    figure = diagram.draw_int4_packing()
    values = diagram.example_weights(8)
    weights, _, _ = diagram.weight_files.load(diagram.weight_files.path_for("target"))
    assert np.array_equal(values, weights["layers.0.wq"][:8, 0])
    matrix = check_packing(figure, values, 8)
    assert matrix.packed_nbytes == 6
    assert "6 bits per weight (fp32: 32;\ngroups of 128: 4.125)" in by_gid(figure, "cost")["cost"]
    assert_legible(figure, free=("title", "row:", "scale", "bytevalue:", "memory:codes", "memory:scale",
                                 "cost", "index:"))


@pytest.mark.parametrize("values", [np.zeros(8), np.array([-1e-5, 3e-4, 12345.0, -0.5, 7e-3, -98765.0, 1.0, 0.0]),
                                    np.array([0.25, -0.5]), np.linspace(-1, 1, 6)])
def test_hard_groups_stay_legible(values):
    figure = diagram.draw_int4_packing(values, group=len(values))
    check_packing(figure, values, len(values))
    assert_legible(figure, free=("title", "row:", "scale", "bytevalue:", "memory:codes", "memory:scale",
                                 "cost", "index:"))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), half=st.integers(1, diagram.MAX_GROUP // 2),
       magnitude=st.sampled_from([1e-3, 0.05, 1.0, 300.0]))
def test_the_drawn_bytes_are_the_matrix_codes(seed, half, magnitude):
    values = np.random.default_rng(seed).standard_normal(2 * half).astype(np.float32) * magnitude
    check_packing(diagram.draw_int4_packing(values, group=2 * half), values, 2 * half)


def test_groups_it_cannot_draw_are_refused_by_name():
    with pytest.raises(ValueError, match=r"one int4 group of 2 to 8 values, an even count .* got group=3"):
        diagram.draw_int4_packing(np.ones(3), group=3)
    with pytest.raises(ValueError, match="got group=16"):
        diagram.draw_int4_packing(np.ones(16), group=16)
    with pytest.raises(ValueError, match="got group=True"):
        diagram.draw_int4_packing(np.ones(2), group=True)
    with pytest.raises(ValueError, match=r"need the group's 8 weights, shape \(8,\); got shape \(4,\)"):
        diagram.draw_int4_packing(np.ones(4))
    with pytest.raises(ValueError, match="weights must be finite"):
        diagram.draw_int4_packing(np.array([1.0, np.nan]), group=2)
