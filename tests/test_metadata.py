"""Per-step metadata built from block tables, against a brute-force walk over every token."""
import numpy as np
from hypothesis import given, settings, strategies as st

from infra_lab.kv import metadata


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 5), block_size=st.sampled_from([1, 2, 16]))
def test_build_matches_a_walk_over_every_new_token(seed, batch, block_size):
    rng = np.random.default_rng(seed)
    before = rng.integers(0, 40, batch)
    new = rng.integers(1, 20, batch)
    blocks_each = -(-(before + new) // block_size)
    ids = rng.permutation(int(blocks_each.sum()) + 5)
    tables, used = [], 0
    for n in blocks_each:
        tables.append(ids[used:used + n].tolist())
        used += n
    meta = metadata.build(tables, before.tolist(), new.tolist(), block_size)
    rows = [(b, p) for b in range(batch) for p in range(before[b], before[b] + new[b])]  # (sequence, position)
    assert meta.n_tokens == len(rows) and meta.query_starts.tolist() == [0] + np.cumsum(new).tolist()
    assert meta.positions.tolist() == [p for _, p in rows]
    assert meta.slot_mapping.tolist() == [tables[b][p // block_size] * block_size + p % block_size for b, p in rows]
    assert meta.context_lens.tolist() == (before + new).tolist()
    assert meta.last_rows.tolist() == (np.cumsum(new) - 1).tolist()
    assert meta.is_decode == bool((new == 1).all())
    meta.check(num_blocks=len(ids))
