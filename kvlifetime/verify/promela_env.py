"""The environment of the generated Promela model: requests, peers, the faulty control channel,
the engine's release policies, and the safety assertions (``kvlifetime.verify.promela``).

This is the part of the model that is no row of the specification: what ``kvlifetime verify``
builds around the ledger (``kvlifetime.verify.events`` / ``semantics`` / ``policies``), the same
events with the same enabling rules and fault budgets. Every mention of the ledger here goes
through a name the generator emits from ``kvlifetime.spec`` (``@@...@@`` below): the request
states (``RS_*``), the transitions (``fire_<event>``, ``advance``), the grant proof
(``pfnext``, ``pfact``, ``CLOSED``, ``CHANGES``), the evidence codes (``EV_*``).

One process, whose loop takes one event per iteration: every event is a d_step, so one SPIN
transition is one event of ``kvlifetime verify`` and a stored state is a state between events.
The loop ends when no event is enabled (a quiet state), where "nothing leaked" is asserted.
"""

from __future__ import annotations

ENVIRONMENT = r"""
#define NAIVE 0
#define TIMEOUT 1
#define PROOF 2
#define TRUSTING 3

#define G (R * P)       /* grant slots: grant g is request g / P to peer g % P */
#define REQ(g) ((g) / P)
#define PEER(g) ((g) % P)
#define QL 5            /* messages to the ledger on one grant's channel, at most */
#define QC 2            /* cancels to the peer on one grant's channel, at most */

/* owner phases of a request (the ledger's own states are RS_*, from the specification) */
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
/* the evidence code (EV_*) of a message kind and value */
#define EVC(k, v) ((k) == CR -> EV_CR : ((k) == SS -> EV_SS + (v) : \
                   ((k) == TQ -> EV_TQ + (v) : EV_TC + (v))))

@@SPEC@@

/* ------------------------------------------------------------------ the state */

byte admitted;                  /* requests admitted so far, in order */
byte phase[R];                  /* the owner's side */
byte rs[R];                     /* the ledger's request state (RS_*; 0: not admitted) */
byte blk[R];                    /* the block it was allocated */
byte gen[B];                    /* generation of each block: bumped when it goes back */
bit bused[B];
byte nheld;                     /* derived: blocks held by requests not released */
bit ledger_error;               /* never set: assert(ledger_error) is "the ledger refused" */

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

/* The ledger's proof of each grant (GrantProof, packed by the generator); forgotten (0) when
   its request is released. */
byte pf[G];

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
byte i_, j_, k_, m_, n_;


/* ------------------------------------------------------------------ derived predicates */

#define OPEN(g) (granted(g) && rs[REQ(g)] != RS_released && !CLOSED(g))
#define PROMPT(g) (nprompt[g] > 0)
#define BUDGET (faults_left != 0)
#define FITS(c) (faults_left < 0 || (c) <= faults_left)

#define BLOCKED(r) (@@ANY_PROMPT_OF_R@@)
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
#define RACT(r) ((phase[r] == LIVE && !BLOCKED(r)) || @@ANY_GACT_OF_R@@)
#define PEER_EV(p) (MAYCRASH(p) && (!lost(p) || (F_FENCE && !fenced(p))))
#define ANY_PEER_EV (@@ANY_PEER_EV@@)
#define CAN_LEASE(g) (GQUIET(g) && ENDED(REQ(g)) && OPEN(g) && !leased(g))
#define LEASE_EARLY(g) (RACT(REQ(g)) || ANY_PEER_EV)

@@SPEC_INLINES@@

/* ------------------------------------------------------------------ the ledger's calls

   The ledger's request transitions are the specification's rows (fire_<event>, advance, above);
   what follows is what the ledger does around them (kvlifetime.ledger): evidence for a released
   request is stale and for a closed grant a no-op; a release bumps the block's generation and
   forgets the request's grants; and the engine's release policy around the ledger. */

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

/* the ledger lets the request's block go back to the pool, generation + 1 */
inline let_go(r) {
  phase[r] = RELEASED;
  gen[blk[r]]++;
  bused[blk[r]] = 0;
  nheld--;
  for (k_ : 0 .. P - 1) {
    pf[(r) * P + k_] = 0
  };
  k_ = 0
}

/* BlockLedger.force_release: an ordinary release once transfer_quiesced, else unsafe */
inline force_release(r) {
  if
  :: rs[r] == RS_transfer_quiesced -> fire_released(r)
  :: else -> fire_force_released(r)
  fi;
  let_go(r)
}

/* The engine around the ledger, after every step that may have changed it: the ledger fires
   the evidence-driven transitions; the timeout policy's lease reaper frees what is
   quarantined; every policy frees what is releasable (collect_releasable). */
inline settle() {
  for (i_ : 0 .. R - 1) {
    if
    :: rs[i_] != RS_NONE && rs[i_] != RS_released ->
       advance(i_);
       if
       :: POLICY == TIMEOUT && ENDED(i_) && rs[i_] == RS_quarantined -> force_release(i_)
       :: else -> skip
       fi;
       if
       :: rs[i_] == RS_transfer_quiesced -> fire_released(i_); let_go(i_)
       :: else -> skip
       fi
    :: else -> skip
    fi
  };
  i_ = 0
}

/* Evidence about grant g (code e), as the ledger takes it: stale (its request released) or
   about a closed grant, a no-op; contradicting what is proven, refused. */
inline ack(g, e) {
  if
  :: rs[REQ(g)] == RS_released -> skip  /* stale: the ledger forgot the grant */
  :: else ->
     pf_next(g, e);
     if
     :: n_ == CONTRA -> @@ON_CONTRA@@
     :: n_ != CONTRA && !OPEN(g) -> skip  /* a closed grant of a live request: a no-op */
     :: else -> pf_set(g)
     fi;
     n_ = 0
  fi;
  settle()
}

/* PeerLost(p) marks p's open grants suspect; AccessRevoked(p) closes them. */
inline peer_lost_ev(p) {
  for (j_ : 0 .. R - 1) {
    if
    :: OPEN(j_ * P + (p)) -> pf_next(j_ * P + (p), EV_SUSPECT); pf_set(j_ * P + (p))
    :: else -> skip
    fi
  };
  j_ = 0; n_ = 0;
  settle()
}

inline revoke_ev(p) {
  for (j_ : 0 .. R - 1) {
    if
    :: OPEN(j_ * P + (p)) -> pf_next(j_ * P + (p), EV_AR); pf_set(j_ * P + (p))
    :: else -> skip
    fi
  };
  j_ = 0; n_ = 0;
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
   message that overtakes an earlier one on its channel (reorder) spends one fault. Of
   identical messages (same kind, value and marks) only the first is taken, as
   `kvlifetime verify` takes them (events._deliverable): the others lead to the same states
   up to the order of identical messages. */
#define NEQ_L(g, i, j) ((j) >= (i) || lq[(g) * QL + (j)] != lq[(g) * QL + (i)])
#define FIRST_L(g, i) (NEQ_L(g, i, 0) && NEQ_L(g, i, 1) && NEQ_L(g, i, 2) && NEQ_L(g, i, 3))
#define LQ_HERE(g, i) ((i) < lqn[g] && ((i) == 0 || (F_REORDER && BUDGET && FIRST_L(g, i))))
#define LQ_OPTS(g, i) \
  :: d_step { (LQ_HERE(g, i) && FITS((i) > 0)) -> \
       spend((i) > 0); m_ = lq[(g) * QL + (i)]; take_l(g, i); \
       ack(g, EVC(KIND(m_), VAL(m_))); m_ = 0 @@STEP_END@@ } \
  :: d_step { (LQ_HERE(g, i) && losses_left > 0 && FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); losses_left--; take_l(g, i) @@STEP_END@@ } \
  :: d_step { (LQ_HERE(g, i) && dups_left > 0 && !(lq[(g) * QL + (i)] & NODUP) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); dups_left--; m_ = lq[(g) * QL + (i)]; \
       if :: !(m_ & DLY) -> nprompt[g]-- :: else -> skip fi; \
       lq[(g) * QL + (i)] = m_ | NODUP | DLY; ack(g, EVC(KIND(m_), VAL(m_))); m_ = 0 \
       @@STEP_END@@ } \
  :: d_step { (LQ_HERE(g, i) && delays_left > 0 && !(lq[(g) * QL + (i)] & DLY) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); delays_left--; nprompt[g]--; \
       lq[(g) * QL + (i)] = lq[(g) * QL + (i)] | DLY @@STEP_END@@ }

#define FIRST_C(g, i) ((i) == 0 || cq[(g) * QC] != cq[(g) * QC + (i)])
#define CQ_HERE(g, i) ((i) < cqn[g] && ((i) == 0 || (F_REORDER && BUDGET && FIRST_C(g, i))))
#define CQ_OPTS(g, i) \
  :: d_step { (CQ_HERE(g, i) && FITS((i) > 0)) -> \
       spend((i) > 0); take_c(g, i); deliver_to_peer(g) @@STEP_END@@ } \
  :: d_step { (CQ_HERE(g, i) && losses_left > 0 && FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); losses_left--; take_c(g, i) @@STEP_END@@ } \
  :: d_step { (CQ_HERE(g, i) && dups_left > 0 && !(cq[(g) * QC + (i)] & NODUP) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); dups_left--; m_ = cq[(g) * QC + (i)]; \
       if :: !(m_ & DLY) -> nprompt[g]-- :: else -> skip fi; \
       cq[(g) * QC + (i)] = m_ | NODUP | DLY; m_ = 0; deliver_to_peer(g) @@STEP_END@@ } \
  :: d_step { (CQ_HERE(g, i) && delays_left > 0 && !(cq[(g) * QC + (i)] & DLY) && \
               FITS(((i) > 0) + 1)) -> \
       spend(((i) > 0) + 1); delays_left--; nprompt[g]--; \
       cq[(g) * QC + (i)] = cq[(g) * QC + (i)] | DLY @@STEP_END@@ }

/* A write lands: unless its peer was fenced (then it touches nothing), the block must still
   be at the generation it was meant for. */
#define SEQ_OPTS(g, s) \
  :: d_step { (CAN_LAND(g, s)) -> \
       if :: TR(g, s) == INFL -> SET_TR(g, s, LANDED) \
          :: else -> SET_TR(g, s, UNSEEN) fi; \
       if :: fenced(PEER(g)) -> skip \
          :: else -> assert(gen[blk[REQ(g)]] == ggen[g])  /* isolation */ fi @@STEP_END@@ } \
  :: d_step { (CAN_FAIL(g, s)) -> \
       spend(1); SET_TR(g, s, FAILD) @@STEP_END@@ }

/* The events of grant g. */
#define GRANT_OPTS(g) \
  :: d_step { (CAN_POST(g)) -> SET_TR(g, ntr(g), INFL) @@STEP_END@@ } \
  :: d_step { (CAN_STOP(g)) -> \
       SETG(g, STOPPED); send_ledger(g, MSG(SS, ntr(g))) @@STEP_END@@ } \
  :: d_step { (CAN_QUIESCE(g)) -> \
       SETG(g, QSENT); send_ledger(g, MSG(TQ, ntr(g))) @@STEP_END@@ } \
  :: d_step { (CAN_COMPLETE(g)) -> \
       SETG(g, STOPPED); SETG(g, QSENT); send_ledger(g, MSG(TC, ntr(g))) @@STEP_END@@ } \
  :: d_step { (CAN_RETRY(g)) -> \
       spend(1); gf[g] = gf[g] + RETRY1; send_cancel(g) @@STEP_END@@ } \
  :: d_step { (CAN_SILENT(g)) -> \
       spend(!crashed(PEER(g))); crash(PEER(g)); SETG(g, SILENT) @@STEP_END@@ } \
  :: d_step { (CAN_LEASE(g) && !LEASE_EARLY(g)) -> \
       SETG(g, LEASED); pf_next(g, EV_SUSPECT); pf_set(g); n_ = 0; settle() @@STEP_END@@ } \
  :: d_step { (F_TIMEOUT && BUDGET && CAN_LEASE(g) && LEASE_EARLY(g)) -> \
       spend(1); SETG(g, LEASED); pf_next(g, EV_SUSPECT); pf_set(g); n_ = 0; settle() \
       @@STEP_END@@ }

/* The owner grants request r's blocks to peer p: never to a peer it has seen lost or fenced. */
#define GRANT_TO(r, p) \
  :: d_step { (phase[r] == LIVE && !BLOCKED(r) && !granted((r) * P + (p)) && !lost(p) && \
               !fenced(p)) -> \
       SETG((r) * P + (p), GRANTED); ggen[(r) * P + (p)] = gen[blk[r]] @@STEP_END@@ }

/* The owner's decisions about a live request with no prompt message. Naive: a rejection
   frees the blocks at once (force_release). */
#define REQ_OPTS(r) \
  :: d_step { (phase[r] == LIVE && !BLOCKED(r)) -> \
       phase[r] = FINISHED; fire_finished(r); advance(r); settle() @@STEP_END@@ } \
  :: d_step { (phase[r] == LIVE && !BLOCKED(r)) -> \
       phase[r] = REJECTED; fire_rejected(r); advance(r); \
       for (j_ : 0 .. P - 1) { \
         if :: granted((r) * P + j_) -> send_cancel((r) * P + j_) :: else -> skip fi \
       }; j_ = 0; \
       if :: POLICY == NAIVE -> force_release(r) :: else -> skip fi; \
       settle() @@STEP_END@@ }

/* A crashed peer: its heartbeat fails (PeerLost), it is fenced (AccessRevoked: its later
   writes touch nothing). Its first crash event spends the crash budget. */
#define PEER_OPTS(p) \
  :: d_step { (MAYCRASH(p) && !lost(p)) -> \
       spend(!crashed(p)); crash(p); SETP(p, LOST); peer_lost_ev(p) @@STEP_END@@ } \
  :: d_step { (F_FENCE && MAYCRASH(p) && !fenced(p)) -> \
       spend(!crashed(p)); crash(p); SETP(p, FENCED); revoke_ev(p) @@STEP_END@@ }

/* Lies (F_LIE). With provenance (every policy but trusting) the receiver stamps a peer's
   evidence with its connection, and a peer may not claim AccessRevoked, PeerLost or
   LeaseExpired, nor anything about another peer's grant: every lie is refused and changes
   nothing, a self-loop, so it is no transition here (as in `kvlifetime verify`, which sends
   each one to the real ledger to check that). A trusting receiver believes them: a believed
   lie that changes the ledger is a fault (it spends one); one the ledger refuses as
   contradicting, or that proves nothing new, is a self-loop, left out too. */
#define LIE_OK (F_LIE && POLICY == TRUSTING && faults_left != 0)
#define LIE_CHANGES(g, e) (OPEN(g) && CHANGES(g, e))
#define LIE_G(g, e) \
  :: d_step { (LIE_OK && LIE_CHANGES(g, e)) -> \
       spend(1); pf_next(g, e); pf_set(g); n_ = 0; settle() @@STEP_END@@ }
#define LIE_P(p) \
  :: d_step { (LIE_OK && (@@ANY_OPEN_OF_P@@)) -> spend(1); revoke_ev(p) @@STEP_END@@ } \
  :: d_step { (LIE_OK && (@@ANY_UNSUSPECT_OF_P@@)) -> spend(1); peer_lost_ev(p) @@STEP_END@@ }

@@PRINT_STATE@@

active proctype kvlifetime() {
@@FIRST@@
  do
@@LOOP@@
  od;
  skip;
  /* Quiet: nothing can happen any more. Nothing leaked: every block is free, or held by a
     quarantined request. */
  d_step {
    for (i_ : 0 .. R - 1) {
      assert(phase[i_] == UNADMITTED || phase[i_] == RELEASED || rs[i_] == RS_quarantined)
    };
    i_ = 0
  }
}
"""
"""The environment's Promela text. ``@@NAME@@`` marks what ``kvlifetime.verify.promela``
fills in: the specification's part, the enumerations over the configuration's requests, peers
and grants, and the optional state print of ``project=True``."""

ADMIT = r"""
  /* A request is admitted: the ledger takes it (the specification's initial state) with the
     free block with the lowest id. No block is owned twice. */
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
       rs[admitted] = RS_INITIAL;
       admitted++ @@STEP_END@@ }"""
"""The admission event (the loop's first option)."""
