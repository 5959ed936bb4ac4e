"""use_backend() reaches the backward even when autograd runs it on another thread.

On CUDA, autograd runs the backward on its device thread, which does not see the context
variable use_backend() sets; each op's forward records the forced backend and its backward
re-enters it (compileops.backends.keep_forward_backend). A fresh thread on CPU shows the same
gap (new threads start with empty context variables), so this is tested here. That holds for
the custom ops and for the package's torch.autograd.Function subclasses
(backends.keeps_forward_backend).

One use_backend instance may also be shared: a decorator run by several threads or asyncio
tasks at once, nested in itself, left by an exception. Each thread and task must see its own
blocks only (property-tested on drawn interleavings, tests/fuzzing.py backend_schedules)."""
import asyncio
import contextlib
import importlib
import threading

import pytest
import torch
from hypothesis import given

import compileops
from compileops import backends
from tests import fuzzing


def _run_in_thread(fn):
    errors = []

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (reraised below)
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _cases():
    ids = torch.tensor([[1, 3, 1]])
    yield "embedding", lambda: compileops.embedding(ids, torch.randn(5, 4, requires_grad=True))
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 4, 8, requires_grad=True)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    yield "grouped_linear", lambda: compileops.grouped_linear(x, w, offs)
    yield "grouped_linear_swiglu", lambda: compileops.grouped_linear_swiglu(x, w, offs)
    scale = torch.rand(6, requires_grad=True)
    yield "grouped_linear_row_scale", lambda: compileops.grouped_linear(x, w, offs, row_scale=scale)
    x64, w64, scale64 = (t.detach().double().requires_grad_() for t in (x, w, scale))
    # fp64 runs on the reference backend only: a backward that lost it fails outright.
    yield "grouped_linear_row_scale_fp64", lambda: compileops.grouped_linear(
        x64, w64, offs, row_scale=scale64)
    ids = torch.tensor([[0, 1], [1, 0], [0, 0]])

    def routed():
        xs, order, offsets = compileops.grouped_linear.permute_by_expert(x[:3], ids, 2)
        y = compileops.grouped_linear(xs, w, offsets)
        return compileops.grouped_linear.unpermute_and_combine(y, order, torch.rand(3, 2))

    yield "routing", routed
    q = torch.randn(1, 1, 5, 4, requires_grad=True)
    gates = torch.randn(1, 1, 5, requires_grad=True)
    yield "mlstm", lambda: compileops.mlstm(q, q, q, gates, gates, norm_weight=torch.ones(4))


@pytest.mark.parametrize("case", [name for name, _ in _cases()])
def test_forced_backend_reaches_a_backward_on_another_thread(case, monkeypatch):
    forward = dict(_cases())[case]
    seen = []
    real = backends.select

    def spy(op, device):
        chosen = real(op, device)
        seen.append((op, chosen))
        return chosen

    monkeypatch.setattr(backends, "select", spy)
    with compileops.use_backend("reference"):
        out = forward()
    seen.clear()
    _run_in_thread(lambda: out.float().sum().backward())
    assert seen, "the backward selected no backend"
    assert all(chosen == "reference" for _, chosen in seen), seen


def _autograd_functions(cls=torch.autograd.Function):
    for sub in cls.__subclasses__():
        yield sub
        yield from _autograd_functions(sub)


def test_every_autograd_function_keeps_the_forward_backend():
    # A torch.autograd.Function of the package must run its backward under the forward's
    # forced backend, as the custom ops' (backends.register_autograd) do.
    importlib.import_module("compileops.grouped_linear.scaled")  # imported lazily otherwise
    ours = {c for c in _autograd_functions() if c.__module__.startswith("compileops.")}
    assert any(c.__name__ == "_RowScaledGroupedLinear" for c in ours)
    missing = sorted(f"{c.__module__}.{c.__qualname__}" for c in ours
                     if not vars(c).get("keeps_forward_backend"))
    assert not missing, f"not decorated with backends.keeps_forward_backend: {missing}"


# ---------------------------------------------------------------------------------------
# One use_backend instance shared by threads and asyncio tasks


class _Boom(Exception):
    """Raised inside a block to leave it by an exception."""


def _forced():
    return backends._forced.get()


class _Turns:
    """Lets workers take steps in a drawn order: a worker holds the turn from its ``take`` to
    its next ``take`` (or ``release``), so the steps never overlap and the interleaving is the
    schedule's. A failing worker aborts the rest instead of leaving them waiting."""

    def __init__(self, schedule):
        self.schedule, self.pos, self.holder, self.aborted = list(schedule), 0, None, False
        self.cond = threading.Condition()

    def _mine(self, worker) -> bool:
        return self.aborted or (self.pos < len(self.schedule) and self.schedule[self.pos] == worker)

    def release(self, worker) -> None:
        with self.cond:
            if self.holder == worker:
                self.pos, self.holder = self.pos + 1, None
                self.cond.notify_all()

    def take(self, worker) -> None:
        self.release(worker)
        with self.cond:
            assert self.cond.wait_for(lambda: self._mine(worker), timeout=60), "schedule stuck"
            assert not self.aborted, "another worker failed"
            self.holder = worker

    async def take_async(self, worker) -> None:
        self.release(worker)
        while not self._mine(worker):
            await asyncio.sleep(0)
        assert not self.aborted, "another worker failed"
        self.holder = worker

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


def _pool():
    # Two instances of one name, so sharing and re-entering both happen.
    return [compileops.use_backend(name) for name in ("reference", "triton", "reference")]


def _run_blocks_in_thread(blocks, pool, turns, me, outer):
    for block in blocks:
        with contextlib.suppress(_Boom):
            _run_block_in_thread(block, pool, turns, me, outer)
        assert _forced() == outer, f"worker {me}: leaving a block did not restore {outer!r}"


def _run_block_in_thread(block, pool, turns, me, outer):
    index, form, raises, children = block
    inside = pool[index].name
    turns.take(me)  # the entry step

    def body():
        assert _forced() == inside, f"worker {me}: {_forced()!r} forced, want {inside!r}"
        _run_blocks_in_thread(children, pool, turns, me, inside)
        turns.take(me)  # the exit step
        assert _forced() == inside, f"worker {me}: {_forced()!r} forced, want {inside!r}"
        if raises:
            raise _Boom()

    if form == "with":
        with pool[index]:
            body()
    else:
        pool[index](body)()


async def _run_blocks_in_task(blocks, pool, turns, me, outer):
    for block in blocks:
        with contextlib.suppress(_Boom):
            await _run_block_in_task(block, pool, turns, me, outer)
        assert _forced() == outer, f"task {me}: leaving a block did not restore {outer!r}"


async def _run_block_in_task(block, pool, turns, me, outer):
    index, form, raises, children = block
    inside = pool[index].name
    await turns.take_async(me)

    async def body():
        assert _forced() == inside, f"task {me}: {_forced()!r} forced, want {inside!r}"
        await _run_blocks_in_task(children, pool, turns, me, inside)
        await turns.take_async(me)
        assert _forced() == inside, f"task {me}: {_forced()!r} forced, want {inside!r}"
        if raises:
            raise _Boom()

    if form == "with":
        with pool[index]:
            await body()
    else:
        await pool[index](body)()


@given(fuzzing.backend_schedules())
def test_one_instance_shared_by_threads_nests_and_restores(program):
    programs, schedule = program
    pool, turns = _pool(), _Turns(schedule)
    errors = []

    def worker(me):
        try:
            _run_blocks_in_thread(programs[me], pool, turns, me, None)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            turns.abort()
        finally:
            turns.release(me)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert _forced() is None


@given(fuzzing.backend_schedules())
def test_one_instance_shared_by_asyncio_tasks_nests_and_restores(program):
    programs, schedule = program
    pool, turns = _pool(), _Turns(schedule)

    async def worker(me):
        try:
            await _run_blocks_in_task(programs[me], pool, turns, me, None)
        except BaseException:
            turns.abort()
            raise
        finally:
            turns.release(me)

    async def main():
        await asyncio.gather(*(worker(w) for w in range(len(programs))))

    asyncio.run(main())
    assert _forced() is None


def test_decorator_shared_by_two_threads_runs_both_forced():
    # As reported: both threads inside one decorated function at once, and the first one in
    # leaves first.
    first_in, second_in, first_out = (threading.Event() for _ in range(3))
    seen, errors = {}, []

    @compileops.use_backend("reference")
    def work(role):
        seen[role] = backends.select("grouped_linear", "cpu")
        if role == "first":
            first_in.set()
            assert second_in.wait(30)
        else:
            second_in.set()
            assert first_out.wait(30)

    def target(role):
        try:
            if role == "second":
                assert first_in.wait(30)
            work(role)
            seen[role + " after"] = _forced()
        except BaseException as e:  # noqa: BLE001 (reraised below)
            errors.append(e)
        finally:
            if role == "first":
                first_out.set()

    threads = [threading.Thread(target=target, args=(role,)) for role in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == {"first": "reference", "second": "reference", "first after": None,
                    "second after": None}


def test_async_with_and_async_decorator():
    force = compileops.use_backend("reference")

    @force
    async def decorated():
        await asyncio.sleep(0)
        return _forced()

    async def main():
        assert _forced() is None
        async with force:
            await asyncio.sleep(0)
            inside = _forced()
        return inside, await decorated(), _forced()

    assert asyncio.run(main()) == ("reference", "reference", None)


def test_an_exception_leaves_the_block_and_restores_the_outer_backend():
    force = compileops.use_backend("reference")
    with compileops.use_backend("triton"):
        with pytest.raises(_Boom):
            with force:
                with force:
                    raise _Boom()
        assert _forced() == "triton"
    assert _forced() is None


def test_leaving_a_block_that_was_not_entered_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not entered in this thread"):
        compileops.use_backend("reference").__exit__(None, None, None)
