/*
 * kvlifetime's block-lifetime protocol as a Promela model for SPIN: the anchor beside
 * `kvlifetime verify`. The same environment (requests, peers, a faulty control channel, the
 * engine's release policy), the same events with the same enabling rules and fault budgets,
 * the same safety properties; the ledger itself is abstracted to the closing rule of the
 * contract (see "The ledger" below), where `kvlifetime verify` drives the real BlockLedger.
 *
 * Parameters (spin -D...; bench/spin_anchor.py sets them from a `kvlifetime verify` config):
 *   R P B        requests ever admitted, peers, blocks (one block per request)
 *   T            transfers a peer may post per grant (1 or 2)
 *   POLICY       0 naive, 1 timeout, 2 proof, 3 trusting
 *   F_REORDER F_DUP F_DELAY F_LOSS F_CRASH F_FENCE F_TIMEOUT F_RETRY F_FAIL F_LIE   0 or 1
 *   MAXDUP MAXDELAY MAXLOSS MAXCRASH MAXRETRY   the per-kind bounds (1 each by default)
 *   MAXF         fault events of any kind in one run; -1: only the per-kind bounds
 *
 * One process, whose loop takes one event per iteration: every event is a d_step, so one
 * SPIN transition is one event of `kvlifetime verify` and a stored state is a state between
 * events. The loop ends when no event is enabled (a quiet state), where "nothing leaked" is
 * asserted. Sizes up to R=4, P=3, T=2 (the enumeration macros below).
 */

#ifndef R
#define R 2
#endif
#ifndef P
#define P 2
#endif
#ifndef B
#define B 2
#endif
#ifndef T
#define T 1
#endif
#ifndef POLICY
#define POLICY 2
#endif
#ifndef MAXF
#define MAXF (-1)
#endif
#ifndef MAXDUP
#define MAXDUP 1
#endif
#ifndef MAXDELAY
#define MAXDELAY 1
#endif
#ifndef MAXLOSS
#define MAXLOSS 1
#endif
#ifndef MAXCRASH
#define MAXCRASH 1
#endif
#ifndef MAXRETRY
#define MAXRETRY 1
#endif
#ifndef F_REORDER
#define F_REORDER 1
#endif
#ifndef F_DUP
#define F_DUP 1
#endif
#ifndef F_DELAY
#define F_DELAY 1
#endif
#ifndef F_LOSS
#define F_LOSS 1
#endif
#ifndef F_CRASH
#define F_CRASH 1
#endif
#ifndef F_FENCE
#define F_FENCE 1
#endif
#ifndef F_TIMEOUT
#define F_TIMEOUT 1
#endif
#ifndef F_RETRY
#define F_RETRY 1
#endif
#ifndef F_FAIL
#define F_FAIL 1
#endif
#ifndef F_LIE
#define F_LIE 1
#endif

#define NAIVE 0
#define TIMEOUT 1
#define PROOF 2
#define TRUSTING 3

#define G (R * P)       /* grant slots: grant g is request g / P to peer g % P */
#define REQ(g) ((g) / P)
#define PEER(g) ((g) % P)
#define QL 5            /* messages to the ledger on one grant's channel, at most */
#define QC 2            /* cancels to the peer on one grant's channel, at most */

/* owner phases of a request */
#define UNADMITTED 0
#define LIVE 1
#define FINISHED 2
#define REJECTED 3
#define RELEASED 4
#define ENDED(r) (phase[r] == FINISHED || phase[r] == REJECTED)

/* the status of one numbered transfer */
#define NONE 0
#define INFL 1          /* posted: it touches the blocks when it lands */
#define FAILD 2         /* reported FAILED, yet it may still land */
#define LANDED 3        /* landed, and its peer saw it end */
#define UNSEEN 4        /* a FAILED transfer that landed: its peer never learns it ended */

/* a message: kind in bits 0-2, value (last_seq / through_seq) in bits 3-4, not-dupable bit 5,
   delayed bit 6. Kinds to the ledger: */
#define CR 1            /* CancelReceived */
#define SS 2            /* SchedulingStopped(last_seq) */
#define TQ 3            /* TransferQuiesced(through_seq) */
#define TC 4            /* TransferCompleted(last_seq) */
#define CANCEL 5        /* the only kind to the peer */
#define MSG(k, v) ((k) | ((v) << 3))
#define KIND(m) ((m) & 7)
#define VAL(m) (((m) >> 3) & 3)
#define NODUP 32
#define DLY 64

/* ------------------------------------------------------------------ the state

   Packed into bitfields: the state vector is what SPIN stores per state, so its size is what
   bounds the search in memory. Each field is read through the macro named after it. */

byte admitted;                  /* requests admitted so far, in order */
byte phase[R];
bit quar[R];                    /* the ledger quarantined it (sticky until release) */
byte blk[R];                    /* the block it was allocated */
byte gen[B];                    /* generation of each block: bumped when it goes back */
bit bused[B];
byte nheld;                     /* derived: blocks held by requests not released */

/* A grant as its peer and the wire see it: flags, and its cancels re-sent (bits 6-7). */
byte gf[G];
#define GRANTED 1
#define CANCELLED 2             /* the peer received a cancel */
#define STOPPED 4               /* the peer stopped scheduling (and said so) */
#define QSENT 8                 /* TransferQuiesced / TransferCompleted sent */
#define LEASED 16               /* its lease expired */
#define SILENT 32               /* its peer crashed, as this grant sees it */
#define RETRY1 64
#define granted(g) ((gf[g] & GRANTED) != 0)
#define cancelled(g) ((gf[g] & CANCELLED) != 0)
#define stopped(g) ((gf[g] & STOPPED) != 0)
#define qsent(g) ((gf[g] & QSENT) != 0)
#define leased(g) ((gf[g] & LEASED) != 0)
#define silent(g) ((gf[g] & SILENT) != 0)
#define retries(g) (gf[g] >> 6)
#define SETG(g, f) gf[g] = gf[g] | (f)
byte ggen[G];                   /* the generation its write was meant for */
/* The status of each numbered transfer (3 bits per sequence number; seq = index + 1). */
byte tf[G];
#define TR(g, s) ((tf[g] >> (3 * (s))) & 7)
#define SET_TR(g, s, v) tf[g] = (tf[g] & ~(7 << (3 * (s)))) | ((v) << (3 * (s)))
#define ntr(g) ((TR(g, 0) != NONE) + (TR(g, 1) != NONE))  /* transfers posted */

/* The ledger's proof of each grant (forgotten when its request is released): cancel received
   (or anything stronger), access revoked, suspect (a lease expired or the peer was lost),
   last_seq + 1 (0: not proven; bits 3-4), the greatest through_seq proven (bits 5-6). */
byte pf[G];
#define PCR 1
#define PREV 2
#define PSUS 4
#define pcr(g) ((pf[g] & PCR) != 0)
#define prev(g) ((pf[g] & PREV) != 0)
#define psus(g) ((pf[g] & PSUS) != 0)
#define plast(g) ((pf[g] >> 3) & 3)
#define pthr(g) ((pf[g] >> 5) & 3)
#define SETPF(g, f) pf[g] = pf[g] | (f)
#define SET_PLAST(g, v) pf[g] = (pf[g] & 231) | ((v) << 3)
#define SET_PTHR(g, v) pf[g] = (pf[g] & 159) | ((v) << 5)

/* the control channel: one FIFO per grant and direction */
byte lq[G * QL];                /* to the ledger */
byte lqn[G];
byte cq[G * QC];                /* to the peer */
byte cqn[G];
byte nprompt[G];                /* derived: messages of the grant not delayed */

byte peerf[P];
#define CRASHED 1               /* the crash budget is spent on it */
#define FENCED 2
#define LOST 4                  /* PeerLost was reported */
#define crashed(p) ((peerf[p] & CRASHED) != 0)
#define fenced(p) ((peerf[p] & FENCED) != 0)
#define lost(p) ((peerf[p] & LOST) != 0)
#define SETP(p, f) peerf[p] = peerf[p] | (f)

byte dups_left = (F_DUP * MAXDUP);
byte delays_left = (F_DELAY * MAXDELAY);
byte losses_left = (F_LOSS * MAXLOSS);
byte crashes_left = (F_CRASH * MAXCRASH);
short faults_left = MAXF;       /* -1: no total bound */

/* scratch of one step, back to 0 at its end (so it is constant in every stored state) */
byte i_, j_, k_, m_;

/* ------------------------------------------------------------------ derived predicates */

#define CLOSED(g) (prev(g) || (plast(g) > 0 && pthr(g) + 1 >= plast(g)))
#define OPEN(g) (granted(g) && phase[REQ(g)] != RELEASED && !CLOSED(g))
#define PROMPT(g) (nprompt[g] > 0)
#define BUDGET (faults_left != 0)
#define FITS(c) (faults_left < 0 || (c) <= faults_left)

/* The enumeration macros: one option per index in the configured range (the preprocessor
   picks the list; every guard also tests its index, first). */
#define UPTO_1(M) M(0)
#define UPTO_2(M) UPTO_1(M) M(1)
#define UPTO_3(M) UPTO_2(M) M(2)
#define UPTO_4(M) UPTO_3(M) M(3)
#define UPTO_5(M) UPTO_4(M) M(4)
#define UPTO_6(M) UPTO_5(M) M(5)
#define UPTO_7(M) UPTO_6(M) M(6)
#define UPTO_8(M) UPTO_7(M) M(7)
#define UPTO_9(M) UPTO_8(M) M(8)
#define UPTO_10(M) UPTO_9(M) M(9)
#define UPTO_11(M) UPTO_10(M) M(10)
#define UPTO_12(M) UPTO_11(M) M(11)
#define CAT_(a, b) a##b
#define UPTO(n) CAT_(UPTO_, n)
#if R > 4 || P > 3 || T > 2 || R < 1 || P < 1 || B < 1 || T < 1 || MAXRETRY > 3
#error "sizes supported: 1 <= R <= 4, 1 <= P <= 3, 1 <= T <= 2, B >= 1, MAXRETRY <= 3"
#endif
#define EACH_R(M) UPTO(R)(M)
#define EACH_P(M) UPTO(P)(M)
#if R * P == 1
#define EACH_G(M) UPTO_1(M)
#elif R * P == 2
#define EACH_G(M) UPTO_2(M)
#elif R * P == 3
#define EACH_G(M) UPTO_3(M)
#elif R * P == 4
#define EACH_G(M) UPTO_4(M)
#elif R * P == 6
#define EACH_G(M) UPTO_6(M)
#elif R * P == 8
#define EACH_G(M) UPTO_8(M)
#elif R * P == 9
#define EACH_G(M) UPTO_9(M)
#else
#define EACH_G(M) UPTO_12(M)
#endif
#define OR_P(X, r) (X((r) * P) || (P > 1 && X((r) * P + 1)) || (P > 2 && X((r) * P + 2)))
#define OR_PEERS(X) (X(0) || (P > 1 && X(1)) || (P > 2 && X(2)))

#define BLOCKED(r) OR_P(PROMPT, r)
#define ALL_SEEN(g) ((ntr(g) < 1 || TR(g, 0) == LANDED) && \
                     (ntr(g) < 2 || TR(g, 1) == LANDED))
#define MAYCRASH(p) (crashed(p) || (F_CRASH && crashes_left > 0 && BUDGET))

/* The events of a grant (all but its messages and its lease), as `kvlifetime verify` enables
   them: nothing of a grant with a prompt message happens but that message. */
#define GQUIET(g) (granted(g) && !PROMPT(g))
#define CAN_LAND(g, s) (GQUIET(g) && (s) < ntr(g) && \
                        (TR(g, s) == INFL || TR(g, s) == FAILD))
#define CAN_FAIL(g, s) (F_FAIL && GQUIET(g) && (s) < ntr(g) && TR(g, s) == INFL && \
                        !silent(g) && BUDGET)
#define CAN_RETRY(g) (F_RETRY && GQUIET(g) && phase[REQ(g)] == REJECTED && OPEN(g) && \
                      retries(g) < MAXRETRY && BUDGET && cqn[g] == 0)
#define CAN_SILENT(g) (GQUIET(g) && !silent(g) && !(stopped(g) && qsent(g)) && \
                       MAYCRASH(PEER(g)))
#define CAN_POST(g) (GQUIET(g) && !silent(g) && !stopped(g) && ntr(g) < T)
#define CAN_STOP(g) (GQUIET(g) && !silent(g) && cancelled(g) && !stopped(g))
#define CAN_QUIESCE(g) (GQUIET(g) && !silent(g) && stopped(g) && !qsent(g) && ntr(g) > 0 && \
                        ALL_SEEN(g))
#define CAN_COMPLETE(g) (GQUIET(g) && !silent(g) && !cancelled(g) && !stopped(g) && ALL_SEEN(g))
#define GACT(g) (lqn[g] > 0 || cqn[g] > 0 || CAN_LAND(g, 0) || (T > 1 && CAN_LAND(g, 1)) || \
                 CAN_FAIL(g, 0) || (T > 1 && CAN_FAIL(g, 1)) || CAN_RETRY(g) || CAN_SILENT(g) || \
                 CAN_POST(g) || CAN_STOP(g) || CAN_QUIESCE(g) || CAN_COMPLETE(g))
/* Whether anything but a lease may still happen to request r now, or to any peer: a lease
   that expires then is early (the timeout fault); one that expires when nothing else can is
   generous (always allowed, free). */
#define RACT(r) ((phase[r] == LIVE && !BLOCKED(r)) || OR_P(GACT, r))
#define PEER_EV(p) (MAYCRASH(p) && (!lost(p) || (F_FENCE && !fenced(p))))
#define ANY_PEER_EV OR_PEERS(PEER_EV)
#define CAN_LEASE(g) (GQUIET(g) && ENDED(REQ(g)) && OPEN(g) && !leased(g))
#define LEASE_EARLY(g) (RACT(REQ(g)) || ANY_PEER_EV)

/* ------------------------------------------------------------------ the ledger

   An abstraction of BlockLedger to the contract's rules: a grant is closed by AccessRevoked,
   or by SchedulingStopped(N) with TransferQuiesced(>= N) in either order, or by
   TransferCompleted; LeaseExpired / PeerLost only make an open grant suspect; an ended request
   with every grant closed is released (collect_releasable), one with an open suspect grant is
   quarantined; a release bumps the block's generation and forgets the request's grants
   (evidence about them is stale: a no-op). */

inline spend(c) {
  if
  :: faults_left > 0 -> faults_left = faults_left - (c)
  :: else -> skip
  fi
}

inline crash(p) {
  if
  :: !crashed(p) -> SETP(p, CRASHED); crashes_left--
  :: else -> skip
  fi
}

inline release(r) {
  phase[r] = RELEASED;
  quar[r] = 0;
  gen[blk[r]]++;
  bused[blk[r]] = 0;
  nheld--;
  for (k_ : 0 .. P - 1) {
    pf[(r) * P + k_] = 0
  };
  k_ = 0
}

/* The engine around the ledger, after every step that may have changed it: the timeout
   policy's lease reaper frees what is quarantined; every policy frees what is releasable. */
inline settle() {
  for (i_ : 0 .. R - 1) {
    if
    :: ENDED(i_) ->
       m_ = 0;  /* 1: an open grant; 2: an open suspect grant */
       for (j_ : 0 .. P - 1) {
         if
         :: OPEN(i_ * P + j_) && psus(i_ * P + j_) -> m_ = 2
         :: OPEN(i_ * P + j_) && !psus(i_ * P + j_) && m_ == 0 -> m_ = 1
         :: else -> skip
         fi
       };
       if
       :: m_ == 0 -> release(i_)
       :: m_ == 2 -> quar[i_] = 1
       :: else -> skip
       fi;
       if
       :: POLICY == TIMEOUT && phase[i_] != RELEASED && quar[i_] -> release(i_)
       :: else -> skip
       fi
    :: else -> skip
    fi
  };
  i_ = 0; j_ = 0; m_ = 0
}

/* An acknowledgement about grant g, of kind k with value v, as the ledger takes it. Honest
   evidence never contradicts (a failed assertion: a bug of the model, the explorer's
   "ledger_error"); only a lie a trusting receiver believed can make it contradict, and then
   it is refused, a no-op. */
inline ack(g, k, v) {
  if
  :: phase[REQ(g)] == RELEASED -> skip  /* stale: the ledger forgot the grant */
  :: else ->
     if
     :: (k == SS || k == TC) && plast(g) > 0 && plast(g) != (v) + 1 ->
        assert(POLICY == TRUSTING)  /* ledger_error: honest evidence contradicts */
     :: else ->
        if
        :: !OPEN(g) -> skip  /* a closed grant of a live request: a no-op */
        :: else ->
           if
           :: k == CR -> SETPF(g, PCR)
           :: k == SS -> SETPF(g, PCR); SET_PLAST(g, (v) + 1)
           :: k == TQ -> if :: (v) > pthr(g) -> SET_PTHR(g, (v)) :: else -> skip fi
           :: k == TC -> SETPF(g, PCR); SET_PLAST(g, (v) + 1);
                         if :: (v) > pthr(g) -> SET_PTHR(g, (v)) :: else -> skip fi
           fi
        fi
     fi
  fi;
  settle()
}

/* PeerLost(p) marks p's open grants suspect; AccessRevoked(p) closes them. */
inline peer_lost_ev(p) {
  for (j_ : 0 .. R - 1) {
    if :: OPEN(j_ * P + (p)) -> SETPF(j_ * P + (p), PSUS) :: else -> skip fi
  };
  j_ = 0;
  settle()
}

inline revoke_ev(p) {
  for (j_ : 0 .. R - 1) {
    if :: OPEN(j_ * P + (p)) -> SETPF(j_ * P + (p), PREV) :: else -> skip fi
  };
  j_ = 0;
  settle()
}

/* ------------------------------------------------------------------ the environment */

inline send_ledger(g, m) {
  assert(lqn[g] < QL);
  lq[(g) * QL + lqn[g]] = (m);
  lqn[g]++;
  nprompt[g]++
}

inline send_cancel(g) {
  assert(cqn[g] < QC);
  cq[(g) * QC + cqn[g]] = CANCEL;
  cqn[g]++;
  nprompt[g]++
}

/* take message i off grant g's channel to the ledger (take_l) or to the peer (take_c) */
inline take_l(g, i) {
  if :: !(lq[(g) * QL + (i)] & DLY) -> nprompt[g]-- :: else -> skip fi;
  for (k_ : (i) .. QL - 2) { lq[(g) * QL + k_] = lq[(g) * QL + k_ + 1] };
  lq[(g) * QL + QL - 1] = 0;
  lqn[g]--;
  k_ = 0
}

inline take_c(g, i) {
  if :: !(cq[(g) * QC + (i)] & DLY) -> nprompt[g]-- :: else -> skip fi;
  for (k_ : (i) .. QC - 2) { cq[(g) * QC + k_] = cq[(g) * QC + k_ + 1] };
  cq[(g) * QC + QC - 1] = 0;
  cqn[g]--;
  k_ = 0
}

inline deliver_to_peer(g) {
  if
  :: silent(g) -> skip  /* a peer silent on the grant never answers */
  :: else ->
     SETG(g, CANCELLED);
     if
     :: qsent(g) -> send_ledger(g, MSG(TC, ntr(g)))
     :: !qsent(g) && stopped(g) -> send_ledger(g, MSG(SS, ntr(g)))
     :: else -> send_ledger(g, MSG(CR, 0))
     fi
  fi
}

/* Message slot i of grant g's channel to the ledger: deliver, lose, duplicate, delay. A
   message that overtakes an earlier one on its channel (reorder) spends one fault. */
#define LQ_HERE(g, i) ((g) < G && (i) < lqn[(g) % G] && \
                       ((i) == 0 || (F_REORDER && BUDGET)))
#define LQ_OPTS(g, i) \
  :: d_step { (LQ_HERE(g, i) && FITS((i) > 0)) -> \
       spend((i) > 0); m_ = lq[(g) * QL + (i)]; take_l(g, i); \
       ack(g, KIND(m_), VAL(m_)); m_ = 0 } \
  :: d_step { (LQ_HERE(g, i) && losses_left > 0 && FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); losses_left--; take_l(g, i) } \
  :: d_step { (LQ_HERE(g, i) && dups_left > 0 && !(lq[(g) * QL + (i)] & NODUP) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); dups_left--; m_ = lq[(g) * QL + (i)]; \
       if :: !(m_ & DLY) -> nprompt[g]-- :: else -> skip fi; \
       lq[(g) * QL + (i)] = m_ | NODUP | DLY; ack(g, KIND(m_), VAL(m_)); m_ = 0 } \
  :: d_step { (LQ_HERE(g, i) && delays_left > 0 && !(lq[(g) * QL + (i)] & DLY) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); delays_left--; nprompt[g]--; \
       lq[(g) * QL + (i)] = lq[(g) * QL + (i)] | DLY }

#define CQ_HERE(g, i) ((g) < G && (i) < cqn[(g) % G] && \
                       ((i) == 0 || (F_REORDER && BUDGET)))
#define CQ_OPTS(g, i) \
  :: d_step { (CQ_HERE(g, i) && FITS((i) > 0)) -> \
       spend((i) > 0); take_c(g, i); deliver_to_peer(g) } \
  :: d_step { (CQ_HERE(g, i) && losses_left > 0 && FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); losses_left--; take_c(g, i) } \
  :: d_step { (CQ_HERE(g, i) && dups_left > 0 && !(cq[(g) * QC + (i)] & NODUP) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); dups_left--; m_ = cq[(g) * QC + (i)]; \
       if :: !(m_ & DLY) -> nprompt[g]-- :: else -> skip fi; \
       cq[(g) * QC + (i)] = m_ | NODUP | DLY; m_ = 0; deliver_to_peer(g) } \
  :: d_step { (CQ_HERE(g, i) && delays_left > 0 && !(cq[(g) * QC + (i)] & DLY) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); delays_left--; nprompt[g]--; \
       cq[(g) * QC + (i)] = cq[(g) * QC + (i)] | DLY }

/* A write lands: unless its peer was fenced (then it touches nothing), the block must still
   be at the generation it was meant for. */
#define SEQ_OPTS(g, s) \
  :: d_step { ((g) < G && (s) < T && CAN_LAND((g) % G, (s) % T)) -> \
       if :: TR(g, s) == INFL -> SET_TR(g, s, LANDED) \
          :: else -> SET_TR(g, s, UNSEEN) fi; \
       if :: fenced(PEER(g)) -> skip \
          :: else -> assert(gen[blk[REQ(g)]] == ggen[g])  /* isolation */ fi } \
  :: d_step { ((g) < G && (s) < T && CAN_FAIL((g) % G, (s) % T)) -> \
       spend(1); SET_TR(g, s, FAILD) }

/* Without reordering only the head of a channel is ever taken; a second transfer only with
   T = 2. */
#if F_REORDER
#define LQ_ALL(g) LQ_OPTS(g, 0) LQ_OPTS(g, 1) LQ_OPTS(g, 2) LQ_OPTS(g, 3) LQ_OPTS(g, 4)
#define CQ_ALL(g) CQ_OPTS(g, 0) CQ_OPTS(g, 1)
#else
#define LQ_ALL(g) LQ_OPTS(g, 0)
#define CQ_ALL(g) CQ_OPTS(g, 0)
#endif
#if T > 1
#define SEQ_ALL(g) SEQ_OPTS(g, 0) SEQ_OPTS(g, 1)
#else
#define SEQ_ALL(g) SEQ_OPTS(g, 0)
#endif
#define GRANT_OPTS(g) \
  SEQ_ALL(g) LQ_ALL(g) CQ_ALL(g) \
  :: d_step { ((g) < G && CAN_POST((g) % G)) -> SET_TR(g, ntr(g), INFL) } \
  :: d_step { ((g) < G && CAN_STOP((g) % G)) -> \
       SETG(g, STOPPED); send_ledger(g, MSG(SS, ntr(g))) } \
  :: d_step { ((g) < G && CAN_QUIESCE((g) % G)) -> \
       SETG(g, QSENT); send_ledger(g, MSG(TQ, ntr(g))) } \
  :: d_step { ((g) < G && CAN_COMPLETE((g) % G)) -> \
       SETG(g, STOPPED); SETG(g, QSENT); send_ledger(g, MSG(TC, ntr(g))) } \
  :: d_step { ((g) < G && CAN_RETRY((g) % G)) -> \
       spend(1); gf[g] = gf[g] + RETRY1; send_cancel(g) } \
  :: d_step { ((g) < G && CAN_SILENT((g) % G)) -> \
       spend(!crashed(PEER(g))); crash(PEER(g)); SETG(g, SILENT) } \
  :: d_step { ((g) < G && CAN_LEASE((g) % G) && !LEASE_EARLY((g) % G)) -> \
       SETG(g, LEASED); SETPF(g, PSUS); settle() } \
  :: d_step { ((g) < G && F_TIMEOUT && BUDGET && CAN_LEASE((g) % G) && LEASE_EARLY((g) % G)) -> \
       spend(1); SETG(g, LEASED); SETPF(g, PSUS); settle() } \
  LIE_G_OPTS(g)

/* The owner's decisions about a live request with no prompt message. It grants to no peer it
   has seen lost or fenced. Naive: a rejection frees the blocks at once. */
#define GRANT_TO(r, p) \
  :: d_step { ((r) < R && (p) < P && phase[(r) % R] == LIVE && !BLOCKED((r) % R) && \
               !granted(((r) % R) * P + (p) % P) && !lost((p) % P) && !fenced((p) % P)) -> \
       SETG((r) * P + (p), GRANTED); ggen[(r) * P + (p)] = gen[blk[r]] }
#define GRANTS_OF(r) GRANT_TO(r, 0) GRANTS_MORE(r)
#if P == 1
#define GRANTS_MORE(r)
#elif P == 2
#define GRANTS_MORE(r) GRANT_TO(r, 1)
#else
#define GRANTS_MORE(r) GRANT_TO(r, 1) GRANT_TO(r, 2)
#endif
#define REQ_OPTS(r) \
  GRANTS_OF(r) \
  :: d_step { ((r) < R && phase[(r) % R] == LIVE && !BLOCKED((r) % R)) -> \
       phase[r] = FINISHED; settle() } \
  :: d_step { ((r) < R && phase[(r) % R] == LIVE && !BLOCKED((r) % R)) -> \
       phase[r] = REJECTED; \
       for (j_ : 0 .. P - 1) { \
         if :: granted((r) * P + j_) -> send_cancel((r) * P + j_) :: else -> skip fi \
       }; j_ = 0; \
       if :: POLICY == NAIVE -> release(r) :: else -> skip fi; \
       settle() }

/* A crashed peer: its heartbeat fails (PeerLost), it is fenced (AccessRevoked: its later
   writes touch nothing). Its first crash event spends the crash budget. */
#define PEER_OPTS(p) \
  :: d_step { ((p) < P && MAYCRASH((p) % P) && !lost((p) % P)) -> \
       spend(!crashed(p)); crash(p); SETP(p, LOST); peer_lost_ev(p) } \
  :: d_step { ((p) < P && F_FENCE && MAYCRASH((p) % P) && !fenced((p) % P)) -> \
       spend(!crashed(p)); crash(p); SETP(p, FENCED); revoke_ev(p) } \
  LIE_P_OPTS(p)

/* Lies (F_LIE). With provenance (every policy but trusting) the receiver stamps a peer's
   evidence with its connection, and a peer may not claim AccessRevoked, PeerLost or
   LeaseExpired, nor anything about another peer's grant: every lie is refused and changes
   nothing, a self-loop, so it is no transition here (as in `kvlifetime verify`, which sends
   each one to the real ledger to check that). A trusting receiver stamps them local and
   believes them: a believed lie that changes the ledger is a fault (it spends one). */
#if F_LIE && POLICY == TRUSTING
#define LIE_OK ((faults_left != 0))
#define LIE_G_OPTS(g) \
  :: d_step { ((g) < G && LIE_OK && OPEN((g) % G)) -> spend(1); SETPF(g, PREV); settle() } \
  :: d_step { ((g) < G && LIE_OK && OPEN((g) % G) && !psus((g) % G)) -> \
       spend(1); SETPF(g, PSUS); settle() } \
  :: d_step { ((g) < G && P > 1 && LIE_OK && OPEN((g) % G) && !pcr((g) % G)) -> \
       spend(1); SETPF(g, PCR); settle() } \
  :: d_step { ((g) < G && P > 1 && LIE_OK && OPEN((g) % G) && plast((g) % G) == 0) -> \
       spend(1); SETPF(g, PCR); SET_PLAST(g, T + 1); settle() } \
  :: d_step { ((g) < G && P > 1 && LIE_OK && OPEN((g) % G) && pthr((g) % G) < T) -> \
       spend(1); SET_PTHR(g, T); settle() } \
  :: d_step { ((g) < G && P > 1 && LIE_OK && OPEN((g) % G) && \
               (plast((g) % G) == 0 || (plast((g) % G) == T + 1 && pthr((g) % G) < T))) -> \
       spend(1); SETPF(g, PCR); SET_PLAST(g, T + 1); SET_PTHR(g, T); settle() }
#define OPEN_OF(p, r) OPEN((r) * P + (p))
#define HAS_OPEN(p) (OPEN_OF(p, 0) || (R > 1 && OPEN_OF(p, 1)) || (R > 2 && OPEN_OF(p, 2)) || \
                     (R > 3 && OPEN_OF(p, 3)))
#define SUS_OF(p, r) (OPEN((r) * P + (p)) && !psus((r) * P + (p)))
#define HAS_UNSUS(p) (SUS_OF(p, 0) || (R > 1 && SUS_OF(p, 1)) || (R > 2 && SUS_OF(p, 2)) || \
                      (R > 3 && SUS_OF(p, 3)))
#define LIE_P_OPTS(p) \
  :: d_step { ((p) < P && LIE_OK && HAS_OPEN((p) % P)) -> spend(1); revoke_ev(p) } \
  :: d_step { ((p) < P && LIE_OK && HAS_UNSUS((p) % P)) -> spend(1); peer_lost_ev(p) }
#else
#define LIE_G_OPTS(g)
#define LIE_P_OPTS(p)
#endif

active proctype kvlifetime() {
  do
  /* A request is admitted: it takes the free block with the lowest id. No block is owned
     twice. */
  :: d_step { (admitted < R && nheld < B) ->
       for (i_ : 0 .. B - 1) {
         if :: !bused[i_] && m_ == 0 -> m_ = 1; blk[admitted] = i_ :: else -> skip fi
       };
       i_ = 0; m_ = 0;
       for (i_ : 0 .. R - 1) {
         assert(!(i_ < admitted && phase[i_] != RELEASED && blk[i_] == blk[admitted]))
       };
       i_ = 0;
       bused[blk[admitted]] = 1; nheld++;
       phase[admitted] = LIVE;
       admitted++ }
  EACH_R(REQ_OPTS)
  EACH_G(GRANT_OPTS)
  EACH_P(PEER_OPTS)
  :: else -> break
  od;
  skip;
  /* Quiet: nothing can happen any more. Nothing leaked: every block is free, or held by a
     quarantined request. */
  d_step {
    for (i_ : 0 .. R - 1) {
      assert(phase[i_] == UNADMITTED || phase[i_] == RELEASED || quar[i_])
    };
    i_ = 0
  }
}
