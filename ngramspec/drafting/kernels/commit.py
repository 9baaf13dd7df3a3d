"""numba kernels of a commit (run from kernels/step.py): calibration update, then indexing and
counting."""

from __future__ import annotations

from numba import njit

from ngramspec.drafting.calibration import (
    GAIN_ACCEPTED,
    GAIN_DECAY,
    GAIN_FLOATS,
    GAIN_PREDICTED,
    PRIOR_MASS,
    PRIOR_WEIGHT,
)
from ngramspec.drafting.kernels import context as cx
from ngramspec.drafting.kernels import trie as tk
from ngramspec.drafting.kernels.build import R_PENDING, bucket, request_views
from ngramspec.drafting.sources import NUM_SOURCES


@njit(cache=True, inline="always")
def learn(out_i, out_base, n, ev_i, ev_raw, ev_off, accepted_tokens, cal, settings, gain, stats,
          work) -> None:
    """Calibrate on every node the verifier judged (its parent accepted); tests/oracles/drafter.py
    `_learn` is the reference.

    cal (float64 [4, NUM_CLASSES, buckets]): raw sums, acceptances, trials, factors;
    settings: calibration.py's columns; gain: the request's sums per source (decayed, then
    each judged node added to its winning source's: accepted, and its conditional estimate
    before the gain, out_base); work: int64 scratch of >= n.

    The node the last committed token matched was not verified when the engine cut the tree
    short (the bonus token is the target's own): its children were never judged.
    """
    accepted = work[:n]
    accepted[:] = 0
    accepted[0] = 1
    node, matched = 0, 0
    for t in accepted_tokens:
        nxt = -1
        for i in range(node + 1, n):
            if out_i[1, i] == node and out_i[0, i] == t:
                nxt = i
                break
        if nxt < 0:
            break
        accepted[nxt] = 1
        node, matched = nxt, matched + 1
    if matched and matched == len(accepted_tokens):
        accepted[node] = 2  # matched by the last token: its children were not judged
    for j in range(GAIN_FLOATS):
        gain[j] *= settings[GAIN_DECAY]
    for i in range(1, n):
        parent = out_i[1, i]
        if accepted[parent] != 1:
            continue  # never judged by the verifier: no information
        ok = accepted[i]
        src = out_i[2, i]  # the source that won the node
        gain[2 * src + GAIN_ACCEPTED] += 1.0 if ok else 0.0
        gain[2 * src + GAIN_PREDICTED] += out_base[i]
        if ok:
            stats[NUM_SOURCES + src] += 1
        for e in range(ev_off[i], ev_off[i + 1]):
            s, b = ev_i[0, e], bucket(ev_i[1, e])
            cal[0, s, b] += ev_raw[e]
            cal[1, s, b] += 1.0 if ok else 0.0
            cal[2, s, b] += 1
            cal[3, s, b] = (cal[1, s, b] + settings[PRIOR_MASS]) / (
                cal[0, s, b] + settings[PRIOR_WEIGHT])


@njit(cache=True, inline="always")
def commit_one(r_ints, r_floats, params, new, trie_from, cal, settings, stats, tok, prev, hashes,
               table, st, cols, edges, runs, meta, tstate, work) -> int:
    """One queued operation of a request (kernels/step.py): learn from its pending tree, index
    the new tokens, count the n-grams ending at positions from `trie_from` (-1: the first new
    token). 0, or -2 when the trie was not grown first (a bug)."""
    pending = r_ints[R_PENDING]
    if pending:
        out_i, ev_i, ev_off, _, ev_raw, out_base, gain = request_views(r_ints, r_floats, params)
        learn(out_i, out_base, pending, ev_i, ev_raw, ev_off, new, cal, settings, gain, stats,
              work)
        r_ints[R_PENDING] = 0
    start = st[cx.NUM] if trie_from < 0 else trie_from
    cx.append(tok, prev, hashes, table, st, new)
    return tk.extend(cols, edges, runs, meta, tstate, tok, start, st[cx.NUM], work)
