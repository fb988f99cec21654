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
#define FIRST_FAILURE 4
#define COUNTED 5
#define SGLANG 6
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
  unsigned char phase[R], rs[R], blk[R], comp[R];  /* comp: completion notices counted */
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
/* counted-completions (a field bug class): the engine frees an ended request once it has
 * counted as many completion notices as the request has grants, whichever grant (or copy)
 * each was about, while a grant is still open */
static int counted_out(const st_t *s, int r) {
  int n = 0, open = 0;
  for (int p = 0; p < P; p++) {
    n += granted(s, r * P + p);
    open |= granted(s, r * P + p) && !pf_closed(s->pf[r * P + p]);
  }
  return n > 0 && s->comp[r] >= n && open;
}
/* sglang-0.5.23 (push: the prefill ranks write the decode's pages): an aborted request is held
 * until every grant is closed or its one deadline passes (the first of its leases fires),
 * "ready = drained or now >= deadline"; then released anyway */
static int sglang_deadline(const st_t *s, int r) {
  int open = 0, fired = 0;
  for (int p = 0; p < P; p++) {
    int g = r * P + p;
    open |= granted(s, g) && !pf_closed(s->pf[g]);
    fired |= granted(s, g) && leased(s, g);
  }
  return open && fired;
}
static int settle(st_t *s) {
  for (int i = 0; i < R; i++) {
    if (s->rs[i] == RS_NONE || s->rs[i] == RS_released) continue;
    advance_r(s, i);
    if (POLICY == TIMEOUT && ENDED(s, i) && s->rs[i] == RS_quarantined) {
      int e = force_release(s, i);
      if (e) return e;
    }
    if (POLICY == SGLANG && s->phase[i] == REJECTED && sglang_deadline(s, i)) {
      int e = force_release(s, i);
      if (e) return e;
    }
    if (POLICY == COUNTED && ENDED(s, i) && counted_out(s, i)) {
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
/* first-failure (a field bug class): at a transfer reporting FAILED the engine ends the
 * request (a live one is rejected, as vLLM fails a request whose load failed) and frees its
 * blocks at once, whatever its other transfers are doing */
static int free_on_failure(st_t *s, int r) {
  if (s->phase[r] == RELEASED) return 0;
  if (s->phase[r] == LIVE) {
    int e = call(s, r, fire_rejected);
    if (e) return e;
    s->phase[r] = REJECTED;
    advance_r(s, r);
  }
  int e = force_release(s, r);
  return e ? e : settle(s);
}
static int ack(st_t *s, int g, int e) {
  if (POLICY == COUNTED && e >= EV_TC0 && e <= EV_TC0 + T && s->phase[REQ(g)] != RELEASED)
    s->comp[REQ(g)]++;
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

/* defined after the environment: the stored state (cstate.c) and the partial-order reduction
 * (cpor.c) */
static void pack(const st_t *s, unsigned char *out);
static void unpack(const unsigned char *in, st_t *s);
static void canon(st_t *s);
#if KVL_POR
static void choose_and_emit(const st_t *s, void *ctx);
#endif

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
      out(ctx, EVENT(31, g, i), POLICY == FIRST_FAILURE ? free_on_failure(&n, REQ(g)) : 0, &n);
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
