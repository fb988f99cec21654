/* The environment of kvlifetime verify's model, as C: requests, peers, the faulty control
 * channel, the engine's release policies, the lies, and the invariants as violation codes
 * (kvlifetime.verify.cenv, which puts the configuration's #define lines and the
 * specification's C, kvlifetime.verify.cspec, before this text, and csearch.c after it).
 *
 * The same state variables and events, with the same enabling rules and fault budgets, as the
 * Promela model's environment (kvlifetime.verify.promela_env): one event is one successor. */
/* ------------------------------------------------ the environment (kvlifetime.verify.cenv) */

#define NAIVE 0
#define TIMEOUT 1
#define PROOF 2
#define TRUSTING 3
#define G (R * P)
#define REQ(g) ((g) / P)
#define PEER(g) ((g) % P)
#define UNADMITTED 0
#define LIVE 1
#define FINISHED 2
#define REJECTED 3
#define RELEASED 4
#define NONE 0
#define INFL 1
#define FAILD 2
#define LANDED 3
#define UNSEEN 4
#define CR 1
#define SS 2
#define TQ 3
#define TC 4
#define CANCEL 5
#define MSG(k, v) ((k) | ((v) << 3))
#define KIND(m) ((m) & 7)
#define VAL(m) (((m) >> 3) & 3)
#define NODUP 32
#define DLY 64
#define GRANTED 1
#define CANCELLED 2
#define STOPPED 4
#define QSENT 8
#define LEASED 16
#define SILENT 32
#define RETRY1 64
#define CRASHED 1
#define FENCED 2
#define LOST 4
#define CRASHABLE 8  /* may crash: every peer, or with KVL_POR the first MAXCRASH */

typedef struct {
  unsigned char admitted, nheld;
  unsigned char phase[R], rs[R], blk[R];
  unsigned char gf[G], tf[G], pf[G], lqn[G], cqn[G], nprompt[G];
  unsigned char lq[G * QL], cq[G * QC];
  unsigned char peerf[P];
  unsigned char dups_left, delays_left, losses_left, crashes_left;
  signed char faults_left;
} st_t;

#define ST_W ((int)sizeof(st_t))

static int evc(int k, int v) {
  return k == CR ? EV_CR : k == SS ? EV_SS0 + v : k == TQ ? EV_TQ0 + v : EV_TC0 + v;
}
#define granted(s, g) (((s)->gf[g] & GRANTED) != 0)
#define cancelled(s, g) (((s)->gf[g] & CANCELLED) != 0)
#define stopped(s, g) (((s)->gf[g] & STOPPED) != 0)
#define qsent(s, g) (((s)->gf[g] & QSENT) != 0)
#define leased(s, g) (((s)->gf[g] & LEASED) != 0)
#define silent(s, g) (((s)->gf[g] & SILENT) != 0)
#define retries(s, g) ((s)->gf[g] >> 6)
#define crashed(s, p) (((s)->peerf[p] & CRASHED) != 0)
#define fenced(s, p) (((s)->peerf[p] & FENCED) != 0)
#define lost(s, p) (((s)->peerf[p] & LOST) != 0)
#define TR(s, g, i) (((s)->tf[g] >> (3 * (i))) & 7)
#define ENDED(s, r) ((s)->phase[r] == FINISHED || (s)->phase[r] == REJECTED)
#define BUDGET(s) ((s)->faults_left != 0)
#define FITS(s, c) ((s)->faults_left < 0 || (c) <= (s)->faults_left)

static void set_tr(st_t *s, int g, int i, int v) {
  s->tf[g] = (unsigned char)((s->tf[g] & ~(7 << (3 * i))) | (v << (3 * i)));
}
static int ntr(const st_t *s, int g) { return (TR(s, g, 0) != NONE) + (TR(s, g, 1) != NONE); }
static int open_(const st_t *s, int g) {
  return granted(s, g) && s->rs[REQ(g)] != RS_released && !pf_closed(s->pf[g]);
}
static int prompt(const st_t *s, int g) { return s->nprompt[g] > 0; }
static int blocked(const st_t *s, int r) {
  for (int j = 0; j < P; j++) if (prompt(s, r * P + j)) return 1;
  return 0;
}
static int all_seen(const st_t *s, int g) {
  int n = ntr(s, g);
  return (n < 1 || TR(s, g, 0) == LANDED) && (n < 2 || TR(s, g, 1) == LANDED);
}
static int maycrash(const st_t *s, int p) {
  return crashed(s, p) || ((s->peerf[p] & CRASHABLE) && s->crashes_left > 0 && BUDGET(s));
}
static int gquiet(const st_t *s, int g) { return granted(s, g) && !prompt(s, g); }
static int can_land(const st_t *s, int g, int i) {
  return gquiet(s, g) && i < ntr(s, g) && (TR(s, g, i) == INFL || TR(s, g, i) == FAILD);
}
static int can_fail(const st_t *s, int g, int i) {
  return F_FAIL && gquiet(s, g) && i < ntr(s, g) && TR(s, g, i) == INFL && !silent(s, g) &&
         BUDGET(s);
}
static int can_retry(const st_t *s, int g) {
  return F_RETRY && gquiet(s, g) && s->phase[REQ(g)] == REJECTED && open_(s, g) &&
         retries(s, g) < MAXRETRY && BUDGET(s) && s->cqn[g] == 0;
}
static int can_silent(const st_t *s, int g) {
  return gquiet(s, g) && !silent(s, g) && !(stopped(s, g) && qsent(s, g)) &&
         maycrash(s, PEER(g));
}
static int can_post(const st_t *s, int g) {
  return gquiet(s, g) && !silent(s, g) && !stopped(s, g) && ntr(s, g) < T;
}
static int can_stop(const st_t *s, int g) {
  return gquiet(s, g) && !silent(s, g) && cancelled(s, g) && !stopped(s, g);
}
static int can_quiesce(const st_t *s, int g) {
  return gquiet(s, g) && !silent(s, g) && stopped(s, g) && !qsent(s, g) && ntr(s, g) > 0 &&
         all_seen(s, g);
}
static int can_complete(const st_t *s, int g) {
  return gquiet(s, g) && !silent(s, g) && !cancelled(s, g) && !stopped(s, g) &&
         all_seen(s, g);
}
static int gact(const st_t *s, int g) {
  return s->lqn[g] > 0 || s->cqn[g] > 0 || can_land(s, g, 0) || (T > 1 && can_land(s, g, 1)) ||
         can_fail(s, g, 0) || (T > 1 && can_fail(s, g, 1)) || can_retry(s, g) ||
         can_silent(s, g) || can_post(s, g) || can_stop(s, g) || can_quiesce(s, g) ||
         can_complete(s, g);
}
static int ract(const st_t *s, int r) {
  if (s->phase[r] == LIVE && !blocked(s, r)) return 1;
  for (int j = 0; j < P; j++) if (gact(s, r * P + j)) return 1;
  return 0;
}
static int peer_ev(const st_t *s, int p) {
  return maycrash(s, p) && (!lost(s, p) || (F_FENCE && !fenced(s, p)));
}
static int any_peer_ev(const st_t *s) {
  for (int p = 0; p < P; p++) if (peer_ev(s, p)) return 1;
  return 0;
}
static int can_lease(const st_t *s, int g) {
  return gquiet(s, g) && ENDED(s, REQ(g)) && open_(s, g) && !leased(s, g);
}
static int lease_early(const st_t *s, int g) { return ract(s, REQ(g)) || any_peer_ev(s); }

/* the ledger's calls: the request's open grants' proofs, for the specification's rows */
static int open_proofs(const st_t *s, int r, unsigned char *op) {
  int n = 0;
  for (int j = 0; j < P; j++) if (granted(s, r * P + j)) op[n++] = s->pf[r * P + j];
  return n;
}
static int call(st_t *s, int r, int (*fire)(int, const unsigned char *, int)) {
  unsigned char op[P];
  int n = open_proofs(s, r, op);
  int t = fire(s->rs[r], op, n);
  if (t < 0) return LEDGER_ERROR;
  s->rs[r] = (unsigned char)t;
  return 0;
}
static void advance_r(st_t *s, int r) {
  unsigned char op[P];
  int n = open_proofs(s, r, op);
  s->rs[r] = (unsigned char)advance(s->rs[r], op, n);
}
static void spend(st_t *s, int c) {
  if (s->faults_left > 0) s->faults_left = (signed char)(s->faults_left - c);
}
static void crash(st_t *s, int p) {
  if (!crashed(s, p)) { s->peerf[p] |= CRASHED; s->crashes_left--; }
}
static void let_go(st_t *s, int r) {
  s->phase[r] = RELEASED;  /* its block is free, every grant on it stale */
  s->nheld--;
  for (int k = 0; k < P; k++) s->pf[r * P + k] = 0;
}
static int force_release(st_t *s, int r) {
  int e = s->rs[r] == RS_transfer_quiesced ? call(s, r, fire_released)
                                            : call(s, r, fire_force_released);
  if (e) return e;
  let_go(s, r);
  return 0;
}
static int settle(st_t *s) {
  for (int i = 0; i < R; i++) {
    if (s->rs[i] == RS_NONE || s->rs[i] == RS_released) continue;
    advance_r(s, i);
    if (POLICY == TIMEOUT && ENDED(s, i) && s->rs[i] == RS_quarantined) {
      int e = force_release(s, i);
      if (e) return e;
    }
    if (s->rs[i] == RS_transfer_quiesced) {
      int e = call(s, i, fire_released);
      if (e) return e;
      let_go(s, i);
    }
  }
  return 0;
}
static int ack(st_t *s, int g, int e) {
  if (s->rs[REQ(g)] != RS_released) {
    int n = pf_next(s->pf[g], e);
    if (n == CONTRA) {
      if (POLICY != TRUSTING) return LEDGER_ERROR;
    } else if (open_(s, g)) {
      s->pf[g] = (unsigned char)n;
    }
  }
  return settle(s);
}
static int peer_wide(st_t *s, int p, int e) {
  for (int j = 0; j < R; j++)
    if (open_(s, j * P + p)) s->pf[j * P + p] = (unsigned char)pf_next(s->pf[j * P + p], e);
  return settle(s);
}
static int send_ledger(st_t *s, int g, int m) {
  if (s->lqn[g] >= QL) return MODEL_BOUND;
  s->lq[g * QL + s->lqn[g]] = (unsigned char)m;
  s->lqn[g]++;
  s->nprompt[g]++;
  return 0;
}
static int send_cancel(st_t *s, int g) {
  if (s->cqn[g] >= QC) return MODEL_BOUND;
  s->cq[g * QC + s->cqn[g]] = CANCEL;
  s->cqn[g]++;
  s->nprompt[g]++;
  return 0;
}
static void take_l(st_t *s, int g, int i) {
  if (!(s->lq[g * QL + i] & DLY)) s->nprompt[g]--;
  for (int k = i; k < QL - 1; k++) s->lq[g * QL + k] = s->lq[g * QL + k + 1];
  s->lq[g * QL + QL - 1] = 0;
  s->lqn[g]--;
}
static void take_c(st_t *s, int g, int i) {
  if (!(s->cq[g * QC + i] & DLY)) s->nprompt[g]--;
  for (int k = i; k < QC - 1; k++) s->cq[g * QC + k] = s->cq[g * QC + k + 1];
  s->cq[g * QC + QC - 1] = 0;
  s->cqn[g]--;
}
static int deliver_to_peer(st_t *s, int g) {
  if (silent(s, g)) return 0;
  s->gf[g] |= CANCELLED;
  if (qsent(s, g)) return send_ledger(s, g, MSG(TC, ntr(s, g)));
  if (stopped(s, g)) return send_ledger(s, g, MSG(SS, ntr(s, g)));
  return send_ledger(s, g, MSG(CR, 0));
}
static int first_l(const st_t *s, int g, int i) {
  for (int j = 0; j < i; j++) if (s->lq[g * QL + j] == s->lq[g * QL + i]) return 0;
  return 1;
}
static int lq_here(const st_t *s, int g, int i) {
  return i < s->lqn[g] && (i == 0 || (F_REORDER && BUDGET(s) && first_l(s, g, i)));
}
static int cq_here(const st_t *s, int g, int i) {
  return i < s->cqn[g] &&
         (i == 0 || (F_REORDER && BUDGET(s) && s->cq[g * QC] != s->cq[g * QC + i]));
}

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
typedef struct { unsigned char phase, rs, slot[P][SLOT]; } rec_t;

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
    s->blk[r] = best[r].phase == RELEASED ? 0 : (unsigned char)k++;
    for (int p = 0; p < P; p++) put_slot(s, r * P + p, best[r].slot[p]);
  }
}

/* one successor: the step's outcome goes to the search (a violation, or the next state) */
#define EVENT(kind, a, b) ((kind) * 4096 + (a) * 64 + (b))
static int kvl_n_;  /* successors of the state being expanded */
static int counting_;  /* kvl_enabled: count the events, take none */
static void emit_one(void *ctx, int ev, int code, const st_t *n);
#if KVL_POR
typedef struct { int ev, code; st_t n; } succ_t;
#define MAXSUCC 1024
static succ_t succ_[MAXSUCC];
static int nsucc_;
#endif
static void out(void *ctx, int ev, int code, const st_t *n) {
  kvl_n_++;
  if (counting_) return;
#if KVL_POR
  if (nsucc_ < MAXSUCC) {
    succ_[nsucc_].ev = ev; succ_[nsucc_].code = code; succ_[nsucc_].n = *n;
    nsucc_++;
    return;
  }
  kvl_fail(ctx, ev, MODEL_BOUND);
#else
  emit_one(ctx, ev, code, n);
#endif
}
static void emit_one(void *ctx, int ev, int code, const st_t *n) {
  if (code) { kvl_fail(ctx, ev, code); return; }
  unsigned char packed[KVL_W];
#if KVL_CANON
  st_t c = *n;
  canon(&c);
  pack(&c, packed);
#else
  pack(n, packed);
#endif
  kvl_emit(ctx, ev, packed);
}

static void kvl_initial(unsigned char *b) {
  st_t st, *s = &st;
  memset(s, 0, sizeof *s);
  s->dups_left = F_DUP * MAXDUP;
  s->delays_left = F_DELAY * MAXDELAY;
  s->losses_left = F_LOSS * MAXLOSS;
  s->crashes_left = F_CRASH * MAXCRASH;
  s->faults_left = MAXF;
  for (int p = 0; p < P; p++)
    if (F_CRASH && (!KVL_POR || p < MAXCRASH)) s->peerf[p] |= CRASHABLE;
  pack(s, b);
}

static int kvl_check(const unsigned char *b) { (void)b; return 0; }

/* the lowest block no unreleased request holds (a request holds one block) */
static int first_free(const st_t *s) {
  int k = 0;
  for (;;) {
    int held = 0;
    for (int i = 0; i < s->admitted; i++)
      if (s->phase[i] != RELEASED && s->blk[i] == k) held = 1;
    if (!held) return k;
    k++;
  }
}

static void lq_opts(const st_t *s, int g, int i, void *ctx) {
  if (!lq_here(s, g, i)) return;
  int o = i > 0;
  unsigned char m = s->lq[g * QL + i];
  st_t n;
  if (FITS(s, o)) {
    n = *s; spend(&n, o); take_l(&n, g, i);
    out(ctx, EVENT(10, g, i), ack(&n, g, evc(KIND(m), VAL(m))), &n);
  }
  if (s->losses_left > 0 && FITS(s, o + 1)) {
    n = *s; spend(&n, o + 1); n.losses_left--; take_l(&n, g, i);
    out(ctx, EVENT(11, g, i), 0, &n);
  }
  if (s->dups_left > 0 && !(m & NODUP) && FITS(s, o + 1)) {
    n = *s; spend(&n, o + 1); n.dups_left--;
    if (!(m & DLY)) n.nprompt[g]--;
    n.lq[g * QL + i] = (unsigned char)(m | NODUP | DLY);
    out(ctx, EVENT(12, g, i), ack(&n, g, evc(KIND(m), VAL(m))), &n);
  }
  if (s->delays_left > 0 && !(m & DLY) && FITS(s, o + 1)) {
    n = *s; spend(&n, o + 1); n.delays_left--; n.nprompt[g]--;
    n.lq[g * QL + i] = (unsigned char)(m | DLY);
    out(ctx, EVENT(13, g, i), 0, &n);
  }
}

static void cq_opts(const st_t *s, int g, int i, void *ctx) {
  if (!cq_here(s, g, i)) return;
  int o = i > 0;
  unsigned char m = s->cq[g * QC + i];
  st_t n;
  if (FITS(s, o)) {
    n = *s; spend(&n, o); take_c(&n, g, i);
    out(ctx, EVENT(20, g, i), deliver_to_peer(&n, g), &n);
  }
  if (s->losses_left > 0 && FITS(s, o + 1)) {
    n = *s; spend(&n, o + 1); n.losses_left--; take_c(&n, g, i);
    out(ctx, EVENT(21, g, i), 0, &n);
  }
  if (s->dups_left > 0 && !(m & NODUP) && FITS(s, o + 1)) {
    n = *s; spend(&n, o + 1); n.dups_left--;
    if (!(m & DLY)) n.nprompt[g]--;
    n.cq[g * QC + i] = (unsigned char)(m | NODUP | DLY);
    out(ctx, EVENT(22, g, i), deliver_to_peer(&n, g), &n);
  }
  if (s->delays_left > 0 && !(m & DLY) && FITS(s, o + 1)) {
    n = *s; spend(&n, o + 1); n.delays_left--; n.nprompt[g]--;
    n.cq[g * QC + i] = (unsigned char)(m | DLY);
    out(ctx, EVENT(23, g, i), 0, &n);
  }
}

static int lease(st_t *n, int g) {
  n->gf[g] |= LEASED;
  n->pf[g] = (unsigned char)pf_next(n->pf[g], EV_SUSPECT);
  return settle(n);
}

static void grant_opts(const st_t *s, int g, void *ctx) {
  st_t n;
  for (int i = 0; i < T; i++) {
    if (can_land(s, g, i)) {
      n = *s;
      set_tr(&n, g, i, TR(s, g, i) == INFL ? LANDED : UNSEEN);
      int bad = !fenced(s, PEER(g)) && s->phase[REQ(g)] == RELEASED;
      out(ctx, EVENT(30, g, i), bad ? ISOLATION : 0, &n);
    }
    if (can_fail(s, g, i)) {
      n = *s; spend(&n, 1); set_tr(&n, g, i, FAILD);
      out(ctx, EVENT(31, g, i), 0, &n);
    }
  }
  for (int i = 0; i < (F_REORDER ? QL : 1); i++) lq_opts(s, g, i, ctx);
  for (int i = 0; i < (F_REORDER ? QC : 1); i++) cq_opts(s, g, i, ctx);
  if (can_post(s, g)) {
    n = *s; set_tr(&n, g, ntr(s, g), INFL);
    out(ctx, EVENT(40, g, 0), 0, &n);
  }
  if (can_stop(s, g)) {
    n = *s; n.gf[g] |= STOPPED;
    out(ctx, EVENT(41, g, 0), send_ledger(&n, g, MSG(SS, ntr(s, g))), &n);
  }
  if (can_quiesce(s, g)) {
    n = *s; n.gf[g] |= QSENT;
    out(ctx, EVENT(42, g, 0), send_ledger(&n, g, MSG(TQ, ntr(s, g))), &n);
  }
  if (can_complete(s, g)) {
    n = *s; n.gf[g] |= STOPPED | QSENT;
    out(ctx, EVENT(43, g, 0), send_ledger(&n, g, MSG(TC, ntr(s, g))), &n);
  }
  if (can_retry(s, g)) {
    n = *s; spend(&n, 1); n.gf[g] = (unsigned char)(n.gf[g] + RETRY1);
    out(ctx, EVENT(44, g, 0), send_cancel(&n, g), &n);
  }
  if (can_silent(s, g)) {
    n = *s; spend(&n, !crashed(s, PEER(g))); crash(&n, PEER(g)); n.gf[g] |= SILENT;
    out(ctx, EVENT(45, g, 0), 0, &n);
  }
  if (can_lease(s, g)) {
    if (!lease_early(s, g)) {
      n = *s;
      out(ctx, EVENT(46, g, 0), lease(&n, g), &n);
    } else if (F_TIMEOUT && BUDGET(s)) {
      n = *s; spend(&n, 1);
      out(ctx, EVENT(47, g, 0), lease(&n, g), &n);
    }
  }
  if (F_LIE && POLICY == TRUSTING && s->faults_left != 0 && open_(s, g)) {
    for (int k = 0; k < NLIE_G; k++) {
      int e = LIE_G[k];
      int nx = pf_next(s->pf[g], e);
      if (nx == s->pf[g] || nx == CONTRA) continue;
      n = *s; spend(&n, 1); n.pf[g] = (unsigned char)nx;
      out(ctx, EVENT(50, g, k), settle(&n), &n);
    }
  }
}


#if KVL_POR
/* ------------------------------------------------------ the partial-order reduction (KVL_POR)
 * kvlifetime verify's stubborn sets (kvlifetime.verify.por, argued in explore.py), on the
 * state expanded: the events of one request r, or once r has ended those of one of its grants
 * with the leases of its others, taken alone when r is isolated and the set has a key; else
 * every event. Candidates: the requests in order, smaller sets first within one. */
#define EV_KIND(e) ((e) / 4096)
#define EV_A(e) (((e) / 64) % 64)
#define EV_B(e) ((e) % 64)
static int ev_owner(int e) {
  int k = EV_KIND(e);
  if (k == 2 || k == 3 || k == 4) return EV_A(e);
  if (k >= 10 && k <= 50) return REQ(EV_A(e));
  return -1;
}
static int ev_grant(int e) {
  int k = EV_KIND(e);
  return k >= 10 && k <= 50 ? EV_A(e) : -1;
}
static int lost_possible(const st_t *s, int p) { return !lost(s, p) && maycrash(s, p); }
static int fence_possible(const st_t *s, int p) {
  return F_FENCE && !fenced(s, p) && maycrash(s, p);
}
static int peer_may_act(const st_t *s, int p) { return lost_possible(s, p) || fence_possible(s, p); }
static int fences_may_close(const st_t *s, unsigned peers) {
  if (!peers) return 0;
  int need = 0;
  for (int p = 0; p < P; p++) {
    if (!((peers >> p) & 1)) continue;
    if (!fence_possible(s, p)) return 0;
    need += !crashed(s, p);
  }
  return need <= s->crashes_left && (s->faults_left < 0 || need <= s->faults_left);
}
static int is_key(const st_t *s, int e) {
  int k = EV_KIND(e);
  if (k == 46) return 1;                     /* a generous lease stays generous */
  if (k == 47) return 0;                     /* an early one: a budget may run out */
  if (k == 11 || k == 12 || k == 13 || k == 21 || k == 22 || k == 23) return 0; /* budgeted */
  if (k == 31 || k == 44 || k == 45) return 0;
  if ((k == 10 || k == 20) && EV_B(e) > 0) return 0;  /* an overtaking delivery */
  if (k == 2) return !peer_may_act(s, EV_B(e));
  return 1;
}
static int isolated_strict(const st_t *s, int r) {
  for (int p = 0; p < P; p++)
    if ((s->phase[r] == LIVE || granted(s, r * P + p)) && peer_may_act(s, p)) return 0;
  return 1;
}
static int released_count(const st_t *s) {
  int n = 0;
  for (int r = 0; r < R; r++) n += s->phase[r] == RELEASED;
  return n;
}
static int releases(const st_t *s, const succ_t *x) {
  int k = EV_KIND(x->ev);
  if (!(k == 3 || k == 4 || k == 10 || k == 12 || k == 20 || k == 22 || k == 46 || k == 47))
    return 0;
  return x->code != 0 || released_count(&x->n) != released_count(s);
}
static int isolated(const st_t *s, int r, const int *set, int n) {
  if (s->phase[r] == RELEASED || s->phase[r] == LIVE) return 1;
  unsigned open_peers = 0;
  int quarantined = s->rs[r] == RS_quarantined, suspect = 0;
  for (int p = 0; p < P; p++) {
    int g = r * P + p;
    if (granted(s, g) && !pf_closed(s->pf[g])) {
      open_peers |= 1u << p;
      if (s->pf[g] & 4) suspect = 1;
    }
  }
  if (!quarantined && suspect) return 0;  /* (a4) */
  int far_land = 0;
  for (int i = 0; i < n; i++) {
    int e = succ_[set[i]].ev;
    if (EV_KIND(e) == 30 && !((open_peers >> PEER(EV_A(e))) & 1)) far_land = 1;
  }
  if (far_land && fences_may_close(s, open_peers)) return 0;  /* (a5) */
  for (int i = 0; i < n; i++) {
    const succ_t *x = &succ_[set[i]];
    int k = EV_KIND(x->ev), g = EV_A(x->ev);
    if (k != 10 && k != 12) continue;       /* a delivery (or duplicate) to the ledger */
    if (!((open_peers >> PEER(g)) & 1)) continue;
    if (x->code) return 0;
    if (x->n.phase[r] == RELEASED) continue;
    if (!pf_closed(x->n.pf[g])) continue;
    if (!quarantined && lost_possible(s, PEER(g))) return 0;  /* (a6) */
  }
  return 1;
}
/* whether the set (indices into succ_) qualifies: isolated, a key, and (g1) (g2) */
static int qualifies(const st_t *s, int r, const int *set, int n, int per_grant) {
  if (n == nsucc_) return 0;
  if (STRICT ? !isolated_strict(s, r) : !isolated(s, r, set, n)) return 0;
  int key = -1;
  for (int i = 0; i < n && key < 0; i++) {
    int e = succ_[set[i]].ev;
    if ((EV_KIND(e) != 46 && EV_KIND(e) != 47) || !per_grant)
      if (is_key(s, e)) key = e;
  }
  if (key < 0) return 0;
  if (per_grant) {
    int g = ev_grant(key);
    if (pf_closed(s->pf[g]))
      for (int i = 0; i < ntr(s, g); i++)
        if (TR(s, g, i) == INFL || TR(s, g, i) == FAILD) return 0;  /* (g1) */
    for (int i = 0; i < n; i++) if (releases(s, &succ_[set[i]])) return 0;  /* (g2) */
  }
  return 1;
}
static void choose_and_emit(const st_t *s, void *ctx) {
  static int set[MAXSUCC], best[MAXSUCC];
  int nbest = -1;
  int full = s->admitted == 0 || nsucc_ < 2 || (POLICY == TRUSTING && F_LIE);
  for (int r = 0; r < R && !full && nbest < 0; r++) {
    int n = 0;
    for (int i = 0; i < nsucc_; i++) if (ev_owner(succ_[i].ev) == r) set[n++] = i;
    if (!n) continue;
    /* the grant-level sets first when smaller (they are), then the request's */
    int ngr = 0;
    for (int p = 0; p < P; p++) ngr += granted(s, r * P + p);
    if ((s->phase[r] == FINISHED || s->phase[r] == REJECTED) && ngr >= 2) {
      int groups = 0;
      for (int p = 0; p < P; p++) {
        int g = r * P + p, any = 0;
        for (int i = 0; i < n; i++) if (ev_grant(succ_[set[i]].ev) == g) any = 1;
        groups += any;
      }
      if (groups >= 2) {
        /* order the grant-level sets by size, as por.stubborn sorts its candidates */
        int order[P], size[P], m = 0;
        for (int p = 0; p < P; p++) {
          int g = r * P + p, c = 0, any = 0;
          for (int i = 0; i < n; i++) {
            int e = succ_[set[i]].ev;
            if (ev_grant(e) == g) { c++; any = 1; }
            else if (EV_KIND(e) == 46 || EV_KIND(e) == 47) c++;
          }
          if (any) { order[m] = p; size[m] = c; m++; }
        }
        for (int i = 1; i < m; i++)
          for (int j = i; j > 0 && size[j - 1] > size[j]; j--) {
            int t = size[j]; size[j] = size[j - 1]; size[j - 1] = t;
            t = order[j]; order[j] = order[j - 1]; order[j - 1] = t;
          }
        for (int q = 0; q < m && nbest < 0; q++) {
          int g = r * P + order[q], c = 0;
          for (int i = 0; i < n; i++) {
            int e = succ_[set[i]].ev;
            if (ev_grant(e) == g || EV_KIND(e) == 46 || EV_KIND(e) == 47) best[c++] = set[i];
          }
          /* the request's whole set is larger: tried after every grant-level one */
          if (c < n && qualifies(s, r, best, c, 1)) nbest = c;
        }
      }
    }
    if (nbest < 0 && qualifies(s, r, set, n, 0)) {
      memcpy(best, set, sizeof(int) * (size_t)n);
      nbest = n;
    }
  }
  if (nbest < 0)
    for (int i = 0; i < nsucc_; i++) emit_one(ctx, succ_[i].ev, succ_[i].code, &succ_[i].n);
  else
    for (int i = 0; i < nbest; i++) {
      const succ_t *x = &succ_[best[i]];
      emit_one(ctx, x->ev, x->code, &x->n);
    }
}
#endif

static void kvl_successors(const unsigned char *b, void *ctx) {
  st_t st;
  unpack(b, &st);
  const st_t *s = &st;
  st_t n;
  kvl_n_ = 0;
#if KVL_POR
  nsucc_ = 0;
#endif
  if (s->admitted < R && s->nheld < B) {
    n = *s;
    int a = n.admitted, k = first_free(&n);
    n.blk[a] = (unsigned char)k;
    int bad = 0;
    for (int i = 0; i < a; i++)
      if (n.phase[i] != RELEASED && n.blk[i] == n.blk[a]) bad = EXCLUSIVITY;
    n.nheld++;
    n.phase[a] = LIVE; n.rs[a] = RS_INITIAL; n.admitted++;
    out(ctx, EVENT(1, 0, 0), bad, &n);
  }
  for (int r = 0; r < R; r++) {
    int free_ = s->phase[r] == LIVE && !blocked(s, r);
    for (int p = 0; p < P; p++) {
      int g = r * P + p;
      if (free_ && !granted(s, g) && !lost(s, p) && !fenced(s, p)) {
        n = *s; n.gf[g] |= GRANTED;
        out(ctx, EVENT(2, r, p), 0, &n);
      }
    }
    if (free_) {
      n = *s; n.phase[r] = FINISHED;
      int e = call(&n, r, fire_finished);
      if (!e) { advance_r(&n, r); e = settle(&n); }
      out(ctx, EVENT(3, r, 0), e, &n);
      n = *s; n.phase[r] = REJECTED;
      e = call(&n, r, fire_rejected);
      if (!e) {
        advance_r(&n, r);
        for (int j = 0; j < P && !e; j++)
          if (granted(&n, r * P + j)) e = send_cancel(&n, r * P + j);
        if (!e && POLICY == NAIVE) e = force_release(&n, r);
        if (!e) e = settle(&n);
      }
      out(ctx, EVENT(4, r, 0), e, &n);
    }
  }
  for (int g = 0; g < G; g++) grant_opts(s, g, ctx);
  for (int p = 0; p < P; p++) {
    if (maycrash(s, p) && !lost(s, p)) {
      n = *s; spend(&n, !crashed(s, p)); crash(&n, p); n.peerf[p] |= LOST;
      out(ctx, EVENT(60, p, 0), peer_wide(&n, p, EV_SUSPECT), &n);
    }
    if (F_FENCE && maycrash(s, p) && !fenced(s, p)) {
      n = *s; spend(&n, !crashed(s, p)); crash(&n, p); n.peerf[p] |= FENCED;
      out(ctx, EVENT(61, p, 0), peer_wide(&n, p, EV_AR), &n);
    }
    if (F_LIE && POLICY == TRUSTING && s->faults_left != 0) {
      int any_open = 0, any_unsuspect = 0;
      for (int r = 0; r < R; r++) {
        int g = r * P + p;
        if (!open_(s, g)) continue;
        any_open = 1;
        int nx = pf_next(s->pf[g], EV_SUSPECT);
        if (nx != s->pf[g] && nx != CONTRA) any_unsuspect = 1;
      }
      if (any_open) {
        n = *s; spend(&n, 1);
        out(ctx, EVENT(62, p, 0), peer_wide(&n, p, EV_AR), &n);
      }
      if (any_unsuspect) {
        n = *s; spend(&n, 1);
        out(ctx, EVENT(63, p, 0), peer_wide(&n, p, EV_SUSPECT), &n);
      }
    }
  }
#if KVL_POR
  if (!counting_) choose_and_emit(s, ctx);
#endif
  if (kvl_n_ == 0 && !counting_) {  /* quiet: every block free, or held by a quarantined request */
    for (int i = 0; i < R; i++)
      if (!(s->phase[i] == UNADMITTED || s->phase[i] == RELEASED || s->rs[i] == RS_quarantined)) {
        kvl_fail(ctx, -1, NO_LEAK);
        return;
      }
  }
}

/* for kvlifetime.verify.cenv (its tests and the mapping of a counterexample back onto the
 * Python model's events): a state (st_t) as the search stores it, in canonical form when the
 * search is reduced; and a stored state back as st_t */
void kvl_store_form(const unsigned char *st, unsigned char *out) {
  st_t c;
  memcpy(&c, st, sizeof c);
#if KVL_CANON
  canon(&c);
#endif
  pack(&c, out);
}
void kvl_unpack(const unsigned char *in, unsigned char *st) { unpack(in, (st_t *)st); }
int kvl_st_width(void) { return ST_W; }

/* the events enabled in a stored state (0: it is quiet), for the tests */
int kvl_enabled(const unsigned char *stored) {
  counting_ = 1;
  kvl_successors(stored, NULL);
  counting_ = 0;
  return kvl_n_;
}
