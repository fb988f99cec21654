/* The compiled checker's search: breadth first over fixed-width packed states (issue 34).
 *
 * Appended to a model's C text (kvlifetime.verify.csearch.source), which defines before it:
 *
 *   #define KVL_W  <bytes of one packed state>
 *   static void kvl_initial(unsigned char *s);       the root state, canonical
 *   static int  kvl_check(const unsigned char *s);   0, or the code of the invariant s breaks
 *   static void kvl_successors(const unsigned char *s, void *ctx);
 *                                                     calls kvl_emit(ctx, event, next) once per
 *                                                     enabled event, next in canonical form, or
 *                                                     kvl_fail(ctx, event, code) for an event
 *                                                     that breaks an invariant as it happens
 *                                                     (event -1: s itself, e.g. a quiet state
 *                                                     that leaks)
 *
 * The visited set is the queue: states are appended to one arena in the order they are
 * found, so the arena's levels are the breadth-first levels, and a state's parent index and
 * the event that reached it (4 + 4 bytes) give back the shortest trace. An open-addressing
 * table of 32-bit arena indices (at most half full, three quarters once the budget refuses a
 * larger one) finds a state by its bytes. A stored state costs KVL_W + 8 bytes in the arena
 * and 8 bytes (two slots) in the table; the arena doubles, and by smaller steps near the
 * budget.
 *
 * kvl_search stops at the first state that breaks an invariant (the shortest such trace), at
 * max_states, or when the next growth would pass the memory budget: never an out-of-memory
 * kill. Single-threaded; one search at a time per loaded library.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void kvl_emit(void *ctx, int event, const unsigned char *next);
static void kvl_fail(void *ctx, int event, int code);
int kvl_trace(uint32_t i, uint32_t *events, int max);

typedef struct {
  unsigned char *states; /* n * KVL_W bytes */
  uint32_t *parent;      /* per state: its parent's index (the root: itself) */
  uint32_t *event;       /* per state: the event that reached it */
  uint32_t n, cap;       /* states stored; room for */
  uint32_t *slots;       /* index + 1, 0: empty */
  uint32_t mask;         /* slots - 1 (a power of two) */
  uint64_t budget;       /* bytes; 0: none */
  uint64_t transitions;  /* successors generated */
  uint32_t expanding;    /* the state being expanded */
  int full;              /* a growth was refused (budget or allocation) */
  int found;             /* the code of the first broken invariant */
  uint32_t bad;          /* the state that broke it, or whose event did */
  int bad_event;         /* that event (-1: the state itself broke it) */
  uint32_t found_len;    /* the trace's length (events from the root) */
  uint32_t depth;        /* the level being expanded */
  uint32_t max_states;
  /* hash compaction (kvl_search_compact): the visited set keeps a 64-bit hash per state, and
   * only the frontier keeps whole states (this level's and the next's) */
  int compact;
  uint64_t *hashes;      /* per visited state */
  unsigned char *cur, *nxt;
  uint32_t *cur_idx, *nxt_idx;
  uint32_t ncur, nnxt, cap_front;
  /* capture (kvl_replay): a successor with this event is copied out; nothing is stored */
  int capturing, captured;
  uint32_t capture_event;
  unsigned char *capture;
} kvl_search_t;

static kvl_search_t S;

static uint64_t kvl_hash(const unsigned char *s) {
  /* eight bytes at a time, each multiplied in and rotated, then murmur3's final mix */
  uint64_t h = 1469598103934665603ULL ^ (uint64_t)KVL_W;
  int i = 0;
  for (; i + 8 <= KVL_W; i += 8) {
    uint64_t w;
    memcpy(&w, s + i, 8);
    h = (h ^ (w * 0x87c37b91114253d5ULL)) * 0x4cf5ad432745937fULL;
    h = (h << 31) | (h >> 33);
  }
  if (i < KVL_W) {
    uint64_t w = 0;
    memcpy(&w, s + i, (size_t)(KVL_W - i));
    h = (h ^ (w * 0x87c37b91114253d5ULL)) * 0x4cf5ad432745937fULL;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  return h;
}

/* Bytes the search holds with room for cap states, a table of slots and a frontier of front
 * states a level. Exact: a whole state, its parent and its event a state. Hash compaction: its
 * hash, parent and event, and the frontier's two levels of whole states. */
static uint64_t kvl_bytes_for(uint32_t cap, uint32_t slots, uint32_t front) {
  uint64_t per = S.compact ? 16 : (uint64_t)KVL_W + 8;
  return (uint64_t)cap * per + (uint64_t)slots * 4 + (uint64_t)front * 2 * (KVL_W + 4);
}

static uint64_t kvl_bytes(void) { return kvl_bytes_for(S.cap, S.mask + 1, S.cap_front); }

/* *p reallocated to n bytes: 1, or 0 with *p left as it was (no room) */
static int kvl_resize(void **p, size_t n) {
  void *q = realloc(*p, n);
  if (!q) return 0;
  *p = q;
  return 1;
}

static int kvl_grow_arena(void) {
  /* double; near the budget, grow by a half, a quarter, ... of what it holds, while that fits */
  uint32_t cap = S.cap ? S.cap * 2 : 1024;
  for (int k = 1; S.budget && kvl_bytes_for(cap, S.mask + 1, S.cap_front) > S.budget; k++) {
    if (k > 4 || !S.cap) return 0;
    cap = S.cap + (S.cap >> k);
  }
  if (cap <= S.cap || cap > 0xfffffff0U) return 0;
  int ok = S.compact ? kvl_resize((void **)&S.hashes, (size_t)cap * 8)
                     : kvl_resize((void **)&S.states, (size_t)cap * KVL_W);
  if (!ok || !kvl_resize((void **)&S.parent, (size_t)cap * 4) ||
      !kvl_resize((void **)&S.event, (size_t)cap * 4))
    return 0;
  S.cap = cap;
  return 1;
}

/* Hash compaction: room for more states in each level of the frontier. */
static int kvl_grow_front(void) {
  uint32_t cap = S.cap_front ? S.cap_front * 2 : 1024;
  if (S.budget && kvl_bytes_for(S.cap, S.mask + 1, cap) > S.budget) return 0;
  if (!kvl_resize((void **)&S.cur, (size_t)cap * KVL_W) ||
      !kvl_resize((void **)&S.nxt, (size_t)cap * KVL_W) ||
      !kvl_resize((void **)&S.cur_idx, (size_t)cap * 4) ||
      !kvl_resize((void **)&S.nxt_idx, (size_t)cap * 4))
    return 0;
  S.cap_front = cap;
  return 1;
}

static uint64_t kvl_stored_hash(uint32_t i) {
  return S.compact ? S.hashes[i] : kvl_hash(S.states + (size_t)i * KVL_W);
}

static int kvl_grow_table(void) {
  uint32_t slots = (S.mask + 1) * 2;
  if (S.budget && kvl_bytes_for(S.cap, slots, S.cap_front) > S.budget) return 0;
  uint32_t *t = calloc(slots, 4);
  if (!t) return 0;
  free(S.slots);
  S.slots = t;
  S.mask = slots - 1;
  for (uint32_t i = 0; i < S.n; i++) {
    uint64_t h = kvl_stored_hash(i) & S.mask;
    while (S.slots[h]) h = (h + 1) & S.mask;
    S.slots[h] = i + 1;
  }
  return 1;
}

/* Store s unless it is there (hash compaction: unless its hash is), with the state that
 * reached it and the event: 1 stored (compaction: and queued for the next level), 0 already
 * there, -1 no room. */
static int kvl_store(const unsigned char *s, uint32_t parent, uint32_t event) {
  uint64_t hv = kvl_hash(s);
  uint64_t h = hv & S.mask;
  for (uint32_t k = S.slots[h]; k; k = S.slots[h]) {
    if (S.compact ? S.hashes[k - 1] == hv
                  : memcmp(S.states + (size_t)(k - 1) * KVL_W, s, KVL_W) == 0)
      return 0;
    h = (h + 1) & S.mask;
  }
  if (S.n == S.cap && !kvl_grow_arena()) return -1;
  if (S.compact && S.nnxt == S.cap_front && !kvl_grow_front()) return -1;
  if ((uint64_t)(S.n + 1) * 2 > (uint64_t)S.mask + 1) {
    /* at most half full; up to three quarters when the budget has no room for a larger table */
    if (kvl_grow_table()) {
      h = hv & S.mask;
      while (S.slots[h]) h = (h + 1) & S.mask;
    } else if ((uint64_t)(S.n + 1) * 4 > ((uint64_t)S.mask + 1) * 3) {
      return -1;
    }
  }
  if (S.compact) {
    S.hashes[S.n] = hv;
    memcpy(S.nxt + (size_t)S.nnxt * KVL_W, s, KVL_W);
    S.nxt_idx[S.nnxt++] = S.n;
  } else {
    memcpy(S.states + (size_t)S.n * KVL_W, s, KVL_W);
  }
  S.parent[S.n] = parent;
  S.event[S.n] = event;
  S.slots[h] = ++S.n;
  return 1;
}

static void kvl_emit(void *ctx, int event, const unsigned char *next) {
  (void)ctx;
  if (S.capturing) {
    if (!S.captured && (uint32_t)event == S.capture_event) {
      memcpy(S.capture, next, KVL_W);
      S.captured = 1;
    }
    return;
  }
  S.transitions++;
  if (S.full || S.found) return;
  if (S.n >= S.max_states) {
    S.full = 2;
    return;
  }
  int r = kvl_store(next, S.expanding, (uint32_t)event);
  if (r < 0) {
    S.full = 1;
    return;
  }
  if (r == 1) {
    int code = kvl_check(next);
    if (code) {
      S.found = code;
      S.bad = S.n - 1;
      S.bad_event = -1;
      S.found_len = S.depth + 1;
    }
  }
}

/* A violation found while expanding level d: by an event (a trace of d + 1), or by the state
 * itself (event -1: a trace of d). The shortest is kept: a state's own violation found later
 * in the same level replaces an event's. */
static void kvl_fail(void *ctx, int event, int code) {
  (void)ctx;
  if (S.capturing) return;
  uint32_t len = S.depth + (event >= 0);
  if (S.found && S.found_len <= len) return;
  S.found = code;
  S.bad = S.expanding;
  S.bad_event = event;
  S.found_len = len;
}

static void kvl_reset(void) {
  free(S.states);
  free(S.parent);
  free(S.event);
  free(S.slots);
  free(S.hashes);
  free(S.cur);
  free(S.nxt);
  free(S.cur_idx);
  free(S.nxt_idx);
  memset(&S, 0, sizeof S);
}

/* A new search, its root stored: 0, 1 (the root breaks an invariant) or 3 (no room). */
static int kvl_begin(int compact, uint32_t max_states, uint64_t budget_bytes) {
  kvl_reset();
  S.compact = compact;
  S.budget = budget_bytes;
  S.max_states = max_states ? max_states : 0xfffffffeU;
  S.mask = 1023;
  S.slots = calloc(S.mask + 1, 4);
  unsigned char root[KVL_W];
  memset(root, 0, KVL_W);
  kvl_initial(root);
  if (!S.slots || kvl_store(root, 0, 0) < 0) return 3;
  if ((S.found = kvl_check(root))) {
    S.bad = 0;
    S.bad_event = -1;
    return 1;
  }
  return 0;
}

/* The outcome in out[0..6]: states stored, transitions, depth of the last level completed (a
 * violation: the level it was found in), the violation's code, its state's index, bytes in
 * use, and the event from that state that broke it (all ones: none, the state itself). */
static int kvl_end(int verdict, uint32_t depth, uint64_t *out) {
  out[0] = S.n;
  out[1] = S.transitions;
  out[2] = depth;
  out[3] = (uint64_t)S.found;
  out[4] = S.bad;
  out[5] = kvl_bytes();
  out[6] = (uint64_t)(int64_t)S.bad_event;
  return verdict;
}

/* The search: 0 pass (every reachable state stored, none broke an invariant), 1 violation,
 * 2 stopped at max_states, 3 stopped at the memory budget; out as kvl_end says. */
int kvl_search(uint32_t max_states, uint64_t budget_bytes, uint64_t *out) {
  int verdict = kvl_begin(0, max_states, budget_bytes);
  uint32_t depth = 0;
  if (verdict) return kvl_end(verdict, depth, out);
  uint32_t level_end = S.n;
  for (uint32_t i = 0; i < S.n; i++) {
    if (i == level_end) {
      if (S.found) break; /* the level that found it is done: no shorter trace is left */
      depth++;
      S.depth = depth;
      level_end = S.n;
    }
    S.expanding = i;
    /* A copy: storing a successor may move the arena under the state being expanded. */
    unsigned char cur[KVL_W];
    memcpy(cur, S.states + (size_t)i * KVL_W, KVL_W);
    kvl_successors(cur, NULL);
    if (S.full) {
      verdict = S.full == 2 ? 2 : 3;
      break;
    }
  }
  if (S.found) verdict = 1;
  else if (!verdict) depth++;
  return kvl_end(verdict, depth, out);
}

/* ---- hash compaction: approximate (two states with one hash are taken as one) ---- */

/* As kvl_search, storing a 64-bit hash of each state instead of the state: an approximate
 * search (a collision merges two states), never a pass. */
int kvl_search_compact(uint32_t max_states, uint64_t budget_bytes, uint64_t *out) {
  int verdict = kvl_begin(1, max_states, budget_bytes);
  uint32_t depth = 0;
  if (verdict) return kvl_end(verdict, depth, out);
  for (;;) {
    /* the next level becomes this one */
    unsigned char *t = S.cur;
    S.cur = S.nxt;
    S.nxt = t;
    uint32_t *ti = S.cur_idx;
    S.cur_idx = S.nxt_idx;
    S.nxt_idx = ti;
    S.ncur = S.nnxt;
    S.nnxt = 0;
    if (S.ncur == 0) break;
    S.depth = depth;
    for (uint32_t i = 0; i < S.ncur && !S.full; i++) {
      S.expanding = S.cur_idx[i];
      unsigned char cur[KVL_W];
      memcpy(cur, S.cur + (size_t)i * KVL_W, KVL_W);
      kvl_successors(cur, NULL);
    }
    if (S.full) {
      verdict = S.full == 2 ? 2 : 3;
      break;
    }
    if (S.found) break;
    depth++;
  }
  if (S.found) verdict = 1;
  return kvl_end(verdict, depth, out);
}

/* The states from the root to visited state i, rebuilt by replaying its trace's events
 * (a hash-compacted search keeps no states): n states into out (root first); their number,
 * -1 when an event of the trace has no successor (a model that is not deterministic). */
int kvl_replay(uint32_t i, unsigned char *out, int max) {
  uint32_t events[4096];
  int n = kvl_trace(i, events, 4096);
  if (n + 1 > max) return -1;
  unsigned char s[KVL_W], next[KVL_W];
  memset(s, 0, KVL_W);
  kvl_initial(s);
  memcpy(out, s, KVL_W);
  S.capturing = 1;
  S.capture = next;
  for (int k = 0; k < n; k++) {
    S.captured = 0;
    S.capture_event = events[k];
    kvl_successors(s, NULL);
    if (!S.captured) {
      S.capturing = 0;
      return -1;
    }
    memcpy(s, next, KVL_W);
    memcpy(out + (size_t)(k + 1) * KVL_W, s, KVL_W);
  }
  S.capturing = 0;
  return n + 1;
}

/* The events from the root to state i (at most max of them, root first); their number. */
int kvl_trace(uint32_t i, uint32_t *events, int max) {
  int n = 0;
  for (uint32_t k = i; k != 0 && n < max; k = S.parent[k]) events[n++] = S.event[k];
  for (int a = 0, b = n - 1; a < b; a++, b--) {
    uint32_t t = events[a];
    events[a] = events[b];
    events[b] = t;
  }
  return n;
}

/* The stored states from the root to state i (their indices, root first); their number. */
int kvl_path(uint32_t i, uint32_t *idx, int max) {
  int n = 0;
  if (i >= S.n) return 0;
  for (uint32_t k = i;; k = S.parent[k]) {
    if (n == max) return -1;
    idx[n++] = k;
    if (k == 0) break;
  }
  for (int a = 0, b = n - 1; a < b; a++, b--) {
    uint32_t t = idx[a];
    idx[a] = idx[b];
    idx[b] = t;
  }
  return n;
}

/* State i's bytes (for the tests' state-set comparisons and the trace's replay). */
int kvl_state(uint32_t i, unsigned char *buf) {
  if (i >= S.n) return 0;
  memcpy(buf, S.states + (size_t)i * KVL_W, KVL_W);
  return KVL_W;
}

int kvl_width(void) { return KVL_W; }

void kvl_free(void) { kvl_reset(); }
