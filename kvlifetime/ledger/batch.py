"""The batch calls' helpers: reading a batch once, and a step's holds as one array.

A per-step batch call (``acquire_many``, ``apply_many``, ``finish_many``, ``reject_many``)
reads its argument once (``items``, ``pairs``): the items applied are the items walked, whatever
the caller's sequence (or another thread) does meanwhile. ``acquire_many`` checks every
request's ids as one array (``holds``): one conversion, one range check and one sort for the
step, and each request's part of it is a view (``views``), merged once a long-lived request
holds too many of them (``merge``).

Nothing here holds the ledger's lock or touches its state: these run before the facade takes
the lock, on the caller's values, and hand back validated ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvlifetime import errors, inputs
from kvlifetime.errors import DuplicateBlockIds, show
from kvlifetime.grant import Access, BlockIds, PeerId, RequestKey

HoldAndGrant = (
    tuple[RequestKey, npt.ArrayLike, PeerId] | tuple[RequestKey, npt.ArrayLike, PeerId, Access]
)
"""An item of ``acquire_and_grant_many``: a request, its block ids, the peer, the access."""

_T = TypeVar("_T", bound=np.generic)
_PLAIN = (list, tuple)  # batches holds() flattens without a conversion per request

# A request's holds from acquire_many are views into that step's array of every request's ids:
# past this many, they are merged into one array of its own, so that a long-lived request never
# keeps more than this many steps' arrays alive (memory bounded by the live holds, not by how
# long a request has run).
STEP_VIEWS = 16


def _empty() -> BlockIds:
    return np.empty(0, dtype=np.int64)


def items(batch: object, name: str, what: str) -> Sequence[Any]:
    """A batch call's items: a list or tuple (or another sequence that is not text or a
    mapping), else ``InvalidField`` with nothing changed."""
    t = type(batch)
    if t is tuple:
        return batch  # type: ignore[return-value]
    if isinstance(batch, Sequence) and not issubclass(t, str | bytes | bytearray):
        # One walk (a list copied): the items applied are the items walked, whatever the
        # caller's sequence (or another thread) does meanwhile.
        return inputs.materialised(batch, name)
    raise errors.InvalidField(f"{name} must be a sequence of {what}, got {t.__name__}")


class Holds:
    """``acquire_many``'s argument, validated: each request's key, where its ids start in the
    one array of every request's ids, and how many (``allids``, read-only, in range, no id
    twice within a request); ``repeats`` names the ids several requests take (``None``: every
    id is distinct, the common case)."""

    __slots__ = ("allids", "keys", "lens", "repeats", "starts")

    def __init__(
        self,
        keys: list[RequestKey],
        allids: BlockIds,
        starts: list[int],
        lens: list[int],
        repeats: tuple[int | None, BlockIds, BlockIds, npt.NDArray[np.int64]] | None,
    ) -> None:
        self.keys = keys
        self.allids = allids
        self.starts = starts
        self.lens = lens
        self.repeats = repeats


def hold_and_grant(
    item: object, num_blocks: int, unique: bool
) -> tuple[RequestKey, BlockIds, PeerId, Access]:
    """An item of ``acquire_and_grant_many``, a tuple ``(request, ids, peer)`` (a write grant)
    or ``(request, ids, peer, access)``, validated as ``acquire_and_grant`` validates its
    arguments: ``(request, ids as an array, peer, access)``, else ``InvalidField`` (or the
    block ids' own error)."""
    if type(item) is tuple and len(item) in (3, 4):
        request = inputs.request_key(item[0])
        peer = inputs.peer_id(item[2])
        access = item[3] if len(item) == 4 else Access.WRITE
        inputs.instance(access, Access, "access")
        return request, inputs.block_ids(item[1], num_blocks, unique=unique), peer, access
    raise errors.InvalidField(
        f"an item must be a (request, ids, peer) or (request, ids, peer, access) tuple, got "
        f"{show(item)}"
    )


class FreshGrants:
    """``acquire_and_grant_many``'s items when each is simple (``fresh_grants``): distinct
    valid keys, valid peers, one access for all, every request's ids in one array in range with
    no id twice anywhere in the batch."""

    __slots__ = ("access", "allids", "keys", "lens", "peers", "starts")

    def __init__(
        self,
        keys: list[RequestKey],
        peers: list[PeerId],
        access: Access,
        allids: BlockIds,
        starts: list[int],
        lens: list[int],
    ) -> None:
        self.keys = keys
        self.peers = peers
        self.access = access
        self.allids = allids
        self.starts = starts
        self.lens = lens


def fresh_grants(batch: Sequence[Any], num_blocks: int) -> FreshGrants | None:
    """``batch`` (``acquire_and_grant_many``'s items) as one array when no item can be refused
    for its own values (``None`` otherwise, and the caller takes each item on its own): the
    vectorized path's arguments, checked exactly as the single call checks them."""
    keys: list[RequestKey] = []
    peers: list[PeerId] = []
    values: list[Any] = []
    access: Access | None = None
    try:
        for item in batch:
            if type(item) is not tuple or len(item) not in (3, 4):
                return None
            a = item[3] if len(item) == 4 else Access.WRITE
            if type(a) is not Access or (access is not None and a is not access):
                return None
            access = a
            keys.append(inputs.request_key(item[0]))
            peers.append(inputs.peer_id(item[2]))
            values.append(item[1])
    except errors.KVLifetimeError:
        return None
    if access is None or len(set(keys)) != len(keys):
        return None
    lens = [len(v) if type(v) in _PLAIN else -1 for v in values]
    if -1 in lens:
        if not all(type(v) is np.ndarray and v.ndim == 1 and v.dtype == np.int64 for v in values):
            return None
        lens = [len(v) for v in values]
        parts: list[Any] = values
    else:
        flat = list(chain.from_iterable(values))
        if len(flat) != sum(lens) or not set(map(type, flat)) <= {int}:
            return None
        parts = [flat]
    try:
        allids = concat_ids(parts, num_blocks)
    except errors.KVLifetimeError:
        return None
    if repeats(allids, [len(allids)]) is not None:
        return None  # an id twice: the items decide, each on its own
    starts = [0] * len(keys)
    total = 0
    for i, n in enumerate(lens):
        starts[i] = total
        total += n
    return FreshGrants(keys, peers, access, allids, starts, lens)


def check_mapping(batch: object) -> None:
    """``acquire_many``'s argument is a mapping, else ``InvalidField``."""
    if not isinstance(batch, Mapping):
        raise errors.InvalidField(
            f"holds must be a mapping of request -> block ids, got {type(batch).__name__}"
        )


def holds(batch: Mapping[Any, Any], num_blocks: int) -> Holds | None:
    """``acquire_many``'s mapping of request -> block ids (``check_mapping``), read once and
    validated (``None``: empty). Refused (``InvalidField``, ``BlockOutOfRange``,
    ``InvalidBlockIds``, ``DuplicateBlockIds``) before the ledger is looked at."""
    # One walk, as (key, ids) pairs: a mapping whose keys and values() disagree (or that
    # changes between two walks) cannot pair a request with ids it was not checked with.
    walked = pairs(batch)
    if not walked:
        return None
    # Any until checked below (a compiled build checks a declared element type on every read).
    keys: list[Any]
    keys, values = map(list, zip(*walked, strict=True))
    # Plain int and str keys of a dict are valid as they are (it keeps them distinct);
    # anything else is normalized, and two keys that become one (an IntEnum member and its
    # value; a mapping that names one key twice) are refused.
    if type(batch) is not dict or not all(type(k) is int or (type(k) is str and k) for k in keys):
        keys = [inputs.request_key(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise errors.InvalidField(f"holds names a request twice: {show(keys)}")
    lens = [len(v) if type(v) in _PLAIN else -1 for v in values]
    flat = list(chain.from_iterable(values)) if -1 not in lens else None
    if flat is not None and len(flat) != sum(lens):
        flat = None  # a list changed under us (another thread): take each one's copy below
    if flat is not None and set(map(type, flat)) <= {int}:
        # The common case, a list or tuple of ints per request: one conversion for all.
        allids = concat_ids([flat], num_blocks)
    else:
        parts = [_part(v, num_blocks) for v in values]
        lens = [len(p) for p in parts]
        allids = concat_ids(parts, num_blocks)
    starts = [0] * len(keys)
    total = 0
    for i, n in enumerate(lens):
        starts[i] = total
        total += n
    # One sort finds every repeat: within one request it is DuplicateBlockIds, as in
    # acquire; across requests it is a block taken by two of them (refused where holds are
    # exclusive; counted twice, below the holder limit, where they are shared).
    found = repeats(allids, lens)
    if found is not None and found[0] is not None:
        raise DuplicateBlockIds(
            f"duplicate block ids in one batch of request {show(keys[found[0]])}: "
            f"{found[2][:16].tolist()}"
        )
    return Holds(keys, allids, starts, lens, found)


def _part(value: object, num_blocks: int) -> BlockIds | list[int]:
    """One request's ids for ``holds``: an int64 array or a list of ints are taken as they
    are (checked with the whole batch); anything else through ``inputs.block_ids``, which
    refuses what is not a batch of ids."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype == np.int64:
        return value
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        ints = list(value)
        if all(type(v) is int for v in ints):
            return ints
    return inputs.block_ids(value, num_blocks, unique=False)


def concat_ids(parts: Sequence[BlockIds | list[int]], num_blocks: int) -> BlockIds:
    """The ids of every request of an ``acquire_many``, as one read-only int64 array, refused
    (``BlockOutOfRange``) unless each is in ``[0, num_blocks)``. The parts are int64 arrays
    or lists of ints (``_part``), so the concatenation converts nothing."""
    try:
        if len(parts) == 1:
            arr = np.array(parts[0], dtype=np.int64)
        else:
            arr = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    except OverflowError:
        raise errors.BlockOutOfRange("block ids out of range: beyond int64") from None
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        bad = arr[(arr < 0) | (arr >= num_blocks)]
        raise errors.BlockOutOfRange(
            f"block ids out of range [0, {num_blocks}): {bad[:16].tolist()}"
        )
    arr.flags.writeable = False
    return arr


def merge(batches: list[BlockIds]) -> int:
    """Replace ``batches`` by one read-only array of them all; return how many fewer there are."""
    merged = np.concatenate(batches)
    merged.flags.writeable = False
    fewer = len(batches) - 1
    batches[:] = [merged]
    return fewer


def views(allids: npt.NDArray[_T], starts: list[int], lens: list[int]) -> list[npt.NDArray[_T]]:
    """Each request's part of ``allids`` as a read-only view. When every request takes as many
    blocks (a decode step: one each), the rows of a reshape: numpy makes those views in one
    call, at half the cost of slicing each in Python."""
    k = len(lens)
    width = lens[0]
    if width and k * width == len(allids) and lens.count(width) == k:
        return list(allids.reshape(k, width))
    return [allids[a : a + n] for a, n in zip(starts, lens, strict=True)]


def repeats(
    allids: BlockIds, lens: Sequence[int]
) -> tuple[int | None, BlockIds, BlockIds, npt.NDArray[np.int64]] | None:
    """Repeated ids in ``allids`` (the batches of ``lens`` requests, concatenated). ``None``
    when every id is distinct (the common case: one sort, one comparison). Otherwise
    ``(index of the first request that names an id twice, or None; the ids named by more than
    one request; that request's repeated ids; how many requests name each id)``."""
    if len(allids) < 2:
        return None
    order = np.argsort(allids, kind="stable")
    s = allids[order]
    eq = s[1:] == s[:-1]
    if not np.count_nonzero(eq):
        return None
    seg = np.repeat(np.arange(len(lens), dtype=np.int64), lens)[order]
    same_req = eq & (seg[1:] == seg[:-1])
    if np.count_nonzero(same_req):
        first = int(seg[1:][same_req].min())
        dups = np.unique(s[1:][same_req & (seg[1:] == first)])
        return first, _empty(), dups, np.empty(0, dtype=np.int64)
    ids, times = np.unique(s, return_counts=True)
    multi = times > 1
    return None, ids[multi], _empty(), times[multi].astype(np.int64)


def pairs(batch: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """A mapping as ``(key, value)`` pairs, from one walk of its items (a dict's own, with no
    code of the caller's run; any other mapping's ``items()``). A walk that raises or yields
    something that is not a pair is ``InvalidField``."""
    if type(batch) is dict:
        return list(batch.items())
    try:
        walked = list(batch.items())
    except Exception as e:
        raise errors.InvalidField(
            f"holds could not be read: {type(batch).__name__}.items() raised {type(e).__name__}"
        ) from e
    for p in walked:
        if type(p) is not tuple or len(p) != 2:
            raise errors.InvalidField(
                f"holds.items() must yield (request, block ids) pairs, got {show(p)}"
            )
    return walked
