"""Properties of every generator over random sizes: valid, lowerable, conserved work."""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st

from hpfunc.schedules import (
    GENERATORS,
    insert_comms,
    insert_fsdp,
    merge_backward,
    read_csv,
    simulate,
    split_backward,
    validate,
    write_csv,
)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(GENERATORS)), st.integers(1, 6), st.integers(1, 14))
def test_generators_valid_or_refuse_clearly(name: str, p: int, m: int) -> None:
    make = GENERATORS[name]
    try:
        s = make(p, m)
    except ValueError as err:
        # only the documented constraints
        assert (name == "dualpipev" and (p < 2 or m < 2 * p)) or (name == "interleaved_1f1b" and m % p), err
        assert name in str(err)
        return
    validate(s)
    lowered = validate(insert_fsdp(insert_comms(split_backward(s))))
    validate(merge_backward(s))
    r = simulate(lowered)
    per_rank = {rank: len(s.stages_of(rank)) for rank in s.ranks}
    for rank in s.ranks:
        assert r.useful[rank] == 3 * m * per_rank[rank]  # F + B + W for every stage and microbatch
        assert r.makespan >= r.useful[rank]
        assert 1 <= r.peak_inflight[rank] <= m * per_rank[rank]
        assert r.peak_inflight[rank] <= r.peak_until_w[rank]


    buf = io.StringIO()
    write_csv(lowered, buf)
    assert read_csv(io.StringIO(buf.getvalue())) == lowered
