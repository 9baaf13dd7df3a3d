"""ReferenceDrafter: the pure-Python oracle of drafting/drafter.py (NgramDrafter), tree for tree.

One best-first draft tree over every n-gram source.

Sources (drafting/sources.py): the request's own context (references, prompt, output), the global
trie learned across requests, and every external corpus. Each source turns a matched suffix into
a cursor; a cursor lists continuation tokens with raw estimates normalised within that source,
which the calibrator turns into P(accepted | parent accepted) per (source, matched length). All
cursors feed ONE heap keyed by the estimated probability that the whole path is accepted, so the
tree is best-first: node i's path probability never exceeds that of any earlier node.

Trie policy: the prompt and every committed token go into the global trie as soon as they are
known (count once), so concurrent requests sharing text help each other at once. The same
tokens are also in the request's own context, so both sources may propose the same token; such
candidates merge into one node that keeps the higher estimate (the two estimates are one piece
of evidence counted twice, so they are not combined as independent).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ngramspec.drafting.calibration import SKIP_CLASSES
from ngramspec.drafting.config import CorpusSnapshot, DrafterConfig
from ngramspec.drafting.index.sam import SuffixAutomaton
from ngramspec.drafting.sources import CONTEXT, CORPUS, NUM_SOURCES, SOURCE_NAMES, TRIE
from ngramspec.drafting.tree import DraftTree
from oracles.calibration import ReferenceCalibrator
from oracles.context import ReferenceContextIndex
from oracles.trie import ROOT, ReferenceTrie, ReferenceTrieState

# A cursor: (source, handle, matched length, wildcard: a wildcard match or a fallback, and all
# that descends from one). Handles: CONTEXT -> (index, end positions, offset), TRIE -> node id,
# CORPUS -> (automaton, state).
Cursor = tuple[int, object, int, bool]
# One drafted node's evidence for calibration: (evidence class, matched length, raw estimate).
Evidence = tuple[int, int, float]


@dataclass(slots=True)
class _SamMatch:
    sam: SuffixAutomaton
    state: int
    length: int
    processed: int  # request tokens already fed


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # prompt + committed output
    context: ReferenceContextIndex
    trie_state: ReferenceTrieState
    sam_matches: dict[str, _SamMatch] = field(default_factory=dict)
    # The last tree, its nodes' evidence and their estimates before the request gain.
    pending: tuple[DraftTree, list[list[Evidence]], list[float]] | None = None
    # Per source: [accepted, predicted] (the request gain: calibration.py)
    gain_sums: dict[int, list[float]] = field(
        default_factory=lambda: {s: [0.0, 0.0] for s in SOURCE_NAMES})


class ReferenceDrafter:
    def __init__(self, config: DrafterConfig, corpora: CorpusSnapshot | None = None) -> None:
        self.config = config
        self.corpora = corpora
        self.trie = ReferenceTrie(config.capacity, config.max_trie_depth)
        self.calibrator = ReferenceCalibrator(config.calibrate, config.calibration_prior_weight,
                                              gain_prior=config.request_gain_prior,
                                              gain_decay=config.request_gain_decay)
        self._requests: dict[str, _Request] = {}
        self._reset_counters()

    def _reset_counters(self) -> None:
        # [0, NUM_SOURCES): drafted nodes by winning source; then accepted ones.
        self._counts: list[int] = [0] * (2 * NUM_SOURCES)

    # ----------------------------------------------------------------- lifecycle

    def _check_start(self, request_id: str, prompt_ids: list[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token (the tree root)")

    def start(
        self, request_id: str, prompt_ids: list[int], references: list[list[int]] | None = None
    ) -> None:
        self._check_start(request_id, prompt_ids)
        cfg = self.config
        context = ReferenceContextIndex(cfg.max_context_match, cfg.max_context_occurrences)
        for doc in references or ():
            context.add_document(list(doc))
        tokens = list(prompt_ids)
        context.extend(tokens)
        state = ReferenceTrieState()
        if cfg.insert_prompt:
            self.trie.extend(state, tokens, 0)
        self._requests[request_id] = _Request(tokens, context, state)

    def commit(self, request_id: str, accepted_token_ids: list[int]) -> None:
        req = self._requests[request_id]
        if req.pending is not None:
            self._learn(req, *req.pending, accepted_token_ids)
            req.pending = None
        start = len(req.tokens)
        req.tokens.extend(accepted_token_ids)
        req.context.extend(accepted_token_ids)
        self.trie.extend(req.trie_state, req.tokens, start)

    def stop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def reset_calibration(self) -> None:
        """Forget the calibration tables only (NgramDrafter.reset_calibration)."""
        self.calibrator.reset()

    def reset(self) -> None:
        """Clear the trie, calibration and all request states; external corpora are kept."""
        self.trie.reset()
        self.calibrator.reset()
        self._requests.clear()
        self._reset_counters()

    # ----------------------------------------------------------------- proposing

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        if len(request_ids) != len(budgets):
            raise ValueError("request_ids and budgets must have the same length")
        sams = dict(sorted(self.corpora.snapshot().items())) if self.corpora else {}
        trees = []
        for rid, budget in zip(request_ids, budgets):
            req = self._requests[rid]
            req.pending = self._build(req, min(budget, self.config.num_draft_tokens), sams)
            tree = req.pending[0]
            trees.append(tree)
        return trees

    def _build(
        self, req: _Request, budget: int, sams: dict[str, SuffixAutomaton]
    ) -> tuple[DraftTree, list[list[Evidence]], list[float]]:
        tokens, parents, probs, sources = [req.tokens[-1]], [-1], [1.0], [-1]
        evidence: list[list[Evidence]] = [[]]
        bases = [1.0]
        if budget <= 0:
            return DraftTree(tokens, parents, probs, sources), evidence, bases
        heap: list = []
        gain = {s: self.calibrator.gain(req.gain_sums, s) for s in SOURCE_NAMES}
        seq = self._push_children(heap, 0, 0, 1.0, self._root_cursors(req, sams), budget, gain,
                                  -1)
        while heap and len(tokens) <= budget:
            neg_prob, _, parent, token, source, cursors, proof, base = heapq.heappop(heap)
            if -neg_prob < self.config.min_path_prob:
                break
            slot = len(tokens)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg_prob)
            sources.append(source)
            evidence.append(proof)
            bases.append(base)
            self._counts[source] += 1
            if len(tokens) <= budget:  # children of the last node could never be placed
                seq = self._push_children(heap, seq, slot, -neg_prob, cursors,
                                          budget + 1 - len(tokens), gain, source)
        return DraftTree(tokens, parents, probs, sources), evidence, bases

    def _push_children(
        self, heap: list, seq: int, slot: int, prob: float, cursors: list[Cursor], room: int,
        gain: dict[int, float], node_source: int,
    ) -> int:
        """Merge every cursor's continuations by token and push one candidate per token. A
        cursor offers at most `room` (the nodes the tree can still take) continuations, and
        stops at the first whose path probability does not beat the room-th best candidate
        when the cursor starts, among the heap and the earlier cursors' merged candidates at
        their estimates then (it is pushed later, so it loses a tie); its estimates carry the
        request's gain for its source. Corpus cursors continue only under the root
        (node_source -1) and under nodes the corpus won."""
        limit = min(self.config.max_bfs_breadth, room)
        queued = [-entry[0] for entry in heapq.nsmallest(room, heap)]
        # token -> [estimate, source, child cursors, evidence, estimate before the gain]
        merged: dict[int, list] = {}
        estimate = self.calibrator.estimate
        for source, handle, length, wild in cursors:
            if source == CORPUS and node_source not in (-1, CORPUS):
                continue
            ranked = sorted(queued + [prob * entry[0] for entry in merged.values()],
                            reverse=True)
            threshold = ranked[room - 1] if len(ranked) >= room else -1.0
            for token, child, count, total in self._continuations(source, handle, limit, wild):
                raw = count / (total + 1)
                # The evidence class (calibration.py)
                cls = 2 * source + (total <= 1) + (SKIP_CLASSES if wild else 0)
                est, base = estimate(cls, length, raw, gain[source])
                if prob * est <= threshold:
                    break  # its later continuations rank lower still
                entry = merged.get(token)
                if entry is None:
                    merged[token] = [est, source, [(source, child, length + 1, wild)],
                                     [(cls, length, raw)], base]
                    continue
                if est > entry[0]:
                    entry[0], entry[1], entry[4] = est, source, base
                entry[2].append((source, child, length + 1, wild))
                entry[3].append((cls, length, raw))
        for token, (est, source, kids, proof, base) in merged.items():
            heapq.heappush(heap, (-prob * est, seq, slot, token, source, kids, proof, base))
            seq += 1
        return seq

    def _continuations(self, source: int, handle, limit: int,
                       wild: bool) -> list[tuple[int, object, int, int]]:
        """(token, child handle, count, total occurrences) of one cursor, best `limit` first."""
        if source == CONTEXT:
            context, ends, offset = handle
            groups = context.continuations(ends, offset)
            # Stable sort: equal counts keep first-seen (oldest occurrence) order.
            ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]
            return [(t, (context, g, offset + 1), len(g), len(ends)) for t, g in ranked]
        if source == TRIE:
            if handle == ROOT:  # the trie fallback: all it offers are its first `breadth`
                total = sum(n for _, _, n in self.trie.children(ROOT, self.config.max_bfs_breadth))
            else:
                total = self.trie.count(handle)
                if wild:  # under the fallback's first token: its most frequent follower only
                    limit = min(limit, 1)
            return [(t, c, n, total) for t, c, n in self.trie.children(handle, limit)]
        sam, state = handle
        total = sam.occ(state)
        return [(t, (sam, c), n, total) for t, c, n in sam.children_by_freq(state, limit)]

    def _root_cursors(self, req: _Request, sams: dict[str, SuffixAutomaton]) -> list[Cursor]:
        k = self.config.max_anchors_per_source
        cursors: list[Cursor] = [
            (CONTEXT, (req.context, ends, 0), m, False) for m, ends in req.context.anchors(k)
        ]
        new_token = not cursors  # no earlier occurrence of the last token in the request
        if new_token:
            cursors = self._context_wildcards(req, k)
        last_count, num_trie = -1, 0
        for node, length in self._trie_anchors(req):
            count = self.trie.count(node)
            if count != last_count and num_trie < k:
                # A shorter suffix with an equal count has the same occurrences: skip it.
                cursors.append((TRIE, node, length, False))
                last_count, num_trie = count, num_trie + 1
        if new_token and self.config.trie_fallback and self.trie.has_children(ROOT):
            # The most frequent tokens, then their bigrams, as a match of length 0 (config.py).
            cursors.append((TRIE, ROOT, 0, True))
        for name, sam in sams.items():
            match = self._sam_match(req, name, sam)
            for state, length in sam.anchors(match.state, match.length)[:k]:
                cursors.append((CORPUS, (sam, state), length, False))
        return cursors

    def _context_wildcards(self, req: _Request, k: int) -> list[Cursor]:
        """The request's own earlier matches of the tokens before its last w (1, then 2, ...)
        tokens, whose continuation is read w tokens further on (config.max_wildcards)."""
        context = req.context
        for w in range(1, self.config.max_wildcards + 1):
            found = context.anchors_at(len(context) - 1 - w, k)
            if found:
                return [(CONTEXT, (context, ends, w), m + w, True) for m, ends in found]
        return []

    def _trie_anchors(self, req: _Request) -> list[tuple[int, int]]:
        return self.trie.anchors(req.trie_state, req.tokens)

    def _sam_match(self, req: _Request, name: str, sam: SuffixAutomaton) -> _SamMatch:
        """The request's incremental longest-suffix match in `sam` (rebuilt if sam changed)."""
        max_len = self.config.max_sam_match
        match = req.sam_matches.get(name)
        if match is None or match.sam is not sam:
            state, length = sam.match_state(req.tokens, max_len)
            match = _SamMatch(sam, state, length, len(req.tokens))
            req.sam_matches[name] = match
            return match
        for token in req.tokens[match.processed :]:
            match.state, match.length = sam.advance(match.state, match.length, token, max_len)
        match.processed = len(req.tokens)
        return match

    # ----------------------------------------------------------------- learning

    def _learn(self, req: _Request, tree: DraftTree, evidence: list[list[Evidence]],
               bases: list[float], tokens: list[int]) -> None:
        path = tree.accepted_nodes(tokens)
        accepted = {0, *path}
        # A node the last committed token matched was cut from the verified tree (else the
        # verifier would have gone on past it): its children were never judged.
        judging = accepted - {path[-1]} if tokens and len(path) == len(tokens) else accepted
        judged = []
        for node in range(1, len(tree)):
            parent = tree.parents[node]
            if parent not in judging:
                continue  # never judged by the verifier: no information
            ok = node in accepted
            judged.append((tree.sources[node], ok, bases[node]))
            if ok:
                self._counts[NUM_SOURCES + tree.sources[node]] += 1
            for cls, length, raw in evidence[node]:
                self.calibrator.observe(cls, length, raw, ok)
        self.calibrator.observe_request(req.gain_sums, judged)

    def request_gains(self, request_id: str) -> dict[str, float]:
        sums = self._requests[request_id].gain_sums
        return {name: self.calibrator.gain(sums, s) for s, name in SOURCE_NAMES.items()}

    def stats(self) -> dict:
        """Drafted/accepted nodes per winning source, calibration tables, trie size."""
        per_source = {
            name: {"proposed": int(self._counts[s]),
                   "accepted": int(self._counts[NUM_SOURCES + s])}
            for s, name in SOURCE_NAMES.items()
        }
        return {
            "sources": per_source,
            "calibration": self.calibrator.stats(),
            "trie_nodes": self.trie.num_nodes,
            "trie_evicted": self.trie.num_evicted,
            "num_requests": len(self._requests),
        }

