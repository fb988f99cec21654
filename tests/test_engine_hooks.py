"""Hooks as data (``kvlifetime.integrations.hooks``) and the engine-facts probes
(``kvlifetime.integrations.engine_facts``), on stand-in classes: the one wrapper's three
``when``s, all-or-none application, exact restore; every row of each integration names a handler
its translator has, with the calling convention of its ``when``. The rows on the real engines:
tests/in_vllm/test_vllm_engine_facts.py, tests/in_sglang/test_hooks.py."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest

from kvlifetime.integrations import engine_facts
from kvlifetime.integrations.engine_facts import FIELD, UNPACKS, Fact
from kvlifetime.integrations.hooks import PROCEED, Hook, Patches, When
from kvlifetime.integrations.sglang import facts_v0_5_23
from kvlifetime.integrations.sglang.decode_hooks import DecodeHooks
from kvlifetime.integrations.sglang.prefill_hooks import PrefillHooks
from kvlifetime.integrations.vllm import facts_v0_33

HERE = __name__


class Engine:
    """An engine class with one method per kind of hook."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.entries = [(1, "a", 2.0)]

    def step(self, x: int) -> int:
        self.calls.append(f"step {x}")
        return x * 10

    @classmethod
    def make(cls, x: int) -> str:
        return f"{cls.__name__} {x}"

    def drain(self) -> list[str]:
        out = []
        for request, _, deadline in self.entries:
            out.append(f"{request} {deadline}")
        return out

    def setup(self) -> None:
        self.late = 1


def module_function(x: int, *, flag: bool = False) -> tuple[int, bool]:
    return x, flag


_MODULE_FUNCTION = module_function
_MAKE = Engine.__dict__["make"].__func__


class Handlers:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def skip_odd(self, engine: Engine, x: int) -> Any:
        self.seen.append(("before", x))
        return -1 if x % 2 else PROCEED

    def plus_one(self, engine: Engine, result: int, x: int) -> int:
        self.seen.append(("after", result))
        return result + 1

    def twice(self, engine: Engine, original: Any, x: int) -> int:
        return int(original(engine, x)) + int(original(engine, x))

    def tagged(self, cls: type[Any], x: int) -> Any:
        self.seen.append(("cls", cls))
        return PROCEED

    def keyword(self, x: int, original: Any, *, flag: bool = False) -> Any:
        return original(x, flag=not flag)


def _rows(*pairs: tuple[str, When, str]) -> list[Hook]:
    return [Hook(f"{HERE}:Engine", name, when, "test", handler) for name, when, handler in pairs]


def test_before_runs_first_and_may_answer_instead() -> None:
    patches, h = Patches(), Handlers()
    patches.apply(_rows(("step", "before", "skip_odd")), h)
    try:
        e = Engine()
        assert e.step(2) == 20 and e.calls == ["step 2"]
        assert e.step(3) == -1 and e.calls == ["step 2"]  # the engine's code never ran
    finally:
        patches.restore()


def test_after_gets_the_result_and_around_calls_the_original_itself() -> None:
    cases: list[tuple[When, str, int]] = [("after", "plus_one", 21), ("around", "twice", 40)]
    for when, handler, expected in cases:
        patches = Patches()
        patches.apply(_rows(("step", when, handler)), Handlers())
        try:
            assert Engine().step(2) == expected
        finally:
            patches.restore()


def test_classmethods_and_module_functions() -> None:
    patches, h = Patches(), Handlers()
    patches.apply(
        [
            Hook(f"{HERE}:Engine", "make", "before", "test", "tagged", kind="classmethod"),
            Hook(HERE, "module_function", "around", "test", "keyword", kind="function"),
        ],
        h,
    )
    try:
        assert Engine.make(3) == "Engine 3" and h.seen == [("cls", Engine)]
        assert sys.modules[HERE].module_function(4) == (4, True)
        assert patches.original(HERE, "module_function") is _MODULE_FUNCTION
        assert patches.original(f"{HERE}:Engine", "make") is _MAKE
    finally:
        patches.restore()
    assert sys.modules[HERE].module_function(4) == (4, False)
    with pytest.raises(LookupError):
        patches.original(HERE, "module_function")


def test_all_or_none_and_restore_puts_back_the_exact_originals() -> None:
    before = dict(Engine.__dict__)
    patches = Patches()
    rows = _rows(("step", "before", "skip_odd"), ("drain", "after", "no_such_handler"))
    with pytest.raises(AttributeError):
        patches.apply(rows, Handlers())
    assert dict(Engine.__dict__) == before and list(patches.points()) == []
    with pytest.raises(AttributeError):  # a target the engine does not have
        patches.apply(_rows(("step", "before", "skip_odd"), ("gone", "after", "plus_one")),
                      Handlers())  # fmt: skip
    assert dict(Engine.__dict__) == before
    patches.apply(_rows(("step", "before", "skip_odd"), ("drain", "after", "plus_one")), Handlers())
    assert sorted(name for _, name in patches.points()) == ["drain", "step"]
    assert Engine.__dict__["step"] is not before["step"]
    patches.restore()
    assert dict(Engine.__dict__) == before


@pytest.mark.parametrize(
    ("layout", "found"),
    [(("request", "_", "deadline"), True), (("request", "deadline", "_"), False), (("r",), False)],
)
def test_the_unpacks_probe_reads_a_tuple_layout(layout: tuple[str, ...], found: bool) -> None:
    fact = Fact(f"{HERE}:Engine", "entries", UNPACKS, "a test", "drain", layout)
    assert engine_facts.holds(fact) is found
    assert engine_facts.missing([fact]) == ([] if found else [fact.label])


def test_the_field_probe_reads_a_set_up_method() -> None:
    assert engine_facts.holds(Fact(f"{HERE}:Engine", "late", FIELD, "a test", "setup"))
    assert not engine_facts.holds(Fact(f"{HERE}:Engine", "late", FIELD, "a test"))  # not __init__
    assert engine_facts.holds(Fact(f"{HERE}:Engine", "calls", FIELD, "a test"))


# ----------------------------------------------------------------------- the integrations' rows


@pytest.mark.parametrize(
    ("rows", "translator"),
    [(facts_v0_5_23.DECODE_HOOKS, DecodeHooks), (facts_v0_5_23.PREFILL_HOOKS, PrefillHooks)],
    ids=["decode", "prefill"],
)
def test_every_sglang_row_names_a_handler_with_its_calling_convention(
    rows: tuple[Hook, ...], translator: type[Any]
) -> None:
    assert len({(r.where, r.name) for r in rows}) == len(rows)  # each place once
    for row in rows:
        params = list(inspect.signature(getattr(translator, row.handler)).parameters)
        # self, then the engine's self / cls / first argument, then what the wrapper adds
        assert len(params) >= 2, row
        if row.when == "around":
            assert params[2] == "original", row
        elif row.when == "after":
            assert params[2] not in ("original",), row
    handlers = {r.handler for r in rows}
    assert {r.handler for r in rows} <= set(dir(translator))
    assert len(handlers) == len(rows)


def test_the_vllm_rows_are_methods_of_the_connector_base() -> None:
    """(Each row's handler and the guarded class built from the rows, on the real vLLM:
    tests/in_vllm/test_vllm_engine_facts.py.)"""
    wheres = {r.where.rpartition(":")[2] for r in facts_v0_33.HOOKS}
    assert wheres == {"KVConnectorBase_V1", "SupportsHMA"}
    assert len({r.name for r in facts_v0_33.HOOKS}) == len(facts_v0_33.HOOKS)


def test_sglang_facts_name_the_deferred_tuple_as_the_handlers_read_it() -> None:
    held, released = (f for f in facts_v0_5_23.FACTS if f.how == UNPACKS)
    assert held.layout[facts_v0_5_23.DEFERRED_REQUEST] == "decode_req"
    assert held.layout[facts_v0_5_23.DEFERRED_DEADLINE] == "deadline"
    assert released.layout[1] == "start_time" and released.layout[3] == "idx"
    entry = ("req", 1.0, 5.0, 7, 2)
    assert facts_v0_5_23.without_deadline(entry) == ("req", 1.0, float("inf"), 7, 2)
    start, slot = facts_v0_5_23.held_entry(_Req(), 3.0, 9)[1::2][:2]
    assert (start, slot) == (3.0, 9)  # where the released entry's layout reads them


class _Req:
    kv_receiver = None


def test_the_unpacks_probe_reads_cpython_313s_paired_stores() -> None:
    """CPython 3.13 stores two unpacked names at once (``STORE_FAST_STORE_FAST``): the layout
    read is the same as 3.11's one store each."""
    from types import SimpleNamespace as I

    head = [I(opname="LOAD_ATTR", arg=0, argval="entries"), I(opname="GET_ITER", arg=None,
            argval=None), I(opname="FOR_ITER", arg=9, argval=9)]  # fmt: skip
    py313 = [
        *head,
        I(opname="UNPACK_SEQUENCE", arg=3, argval=3),
        I(opname="STORE_FAST_STORE_FAST", arg=0, argval=("request", "_")),
        I(opname="STORE_FAST", arg=2, argval="deadline"),
    ]
    assert engine_facts.unpacked(py313, "entries") == {("request", "_", "deadline")}
    short = [*head, I(opname="UNPACK_SEQUENCE", arg=3, argval=3),
             I(opname="STORE_FAST", arg=0, argval="request"), I(opname="POP_TOP", arg=None,
             argval=None)]  # fmt: skip
    assert engine_facts.unpacked(short, "entries") == set()
    assert engine_facts.unpacked(py313, "other") == set()


def test_a_hook_target_must_be_the_classs_own() -> None:
    """A row's target inherited from a base class is refused at the facts check (it could not
    be replaced and put back exactly), as ``Patches.apply`` refuses it."""

    class Child(Engine):
        pass

    sys.modules[HERE].Child = Child  # type: ignore[attr-defined]
    try:
        row = Hook(f"{HERE}:Child", "step", "before", "test", "skip_odd")
        assert not engine_facts.holds(row.fact)
        assert engine_facts.holds(Hook(f"{HERE}:Engine", "step", "before", "t", "x").fact)
        with pytest.raises(AttributeError):
            Patches().apply([row], Handlers())
    finally:
        del sys.modules[HERE].Child
