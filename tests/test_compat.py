"""lowerings/_compat.py absorbs the differences of Inductor's private API between the
supported torch versions. Each version-dependent branch is exercised here with a stand-in for
the object whose API differs, so every branch runs on whichever torch is installed; the
lowering and snapshot tests cover the real objects of the installed version."""
from types import SimpleNamespace

import sympy

from compileops.lowerings import _compat


class _Graph:
    def __init__(self, sizevars):
        self.sizevars = sizevars




def _graph(sizevars):
    """A stand-in graph (only its ``sizevars``) installed as Inductor's current graph."""
    from torch._inductor import virtualized

    return virtualized.V.set_graph_handler(_Graph(sizevars))


def test_size_hint_on_torch_213_and_newer():
    """2.13 renamed sizevars.size_hint to optimization_hint."""
    s = sympy.Symbol("s0")
    sizevars = SimpleNamespace(optimization_hint=lambda e: 48)
    with _graph(sizevars):
        assert _compat.size_hint(s * 3) == 48


def test_size_hint_on_torch_211():
    s = sympy.Symbol("s0")
    sizevars = SimpleNamespace(size_hint=lambda e: 32)
    with _graph(sizevars):
        assert _compat.size_hint(s) == 32


def _guarding_sizevars(**api):
    calls = []

    def record(name, answer):
        def fn(expr):
            calls.append((name, expr))
            return answer
        return fn

    sizevars = SimpleNamespace(statically_known_multiple_of=lambda e, d: False,
                               optimization_hint=lambda e: 64,
                               **{name: record(name, answer) for name, answer in api.items()})
    return sizevars, calls


def test_multiple_of_guards_with_guard_or_false_where_it_exists():
    """Newer torch: guard_or_false installs the guard (and may decline it)."""
    s = sympy.Symbol("s0", integer=True, positive=True)
    sizevars, calls = _guarding_sizevars(guard_or_false=True)
    with _graph(sizevars):
        assert _compat.multiple_of(s, 16)
    assert calls == [("guard_or_false", sympy.Eq(sympy.Mod(s, 16), 0))]
    sizevars, calls = _guarding_sizevars(guard_or_false=False)
    with _graph(sizevars):
        assert not _compat.multiple_of(s, 16)


def test_multiple_of_guards_with_evaluate_expr_on_torch_211():
    s = sympy.Symbol("s0", integer=True, positive=True)
    sizevars, calls = _guarding_sizevars(evaluate_expr=True)
    with _graph(sizevars):
        assert _compat.multiple_of(s, 16)
    assert calls == [("evaluate_expr", sympy.Eq(sympy.Mod(s, 16), 0))]


def test_multiple_of_is_no_without_a_guard_when_the_hint_is_not_a_multiple():
    s = sympy.Symbol("s0", integer=True, positive=True)
    sizevars, calls = _guarding_sizevars(guard_or_false=True)
    sizevars.optimization_hint = lambda e: 65
    with _graph(sizevars):
        assert not _compat.multiple_of(s, 16)
    assert calls == []
    assert _compat.multiple_of(32, 16) and not _compat.multiple_of(33, 16)  # static: no graph


def test_autotune_select_algorithm_unwraps_both_return_forms(monkeypatch):
    """2.11 returns the chosen node; 2.13 and newer a (node, choice) tuple."""
    from torch._inductor import select_algorithm

    node = object()
    for returned in (node, (node, "the choice")):
        monkeypatch.setattr(select_algorithm, "autotune_select_algorithm",
                            lambda *a, returned=returned, **k: returned)
        assert _compat.autotune_select_algorithm("name", [], [], None) is node


def test_is_static_on_ints_sympy_numbers_and_symbols():
    assert _compat.is_static(4) and _compat.is_static(sympy.Integer(4))
    assert not _compat.is_static(sympy.Symbol("s0"))
