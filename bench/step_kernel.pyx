# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The step path of the step-columnar ledger compiled to C (Cython): issue 32's "compiled
kernel", measured beside ``StepRows`` (mypyc) by ``bench.step_kernel``.

What it covers: the calls a guard makes every scheduler step, on the engine's counts —
``grant_fresh`` (new requests over distinct, checked block ids, one grant each), ``end``
(rejected / finished, then the proof chain), ``prove`` (one claim per grant, every claim kind
and the contradiction rule), ``collect``. The request table (its proof chain and its calls, the
``CHAIN`` and ``CALLS`` of ``ledger.request_rows``, compiled from the specification) is handed
in as data at construction: no rule is written here that is not read from those tables, except
the evidence rules of ``spec.proof.ProofColumns``, written out in C (``_record``).

Requests, grants and what is proven about them are C arrays; keys, the engine's block arrays
and the peers stay Python objects (dicts keyed by them, as in ``StepRows``). Not covered: ids
checked here (``StepLedger._checked`` runs before), a request's later holds, deadlines,
fences, ``force_release``, counters past 255 open grants a block (refused with
OverflowError). ``tests/test_step_kernel.py`` holds it to ``StepRows`` call by call.
"""

from collections import OrderedDict

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t
from cpython.mem cimport PyMem_RawFree, PyMem_RawRealloc
from libc.string cimport memset

cdef enum:
    NS = 8       # request states
    NE = 8       # request events
    MAXR = 4     # rows per (state, event) or per state's chain
    NOSEQ = -1
    C_CANCEL = 1
    C_STOPPED = 2
    C_QUIESCED = 3
    C_COMPLETED = 4
    C_REVOKED = 5
    C_LEASE = 6
    C_LOST = 7
    OPEN = 0
    UNCANCELLED = 1
    RUNNING = 2
    SUSPECT = 3


cdef inline void _grow(void** p, Py_ssize_t size) except *:
    cdef void* q = PyMem_RawRealloc(p[0], size)  # seen by tracemalloc
    if q == NULL:
        raise MemoryError()
    p[0] = q


cdef class StepKernel:
    # the request table
    cdef int32_t chain_n[NS]
    cdef int32_t chain[NS][MAXR][4]
    cdef int32_t calls_n[NS][NE]
    cdef int32_t calls[NS][NE][MAXR][4]
    cdef int32_t initial, quiesced, quarantined, released
    # requests (by slot)
    cdef Py_ssize_t req_cap, nreq
    cdef int8_t* state
    cdef int32_t* ctr  # four a slot: OPEN, UNCANCELLED, RUNNING, SUSPECT
    cdef int32_t* grants_first  # a slot's grants: one here (the step path grants once)
    cdef public dict slot_of
    cdef public list key_of
    cdef list free_slots
    cdef object recently_released
    cdef public dict releasable
    cdef public dict quarantined_at
    # grants (by row)
    cdef Py_ssize_t gr_cap, ngr
    cdef int32_t* greq
    cdef uint8_t* gopen
    cdef uint8_t* gaccess
    cdef uint8_t* gcancel
    cdef uint8_t* grevoked
    cdef uint8_t* gsuspect
    cdef int64_t* glast
    cdef int64_t* gthrough
    cdef int64_t* gserial
    cdef int64_t* gstart  # the grant's blocks: gbase[row][gstart:gstart+glen]
    cdef int64_t* glen
    cdef list gbase
    cdef list gpeer
    cdef list free_rows
    cdef public dict row_of_serial
    cdef public dict by_peer
    cdef int64_t next_serial
    # blocks (the engine's counts, shared with numpy)
    cdef public object sharers_arr, unsettled_arr, readers_arr, generation_arr
    cdef uint16_t[::1] sharers
    cdef uint8_t[::1] unsettled
    cdef uint8_t[::1] readers
    cdef uint32_t[::1] generation
    cdef Py_ssize_t keep_released

    def __cinit__(self):
        self.state = NULL
        self.ctr = NULL
        self.grants_first = NULL
        self.greq = NULL
        self.gopen = NULL
        self.gaccess = NULL
        self.gcancel = NULL
        self.grevoked = NULL
        self.gsuspect = NULL
        self.glast = NULL
        self.gthrough = NULL
        self.gserial = NULL
        self.gstart = NULL
        self.glen = NULL

    def __dealloc__(self):
        PyMem_RawFree(self.state)
        PyMem_RawFree(self.ctr)
        PyMem_RawFree(self.grants_first)
        PyMem_RawFree(self.greq)
        PyMem_RawFree(self.gopen)
        PyMem_RawFree(self.gaccess)
        PyMem_RawFree(self.gcancel)
        PyMem_RawFree(self.grevoked)
        PyMem_RawFree(self.gsuspect)
        PyMem_RawFree(self.glast)
        PyMem_RawFree(self.gthrough)
        PyMem_RawFree(self.gserial)
        PyMem_RawFree(self.gstart)
        PyMem_RawFree(self.glen)

    def __init__(self, chain, calls, int initial, int quiesced, int quarantined, int released,
                 sharers, unsettled, readers, generation, int keep_released):
        """``chain``: per state code, its proof-chain rows in order; ``calls``: (state, event)
        -> rows; a row is (event, counter (-1: none), positive, target). The four per-block
        arrays are the engine's counts (uint16, uint8, uint8, uint32), written in place."""
        cdef int s, e, k, j
        memset(self.chain_n, 0, sizeof(self.chain_n))
        memset(self.calls_n, 0, sizeof(self.calls_n))
        if len(chain) > NS:
            raise ValueError("more request states than the kernel was built for")
        for s, rows in enumerate(chain):
            if len(rows) > MAXR:
                raise ValueError("a state's chain is longer than the kernel was built for")
            self.chain_n[s] = len(rows)
            for k, row in enumerate(rows):
                for j in range(4):
                    self.chain[s][k][j] = int(row[j])
        for (s, e), rows in calls.items():
            if s >= NS or e >= NE or len(rows) > MAXR:
                raise ValueError("a call row past what the kernel was built for")
            self.calls_n[s][e] = len(rows)
            for k, row in enumerate(rows):
                for j in range(4):
                    self.calls[s][e][k][j] = int(row[j])
        self.initial, self.quiesced, self.quarantined, self.released = (
            initial, quiesced, quarantined, released)
        self.slot_of = {}
        self.key_of = []
        self.free_slots = []
        self.recently_released = OrderedDict()
        self.keep_released = keep_released
        self.releasable = {}
        self.quarantined_at = {}
        self.gbase = []
        self.gpeer = []
        self.free_rows = []
        self.row_of_serial = {}
        self.by_peer = {}
        self.next_serial = 1
        self.sharers_arr, self.unsettled_arr, self.readers_arr, self.generation_arr = (
            sharers, unsettled, readers, generation)
        self.sharers = sharers
        self.unsettled = unsettled
        self.readers = readers
        self.generation = generation

    # ---------------------------------------------------------------- rows

    cdef Py_ssize_t _new_slot(self, object key) except -1:
        cdef Py_ssize_t slot
        if self.free_slots:
            slot = self.free_slots.pop()
            self.key_of[slot] = key
        else:
            slot = self.nreq
            if slot == self.req_cap:
                self.req_cap = max(64, 2 * self.req_cap)
                _grow(<void**>&self.state, self.req_cap * sizeof(int8_t))
                _grow(<void**>&self.ctr, 4 * self.req_cap * sizeof(int32_t))
                _grow(<void**>&self.grants_first, self.req_cap * sizeof(int32_t))
            self.nreq += 1
            self.key_of.append(key)
        self.state[slot] = self.initial
        memset(&self.ctr[4 * slot], 0, 4 * sizeof(int32_t))
        self.recently_released.pop(key, None)
        self.slot_of[key] = slot
        return slot

    cdef Py_ssize_t _new_row(self, Py_ssize_t slot) except -1:
        cdef Py_ssize_t row
        if self.free_rows:
            row = self.free_rows.pop()
        else:
            row = self.ngr
            if row == self.gr_cap:
                self.gr_cap = max(64, 2 * self.gr_cap)
                _grow(<void**>&self.greq, self.gr_cap * sizeof(int32_t))
                _grow(<void**>&self.gopen, self.gr_cap)
                _grow(<void**>&self.gaccess, self.gr_cap)
                _grow(<void**>&self.gcancel, self.gr_cap)
                _grow(<void**>&self.grevoked, self.gr_cap)
                _grow(<void**>&self.gsuspect, self.gr_cap)
                _grow(<void**>&self.glast, self.gr_cap * sizeof(int64_t))
                _grow(<void**>&self.gthrough, self.gr_cap * sizeof(int64_t))
                _grow(<void**>&self.gserial, self.gr_cap * sizeof(int64_t))
                _grow(<void**>&self.gstart, self.gr_cap * sizeof(int64_t))
                _grow(<void**>&self.glen, self.gr_cap * sizeof(int64_t))
            self.ngr += 1
            self.gbase.append(None)
            self.gpeer.append(None)
        self.greq[row] = slot
        self.gopen[row] = 1
        self.gcancel[row] = 0
        self.grevoked[row] = 0
        self.gsuspect[row] = 0
        self.glast[row] = NOSEQ
        self.gthrough[row] = 0
        self.gserial[row] = self.next_serial
        self.row_of_serial[self.next_serial] = row
        self.next_serial += 1
        return row

    # ---------------------------------------------------------------- the step calls

    def grant_fresh(self, list keys, object allids, list lens, int access, object peer):
        """New requests of ``keys`` each hold their part of ``allids`` (checked: distinct,
        in range, the engine's per-block rules allow it) with one grant of ``access`` to
        ``peer``: the grants' rows."""
        cdef const int64_t[::1] ids = allids
        cdef Py_ssize_t i, n = ids.shape[0], slot, row, start = 0, ln
        cdef int64_t b
        cdef uint8_t[::1] counts = self.unsettled if access == 1 else self.readers
        for i in range(n):
            b = ids[i]
            if counts[b] == 255:
                raise OverflowError("the kernel counts at most 255 open grants a block")
        for i in range(n):
            b = ids[i]
            self.sharers[b] += 1
            counts[b] += 1
        out = []
        peer_open = self.by_peer.get(peer)
        if peer_open is None:
            peer_open = self.by_peer[peer] = {}
        for i in range(len(keys)):
            ln = lens[i]
            slot = self._new_slot(keys[i])
            row = self._new_row(slot)
            self.grants_first[slot] = row
            self.ctr[4 * slot + OPEN] = 1
            self.ctr[4 * slot + UNCANCELLED] = 1
            self.ctr[4 * slot + RUNNING] = 1
            self.gaccess[row] = access
            self.gbase[row] = allids
            self.gstart[row] = start
            self.glen[row] = ln
            self.gpeer[row] = peer
            peer_open[row] = None
            start += ln
            out.append(row)
        return out

    cdef inline bint _holds(self, Py_ssize_t slot, int32_t counter, int32_t positive):
        cdef int32_t c
        if counter < 0:
            return True
        c = self.ctr[4 * slot + counter]
        return c > 0 if positive else c == 0

    cdef int _fire(self, Py_ssize_t slot, int32_t event, list out) except -2:
        cdef int32_t s = self.state[slot], k
        cdef int32_t n = self.calls_n[s][event]
        if n == 0:
            return -1
        for k in range(n):
            if self._holds(slot, self.calls[s][event][k][1], self.calls[s][event][k][2]):
                self.state[slot] = self.calls[s][event][k][3]
                out.append((slot, self.calls[s][event][k][0], self.calls[s][event][k][3]))
                return 1
        return 0

    cdef int _advance(self, Py_ssize_t slot, list out) except -1:
        cdef bint moved = True
        cdef int32_t s, k, target
        while moved:
            moved = False
            s = self.state[slot]
            for k in range(self.chain_n[s]):
                if self._holds(slot, self.chain[s][k][1], self.chain[s][k][2]):
                    target = self.chain[s][k][3]
                    self.state[slot] = target
                    out.append((slot, self.chain[s][k][0], target))
                    if target == self.quiesced:
                        self.releasable[slot] = None
                    elif target == self.quarantined:
                        self.quarantined_at[slot] = None
                    moved = True
                    break
        return 0

    def end(self, list keys, int event, list out):
        """``event`` for each of ``keys``, then its proof chain: the refused, by position,
        with the name of their error (UnknownRequest, DoubleRelease, IllegalTransition)."""
        cdef Py_ssize_t i, slot
        refused = []
        for i in range(len(keys)):
            key = keys[i]
            s = self.slot_of.get(key)
            if s is None:
                refused.append(
                    (i, "DoubleRelease" if key in self.recently_released else "UnknownRequest"))
                continue
            slot = s
            if self._fire(slot, event, out) != 1:
                refused.append((i, "IllegalTransition"))
                continue
            self._advance(slot, out)
        return refused

    cdef inline bint _closed(self, Py_ssize_t row):
        return self.grevoked[row] or (self.glast[row] != NOSEQ and self.gthrough[row] >= self.glast[row])

    cdef inline bint _stopped(self, Py_ssize_t row):
        return self.grevoked[row] or self.glast[row] != NOSEQ

    cdef inline bint _acked(self, Py_ssize_t row):
        return self.gcancel[row] or self.grevoked[row] or self.glast[row] != NOSEQ

    cdef bint _claim(self, Py_ssize_t row, int code, int64_t seq):
        """``ProofColumns.record``: whether anything new was proven."""
        cdef bint changed
        if code == C_STOPPED or code == C_COMPLETED:
            changed = self.glast[row] == NOSEQ or not self.gcancel[row]
            self.gcancel[row] = 1
            self.glast[row] = seq
            if code == C_COMPLETED and seq > self.gthrough[row]:
                self.gthrough[row] = seq
                changed = True
            return changed
        if code == C_QUIESCED:
            if seq > self.gthrough[row]:
                self.gthrough[row] = seq
                return True
            return False
        if code == C_CANCEL:
            changed = not self.gcancel[row]
            self.gcancel[row] = 1
            return changed
        if code == C_REVOKED:
            changed = not self.grevoked[row]
            self.grevoked[row] = 1
            return changed
        if code == C_LEASE or code == C_LOST:
            if self.gsuspect[row] == 0 and not self._closed(row):
                self.gsuspect[row] = 2 if code == C_LEASE else 3
                return True
        return False

    def prove(self, list rows, int code, list seqs, list out):
        """A claim ``code`` (with ``seqs[i]``) about each grant of ``rows`` (of live
        requests): the positions refused (a contradicting ``last_seq``)."""
        cdef Py_ssize_t i, row, slot, b, j, start, ln
        cdef int64_t seq, last
        cdef bint acked, stopped, suspect
        cdef const int64_t[::1] ids
        cdef uint8_t[::1] counts
        refused = []
        for i in range(len(rows)):
            row = rows[i]
            seq = seqs[i]
            if code == C_STOPPED or code == C_COMPLETED:
                last = self.glast[row]
                if last != NOSEQ and last != seq:
                    refused.append(i)
                    continue
            if not self.gopen[row]:
                continue
            acked = self._acked(row)
            stopped = self._stopped(row)
            suspect = self.gsuspect[row] != 0
            if not self._claim(row, code, seq):
                continue
            slot = self.greq[row]
            if not acked and self._acked(row):
                self.ctr[4 * slot + UNCANCELLED] -= 1
            if not stopped and self._stopped(row):
                self.ctr[4 * slot + RUNNING] -= 1
            if self.gsuspect[row] != 0 and not suspect:
                self.ctr[4 * slot + SUSPECT] += 1
            if self._closed(row):
                self.gopen[row] = 0
                peer = self.gpeer[row]
                peer_open = self.by_peer.get(peer)
                if peer_open is not None:
                    peer_open.pop(row, None)
                    if not peer_open:
                        del self.by_peer[peer]
                self.ctr[4 * slot + OPEN] -= 1
                if self.gsuspect[row] != 0:
                    self.ctr[4 * slot + SUSPECT] -= 1
                ids = self.gbase[row]
                counts = self.unsettled if self.gaccess[row] == 1 else self.readers
                start = self.gstart[row]
                ln = self.glen[row]
                for j in range(start, start + ln):
                    counts[ids[j]] -= 1
            if self.state[slot] != self.initial:
                self._advance(slot, out)
        return refused

    def collect(self, list out):
        """Release every request in transfer_quiesced, in the order they reached it: the
        blocks each held (by key); it and its grant are forgotten."""
        cdef Py_ssize_t slot, row, j, start, ln
        cdef int64_t b
        cdef const int64_t[::1] ids
        if not self.releasable:
            return {}
        slots = list(self.releasable)
        self.releasable.clear()
        released = {}
        rr = self.recently_released
        for s in slots:
            slot = s
            row = self.grants_first[slot]
            base = self.gbase[row]
            ids = base
            start = self.gstart[row]
            ln = self.glen[row]
            for j in range(start, start + ln):
                b = ids[j]
                self.sharers[b] -= 1
                if self.sharers[b] == 0:
                    self.generation[b] += 1
            self._fire(slot, self.released, out)
            key = self.key_of[slot]
            released[key] = base[start:start + ln]
            # forgotten: the key remembered a while, the slot and the row reused
            del self.slot_of[key]
            rr[key] = None
            if len(rr) > self.keep_released:
                rr.popitem(last=False)
            self.quarantined_at.pop(slot, None)
            self.free_slots.append(slot)
            del self.row_of_serial[self.gserial[row]]
            self.gbase[row] = None
            self.free_rows.append(row)
        return released

    # ---------------------------------------------------------------- reads (tests)

    def state_of(self, key):
        return self.state[<Py_ssize_t>self.slot_of[key]]

    def counters_of(self, key):
        cdef Py_ssize_t slot = self.slot_of[key]
        return tuple(self.ctr[4 * slot + k] for k in range(4))

    def is_open(self, Py_ssize_t row):
        return bool(self.gopen[row])

    def proof_of(self, Py_ssize_t row):
        """(cancel received, last_seq, through_seq, revoked, suspect code): ``ProofColumns``'
        columns of ``row``."""
        return (
            bool(self.gcancel[row]), self.glast[row], self.gthrough[row],
            bool(self.grevoked[row]), self.gsuspect[row],
        )
