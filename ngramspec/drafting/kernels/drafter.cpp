// The n-gram drafter's native kernels: the indexes' hot loops, the tree build and the commit.
//
// drafting/index/ and drafting/drafter.py own the arrays (numpy); these functions read and write
// them in place through the structs below, which name each array's rows and columns (the column
// numbers are kernels/layout.py's, checked against this file's when the module loads). One call
// per engine step (`propose`): the queued commits, then every tree of the batch, with the GIL
// released. The pure-Python references in tests/oracles/ give identical results (the lockstep
// property tests), so every float is computed in the reference's order: build with
// -ffp-contract=off and never with -ffast-math.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using i32 = int32_t;
using i64 = int64_t;
using u64 = uint64_t;

constexpr i32 SEPARATOR = INT32_MIN;
constexpr int EMPTY = -1;

// ------------------------------------------------------------------ sources and calibration
enum Source { CONTEXT = 0, TRIE = 1, CORPUS = 2, NUM_SOURCES = 3 };
constexpr i64 BUCKET_EDGES[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
constexpr int NUM_BUCKET_EDGES = 10;
constexpr int NUM_BUCKETS = NUM_BUCKET_EDGES + 1;
constexpr double MAX_CONDITIONAL = 0.98;
constexpr int SKIP_CLASSES = 2 * NUM_SOURCES;
constexpr int NUM_CLASSES = 2 * SKIP_CLASSES;
enum Setting { PRIOR_MASS = 0, PRIOR_WEIGHT, GAIN_PRIOR, GAIN_DECAY };
enum Gain { GAIN_ACCEPTED = 0, GAIN_PREDICTED = 1 };
constexpr int GAIN_FLOATS = 2 * NUM_SOURCES;

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// ------------------------------------------------------------------ id-only hash tables
// A slot holds a node id or -1; the key of a stored node is read back from its columns, so
// entries must be removed before the columns forming their key change. Linear probing with
// backward-shift deletion keeps lookups tombstone-free.

inline u64 mix(i64 key) {  // splitmix64's finaliser
  u64 z = static_cast<u64>(key) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline i64 pair_key(i64 a, i64 b) { return a * (i64(1) << 31) + b; }

// ------------------------------------------------------------------ the global trie
// Node rows (int32, 9 columns): token, parent, count; children as a list sorted by count desc
// (PREV of the first child is the last child); the leaf LRU list, or until the trie first fills
// a leaf's touch stamp (high, low 31 bits); the version bumped at eviction.
enum TrieCol { TOK = 0, PAR, CNT, FIRST, NEXT, PREV, LPREV, LNEXT, VER, TRIE_COLS };
enum TrieMeta { T_NUM = 0, LRU_HEAD, LRU_TAIL, EVICTED, CAPACITY, DEPTH, STAMP, LINKED };
constexpr int STAMP_BITS = 31;
constexpr i32 ROOT = 0;

struct IdTable {
  i32* slot;
  i64 size;  // a power of two

  i64 home(i64 key) const { return static_cast<i64>(mix(key) & static_cast<u64>(size - 1)); }
};

struct Trie {
  i32 (*row)[TRIE_COLS];  // [allocated]
  i64 allocated;
  IdTable edges;  // (PAR, TOK) -> node, for nodes that have a sibling
  IdTable runs;   // (PAR, CNT) -> the first child of a run of >= 2 equal-count siblings
  i64* meta;

  i32& at(i64 n, int col) const { return row[n][col]; }

  i64 find(const IdTable& t, int ca, int cb, i64 a, i64 b) const {
    i64 mask = t.size - 1, i = t.home(pair_key(a, b));
    while (true) {
      i64 n = t.slot[i];
      if (n == EMPTY) return -1;
      if (row[n][ca] == a && row[n][cb] == b) return n;
      i = (i + 1) & mask;
    }
  }
  static i64 slot_of(const IdTable& t, i64 node, i64 key) {
    i64 mask = t.size - 1, i = t.home(key);
    while (t.slot[i] != node) i = (i + 1) & mask;
    return i;
  }
  static void insert(const IdTable& t, i64 node, i64 key) {
    i64 mask = t.size - 1, i = t.home(key);
    while (t.slot[i] != EMPTY) i = (i + 1) & mask;
    t.slot[i] = static_cast<i32>(node);
  }
  void remove(const IdTable& t, int ca, int cb, i64 node) const {
    i64 mask = t.size - 1;
    i64 i = slot_of(t, node, pair_key(row[node][ca], row[node][cb]));
    i64 j = i;
    while (true) {
      j = (j + 1) & mask;
      i64 n = t.slot[j];
      if (n == EMPTY) break;
      i64 k = t.home(pair_key(row[n][ca], row[n][cb]));
      // Entry j may move back to i only if its home is not cyclically in (i, j].
      bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (!stays) {
        t.slot[i] = static_cast<i32>(n);
        i = j;
      }
    }
    t.slot[i] = EMPTY;
  }
  void replace(const IdTable& t, int ca, int cb, i64 old, i64 neu) const {
    t.slot[slot_of(t, old, pair_key(row[old][ca], row[old][cb]))] = static_cast<i32>(neu);
  }

  // ---- sibling list
  void unlink(i64 x) const {
    i64 p = row[x][PAR], nx = row[x][NEXT], pv = row[x][PREV];
    i64 first = row[p][FIRST];
    if (first == x) {
      row[p][FIRST] = nx;
      if (nx != -1) row[nx][PREV] = pv;  // pv is the last child
    } else {
      row[pv][NEXT] = nx;
      if (nx == -1) row[first][PREV] = pv;
      else row[nx][PREV] = pv;
    }
  }
  void insert_after(i64 x, i64 y) const {
    i64 nx = row[y][NEXT];
    row[y][NEXT] = x, row[x][PREV] = y, row[x][NEXT] = nx;
    if (nx == -1) row[row[row[y][PAR]][FIRST]][PREV] = x;
    else row[nx][PREV] = x;
  }
  void insert_before(i64 x, i64 y) const {
    i64 p = row[y][PAR];
    if (row[p][FIRST] == y) {
      row[x][PREV] = row[y][PREV], row[x][NEXT] = y;
      row[y][PREV] = x, row[p][FIRST] = x;
    } else {
      insert_after(x, row[y][PREV]);
    }
  }
  void append_child(i64 p, i64 x) const {
    i64 first = row[p][FIRST];
    row[x][NEXT] = -1;
    if (first == -1) {
      row[p][FIRST] = x, row[x][PREV] = x;
    } else {
      i64 last = row[first][PREV];
      row[last][NEXT] = x, row[x][PREV] = last, row[first][PREV] = x;
    }
  }
  void swap(i64 a, i64 b) const {  // a earlier, b later siblings
    if (row[a][NEXT] == b) {
      unlink(a);
      insert_after(a, b);
      return;
    }
    i64 after_a = row[a][NEXT], before_b = row[b][PREV];
    unlink(b);
    insert_before(b, after_a);
    unlink(a);
    insert_after(a, before_b);
  }

  // ---- leaf LRU
  void lru_remove(i64 n) const {
    i64 p = row[n][LPREV], x = row[n][LNEXT];
    if (p != -1) row[p][LNEXT] = x;
    else meta[LRU_HEAD] = x;
    if (x != -1) row[x][LPREV] = p;
    else meta[LRU_TAIL] = p;
  }
  void lru_append(i64 n) const {
    i64 tail = meta[LRU_TAIL];
    row[n][LPREV] = tail, row[n][LNEXT] = -1;
    if (tail != -1) row[tail][LNEXT] = n;
    else meta[LRU_HEAD] = n;
    meta[LRU_TAIL] = n;
  }
  void lru_push_front(i64 n) const {
    i64 head = meta[LRU_HEAD];
    row[n][LPREV] = -1, row[n][LNEXT] = head;
    if (head != -1) row[head][LPREV] = n;
    else meta[LRU_TAIL] = n;
    meta[LRU_HEAD] = n;
  }
  // Leaf n was counted (or, in stamp mode, created): the tail of the LRU.
  void touch(i64 n) const {
    if (meta[LINKED]) {
      if (meta[LRU_TAIL] != n) {
        lru_remove(n);
        lru_append(n);
      }
      return;
    }
    i64 stamp = meta[STAMP];
    meta[STAMP] = stamp + 1;
    row[n][LPREV] = static_cast<i32>(stamp >> STAMP_BITS);
    row[n][LNEXT] = static_cast<i32>(stamp & ((i64(1) << STAMP_BITS) - 1));
  }
  // The leaves (root excluded) of a trie in stamp mode, least recently touched first.
  std::vector<i64> stamp_order(i64 num) const {
    std::vector<std::pair<i64, i64>> leaves;
    for (i64 n = 1; n < num; ++n)
      if (row[n][FIRST] == -1)
        leaves.emplace_back((i64(row[n][LPREV]) << STAMP_BITS) | row[n][LNEXT], n);
    std::sort(leaves.begin(), leaves.end());  // stamps are unique
    std::vector<i64> out;
    out.reserve(leaves.size());
    for (auto& l : leaves) out.push_back(l.second);
    return out;
  }
  void link_lru() const {  // leave stamp mode: the leaves linked in stamp order
    meta[LRU_HEAD] = -1, meta[LRU_TAIL] = -1;
    for (i64 n : stamp_order(meta[T_NUM])) lru_append(n);
    meta[LINKED] = 1;
  }

  // ---- counting
  bool same_before(i64 n, i64 c) const {  // n has a previous sibling of count c
    return row[row[n][PAR]][FIRST] != n && row[row[n][PREV]][CNT] == c;
  }
  bool same_after(i64 n, i64 c) const {  // n has a next sibling of count c
    return row[n][NEXT] != -1 && row[row[n][NEXT]][CNT] == c;
  }
  // count += 1, then swap with the head of the old count's run (ReferenceTrie._bubble_up).
  void increment(i64 child) const {
    i64 p = row[child][PAR], c = row[child][CNT] + 1;
    i64 head;
    if (same_before(child, c - 1)) {  // not the head: the run has >= 2 members
      head = find(runs, PAR, CNT, p, c - 1);
      swap(head, child);
    } else {
      head = child;
    }
    if (same_after(child, c - 1)) {  // the old run had >= 2 members: it keeps the rest
      i64 nx = row[child][NEXT];
      if (same_after(nx, c - 1)) replace(runs, PAR, CNT, head, nx);
      else remove(runs, PAR, CNT, head);  // one member left: no entry
    }
    row[child][CNT] = static_cast<i32>(c);
    if (same_before(child, c)) {
      i64 before = row[child][PREV];
      if (!same_before(before, c)) insert(runs, before, pair_key(p, c));  // one becomes two
    }
  }
  void leave_run(i64 v) const {  // v leaves its sibling list (its columns still intact)
    i64 c = row[v][CNT];
    bool before = same_before(v, c), after = same_after(v, c);
    if (after && !before) {  // v heads a run of >= 2
      i64 nx = row[v][NEXT];
      if (same_after(nx, c)) replace(runs, PAR, CNT, v, nx);
      else remove(runs, PAR, CNT, v);
    } else if (before && !after) {  // v ends a run of >= 2
      i64 pv = row[v][PREV];
      if (!same_before(pv, c)) remove(runs, PAR, CNT, pv);
    }
  }
  static bool pinned(i64 n, i64 parent, const i64* old, i64 num_old, const i64* neu,
                     i64 num_new) {
    if (n == parent) return true;
    for (i64 i = 0; i < num_old; ++i)
      if (old[i] == n) return true;
    for (i64 i = 0; i < num_new; ++i)
      if (neu[i] == n) return true;
    return false;
  }
  void evict(i64 v) const {
    lru_remove(v);
    i64 p = row[v][PAR];
    leave_run(v);
    if (row[p][FIRST] != v || row[v][NEXT] != -1) remove(edges, PAR, TOK, v);  // had a sibling
    unlink(v);
    i64 only = row[p][FIRST];
    if (only != -1 && row[only][NEXT] == -1) remove(edges, PAR, TOK, only);  // only child again
    if (row[p][FIRST] == -1 && p != ROOT) lru_push_front(p);  // its subtree went cold
    row[v][VER] += 1;
    meta[EVICTED] += 1;
  }
  i64 allocate(i64 parent, const i64* old, i64 num_old, const i64* neu, i64 num_new) const {
    i64 num = meta[T_NUM];
    if (num < allocated) {
      meta[T_NUM] = num + 1;
      row[num][VER] = 1;
      return num;
    }
    if (num < meta[CAPACITY]) return -2;  // the caller did not grow the columns first (a bug)
    if (!meta[LINKED]) link_lru();
    i64 v = meta[LRU_HEAD];
    while (v != -1 && pinned(v, parent, old, num_old, neu, num_new)) v = row[v][LNEXT];
    if (v == -1) return -1;
    evict(v);
    return v;
  }
  i64 count_child(i64 parent, i64 token, const i64* old, i64 num_old, const i64* neu,
                  i64 num_new) const {
    i64 child = child_of(parent, token);
    if (child >= 0) {
      increment(child);
      if (row[child][FIRST] == -1) touch(child);
      return child;
    }
    i64 node = allocate(parent, old, num_old, neu, num_new);
    if (node < 0) return node;
    row[node][TOK] = static_cast<i32>(token), row[node][PAR] = static_cast<i32>(parent);
    row[node][CNT] = 1, row[node][FIRST] = -1;
    i64 first = row[parent][FIRST];
    if (first == -1) {
      if (parent != ROOT && meta[LINKED]) lru_remove(parent);  // no longer a leaf
    } else {
      i64 last = row[first][PREV];
      if (row[last][CNT] == 1 && !same_before(last, 1))
        insert(runs, last, pair_key(parent, 1));  // a run of one becomes two
      if (row[first][NEXT] == -1)  // the only child gets a sibling: now it needs an entry
        insert(edges, first, pair_key(parent, row[first][TOK]));
      insert(edges, node, pair_key(parent, token));
    }
    append_child(parent, node);
    if (meta[LINKED]) lru_append(node);
    else touch(node);
    return node;
  }

  // ---- request anchors
  i64 child_of(i64 parent, i64 token) const {
    i64 first = row[parent][FIRST];  // the most frequent child: checked before any hashing
    if (first == -1) return -1;
    if (row[first][TOK] == token) return first;
    if (row[first][NEXT] == -1) return -1;
    return find(edges, PAR, TOK, parent, token);
  }
  i64 lookup(const i32* ctx, i64 lo, i64 hi) const {
    i64 node = ROOT;
    for (i64 i = lo; i < hi; ++i) {
      node = child_of(node, ctx[i]);
      if (node < 0) return -1;
    }
    return node;
  }
  static i64 run_length(const i32* ctx, i64 n, i64 cap) {  // tokens after the last separator
    i64 lo = std::max<i64>(-1, n - 1 - cap);
    for (i64 i = n - 1; i > lo; --i)
      if (ctx[i] == SEPARATOR) return n - 1 - i;
    return std::min(cap, n);
  }
  // Re-probe the stale or missing suffix anchors of ctx[:n] (ReferenceTrie._refresh). A state is
  // int32 [1 + 2 * depth]: count, anchors[depth], versions[depth].
  void refresh(i32* state, const i32* ctx, i64 n) const {
    i64 depth = meta[DEPTH];
    i64 limit = run_length(ctx, n, depth);
    state[0] = static_cast<i32>(std::min<i64>(state[0], limit));
    for (i64 k = 0; k < limit; ++k) {
      if (k < state[0]) {
        i64 a = state[1 + k];
        if (a >= 0 && row[a][VER] == state[1 + depth + k]) continue;
      } else {
        state[0] = static_cast<i32>(k + 1);
      }
      i64 a = lookup(ctx, n - k - 1, n);
      state[1 + k] = static_cast<i32>(a);
      state[1 + depth + k] = a >= 0 ? row[a][VER] : 0;
    }
  }
  // What counting `token` under each parent reads first: the parent's first child and the
  // (parent, token) hash slot, so that the n-grams' cache misses overlap. A hint only.
  void prefetch_children(const i64* old, i64 num_old, i64 grams, i64 token) const {
    for (i64 k = 0; k < grams; ++k) {
      i64 parent = ROOT;
      if (k > 0) {
        if (k > num_old || old[k - 1] < 0) return;
        parent = old[k - 1];
      }
      i64 first = row[parent][FIRST];
      if (first >= 0) {
        prefetch(row[first]);
        prefetch(edges.slot + edges.home(pair_key(parent, token)));
      }
    }
  }
  // Count the n-grams ending at ctx[start:end] (ReferenceTrie._advance per token); 0 or -2.
  // work: int64 scratch of >= 2 * depth.
  int extend(i32* state, const i32* ctx, i64 start, i64 end, i64* work) const {
    i64 depth = meta[DEPTH];
    i64* old = work;
    i64* neu = work + depth;
    for (i64 pos = start; pos < end; ++pos) {
      i64 token = ctx[pos];
      if (token == SEPARATOR) {  // n-grams never span documents
        state[0] = 0;
        continue;
      }
      i64 num_old = state[0];
      for (i64 i = 0; i < num_old; ++i) old[i] = state[1 + i];
      i64 grams = std::min(depth, pos + 1);
      prefetch_children(old, num_old, grams, token);
      i64 num_new = 0;
      for (i64 k = 0; k < grams; ++k) {
        i64 parent;
        if (k == 0) {
          parent = ROOT;
        } else if (k <= num_old && old[k - 1] >= 0 && row[old[k - 1]][VER] == state[depth + k]) {
          parent = old[k - 1];
        } else {  // evicted or never stored: re-probe the k tokens before `token`
          if (ctx[pos - k] == SEPARATOR) break;
          parent = lookup(ctx, pos - k, pos);
          if (parent < 0) break;
        }
        i64 child = count_child(parent, token, old, num_old, neu, num_new);
        if (child == -2) return -2;
        if (child < 0) break;
        neu[num_new++] = child;
      }
      state[0] = static_cast<i32>(num_new);
      for (i64 i = 0; i < num_new; ++i) {
        state[1 + i] = static_cast<i32>(neu[i]);
        state[1 + depth + i] = row[neu[i]][VER];
      }
    }
    return 0;
  }

  // ---- bulk
  void rehash(i64 num) const {
    std::fill(edges.slot, edges.slot + edges.size, EMPTY);
    std::fill(runs.slot, runs.slot + runs.size, EMPTY);
    for (i64 n = 1; n < num; ++n) {
      if (row[row[n][PAR]][FIRST] != n || row[n][NEXT] != -1)  // only siblings have entries
        insert(edges, n, pair_key(row[n][PAR], row[n][TOK]));
      i64 c = row[n][CNT];
      if (same_after(n, c) && !same_before(n, c)) insert(runs, n, pair_key(row[n][PAR], c));
    }
  }
};

// ------------------------------------------------------------------ a request's context index
// tok, the hashes of the windows ending at the last token (a wrapping polynomial hash), one
// open-addressing table of 16-byte records (key = hash << 7 | length, 0: empty; value =
// occurrences << 32 | latest end), prev[pos * max_match + m - 1] = the previous end of the
// m-window ending at pos, and st: tokens, live hashes, table entries, then each suffix's count.
constexpr u64 HASH_BASE = 0x100000001B3ull;
constexpr int LENGTH_BITS = 7;
enum CtxStat { C_NUM = 0, NUM_HASHES, ENTRIES, SUFFIX_COUNTS };

struct Context {
  i32* tok;
  i32* prev;
  u64* hashes;
  i64 max_match;  // the hashes' length
  u64 (*table)[2];
  i64 table_rows;  // a power of two
  i64* st;

  static i64 home(u64 key, i64 mask) {
    i64 m = static_cast<i64>(key & ((u64(1) << LENGTH_BITS) - 1));
    return static_cast<i64>(((key >> LENGTH_BITS) ^ mix(m)) & static_cast<u64>(mask));
  }
  static i64 slot(u64 (*table)[2], i64 rows, u64 key) {  // key's slot, or where it would go
    i64 mask = rows - 1, i = home(key, mask);
    while (table[i][0] != 0 && table[i][0] != key) i = (i + 1) & mask;
    return i;
  }
  template <class T>
  void append(const T* fresh, i64 count) const {
    const u64 low = 0xFFFFFFFFull;
    for (i64 j = 0; j < count; ++j) {
      i64 t = fresh[j];
      i64 pos = st[C_NUM];
      tok[pos] = static_cast<i32>(t);
      st[C_NUM] = pos + 1;
      if (t == SEPARATOR) {
        st[NUM_HASHES] = 0;
        continue;
      }
      u64 value = static_cast<u64>(t + 1);  // keep token 0 from hashing like "nothing"
      i64 nh = std::min(st[NUM_HASHES] + 1, max_match);
      for (i64 m = nh - 1; m > 0; --m) hashes[m] = hashes[m - 1] * HASH_BASE + value;
      hashes[0] = value;
      st[NUM_HASHES] = nh;
      i64 mask = table_rows - 1;
      for (i64 m = 0; m < nh; ++m)  // every window's slot at once: their misses overlap
        prefetch(table[home((hashes[m] << LENGTH_BITS) | u64(m + 1), mask)]);
      for (i64 m = 0; m < nh; ++m) {
        u64 key = (hashes[m] << LENGTH_BITS) | u64(m + 1);
        i64 i = slot(table, table_rows, key);
        u64 cnt;
        if (table[i][0] == 0) {
          table[i][0] = key;
          prev[pos * max_match + m] = -1;
          cnt = 1;
          st[ENTRIES] += 1;
        } else {
          prev[pos * max_match + m] = static_cast<i32>(table[i][1] & low);
          cnt = (table[i][1] >> 32) + 1;
        }
        table[i][1] = (cnt << 32) | static_cast<u64>(pos);
        st[SUFFIX_COUNTS + m] = static_cast<i64>(cnt);
      }
    }
  }
};

// Anchor k: the `num` latest earlier ends of the m-window ending at `end`, oldest first, as the
// pool segment at pool_used (walked along `prev`); returns the pool entries used after.
inline i64 anchor(const i32* prev, i64 end, i64 m, i64 max_match, i64 num, i64* out_len,
                  i64* out_start, i64* out_num, i64* pool, i64 k, i64 pool_used) {
  i64 q = prev[end * max_match + m - 1];
  for (i64 i = num - 1; i >= 0; --i) {
    pool[pool_used + i] = q;
    q = prev[q * max_match + m - 1];
  }
  out_len[k] = m, out_start[k] = pool_used, out_num[k] = num;
  return pool_used + num;
}

struct Anchors {  // where `anchors` writes: lengths, pool starts and counts, and the pool
  i64* len;
  i64* start;
  i64* num;
  i64* pool;
};

// ReferenceContextIndex.anchors: (m, earlier ends oldest first) as pool segments; returns the
// number of anchors and sets `pool_used` to the pool entries used after them.
inline i64 anchors(const i32* prev, const i64* st, i64 max_match, i64 max_anchors,
                   i64 max_occurrences, const Anchors& out, i64& pool_used) {
  i64 k = 0, last = 0;
  i64 newest = st[C_NUM] - 1;
  for (i64 m = st[NUM_HASHES]; m > 0; --m) {
    i64 count = st[SUFFIX_COUNTS + m - 1] - 1;  // the last occurrence is the suffix itself
    if (count <= last) continue;
    pool_used = anchor(prev, newest, m, max_match, std::min(count, max_occurrences), out.len,
                       out.start, out.num, out.pool, k, pool_used);
    k += 1, last = count;
    if (k == max_anchors || count >= max_occurrences) break;
  }
  return k;
}

// `anchors` of the suffix ending at `end` (a wildcard match's): no counts are kept for it, so
// each window's earlier ends are counted along its `prev` chain, max_occurrences at most.
inline i64 anchors_at(const i32* tok, const i32* prev, i64 end, i64 max_match, i64 max_anchors,
                      i64 max_occurrences, const Anchors& out, i64& pool_used) {
  i64 k = 0, last = 0;
  if (end < 0) return k;
  i64 windows = 0;  // the windows ending at `end`: none spans a separator
  while (windows < max_match && windows <= end && tok[end - windows] != SEPARATOR) ++windows;
  for (i64 m = windows; m > 0; --m) {
    i64 num = 0, q = prev[end * max_match + m - 1];
    while (q >= 0 && num < max_occurrences) {
      ++num;
      q = prev[q * max_match + m - 1];
    }
    if (num <= last) continue;
    pool_used = anchor(prev, end, m, max_match, num, out.len, out.start, out.num, out.pool, k,
                       pool_used);
    k += 1, last = num;
    if (k == max_anchors || num >= max_occurrences) break;
  }
  return k;
}

// ------------------------------------------------------------------ the corpus bank
// Every corpus's suffix automaton laid end to end (kernels/layout.py CorpusBank):
// states [S + 1, 4]: link, max_len, occ, first edge (row s + 1's first edge ends s's range);
// trans [E, 2]: token, target, sorted by token per state; edges [E, 4]: token, occ(target),
// target's first edge, target's edge end, by frequency per state. Corpus k's states are
// roots[k] .. roots[k + 1] - 1. A request's match in corpus k: (state, length, tokens fed),
// fed -1 meaning "match from scratch".
enum StateCol { S_LINK = 0, S_LEN, S_OCC, S_EDGE };
enum TransCol { T_TOKEN = 0, T_TARGET };
enum EdgeCol { E_TOKEN = 0, E_OCC, E_LO, E_HI };
enum MatchCol { M_STATE = 0, M_LEN, M_FED };

struct Bank {
  const i32 (*states)[4];
  const i32 (*trans)[2];
  const i32 (*edges)[4];
  const i64* roots;
  i64 corpora;

  i64 transition(i64 state, i64 token) const {  // binary search of the sorted edges; or -1
    i64 lo = states[state][S_EDGE], hi = states[state + 1][S_EDGE];
    i64 end = hi;
    while (lo < hi) {
      i64 mid = (lo + hi) >> 1;
      if (trans[mid][T_TOKEN] < token) lo = mid + 1;
      else hi = mid;
    }
    if (lo < end && trans[lo][T_TOKEN] == token) return trans[lo][T_TARGET];
    return -1;
  }
  // The first state from `state` up its suffix links with a continuation, or `root`.
  i64 anchor_state(i64 root, i64 state) const {
    while (state > root && states[state + 1][S_EDGE] <= states[state][S_EDGE])
      state = states[state][S_LINK];
    return std::max(root, state);
  }
};

// A batch's matches caught up, their walks interleaved. Feeding a match its new tokens
// (SuffixAutomaton.advance per token) follows a chain of dependent reads that nearly all miss
// the cache in a large corpus; the walks of different requests are independent, so a walk
// stops at every read that would miss, prefetches it, and the driver moves on to the other
// walks before coming back. Each walk makes advance's reads in advance's order.
enum LaneStage { FEED = 0, SEARCH, LINKED_STAGE, CLAMP_ROW, CLAMP_LINK };

struct Lane {
  i64 state, length, next, end;
  int stage;
  i64 link;
  i64 corpus;
  i64* match;     // the request's match row in this corpus
  const i32* tok;  // the request's context

  bool fed_one() {
    next += 1;
    stage = FEED;
    return next == end;
  }
  // One stage of `advance` on the next token; true once the lane fed its last token.
  bool step(const Bank& bank, i64 root, i64 cap) {
    const auto* states = bank.states;
    if (stage == LINKED_STAGE) {  // advance's `length = max_len` after a suffix link
      length = states[state][S_LEN];
      stage = FEED;
    }
    if (stage == FEED) {
      if (tok[next] == SEPARATOR) {
        state = root, length = 0;
        return fed_one();
      }
      prefetch(bank.trans[(states[state][S_EDGE] + states[state + 1][S_EDGE]) >> 1]);
      stage = SEARCH;
      return false;
    }
    if (stage == SEARCH) {
      i64 nxt = bank.transition(state, tok[next]);
      if (nxt >= 0) {
        state = nxt, length += 1;
        prefetch(states[nxt]);
        prefetch(states[nxt + 1]);  // its edge range ends in the next row
        if (length > cap) {
          stage = CLAMP_ROW;
          return false;
        }
        return fed_one();
      }
      if (state == root) {
        length = 0;
        return fed_one();
      }
      i64 l = states[state][S_LINK];
      state = l;
      prefetch(states[l]);
      prefetch(states[l + 1]);
      stage = LINKED_STAGE;
      return false;
    }
    if (stage == CLAMP_ROW) {  // advance's clamp: the state's link, then the link's length
      link = states[state][S_LINK];
      prefetch(states[link]);
      stage = CLAMP_LINK;
      return false;
    }
    if (states[link][S_LEN] >= cap) {  // CLAMP_LINK
      state = link;
      link = states[link][S_LINK];
      prefetch(states[link]);
      return false;
    }
    length = cap;
    return fed_one();
  }
  void finish() const { match[M_STATE] = state, match[M_LEN] = length, match[M_FED] = end; }
};

// Sets up the walk of a match over tok[fed:n] (from the root over the last `cap` tokens from
// `lo` on when marked -1); false when there is nothing to feed (the match is then up to date).
inline bool start_lane(const Bank& bank, i64 k, i64* match, const i32* tok, i64 lo, i64 n,
                       i64 cap, Lane& lane) {
  i64 fed = match[M_FED], state = match[M_STATE], length = match[M_LEN];
  if (fed < 0) state = bank.roots[k], length = 0, fed = std::max(lo, n - cap);
  if (fed >= n) {
    match[M_STATE] = state, match[M_LEN] = length, match[M_FED] = n;
    return false;
  }
  lane = Lane{state, length, fed, n, FEED, 0, k, match, tok};
  return true;
}

constexpr i64 WALK_LANES = 32;  // walks in flight at once: a core tracks ~20-odd misses

// Every walk of `walks` (request, corpus, match row, tokens, lo, n) run to its end, at most
// WALK_LANES at once, round-robin one stage each.
struct Walk {
  i64* match;
  const i32* tok;
  i64 lo, n, corpus;
};

inline void run_walks(const Bank& bank, const std::vector<Walk>& walks, i64 cap) {
  Lane lanes[WALK_LANES];
  i64 live = 0;
  size_t next = 0;
  while (next < walks.size() || live > 0) {
    while (live < WALK_LANES && next < walks.size()) {
      const Walk& w = walks[next++];
      if (start_lane(bank, w.corpus, w.match, w.tok, w.lo, w.n, cap, lanes[live])) ++live;
    }
    i64 j = 0;
    while (j < live) {
      Lane& lane = lanes[j];
      if (lane.step(bank, bank.roots[lane.corpus], cap)) {
        lane.finish();
        lanes[j] = lanes[--live];
      } else {
        ++j;
      }
    }
  }
}

// ------------------------------------------------------------------ the tree build
// Cursors and candidates live in preallocated scratch (kernels/layout.py Scratch):
//   cursor columns: SRC, A (trie node | pool start | state's first edge), B (pool length |
//   state's occurrences), OFF (context offset | state's edge end), LEN (matched length), NEXT
//   (next cursor of the same candidate), CLS (the evidence class), WILD (a wildcard match or a
//   fallback, and all that descends from it);
//   candidate columns: SLOT (parent node), TOK, SRC, HEAD, TAIL (its cursor list).
enum CursorCol { C_SRC = 0, C_A, C_B, C_OFF, C_LEN, C_NEXT, C_CLS, C_WILD, CURSOR_COLUMNS };
enum CandCol { K_SLOT = 0, K_TOK, K_SRC, K_HEAD, K_TAIL, CAND_COLUMNS };
enum Param {
  P_LIMIT = 0, P_ANCHORS, P_OCC, P_CURSORS, P_POOL, P_GROUPS, P_NODES, P_EVIDENCE,
  P_MAX_MATCH, P_CALIBRATE, P_SAM_MATCH, P_WILDCARDS, P_TRIE_FALLBACK, NUM_PARAMS
};
enum Count { N_CUR = 0, N_CAND, N_RANKED, N_POOL };
enum RequestHead { R_TRIE_START = 0, R_PENDING, R_EVIDENCE, R_HEAD };

inline int bucket(i64 length) {
  int b = 0;
  while (b < NUM_BUCKET_EDGES && BUCKET_EDGES[b] <= length - 1) ++b;
  return b;
}

// A request's tree and evidence (kernels/layout.py request_sizes): out_i [3, nodes] (token,
// parent, source), ev_i [2, evidence] (class, matched length), ev_off [nodes + 1], then floats:
// out_p [nodes] (path probabilities), ev_raw [evidence], out_base [nodes] (each node's estimate
// before the request gain), gain [GAIN_FLOATS] (the request's acceptance sums per source).
struct RequestTree {
  i64 nodes, evidence;
  i64* ints;
  i64 *tok, *parent, *src, *ev_cls, *ev_len, *ev_off;
  double *prob, *ev_raw, *base, *gain;

  RequestTree(i64* r_ints, double* r_floats, i64 num_nodes)
      : nodes(num_nodes), evidence(r_ints[R_EVIDENCE]), ints(r_ints) {
    i64* o = r_ints + R_HEAD;
    tok = o, parent = o + nodes, src = o + 2 * nodes;
    o += 3 * nodes;
    ev_cls = o, ev_len = o + evidence;
    ev_off = o + 2 * evidence;
    prob = r_floats, ev_raw = r_floats + nodes, base = r_floats + nodes + evidence;
    gain = base + nodes;
  }
};

// The calibration tables: cal [4, NUM_CLASSES, NUM_BUCKETS] (raw sums, acceptances, trials,
// factors) and the settings (calibration.py).
struct Calibration {
  double* cal;
  const double* settings;

  double& at(int table, i64 cls, int b) const {
    return cal[(table * NUM_CLASSES + cls) * NUM_BUCKETS + b];
  }
  double gain_of(const double* gain, int src) const {  // 1 when the gain is off
    double g = settings[GAIN_PRIOR];
    if (g <= 0.0) return 1.0;
    return (gain[2 * src + GAIN_ACCEPTED] + g) / (gain[2 * src + GAIN_PREDICTED] + g);
  }
};

// One build thread's scratch (kernels/layout.py Scratch: ints, floats, work rows).
struct BuildScratch {
  i64 cursors;
  i64* cur;     // [CURSOR_COLUMNS, cursors]
  double* raw;  // [cursors]
  i64* cand;    // [CAND_COLUMNS, cursors]
  double* est;  // [cursors] the estimate
  double* neg;  // [cursors] -path probability (ranks the candidates)
  double* base; // [cursors] the estimate before the request gain
  i64* ranked;  // [cursors]
  i64* pool;
  i64 groups_len;
  i64* groups;  // [5, groups]
  i64* counts;  // [4]
  i64* work;

  BuildScratch(i64* ints, double* floats, i64* work_row, const i64* params)
      : cursors(params[P_CURSORS]), work(work_row) {
    i64 pool_len = params[P_POOL];
    groups_len = params[P_GROUPS];
    i64* o = ints;
    cur = o, o += CURSOR_COLUMNS * cursors;
    cand = o, o += CAND_COLUMNS * cursors;
    ranked = o, o += cursors;
    pool = o, o += pool_len;
    groups = o, o += 5 * groups_len;
    counts = o;
    raw = floats;
    est = floats + cursors, neg = floats + 2 * cursors, base = floats + 3 * cursors;
  }
  i64& c(int col, i64 i) const { return cur[col * cursors + i]; }
  i64& k(int col, i64 i) const { return cand[col * cursors + i]; }
  i64& g(int row, i64 i) const { return groups[row * groups_len + i]; }

  // Candidate a is placed before b: a higher path probability, then the earlier push.
  bool ranks_before(i64 a, i64 b) const {
    double pa = neg[a], pb = neg[b];
    return pa < pb || (pa == pb && a < b);
  }
  // Insert c into the ranking (best first), keeping the best `room`: the tree takes at most
  // `room` more nodes, each the best left, and a later candidate never ranks above its parent.
  void rank(i64 c, i64 room) const {
    i64 size = counts[N_RANKED];
    if (size >= room && !ranks_before(c, ranked[room - 1])) return;
    i64 i = std::min(size, room - 1);
    while (i > 0 && ranks_before(c, ranked[i - 1])) {
      ranked[i] = ranked[i - 1];
      --i;
    }
    ranked[i] = c;
    counts[N_RANKED] = std::min(size + 1, room);
  }
  void unrank(i64 c) const {  // out of the ranking if it is in it (to rank it again, higher)
    i64 size = counts[N_RANKED];
    for (i64 i = 0; i < size; ++i) {
      if (ranked[i] == c) {
        for (i64 j = i; j < size - 1; ++j) ranked[j] = ranked[j + 1];
        counts[N_RANKED] = size - 1;
        return;
      }
    }
  }
  i64 take_best(i64 room) const {
    i64 top = ranked[0];
    i64 size = counts[N_RANKED] - 1;
    for (i64 i = 0; i < size; ++i) ranked[i] = ranked[i + 1];
    counts[N_RANKED] = std::min(size, room);
    return top;
  }
  // The path probability a new candidate must beat: the room-th ranked one's (it loses ties,
  // pushed later), or -1 while fewer are ranked.
  double threshold(i64 room) const {
    return counts[N_RANKED] >= room ? -neg[ranked[room - 1]] : -1.0;
  }
  i64 new_cursor(i64 src, i64 a, i64 b, i64 off, i64 length, i64 cls, i64 wild) const {
    i64 i = counts[N_CUR];
    counts[N_CUR] = i + 1;
    c(C_SRC, i) = src, c(C_A, i) = a, c(C_B, i) = b, c(C_OFF, i) = off, c(C_LEN, i) = length;
    c(C_NEXT, i) = -1, c(C_CLS, i) = cls, c(C_WILD, i) = wild;
    return i;
  }
  // Merge a continuation into this expansion's candidates (ReferenceDrafter._push_children),
  // ranking a new candidate, or one whose estimate rose, at once.
  void offer(i64 first_cand, i64 slot, i64 token, i64 src, double e, double b, i64 kid, double r,
             double prob, i64 room) const {
    raw[kid] = r;
    for (i64 i = first_cand; i < counts[N_CAND]; ++i) {
      if (k(K_TOK, i) == token) {
        c(C_NEXT, k(K_TAIL, i)) = kid;
        k(K_TAIL, i) = kid;
        if (e > est[i]) {
          est[i] = e, neg[i] = -prob * e, base[i] = b;
          k(K_SRC, i) = src;
          unrank(i);
          rank(i, room);
        }
        return;
      }
    }
    i64 i = counts[N_CAND];
    counts[N_CAND] = i + 1;
    k(K_SLOT, i) = slot, k(K_TOK, i) = token, k(K_SRC, i) = src;
    k(K_HEAD, i) = kid, k(K_TAIL, i) = kid;
    est[i] = e, neg[i] = -prob * e, base[i] = b;
    rank(i, room);
  }
  // Group the ends by the token `off + 1` after them; stable-sort the groups by size desc.
  i64 context_groups(const i32* tok, i64 n_tok, i64 start, i64 num, i64 off) const {
    i64 ng = 0;
    for (i64 i = 0; i < num; ++i) {
      i64 at = pool[start + i] + off + 1;
      if (at >= n_tok || tok[at] == SEPARATOR) {
        g(3, i) = -1;
        continue;
      }
      i64 t = tok[at];
      i64 j = 0;
      while (j < ng && g(0, j) != t) ++j;
      if (j == ng) {
        g(0, ng) = t, g(1, ng) = 0, g(2, ng) = ng;
        ++ng;
      }
      g(1, j) += 1;
      g(3, i) = j;
    }
    for (i64 i = 1; i < ng; ++i) {  // insertion sort: stable
      i64 t = g(0, i), size = g(1, i), first = g(2, i);
      i64 j = i - 1;
      while (j >= 0 && g(1, j) < size) {
        g(0, j + 1) = g(0, j), g(1, j + 1) = g(1, j), g(2, j + 1) = g(2, j);
        --j;
      }
      g(0, j + 1) = t, g(1, j + 1) = size, g(2, j + 1) = first;
    }
    return ng;
  }
  // Copy the ends of the `take` largest groups to the pool, group after group (one pass).
  void split_ends(i64 start, i64 num, i64 ng, i64 take) const {
    for (i64 j = 0; j < ng; ++j) g(4, j) = -1;
    i64 at = counts[N_POOL];
    for (i64 j = 0; j < take; ++j) {
      g(4, g(2, j)) = at;
      at += g(1, j);
    }
    for (i64 i = 0; i < num; ++i) {
      i64 gid = g(3, i);
      if (gid >= 0 && g(4, gid) >= 0) {
        pool[g(4, gid)] = pool[start + i];
        g(4, gid) += 1;
      }
    }
  }
  i64 link(i64 head, i64& tail, i64 cur_id) const {  // append a cursor to head..tail
    if (tail == -1) {
      tail = cur_id;
      return cur_id;
    }
    c(C_NEXT, tail) = cur_id;
    tail = cur_id;
    return head;
  }
};

// Everything one request's build reads besides its scratch.
struct BuildInputs {
  const Trie* trie;
  const Bank* bank;
  const Calibration* cal;
  const i64* params;
  const i32* tok;
  i64 n_tok;
  const i32* prev;
  const i64* cst;
  i32* tstate;
  i64 trie_start;
  const i64 (*match)[3];  // the request's match per corpus
};

inline int evidence_class(i64 src, i64 occurrences, i64 wild) {
  return static_cast<int>(2 * src + (occurrences <= 1 ? 1 : 0) + (wild ? SKIP_CLASSES : 0));
}

class TreeBuild {
 public:
  TreeBuild(const BuildInputs& in, const BuildScratch& s, const RequestTree& out, i64* stats)
      : in_(in), s_(s), out_(out), stats_(stats) {
    calibrate_ = in.params[P_CALIBRATE] != 0;
    for (int src = 0; src < NUM_SOURCES; ++src) gain_[src] = in.cal->gain_of(out.gain, src);
  }

  // Fill the request's tree and evidence; returns the node count (also left in R_PENDING for
  // the commit that follows).
  i64 run(i64 budget, double min_path_prob) {
    std::fill(s_.counts, s_.counts + 4, 0);
    out_.tok[0] = in_.tok[in_.n_tok - 1], out_.parent[0] = -1, out_.src[0] = -1;
    out_.prob[0] = 1.0, out_.base[0] = 1.0;
    out_.ev_off[0] = 0, out_.ev_off[1] = 0;
    out_.ints[R_PENDING] = 1;
    if (budget <= 0) return 1;
    i64 head = root_cursors();
    i64 n = 1, e = 0, parent = 0, node_src = -1;
    double prob = 1.0;
    while (true) {
      push_children(parent, prob, head, budget + 1 - n, node_src);
      if (s_.counts[N_RANKED] == 0) break;
      i64 k = s_.take_best(budget - n);
      prob = -s_.neg[k];
      if (prob < min_path_prob) break;
      i64 src = s_.k(K_SRC, k);
      out_.tok[n] = s_.k(K_TOK, k), out_.parent[n] = s_.k(K_SLOT, k), out_.src[n] = src;
      out_.prob[n] = prob, out_.base[n] = s_.base[k];
      for (i64 c = s_.k(K_HEAD, k); c != -1; c = s_.c(C_NEXT, c)) {
        out_.ev_cls[e] = s_.c(C_CLS, c), out_.ev_len[e] = s_.c(C_LEN, c) - 1;
        out_.ev_raw[e] = s_.raw[c];
        ++e;
      }
      stats_[src] += 1;
      ++n;
      out_.ev_off[n] = e;
      if (n > budget) break;  // children of the last node could never be placed
      parent = n - 1, head = s_.k(K_HEAD, k), node_src = src;
    }
    out_.ints[R_PENDING] = n;
    return n;
  }

 private:
  double factor(i64 cls, i64 length) const {
    return calibrate_ ? in_.cal->at(3, cls, bucket(length)) : 1.0;
  }
  // (estimate, the estimate before the request gain): what ranks the node, and what its gain
  // learns against.
  static void estimate(double f, double r, double gain, double& e, double& b) {
    double p = r * f;
    e = std::min(MAX_CONDITIONAL, p * gain);
    b = std::min(MAX_CONDITIONAL, p);
  }
  // The trie root's occurrences for the fallback: the counts of its first `breadth` children.
  i64 root_total() const {
    i64 total = 0, taken = 0;
    for (i64 child = in_.trie->at(ROOT, FIRST); child != -1 && taken < in_.params[P_LIMIT];
         child = in_.trie->at(child, NEXT), ++taken)
      total += in_.trie->at(child, CNT);
    return total;
  }

  // Context anchors, then distinct-count trie anchors, then each corpus's anchors.
  i64 root_cursors() {
    const i64* params = in_.params;
    const Trie& trie = *in_.trie;
    i64 k_max = params[P_ANCHORS];
    Anchors a{s_.work, s_.work + k_max, s_.work + 2 * k_max, s_.pool};
    i64 used = 0;
    i64 found = anchors(in_.prev, in_.cst, params[P_MAX_MATCH], k_max, params[P_OCC], a, used);
    bool new_token = found == 0;  // no earlier occurrence of the last token
    i64 wild = 0;
    for (i64 w = 1; w <= params[P_WILDCARDS]; ++w) {
      if (found) break;
      used = 0;
      found = anchors_at(in_.tok, in_.prev, in_.n_tok - 1 - w, params[P_MAX_MATCH], k_max,
                         params[P_OCC], a, used);
      wild = w;
    }
    s_.counts[N_POOL] = used;
    i64 head = -1, tail = -1;
    for (i64 i = 0; i < found; ++i) {
      // A wildcard match's continuation is `wild` tokens past its ends.
      i64 c = s_.new_cursor(CONTEXT, a.start[i], a.num[i], wild, a.len[i] + wild, -1,
                            wild ? 1 : 0);
      head = s_.link(head, tail, c);
    }
    trie.refresh(in_.tstate, in_.tok + in_.trie_start, in_.n_tok - in_.trie_start);
    i64 last_count = -1, num_trie = 0;
    for (i64 k = in_.tstate[0] - 1; k >= 0; --k) {
      i64 node = in_.tstate[1 + k];
      if (node < 0 || trie.at(node, FIRST) == -1) continue;
      i64 count = trie.at(node, CNT);
      if (count != last_count && num_trie < k_max) {
        // A shorter suffix with an equal count has the same occurrences: skip it.
        i64 c = s_.new_cursor(TRIE, node, 0, 0, k + 1, -1, 0);
        head = s_.link(head, tail, c);
        last_count = count, num_trie += 1;
      }
    }
    if (new_token && params[P_TRIE_FALLBACK] && trie.at(ROOT, FIRST) != -1) {
      // The most frequent tokens, then their bigrams, as a match of length 0.
      i64 c = s_.new_cursor(TRIE, ROOT, 0, 0, 0, -1, 1);
      head = s_.link(head, tail, c);
    }
    const Bank& bank = *in_.bank;
    for (i64 k = 0; k < bank.corpora; ++k) {
      // Suffix-link climb from the match: states with >= 1 continuation, longest first.
      i64 state = in_.match[k][M_STATE], length = in_.match[k][M_LEN];
      for (i64 j = 0; j < k_max; ++j) {
        state = bank.anchor_state(bank.roots[k], state);
        if (state == bank.roots[k]) break;
        i64 c = s_.new_cursor(CORPUS, bank.states[state][S_EDGE], bank.states[state][S_OCC],
                              bank.states[state + 1][S_EDGE],
                              std::min<i64>(length, bank.states[state][S_LEN]), -1, 0);
        head = s_.link(head, tail, c);
        state = bank.states[state][S_LINK];
      }
    }
    return head;
  }

  // Each cursor offers its best min(breadth, room) continuations, and none whose path
  // probability does not beat the room-th ranked candidate when the cursor starts: it could
  // never be placed through this cursor (kernels/layout.py and tests/oracles/drafter.py say
  // why). A corpus cursor continues only under the root and under nodes a corpus won.
  void push_children(i64 slot, double prob, i64 head, i64 room, i64 node_src) {
    const i64* params = in_.params;
    const Trie& trie = *in_.trie;
    i64 limit = std::min(params[P_LIMIT], room);
    i64 corpus_limit = node_src < 0 || node_src == CORPUS ? limit : 0;
    i64 first_cand = s_.counts[N_CAND];
    for (i64 c = head; c != -1; c = s_.c(C_NEXT, c)) {
      i64 src = s_.c(C_SRC, c), length = s_.c(C_LEN, c), wild = s_.c(C_WILD, c);
      double threshold = s_.threshold(room);
      double src_gain = gain_[src];
      double e, b;
      if (src == TRIE) {
        i64 node = s_.c(C_A, c);
        i64 total = node != ROOT ? trie.at(node, CNT) : root_total();
        // Under the fallback's first token, its most frequent follower only.
        i64 breadth = !wild || node == ROOT ? limit : 1;
        int cls = evidence_class(src, total, wild);
        double f = factor(cls, length);
        i64 child = trie.at(node, FIRST), taken = 0;
        while (child != -1 && taken < breadth) {
          double r = static_cast<double>(trie.at(child, CNT)) / static_cast<double>(total + 1);
          estimate(f, r, src_gain, e, b);
          if (prob * e <= threshold) break;
          i64 kid = s_.new_cursor(src, child, 0, 0, length + 1, cls, wild);
          if (trie.at(child, FIRST) >= 0) prefetch(trie.row[trie.at(child, FIRST)]);
          s_.offer(first_cand, slot, trie.at(child, TOK), src, e, b, kid, r, prob, room);
          child = trie.at(child, NEXT);
          ++taken;
        }
      } else if (src == CORPUS) {
        const auto* edges = in_.bank->edges;
        // A corpus cursor carries its state's edge range and occurrences.
        i64 lo = s_.c(C_A, c), hi = s_.c(C_OFF, c), total = s_.c(C_B, c);
        int cls = evidence_class(src, total, 0);
        double f = factor(cls, length);
        for (i64 x = lo; x < std::min(hi, lo + corpus_limit); ++x) {
          i64 occ = edges[x][E_OCC];
          double r = static_cast<double>(occ) / static_cast<double>(total + 1);
          estimate(f, r, src_gain, e, b);
          if (prob * e <= threshold) break;
          i64 kid = s_.new_cursor(src, edges[x][E_LO], occ, edges[x][E_HI], length + 1, cls, 0);
          prefetch(edges[edges[x][E_LO]]);  // what expanding it reads
          s_.offer(first_cand, slot, edges[x][E_TOKEN], src, e, b, kid, r, prob, room);
        }
      } else {
        i64 start = s_.c(C_A, c), num = s_.c(C_B, c), off = s_.c(C_OFF, c);
        i64 ng = s_.context_groups(in_.tok, in_.n_tok, start, num, off);
        int cls = evidence_class(src, num, wild);
        double f = factor(cls, length);
        i64 take = std::min(ng, limit);
        // The ends of every group that may be offered; a group cut by the threshold leaves
        // its copy unclaimed (the next cursor's split writes over it).
        s_.split_ends(start, num, ng, take);
        for (i64 j = 0; j < take; ++j) {  // the groups' estimates decrease with their sizes
          i64 t = s_.g(0, j), size = s_.g(1, j);
          double r = static_cast<double>(size) / static_cast<double>(num + 1);
          estimate(f, r, src_gain, e, b);
          if (prob * e <= threshold) break;
          i64 at = s_.counts[N_POOL];
          s_.counts[N_POOL] += size;
          i64 kid = s_.new_cursor(src, at, size, off + 1, length + 1, cls, wild);
          s_.offer(first_cand, slot, t, src, e, b, kid, r, prob, room);
        }
      }
    }
  }

  const BuildInputs& in_;
  const BuildScratch& s_;
  const RequestTree& out_;
  i64* stats_;
  bool calibrate_;
  double gain_[NUM_SOURCES];
};

// ------------------------------------------------------------------ the commit
// Calibrate on every node the verifier judged (its parent accepted); tests/oracles/drafter.py
// `_learn` is the reference. The node the last committed token matched was not verified when
// the engine cut the tree short (the bonus token is the target's own): its children were never
// judged. work: int64 scratch of >= n.
inline void learn(const RequestTree& tree, i64 n, const i64* accepted_tokens, i64 count,
                  const Calibration& cal, i64* stats, i64* work) {
  i64* accepted = work;
  std::fill(accepted, accepted + n, 0);
  accepted[0] = 1;
  i64 node = 0, matched = 0;
  for (i64 j = 0; j < count; ++j) {
    i64 t = accepted_tokens[j], nxt = -1;
    for (i64 i = node + 1; i < n; ++i) {
      if (tree.parent[i] == node && tree.tok[i] == t) {
        nxt = i;
        break;
      }
    }
    if (nxt < 0) break;
    accepted[nxt] = 1;
    node = nxt, matched += 1;
  }
  if (matched && matched == count) accepted[node] = 2;  // its children were not judged
  double* gain = tree.gain;
  for (int j = 0; j < GAIN_FLOATS; ++j) gain[j] *= cal.settings[GAIN_DECAY];
  for (i64 i = 1; i < n; ++i) {
    if (accepted[tree.parent[i]] != 1) continue;  // never judged by the verifier
    bool ok = accepted[i] != 0;
    i64 src = tree.src[i];  // the source that won the node
    gain[2 * src + GAIN_ACCEPTED] += ok ? 1.0 : 0.0;
    gain[2 * src + GAIN_PREDICTED] += tree.base[i];
    if (ok) stats[NUM_SOURCES + src] += 1;
    for (i64 e = tree.ev_off[i]; e < tree.ev_off[i + 1]; ++e) {
      i64 s = tree.ev_cls[e];
      int b = bucket(tree.ev_len[e]);
      cal.at(0, s, b) += tree.ev_raw[e];
      cal.at(1, s, b) += ok ? 1.0 : 0.0;
      cal.at(2, s, b) += 1;
      cal.at(3, s, b) = (cal.at(1, s, b) + cal.settings[PRIOR_MASS]) /
                        (cal.at(0, s, b) + cal.settings[PRIOR_WEIGHT]);
    }
  }
}

// ------------------------------------------------------------------ one call per step
// A `Drafter` (the Python type below) holds every array the kernels read: each request slot's
// (its context index, trie state, tree buffers and corpus matches) and the shared ones (the
// trie, calibration, scratch and corpus bank), each as a held buffer, so no pointer outlives
// its array and none of them can be resized while held.
enum QueueOp { O_SLOT = 0, O_COUNT, O_TRIE_FROM, O_TOKENS };
constexpr int BAD_TOKENS = -3;  // a queued token is not an int32 (nothing ran)
constexpr int BAD_SLOT = -4;    // a queued operation or the batch names no live request

// A request's arrays.
struct RequestArrays {
  Context ctx;
  i32* tstate;
  i64 tstate_len;
  i64* ints;
  double* floats;
  i64 (*match)[3];
  i64 corpora;
};

// The shared arrays, and the live requests' (null: a free slot).
struct Shared {
  const i64* params;
  Calibration cal;
  i64* stats;
  i64 stats_len;
  i64 threads;  // rows of the per-thread scratch
  i64 s_ints_cols, s_floats_cols, work_cols, thread_stats_cols;
  i64 *s_ints, *work, *thread_stats;
  double* s_floats;
  Trie trie;
  Bank bank;
  std::vector<const RequestArrays*> requests;  // by slot

  const RequestArrays* request(i64 slot) const {
    return slot >= 0 && slot < static_cast<i64>(requests.size()) ? requests[slot] : nullptr;
  }
};

bool queue_is_int32(const i64* io, i64 queued) {
  for (i64 i = 0; i < queued;) {
    i64 count = io[i + O_COUNT];
    for (i64 j = i + O_TOKENS; j < i + O_TOKENS + count; ++j)
      if (io[j] < INT32_MIN || io[j] > INT32_MAX) return false;
    i += O_TOKENS + count;
  }
  return true;
}

// One queued operation of a request: learn from its pending tree, index the new tokens, count
// the n-grams ending at positions from `trie_from` (-1: the first new token); 0 or -2.
int commit_one(const Shared& sh, i64 slot, const i64* fresh, i64 count, i64 trie_from) {
  const RequestArrays& r = *sh.request(slot);
  i64 pending = r.ints[R_PENDING];
  if (pending) {
    RequestTree tree(r.ints, r.floats, sh.params[P_NODES]);
    learn(tree, pending, fresh, count, sh.cal, sh.stats, sh.work);
    r.ints[R_PENDING] = 0;
  }
  i64 start = trie_from < 0 ? r.ctx.st[C_NUM] : trie_from;
  r.ctx.append(fresh, count);
  return sh.trie.extend(r.tstate, r.ctx.tok, start, r.ctx.st[C_NUM], sh.work);
}

int apply_queue(const Shared& sh, const i64* io, i64 queued) {
  if (!queue_is_int32(io, queued)) return BAD_TOKENS;
  for (i64 i = 0; i < queued;) {  // every slot live before anything runs
    const RequestArrays* r = sh.request(io[i + O_SLOT]);
    if (!r || r->tstate_len != 1 + 2 * sh.trie.meta[DEPTH]) return BAD_SLOT;
    i += O_TOKENS + io[i + O_COUNT];
  }
  for (i64 i = 0; i < queued;) {
    i64 count = io[i + O_COUNT], start = i + O_TOKENS;
    int failed = commit_one(sh, io[i + O_SLOT], io + start, count, io[i + O_TRIE_FROM]);
    if (failed) return failed;
    i = start + count;
  }
  return 0;
}

// Every corpus match of the batch's drafting requests fed its new tokens before the builds read
// them (a request without a tree is fed at its next), then the first edges the builds' root
// corpus cursors read prefetched (a hint).
void catch_up_batch(const Shared& sh, const i64* batch, i64 num) {
  const Bank& bank = sh.bank;
  if (bank.corpora == 0) return;
  i64 cap = sh.params[P_SAM_MATCH];
  std::vector<Walk> walks;
  for (i64 i = 0; i < num; ++i) {
    if (batch[2 * i + 1] <= 0) continue;  // no tree: its build reads no match
    const RequestArrays& r = *sh.request(batch[2 * i]);
    for (i64 k = 0; k < bank.corpora; ++k)
      walks.push_back(Walk{r.match[k], r.ctx.tok, r.ints[R_TRIE_START], r.ctx.st[C_NUM], k});
  }
  run_walks(bank, walks, cap);
  i64 anchors_max = sh.params[P_ANCHORS];
  for (i64 i = 0; i < num; ++i) {
    if (batch[2 * i + 1] <= 0) continue;
    const RequestArrays& r = *sh.request(batch[2 * i]);
    for (i64 k = 0; k < bank.corpora; ++k) {
      i64 state = r.match[k][M_STATE];
      for (i64 j = 0; j < anchors_max; ++j) {
        state = bank.anchor_state(bank.roots[k], state);
        if (state == bank.roots[k]) break;
        i64 lo = bank.states[state][S_EDGE];
        prefetch(bank.edges[lo]);
        prefetch(bank.edges[lo + 4]);  // a cursor reads up to `breadth` edges
        state = bank.states[state][S_LINK];
      }
    }
  }
}

// Request i of the batch with thread t's scratch: its tree into row i of `out` (tokens, parents
// and sources, nodes columns each, then the node count) and of `out_p`.
void build_one(const Shared& sh, i64 i, i64 t, const i64* batch, i64* out, double* out_p,
               double min_path_prob) {
  const i64* params = sh.params;
  i64 nodes = params[P_NODES];
  const RequestArrays& r = *sh.request(batch[2 * i]);
  BuildScratch scratch(sh.s_ints + t * sh.s_ints_cols, sh.s_floats + t * sh.s_floats_cols,
                       sh.work + t * sh.work_cols, params);
  RequestTree tree(r.ints, r.floats, nodes);
  BuildInputs in{&sh.trie, &sh.bank, &sh.cal, params, r.ctx.tok, r.ctx.st[C_NUM], r.ctx.prev,
                 r.ctx.st, r.tstate, r.ints[R_TRIE_START], r.match};
  TreeBuild build(in, scratch, tree, sh.thread_stats + t * sh.thread_stats_cols);
  i64 n = build.run(batch[2 * i + 1], min_path_prob);
  i64* row = out + i * (3 * nodes + 1);
  for (i64 j = 0; j < n; ++j) {
    row[j] = tree.tok[j];
    row[nodes + j] = tree.parent[j];
    row[2 * nodes + j] = tree.src[j];
    out_p[i * nodes + j] = tree.prob[j];
  }
  row[3 * nodes] = n;
}

// The queue (io[:queued]), then one tree per request of the batch (io[queued:]: (slot, budget)
// per request). The queue runs alone (it writes the shared trie and calibration); a build only
// reads those and writes its own request's buffers and its thread's scratch and counts, so
// thread t takes the t-th of T contiguous blocks of the batch (T = the scratch's rows) and the
// trees are the same on one thread or on T. The batch must not name a slot twice.
int propose(const Shared& sh, const i64* io, i64 len, i64 queued, i64* out, double* out_p,
            double min_path_prob, bool parallel) {
  const i64* batch = io + queued;
  i64 num = (len - queued) / 2, threads = sh.threads;
  for (i64 i = 0; i < num; ++i) {
    const RequestArrays* r = sh.request(batch[2 * i]);
    // The corpora its buffers were laid out for must be the bank's (the drafter re-lays a
    // request before it builds under new corpora).
    if (!r || (batch[2 * i + 1] > 0 && r->corpora != sh.bank.corpora) ||
        r->tstate_len != 1 + 2 * sh.trie.meta[DEPTH])
      return BAD_SLOT;
  }
  int failed = apply_queue(sh, io, queued);
  if (failed) return failed;
  catch_up_batch(sh, batch, num);
  auto block = [&](i64 t) {
    for (i64 i = t * num / threads; i < (t + 1) * num / threads; ++i)
      build_one(sh, i, t, batch, out, out_p, min_path_prob);
  };
  if (parallel && threads > 1) {
    std::vector<std::thread> pool;
    for (i64 t = 1; t < threads; ++t) pool.emplace_back(block, t);
    block(0);
    for (auto& th : pool) th.join();
  } else {
    for (i64 t = 0; t < threads; ++t) block(t);
  }
  for (i64 t = 0; t < threads; ++t) {  // each thread counted its own drafts
    i64* row = sh.thread_stats + t * sh.thread_stats_cols;
    for (i64 j = 0; j < sh.stats_len; ++j) {
      sh.stats[j] += row[j];
      row[j] = 0;
    }
  }
  return 0;
}

// ------------------------------------------------------------------ engine: tree lists
// Every token's visible query-token slots, concatenated, with their offsets [T + 1]: a tree
// token's list is its parent's, then its own slot; a token of an item that is not a tree has
// none. Returns an error message or nullptr.
const char* tree_lists(const i64* parents, const i64* tree_starts, const i64* seq_offsets,
                       i64 items, const i64* slots, i64 num, std::vector<i64>& local,
                       i64* offsets) {
  offsets[0] = 0;
  for (i64 t = 0; t < num; ++t) offsets[t + 1] = offsets[t];
  for (i64 b = 0; b < items; ++b) {  // each list's length: its depth + 1
    i64 first = seq_offsets[b], start = tree_starts[b];
    for (i64 t = first; t < seq_offsets[b + 1]; ++t) {
      i64 length = 0;
      if (start >= 0) {
        i64 parent = parents[start + t - first];
        if (parent == -1) length = 1;
        else if (parent < -1) return "a tree node's parent must be -1 (the root) or a node index";
        else if (parent >= t - first) return "a tree node's parent must come before it";
        else length = offsets[first + parent + 1] - offsets[first + parent] + 1;
      }
      offsets[t + 1] = offsets[t] + length;
    }
  }
  local.resize(offsets[num]);
  for (i64 b = 0; b < items; ++b) {
    i64 first = seq_offsets[b], start = tree_starts[b];
    if (start < 0) continue;
    for (i64 t = first; t < seq_offsets[b + 1]; ++t) {
      i64 lo = offsets[t], hi = offsets[t + 1];
      i64 parent = parents[start + t - first];
      if (parent >= 0)
        std::copy(local.begin() + offsets[first + parent],
                  local.begin() + offsets[first + parent + 1], local.begin() + lo);
      local[hi - 1] = slots[t];
    }
  }
  return nullptr;
}

// ================================================================== Python bindings
// Arrays arrive through the buffer protocol: each is checked for its item kind and size, its
// dimensions and C-contiguity, so a strided view or another dtype is refused by name.

struct Buffer {
  Py_buffer view{};
  bool held = false;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  ~Buffer() {
    if (held) PyBuffer_Release(&view);
  }
  template <class T>
  T* data() const { return static_cast<T*>(view.buf); }
  i64 dim(int d) const { return d < view.ndim ? view.shape[d] : 1; }
  i64 items() const { return view.len / view.itemsize; }
};

char kind_of(const char* format) {
  const char* f = format ? format : "B";
  while (*f == '@' || *f == '=' || *f == '<' || *f == '>' || *f == '!') ++f;
  if (f[0] == '\0' || f[1] != '\0') return '?';
  if (std::strchr("bhilqn", f[0])) return 'i';
  if (std::strchr("BHILQN", f[0])) return 'u';
  if (std::strchr("efd", f[0])) return 'f';
  return '?';
}

// kind: 'i' signed integer, 'u' unsigned integer, 'f' float; `write`: the kernel writes it.
bool take(PyObject* obj, Buffer& b, char kind, int itemsize, int ndim, const char* name,
          bool write = true) {
  int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (write ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, &b.view, flags) != 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: expected a %sC-contiguous array", name,
                 write ? "writable " : "");
    return false;
  }
  b.held = true;
  if (kind_of(b.view.format) != kind || b.view.itemsize != itemsize ||
      (ndim >= 0 && b.view.ndim != ndim)) {
    const char* kinds = kind == 'i' ? "int" : kind == 'u' ? "uint" : "float";
    PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous %d-d %s%d array, got format '%s' "
                 "with %d dimension(s)", name, ndim, kinds, itemsize * 8, b.view.format,
                 b.view.ndim);
    return false;
  }
  return true;
}

bool ints(PyObject* const* args, std::initializer_list<int> which, i64* out) {
  int j = 0;
  for (int i : which) {
    out[j] = PyLong_AsLongLong(args[i]);
    if (out[j] == -1 && PyErr_Occurred()) return false;
    ++j;
  }
  return true;
}

PyObject* bad_range(const char* what) {
  PyErr_Format(PyExc_ValueError, "%s out of range", what);
  return nullptr;
}

bool nargs(Py_ssize_t n, Py_ssize_t want, const char* fn) {
  if (n == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", fn, want, n);
  return false;
}

Trie trie_of(Buffer& cols, Buffer& edges, Buffer& runs, Buffer& meta) {
  return Trie{cols.data<i32[TRIE_COLS]>(), cols.dim(0), IdTable{edges.data<i32>(), edges.dim(0)},
              IdTable{runs.data<i32>(), runs.dim(0)}, meta.data<i64>()};
}

bool take_trie(PyObject* const* a, Buffer* b) {
  return take(a[0], b[0], 'i', 4, 2, "cols") && take(a[1], b[1], 'i', 4, 1, "edges") &&
         take(a[2], b[2], 'i', 4, 1, "runs") && take(a[3], b[3], 'i', 8, 1, "meta");
}

// context_append(tok, prev, hashes, table, st, new_tokens_int32)
PyObject* py_context_append(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 6, "context_append")) return nullptr;
  Buffer tok, prev, hashes, table, st, fresh;
  if (!take(args[0], tok, 'i', 4, 1, "tok") || !take(args[1], prev, 'i', 4, 1, "prev") ||
      !take(args[2], hashes, 'u', 8, 1, "hashes") || !take(args[3], table, 'u', 8, 2, "table") ||
      !take(args[4], st, 'i', 8, 1, "st") || !take(args[5], fresh, 'i', 4, 1, "tokens", false))
    return nullptr;
  Context ctx{tok.data<i32>(), prev.data<i32>(), hashes.data<u64>(), hashes.dim(0),
              table.data<u64[2]>(), table.dim(0), st.data<i64>()};
  if (ctx.st[C_NUM] + fresh.dim(0) > tok.dim(0)) {
    PyErr_SetString(PyExc_ValueError, "context_append: reserve room first");
    return nullptr;
  }
  ctx.append(fresh.data<i32>(), fresh.dim(0));
  Py_RETURN_NONE;
}

// context_rehash(table, new_table)
PyObject* py_context_rehash(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 2, "context_rehash")) return nullptr;
  Buffer table, fresh;
  if (!take(args[0], table, 'u', 8, 2, "table") || !take(args[1], fresh, 'u', 8, 2, "new_table"))
    return nullptr;
  auto* t = table.data<u64[2]>();
  auto* nt = fresh.data<u64[2]>();
  for (i64 i = 0; i < table.dim(0); ++i) {
    if (t[i][0] != 0) {
      i64 j = Context::slot(nt, fresh.dim(0), t[i][0]);
      nt[j][0] = t[i][0], nt[j][1] = t[i][1];
    }
  }
  Py_RETURN_NONE;
}

// context_anchors(tok, prev, st, end, max_match, max_anchors, max_occurrences, lens, starts,
// nums, pool) -> found: the anchors of the suffix ending at `end`, or of the newest token (with
// its kept counts) when end is -1
PyObject* py_context_anchors(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 11, "context_anchors")) return nullptr;
  Buffer tok, prev, st, lens, starts, nums, pool;
  i64 v[4];
  if (!take(args[0], tok, 'i', 4, 1, "tok") || !take(args[1], prev, 'i', 4, 1, "prev") ||
      !take(args[2], st, 'i', 8, 1, "st") || !ints(args, {3, 4, 5, 6}, v) ||
      !take(args[7], lens, 'i', 8, 1, "lens") || !take(args[8], starts, 'i', 8, 1, "starts") ||
      !take(args[9], nums, 'i', 8, 1, "nums") || !take(args[10], pool, 'i', 8, 1, "pool"))
    return nullptr;
  i64 end = v[0], max_match = v[1], max_anchors = v[2], max_occ = v[3];
  if (lens.dim(0) < max_anchors || pool.dim(0) < max_anchors * max_occ) {
    PyErr_SetString(PyExc_ValueError, "context_anchors: output arrays too small");
    return nullptr;
  }
  Anchors out{lens.data<i64>(), starts.data<i64>(), nums.data<i64>(), pool.data<i64>()};
  i64 used = 0, found;
  if (end == -1)
    found = anchors(prev.data<i32>(), st.data<i64>(), max_match, max_anchors, max_occ, out, used);
  else
    found = anchors_at(tok.data<i32>(), prev.data<i32>(), end, max_match, max_anchors, max_occ,
                       out, used);
  return PyLong_FromLongLong(found);
}

// trie_child(cols, edges, runs, meta, node, token) -> child or -1
PyObject* py_trie_child(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 6, "trie_child")) return nullptr;
  Buffer b[4];
  i64 v[2];
  if (!take_trie(args, b) || !ints(args, {4, 5}, v)) return nullptr;
  Trie trie = trie_of(b[0], b[1], b[2], b[3]);
  if (v[0] < 0 || v[0] >= trie.meta[T_NUM]) return bad_range("trie_child: node");
  return PyLong_FromLongLong(trie.child_of(v[0], v[1]));
}

// trie_lookup(cols, edges, runs, meta, ctx_int32, lo, hi) -> node or -1
PyObject* py_trie_lookup(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 7, "trie_lookup")) return nullptr;
  Buffer b[4], ctx;
  i64 v[2];
  if (!take_trie(args, b) || !take(args[4], ctx, 'i', 4, 1, "ctx", false) || !ints(args, {5, 6}, v))
    return nullptr;
  if (v[0] < 0 || v[1] > ctx.dim(0)) return bad_range("trie_lookup: lo, hi");
  return PyLong_FromLongLong(trie_of(b[0], b[1], b[2], b[3]).lookup(ctx.data<i32>(), v[0], v[1]));
}

// trie_refresh(cols, edges, runs, meta, state, ctx, n)
PyObject* py_trie_refresh(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 7, "trie_refresh")) return nullptr;
  Buffer b[4], state, ctx;
  i64 v[1];
  if (!take_trie(args, b) || !take(args[4], state, 'i', 4, 1, "state") ||
      !take(args[5], ctx, 'i', 4, 1, "ctx", false) || !ints(args, {6}, v))
    return nullptr;
  if (v[0] > ctx.dim(0)) return bad_range("trie_refresh: n");
  if (state.dim(0) != 1 + 2 * b[3].data<i64>()[DEPTH]) return bad_range("trie_refresh: state");
  trie_of(b[0], b[1], b[2], b[3]).refresh(state.data<i32>(), ctx.data<i32>(), v[0]);
  Py_RETURN_NONE;
}

// trie_extend(cols, edges, runs, meta, state, ctx, start, end) -> 0 or -2
PyObject* py_trie_extend(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 8, "trie_extend")) return nullptr;
  Buffer b[4], state, ctx;
  i64 v[2];
  if (!take_trie(args, b) || !take(args[4], state, 'i', 4, 1, "state") ||
      !take(args[5], ctx, 'i', 4, 1, "ctx", false) || !ints(args, {6, 7}, v))
    return nullptr;
  Trie trie = trie_of(b[0], b[1], b[2], b[3]);
  if (v[0] < 0 || v[1] > ctx.dim(0)) return bad_range("trie_extend: start, end");
  if (state.dim(0) != 1 + 2 * trie.meta[DEPTH]) return bad_range("trie_extend: state");
  std::vector<i64> work(2 * trie.meta[DEPTH]);
  return PyLong_FromLong(trie.extend(state.data<i32>(), ctx.data<i32>(), v[0], v[1], work.data()));
}

// trie_rehash(cols, edges, runs, meta, num)
PyObject* py_trie_rehash(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 5, "trie_rehash")) return nullptr;
  Buffer b[4];
  i64 v[1];
  if (!take_trie(args, b) || !ints(args, {4}, v)) return nullptr;
  trie_of(b[0], b[1], b[2], b[3]).rehash(v[0]);
  Py_RETURN_NONE;
}

// trie_bfs_order(cols, edges, runs, meta, order, index, lru) -> (live nodes, lru entries):
// live nodes parents first (children in list order), their BFS index, and the leaf LRU.
PyObject* py_trie_bfs_order(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 7, "trie_bfs_order")) return nullptr;
  Buffer b[4], order_b, index_b, lru_b;
  if (!take_trie(args, b) || !take(args[4], order_b, 'i', 8, 1, "order") ||
      !take(args[5], index_b, 'i', 8, 1, "index") || !take(args[6], lru_b, 'i', 8, 1, "lru"))
    return nullptr;
  Trie trie = trie_of(b[0], b[1], b[2], b[3]);
  i64 num = trie.meta[T_NUM];
  if (order_b.dim(0) < num || index_b.dim(0) < num || lru_b.dim(0) < num) {
    PyErr_SetString(PyExc_ValueError, "trie_bfs_order: output arrays too small");
    return nullptr;
  }
  i64 *order = order_b.data<i64>(), *index = index_b.data<i64>(), *lru = lru_b.data<i64>();
  std::fill(index, index + num, -1);
  order[0] = ROOT, index[0] = 0;
  i64 size = 1;
  for (i64 i = 0; i < num && i < size; ++i) {
    for (i64 c = trie.at(order[i], FIRST); c != -1; c = trie.at(c, NEXT)) {
      order[size] = c, index[c] = size;
      ++size;
    }
  }
  i64 k = 0;
  if (!trie.meta[LINKED]) {  // stamp mode: the leaves by stamp
    for (i64 leaf : trie.stamp_order(num)) lru[k++] = index[leaf];
  } else {
    for (i64 x = trie.meta[LRU_HEAD]; x != -1; x = trie.at(x, LNEXT)) lru[k++] = index[x];
  }
  return Py_BuildValue("(LL)", static_cast<long long>(size), static_cast<long long>(k));
}

// trie_restore(cols, edges, runs, meta, tokens, parents, counts, lru) -> 0, or the first
// offending entry (a node index, or the number of nodes + an lru index)
PyObject* py_trie_restore(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 8, "trie_restore")) return nullptr;
  Buffer b[4], tokens_b, parents_b, counts_b, lru_b;
  if (!take_trie(args, b) || !take(args[4], tokens_b, 'i', 8, 1, "tokens", false) ||
      !take(args[5], parents_b, 'i', 8, 1, "parents", false) ||
      !take(args[6], counts_b, 'i', 8, 1, "counts", false) || !take(args[7], lru_b, 'i', 8, 1, "lru", false))
    return nullptr;
  Trie t = trie_of(b[0], b[1], b[2], b[3]);
  const i64 *tokens = tokens_b.data<i64>(), *parents = parents_b.data<i64>();
  const i64 *counts = counts_b.data<i64>(), *lru = lru_b.data<i64>();
  i64 num = tokens_b.dim(0);
  if (parents_b.dim(0) != num || counts_b.dim(0) != num || num > t.allocated) {
    PyErr_SetString(PyExc_ValueError, "trie_restore: array lengths differ from the columns");
    return nullptr;
  }
  for (i64 x = 1; x < num; ++x) {
    i64 p = parents[x];
    if (!(0 <= p && p < x) || counts[x] < 1 || tokens[x] < 0 || tokens[x] > INT32_MAX ||
        counts[x] > INT32_MAX)
      return PyLong_FromLongLong(x);
    i64 first = t.at(p, FIRST);
    if (first != -1 && t.at(t.at(first, PREV), CNT) < counts[x])
      return PyLong_FromLongLong(x);  // siblings must come in count order
    t.at(x, TOK) = static_cast<i32>(tokens[x]), t.at(x, PAR) = static_cast<i32>(p);
    t.at(x, CNT) = static_cast<i32>(counts[x]), t.at(x, VER) = 1;
    t.at(x, FIRST) = -1;
    if (first != -1) {
      i64 last = t.at(first, PREV);
      if (t.at(last, CNT) == counts[x] && !t.same_before(last, counts[x]))
        Trie::insert(t.runs, last, pair_key(p, counts[x]));
    }
    t.append_child(p, x);
  }
  for (i64 x = 1; x < num; ++x)
    if (t.at(t.at(x, PAR), FIRST) != x || t.at(x, NEXT) != -1)  // only siblings have entries
      Trie::insert(t.edges, x, pair_key(parents[x], tokens[x]));
  t.meta[T_NUM] = num;
  t.meta[LINKED] = 1;  // the file's order, as a list
  for (i64 i = 0; i < lru_b.dim(0); ++i) {
    i64 x = lru[i];
    if (!(0 < x && x < num)) return PyLong_FromLongLong(num + i);
    t.lru_append(x);
  }
  return PyLong_FromLong(0);
}

// catch_up(states, trans, edges, roots, matches [R, corpora, 3], toks [R, n] int32, los [R],
// cap): every request's match fed its tokens, the walks interleaved as in `propose`.
PyObject* py_catch_up(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 8, "catch_up")) return nullptr;
  Buffer states, trans, edges, roots, matches, toks, los;
  i64 v[1];
  if (!take(args[0], states, 'i', 4, 2, "states") || !take(args[1], trans, 'i', 4, 2, "trans") ||
      !take(args[2], edges, 'i', 4, 2, "edges") || !take(args[3], roots, 'i', 8, 1, "roots") ||
      !take(args[4], matches, 'i', 8, 3, "matches") || !take(args[5], toks, 'i', 4, 2, "toks") ||
      !take(args[6], los, 'i', 8, 1, "los") || !ints(args, {7}, v))
    return nullptr;
  Bank bank{states.data<const i32[4]>(), trans.data<const i32[2]>(),
            edges.data<const i32[4]>(), roots.data<const i64>(), roots.dim(0)};
  i64 requests = matches.dim(0), corpora = matches.dim(1), len = toks.dim(1);
  if (corpora != bank.corpora || toks.dim(0) != requests || los.dim(0) != requests) {
    PyErr_SetString(PyExc_ValueError, "catch_up: shapes differ");
    return nullptr;
  }
  std::vector<Walk> walks;
  for (i64 i = 0; i < requests; ++i)
    for (i64 k = 0; k < corpora; ++k)
      walks.push_back(Walk{matches.data<i64>() + (i * corpora + k) * 3,
                           toks.data<i32>() + i * len, los.data<i64>()[i], len, k});
  run_walks(bank, walks, v[0]);
  Py_RETURN_NONE;
}

// tree_lists(parents, tree_starts, seq_offsets, slots) -> local as a bytearray of int64, offsets written
PyObject* py_tree_lists(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 5, "tree_lists")) return nullptr;
  Buffer parents, starts, seq, slots, offsets;
  if (!take(args[0], parents, 'i', 8, 1, "parents", false) ||
      !take(args[1], starts, 'i', 8, 1, "tree_starts", false) ||
      !take(args[2], seq, 'i', 8, 1, "seq_offsets", false) || !take(args[3], slots, 'i', 8, 1, "slots", false) ||
      !take(args[4], offsets, 'i', 8, 1, "offsets"))
    return nullptr;
  i64 items = seq.dim(0) - 1, num = slots.dim(0);
  if (items < 0 || starts.dim(0) < items || offsets.dim(0) != num + 1 || seq.data<i64>()[items] > num) {
    PyErr_SetString(PyExc_ValueError, "tree_lists: shapes differ");
    return nullptr;
  }
  std::vector<i64> local;
  const char* error = tree_lists(parents.data<i64>(), starts.data<i64>(), seq.data<i64>(), items,
                                 slots.data<i64>(), num, local, offsets.data<i64>());
  if (error) {
    PyErr_SetString(PyExc_ValueError, error);
    return nullptr;
  }
  return PyByteArray_FromStringAndSize(reinterpret_cast<const char*>(local.data()),
                                       static_cast<Py_ssize_t>(local.size() * sizeof(i64)));
}

// ------------------------------------------------------------------ the Drafter type
// Holds the arrays (module comment above `Shared`); `propose` runs with the GIL released, and
// no array may be replaced while it does (a second thread's call is refused).

struct RequestSlot {
  Buffer held[9];  // tok, prev, hashes, table, st, tstate, ints, floats, matches
  RequestArrays arrays;
};

struct DrafterObject {
  PyObject_HEAD
  std::vector<RequestSlot*>* slots;
  Buffer* shared_held;  // [16], or null before set_shared
  Shared* shared;
  bool busy;
};

constexpr int NUM_SHARED = 16;

bool refuse_busy(DrafterObject* self) {
  if (!self->busy) return false;
  PyErr_SetString(PyExc_RuntimeError, "the drafter is proposing on another thread");
  return true;
}

void drop_slot(DrafterObject* self, i64 slot) {
  auto& slots = *self->slots;
  if (slot < static_cast<i64>(slots.size()) && slots[slot]) {
    delete slots[slot];
    slots[slot] = nullptr;
    self->shared->requests[slot] = nullptr;
  }
}

PyObject* drafter_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<DrafterObject*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->slots = new std::vector<RequestSlot*>();
  self->shared_held = nullptr;
  self->shared = new Shared{};
  self->busy = false;
  return reinterpret_cast<PyObject*>(self);
}

void drafter_dealloc(DrafterObject* self) {
  for (RequestSlot* slot : *self->slots) delete slot;
  delete self->slots;
  delete[] self->shared_held;
  delete self->shared;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// set_request(slot, tok, prev, hashes, table, st, tstate, ints, floats, matches): point a slot at
// a request's arrays (drafting/drafter.py _Request.arrays), replacing what it held.
PyObject* drafter_set_request(DrafterObject* self, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 10, "set_request") || refuse_busy(self)) return nullptr;
  i64 slot = PyLong_AsLongLong(args[0]);
  if (slot == -1 && PyErr_Occurred()) return nullptr;
  if (slot < 0 || slot > (i64(1) << 24)) return bad_range("set_request: slot");
  auto* r = new RequestSlot();
  Buffer* h = r->held;
  if (!take(args[1], h[0], 'i', 4, 1, "tok") || !take(args[2], h[1], 'i', 4, 1, "prev") ||
      !take(args[3], h[2], 'u', 8, 1, "hashes") || !take(args[4], h[3], 'u', 8, 2, "table") ||
      !take(args[5], h[4], 'i', 8, 1, "st") || !take(args[6], h[5], 'i', 4, 1, "tstate") ||
      !take(args[7], h[6], 'i', 8, 1, "ints") || !take(args[8], h[7], 'f', 8, 1, "floats") ||
      !take(args[9], h[8], 'i', 8, 2, "matches")) {
    delete r;
    return nullptr;
  }
  i64 max_match = h[2].dim(0);
  if (h[3].dim(1) != 2 || h[8].dim(1) != 3 || h[4].dim(0) < SUFFIX_COUNTS + max_match ||
      h[1].dim(0) < h[0].dim(0) * max_match || h[6].dim(0) <= R_HEAD) {
    delete r;
    return bad_range("set_request: the arrays' shapes");
  }
  r->arrays = RequestArrays{Context{h[0].data<i32>(), h[1].data<i32>(), h[2].data<u64>(),
                                    max_match, h[3].data<u64[2]>(), h[3].dim(0),
                                    h[4].data<i64>()},
                            h[5].data<i32>(), h[5].dim(0), h[6].data<i64>(),
                            h[7].data<double>(), h[8].data<i64[3]>(), h[8].dim(0)};
  auto& slots = *self->slots;
  if (slot >= static_cast<i64>(slots.size())) {
    slots.resize(slot + 1, nullptr);
    self->shared->requests.resize(slot + 1, nullptr);
  }
  drop_slot(self, slot);
  slots[slot] = r;
  self->shared->requests[slot] = &r->arrays;
  Py_RETURN_NONE;
}

// release(slot): the slot holds nothing.
PyObject* drafter_release(DrafterObject* self, PyObject* arg) {
  if (refuse_busy(self)) return nullptr;
  i64 slot = PyLong_AsLongLong(arg);
  if (slot == -1 && PyErr_Occurred()) return nullptr;
  drop_slot(self, slot);
  Py_RETURN_NONE;
}

// set_shared(params, cal, settings, stats, s_ints, s_floats, work, thread_stats, cols, edges,
// runs, meta, states, trans, corpus_edges, roots): the arrays every request's build reads.
PyObject* drafter_set_shared(DrafterObject* self, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, NUM_SHARED, "set_shared") || refuse_busy(self)) return nullptr;
  auto* h = new Buffer[NUM_SHARED];
  bool ok = take(args[0], h[0], 'i', 8, 1, "params") && take(args[1], h[1], 'f', 8, 3, "cal") &&
            take(args[2], h[2], 'f', 8, 1, "settings") && take(args[3], h[3], 'i', 8, 1, "stats") &&
            take(args[4], h[4], 'i', 8, 2, "s_ints") && take(args[5], h[5], 'f', 8, 2, "s_floats") &&
            take(args[6], h[6], 'i', 8, 2, "work") &&
            take(args[7], h[7], 'i', 8, 2, "thread_stats") &&
            take(args[8], h[8], 'i', 4, 2, "cols") && take(args[9], h[9], 'i', 4, 1, "edges") &&
            take(args[10], h[10], 'i', 4, 1, "runs") && take(args[11], h[11], 'i', 8, 1, "meta") &&
            take(args[12], h[12], 'i', 4, 2, "states", false) &&
            take(args[13], h[13], 'i', 4, 2, "trans", false) &&
            take(args[14], h[14], 'i', 4, 2, "corpus_edges", false) &&
            take(args[15], h[15], 'i', 8, 1, "roots", false);
  if (ok && (h[0].dim(0) != NUM_PARAMS || h[1].dim(0) != 4 || h[1].dim(1) != NUM_CLASSES ||
             h[1].dim(2) != NUM_BUCKETS || h[2].dim(0) != 4 || h[3].dim(0) != 2 * NUM_SOURCES ||
             h[7].dim(1) < 2 * NUM_SOURCES || h[8].dim(1) != TRIE_COLS || h[11].dim(0) != 8 ||
             h[12].dim(1) != 4 || h[13].dim(1) != 2 || h[14].dim(1) != 4 ||
             h[12].dim(0) < h[15].dim(0) + 1)) {
    bad_range("set_shared: the arrays' shapes");
    ok = false;
  }
  if (!ok) {
    delete[] h;
    return nullptr;
  }
  Shared& sh = *self->shared;
  sh.params = h[0].data<i64>();
  sh.cal = Calibration{h[1].data<double>(), h[2].data<double>()};
  sh.stats = h[3].data<i64>(), sh.stats_len = h[3].dim(0);
  sh.s_ints = h[4].data<i64>(), sh.s_ints_cols = h[4].dim(1);
  sh.s_floats = h[5].data<double>(), sh.s_floats_cols = h[5].dim(1);
  sh.work = h[6].data<i64>(), sh.work_cols = h[6].dim(1);
  sh.thread_stats = h[7].data<i64>(), sh.thread_stats_cols = h[7].dim(1);
  sh.threads = std::min({h[4].dim(0), h[5].dim(0), h[6].dim(0), h[7].dim(0)});
  sh.trie = Trie{h[8].data<i32[TRIE_COLS]>(), h[8].dim(0), IdTable{h[9].data<i32>(), h[9].dim(0)},
                 IdTable{h[10].data<i32>(), h[10].dim(0)}, h[11].data<i64>()};
  sh.bank = Bank{h[12].data<const i32[4]>(), h[13].data<const i32[2]>(),
                 h[14].data<const i32[4]>(), h[15].data<const i64>(), h[15].dim(0)};
  delete[] self->shared_held;
  self->shared_held = h;
  Py_RETURN_NONE;
}

// propose(io, queued, out, out_p, min_path_prob, parallel) -> 0 or a failure code: io holds the
// queued operations (io[:queued]) then (slot, budget) per request of the batch.
PyObject* drafter_propose(DrafterObject* self, PyObject* const* args, Py_ssize_t n) {
  if (!nargs(n, 6, "propose") || refuse_busy(self)) return nullptr;
  if (!self->shared_held) {
    PyErr_SetString(PyExc_RuntimeError, "propose before set_shared");
    return nullptr;
  }
  Buffer io, out, out_p;
  if (!take(args[0], io, 'i', 8, 1, "io", false) || !take(args[2], out, 'i', 8, 2, "out") ||
      !take(args[3], out_p, 'f', 8, 2, "out_p"))
    return nullptr;
  i64 queued = PyLong_AsLongLong(args[1]);
  double min_path_prob = PyFloat_AsDouble(args[4]);
  int parallel = PyObject_IsTrue(args[5]);
  if (PyErr_Occurred()) return nullptr;
  i64 len = io.items(), num = (len - queued) / 2;
  i64 nodes = self->shared->params[P_NODES];
  if (queued < 0 || queued > len || (len - queued) % 2 ||
      (num > 0 && (out.dim(0) < num || out_p.dim(0) < num || out.dim(1) != 3 * nodes + 1 ||
                   out_p.dim(1) != nodes)))
    return bad_range("propose: the queue length or output rows");
  int failed;
  self->busy = true;
  Py_BEGIN_ALLOW_THREADS
  failed = propose(*self->shared, io.data<i64>(), len, queued, out.data<i64>(),
                   out_p.data<double>(), min_path_prob, parallel != 0);
  Py_END_ALLOW_THREADS
  self->busy = false;
  return PyLong_FromLong(failed);
}

#define DRAFTER_METHOD(name, flags) \
  {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(drafter_##name)), flags, \
   nullptr}
PyMethodDef drafter_methods[] = {
    DRAFTER_METHOD(set_request, METH_FASTCALL), DRAFTER_METHOD(release, METH_O),
    DRAFTER_METHOD(set_shared, METH_FASTCALL), DRAFTER_METHOD(propose, METH_FASTCALL),
    {nullptr, nullptr, 0, nullptr}};
#undef DRAFTER_METHOD

PyTypeObject DrafterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The column numbers that kernels/layout.py must agree with (checked when the module loads).
PyObject* py_layout(PyObject*, PyObject*) {
  return Py_BuildValue(
      "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:d}",
      "TRIE_COLS", int(TRIE_COLS), "CURSOR_COLUMNS", int(CURSOR_COLUMNS), "CAND_COLUMNS",
      int(CAND_COLUMNS), "NUM_PARAMS", int(NUM_PARAMS), "R_HEAD", int(R_HEAD), "O_TOKENS",
      int(O_TOKENS), "BAD_TOKENS", BAD_TOKENS, "BAD_SLOT", BAD_SLOT, "NUM_CLASSES", NUM_CLASSES,
      "NUM_BUCKETS", NUM_BUCKETS, "GAIN_FLOATS", GAIN_FLOATS, "SUFFIX_COUNTS",
      int(SUFFIX_COUNTS), "LINKED", int(LINKED), "STAMP", int(STAMP), "MAX_CONDITIONAL",
      MAX_CONDITIONAL);
}

PyMethodDef methods[] = {
#define FAST(name) \
  {#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_##name)), METH_FASTCALL, \
   nullptr}
    FAST(context_append), FAST(context_rehash), FAST(context_anchors), FAST(trie_child),
    FAST(trie_lookup), FAST(trie_refresh), FAST(trie_extend), FAST(trie_rehash),
    FAST(trie_bfs_order), FAST(trie_restore), FAST(catch_up), FAST(tree_lists),
#undef FAST
    {"layout", py_layout, METH_NOARGS, "The column numbers this build uses."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "ngramspec_drafter", nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_ngramspec_drafter() {
  DrafterType.tp_name = "ngramspec_drafter.Drafter";
  DrafterType.tp_basicsize = sizeof(DrafterObject);
  DrafterType.tp_flags = Py_TPFLAGS_DEFAULT;
  DrafterType.tp_doc = "The arrays of a drafter's requests and shared state, and its step kernel.";
  DrafterType.tp_new = drafter_new;
  DrafterType.tp_dealloc = reinterpret_cast<destructor>(drafter_dealloc);
  DrafterType.tp_methods = drafter_methods;
  if (PyType_Ready(&DrafterType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (!m) return nullptr;
  Py_INCREF(&DrafterType);
  if (PyModule_AddObject(m, "Drafter", reinterpret_cast<PyObject*>(&DrafterType)) < 0) {
    Py_DECREF(&DrafterType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
