/* The compiled checker's partial-order reduction (kvlifetime.verify.cenv puts this text after
 * cenv.c and cstate.c): which of a state's successors, collected by cenv.c's out(), are taken. */

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
  /* a believed lie touches any request; the field's bug classes free on what no argument of
   * explore.py covers: expanded in full */
  int full = s->admitted == 0 || nsucc_ < 2 || (POLICY == TRUSTING && F_LIE) ||
             POLICY == FIRST_FAILURE || POLICY == COUNTED;
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
