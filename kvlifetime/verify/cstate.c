/* The compiled checker's stored state (kvlifetime.verify.cenv puts this text after cenv.c):
 * a state packed into KVL_W bytes, and its canonical form. */

/* ------------------------------------------------------------------------- the stored state
 * A state is stored packed (KVL_W bytes): each field of st_t in PK_BITS[i] bits (cenv.py
 * computes them from the configuration's ranges), the messages renumbered densely, and
 * what follows from the rest left out: nheld, the blocks (canonical: in request order), the
 * queues' lengths and the prompt counts. */
static int lq_code(int m) {
  return m ? 1 + (KIND(m) - 1) + 4 * (VAL(m) + (T + 1) * ((m >> 5) & 3)) : 0;
}
static int lq_msg(int c) {
  if (!c) return 0;
  c--;
  int k = c % 4 + 1, v = (c / 4) % (T + 1), f = c / (4 * (T + 1));
  return MSG(k, v) | (f << 5);
}
static void pack(const st_t *s, unsigned char *out) {
  const unsigned char *b = (const unsigned char *)s;
  unsigned long long acc = 0;  /* bits not yet written, the first at bit 0 */
  int fill = 0, o = 0;
  for (int i = 0; i < NPK; i++) {
    int v = b[PK_OFF[i]];
    if (PK_KIND[i] == 1) v = lq_code(v);
    else if (PK_KIND[i] == 2) v = v ? 1 + ((v >> 5) & 3) : 0;
    else if (PK_KIND[i] == 3) v = (signed char)v + 1;
    acc |= (unsigned long long)v << fill;
    fill += PK_BITS[i];
    while (fill >= 8) { out[o++] = (unsigned char)acc; acc >>= 8; fill -= 8; }
  }
  if (fill) out[o++] = (unsigned char)acc;
  while (o < KVL_W) out[o++] = 0;
}
static void unpack(const unsigned char *in, st_t *s) {
  unsigned char *b = (unsigned char *)s;
  memset(s, 0, sizeof *s);
  unsigned long long acc = 0;
  int fill = 0, o = 0;
  for (int i = 0; i < NPK; i++) {
    while (fill < PK_BITS[i]) { acc |= (unsigned long long)in[o++] << fill; fill += 8; }
    int v = (int)(acc & ((1u << PK_BITS[i]) - 1));
    acc >>= PK_BITS[i];
    fill -= PK_BITS[i];
    if (PK_KIND[i] == 1) v = lq_msg(v);
    else if (PK_KIND[i] == 2) v = v ? CANCEL | ((v - 1) << 5) : 0;
    else if (PK_KIND[i] == 3) v = v - 1;
    b[PK_OFF[i]] = (unsigned char)v;
  }
  int held = 0;
  for (int r = 0; r < s->admitted; r++)
    if (s->phase[r] != RELEASED) {
#if KVL_CANON
      s->blk[r] = (unsigned char)held;
#endif
      held++;
    }
  s->nheld = (unsigned char)held;
  for (int g = 0; g < G; g++) {
    int n = 0;
    for (int i = 0; i < QL && s->lq[g * QL + i]; i++, s->lqn[g]++) n += !(s->lq[g * QL + i] & DLY);
    for (int i = 0; i < QC && s->cq[g * QC + i]; i++, s->cqn[g]++) n += !(s->cq[g * QC + i] & DLY);
    s->nprompt[g] = (unsigned char)n;
  }
}

/* ------------------------------------------------------------- the canonical form (KVL_CANON)
 * kvlifetime verify's canonical key (kvlifetime.verify.keys) as a state: the least, byte by
 * byte, of the state under every renaming of the peers, its admitted requests sorted, after
 * what nothing reads any more is forgotten:
 *   - a dead grant (its request ended, nothing of it on the wire or in flight, closed by the
 *     ledger or forgotten with its request, its peer unable to post, answer, report or go
 *     silent on it) keeps only "granted" (silent, closed) if its request has ended, nothing if
 *     released;
 *   - a closed grant's proof is one closed proof, PF_CLOSED (its facts are never read again);
 *   - a released request's live grants (orphans) are spread over the released requests, per
 *     peer, in order: which released request they were granted by is not read;
 *   - blocks are renamed: the unreleased requests hold blocks 0, 1, ... in their order. */
#define SLOT (6 + QL + QC)
typedef struct { unsigned char phase, rs, comp, slot[P][SLOT]; } rec_t;

static int dead(const st_t *s, int g) {
  int r = REQ(g);
  if (!granted(s, g) || s->phase[r] == LIVE || s->lqn[g] || s->cqn[g]) return 0;
  for (int i = 0; i < ntr(s, g); i++)
    if (TR(s, g, i) == INFL || TR(s, g, i) == FAILD) return 0;
  if (s->phase[r] != RELEASED && !pf_closed(s->pf[g])) return 0;
  if (silent(s, g)) return 1;
  if (!stopped(s, g)) return 0;
  if (qsent(s, g)) return 1;
  return (ntr(s, g) == 0 || !all_seen(s, g)) && !maycrash(s, PEER(g));
}
static void forget(st_t *s) {
  for (int r = 0; r < R; r++)  /* a released request's count is never read again */
    if (s->phase[r] == RELEASED) s->comp[r] = 0;
  for (int p = 0; p < P; p++)  /* "may crash" is read only while the budgets allow a crash */
    if (crashed(s, p) || !(s->crashes_left > 0 && BUDGET(s))) s->peerf[p] &= ~CRASHABLE;
  for (int g = 0; g < G; g++) {
    if (!granted(s, g)) continue;
    if (dead(s, g)) {
      int gone = s->phase[REQ(g)] == RELEASED;
      s->gf[g] = gone ? 0 : GRANTED | SILENT;
      s->tf[g] = 0;
      s->pf[g] = gone ? 0 : PF_CLOSED;
    } else if (s->phase[REQ(g)] != RELEASED && pf_closed(s->pf[g])) {
      s->pf[g] = PF_CLOSED;
    }
  }
}
static void get_slot(const st_t *s, int g, unsigned char *o) {
  o[0] = s->gf[g]; o[1] = s->tf[g]; o[2] = s->pf[g];
  o[3] = s->lqn[g]; o[4] = s->cqn[g]; o[5] = s->nprompt[g];
  memcpy(o + 6, s->lq + g * QL, QL);
  memcpy(o + 6 + QL, s->cq + g * QC, QC);
}
static void put_slot(st_t *s, int g, const unsigned char *o) {
  s->gf[g] = o[0]; s->tf[g] = o[1]; s->pf[g] = o[2];
  s->lqn[g] = o[3]; s->cqn[g] = o[4]; s->nprompt[g] = o[5];
  memcpy(s->lq + g * QL, o + 6, QL);
  memcpy(s->cq + g * QC, o + 6 + QL, QC);
}
static int rec_cmp(const rec_t *a, const rec_t *b) { return memcmp(a, b, sizeof *a); }
static void rec_sort(rec_t *v, int n) {  /* insertion sort: n <= R, a handful */
  for (int i = 1; i < n; i++) {
    rec_t x = v[i];
    int j = i - 1;
    while (j >= 0 && rec_cmp(&v[j], &x) > 0) { v[j + 1] = v[j]; j--; }
    v[j + 1] = x;
  }
}
/* the orphans of peer (slot) q, spread over the released requests in order, greatest first */
static void spread(rec_t *v, int n, int q) {
  for (int i = 0; i < n; i++) {
    if (v[i].phase != RELEASED) continue;
    for (int j = i + 1; j < n; j++) {
      if (v[j].phase != RELEASED) continue;
      if (memcmp(v[j].slot[q], v[i].slot[q], SLOT) > 0) {
        unsigned char t[SLOT];
        memcpy(t, v[i].slot[q], SLOT);
        memcpy(v[i].slot[q], v[j].slot[q], SLOT);
        memcpy(v[j].slot[q], t, SLOT);
      }
    }
  }
}
static int nperm_;
static unsigned char perm_[6][P];  /* every renaming of the peers (P <= 3) */
static void perms_init(void) {
  if (nperm_) return;
  int a[3] = {0, 1, 2};
  for (int x = 0; x < P; x++)
    for (int y = 0; y < P; y++)
      for (int z = 0; z < P; z++) {
        a[0] = x; a[1] = y; a[2] = z;
        int ok = 1;
        for (int i = 0; i < P; i++)
          for (int j = i + 1; j < P; j++) if (a[i] == a[j]) ok = 0;
        if (P < 3 && z) ok = 0;
        if (P < 2 && y) ok = 0;
        if (!ok) continue;
        for (int i = 0; i < P; i++) perm_[nperm_][i] = (unsigned char)a[i];
        nperm_++;
      }
}
static void canon(st_t *s) {
  forget(s);
  perms_init();
  int n = s->admitted;
  rec_t v[R], best[R];
  unsigned char peers[P], bestp[P];
  int have = 0;
  for (int k = 0; k < nperm_; k++) {
    const unsigned char *pm = perm_[k];  /* old peer -> new */
    for (int p = 0; p < P; p++) peers[pm[p]] = s->peerf[p];
    if (have) {
      int c = memcmp(peers, bestp, P);
      if (c > 0) continue;  /* the peers' flags come first: no better renaming */
    }
    for (int r = 0; r < n; r++) {
      v[r].phase = s->phase[r];
      v[r].rs = s->rs[r];
      v[r].comp = s->comp[r];
      for (int p = 0; p < P; p++) get_slot(s, r * P + p, v[r].slot[pm[p]]);
    }
    for (int q = 0; q < P; q++) spread(v, n, q);
    rec_sort(v, n);
    int c = have ? memcmp(peers, bestp, P) : -1;
    if (c == 0) c = memcmp(v, best, sizeof(rec_t) * (size_t)n);
    if (c < 0) {
      memcpy(best, v, sizeof(rec_t) * (size_t)n);
      memcpy(bestp, peers, P);
      have = 1;
    }
  }
  memcpy(s->peerf, bestp, P);
  int k = 0;
  for (int r = 0; r < n; r++) {
    s->phase[r] = best[r].phase;
    s->rs[r] = best[r].rs;
    s->comp[r] = best[r].comp;
    s->blk[r] = best[r].phase == RELEASED ? 0 : (unsigned char)k++;
    for (int p = 0; p < P; p++) put_slot(s, r * P + p, best[r].slot[p]);
  }
}
