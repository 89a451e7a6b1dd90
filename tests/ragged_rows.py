"""One row decoding beside a prompt the ragged call prefills in chunks (`Engine.begin_prompt`,
`generate_ragged`): the greedy tokens of both rows, for the tensor-parallel tests that run it in a
child process with several host devices (tests/unit/test_engine_paged_sharded.py,
tests/unit/test_engine_families_sharded.py)."""
from __future__ import annotations

import numpy as np


def beside(engine, inserted: tuple[int, list[int]], seated: tuple[int, list[int]], calls: int,
           rows: int) -> dict[str, list[int]]:
    """Row `inserted[0]`'s prompt prefilled whole and inserted (a pulled KV's way in); row
    `seated[0]`'s seated and prefilled a chunk a call by the ragged call over `rows` rows, beside
    the first row's steps. Greedy tokens keyed by row: `calls` + 1 of the inserted row's, and the
    seated row's from its first (the call that ends its prompt) until the calls run out."""
    from tandem_core.types import SamplingParams
    from tandem_engine.logits import unpack_tokens

    greedy = SamplingParams()
    (a, a_ids), (b, b_ids) = inserted, seated
    state = engine.init_state()
    prefix = engine.prefill(a_ids, greedy)
    state = engine.insert(prefix, state, a, greedy)
    state = engine.begin_prompt(state, b, b_ids, greedy)
    out: dict[str, list[int]] = {str(a): [prefix.first_token], str(b): []}
    for _ in range(calls):
        state, got = engine.generate_ragged(state, rows)
        host = np.asarray(got.tokens)
        out[str(a)].append(int(host[a]))
        if out[str(b)]:
            out[str(b)].append(int(host[b]))
        if got.slot is not None:
            out[str(b)].append(int(unpack_tokens(np.asarray(got.first)[None])[0]))
    return out
