"""Chapter 06's transfer diagram: one request's K and V leaving a prefill engine's pool and landing
in a decode engine's, drawn from the two live pools (chapter 03's block-table drawing, twice).

Above, the prefill pool just before the request leaves: its table's entries point at the blocks
its prompt filled. Between them, the wire (infra_lab.orchestration.kv_transfer): the header, then
the K and V of every prompt token, no padding. Below, the decode pool just after: the same tokens
in blocks that the decode engine picked from its own free list, beside the requests it was
already decoding.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from infra_lab.diagrams import block_table
from infra_lab.kv.paged import PagedKVCache


def draw(prefill: PagedKVCache, prefill_seq: int, decode: PagedKVCache, decode_seq: int, header_bytes: int,
         kv_bytes: int, formula: str) -> plt.Figure:
    """Both pools and the wire between them. Draw the prefill pool before it frees the request's
    blocks (its table is gone after), and the decode pool after the import. `formula` spells out
    kv_bytes (2 x layers x KV heads x head dim x tokens x bytes)."""
    fig, (above, wire, below) = plt.subplots(3, 1, figsize=(6.5, 6.0), layout="constrained",
                                             gridspec_kw={"height_ratios": [1, 0.16, 1]})
    block_table.draw(prefill, [prefill_seq], ax=above,
                     title=f"prefill worker: the request's table, {prefill.lengths[prefill_seq]} tokens computed")
    others = sorted(s for s in decode.tables if s != decode_seq)[:3]
    block_table.draw(decode, others + [decode_seq], ax=below,
                     title=f"decode worker: the request spliced in as seq {decode_seq}, beside those decoding")
    wire.axis("off")
    wire.annotate("", (0.5, 0.0), (0.5, 1.0), xycoords="axes fraction",
                  arrowprops={"arrowstyle": "-|>", "color": "#f0a030", "lw": 2})
    wire.text(0.5, 0.5, f"wire: header {header_bytes:,} B (state, layout), then K and V {kv_bytes:,} B = {formula}",
              ha="center", va="center", fontsize=9, transform=wire.transAxes,
              bbox={"boxstyle": "round", "facecolor": "#fff7e6", "edgecolor": "#f0a030"})
    return fig
