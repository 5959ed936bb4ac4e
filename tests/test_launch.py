"""compileops._launch: the cached Triton launch path of the eager launchers.

On the CPU the real kernels run under the interpreter, where ``launch`` always takes Triton's
normal path; these tests drive the cached path with a stand-in kernel and driver, and check
what it hands to the compiled kernel's launcher. tests/embedding/test_gpu.py runs the real
thing.
"""
import pytest
import torch
from triton import knobs
from triton.runtime.driver import driver

from compileops import _launch


class _Param:
    def __init__(self, name, default=None, has_default=False):
        self.name, self.default, self.has_default = name, default, has_default


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *call):
        self.calls.append(call)


class _FakeJit:
    """What ``launch`` uses of a JITFunction: ``params``, ``device_caches``, ``[grid](...)``."""
    __name__ = "fake_kernel"
    device_caches = {}

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK"),
                       _Param("FLAG", default=False, has_default=True)]
        self.normal_launches = []
        self.compiled = []

    def __getitem__(self, grid):
        def normal(*args, **kwargs):
            self.normal_launches.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return normal


class _FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def cached_path(monkeypatch):
    """The cached path switched on (not interpreting, no hooks, a stand-in driver)."""
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    # Triton 3.6's knobs: empty hook chains when no profiler is attached.
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", knobs.HookChain(reversed=True))
    monkeypatch.setattr(_launch, "enabled", True)
    monkeypatch.setattr(_launch, "_CACHE", {})
    monkeypatch.setattr(driver, "_active", _FakeDriver())
    yield


def test_second_launch_goes_straight_to_the_compiled_kernel(cached_path):
    fn = _FakeJit()
    x = torch.zeros(64)
    _launch.launch(fn, (3,), (x, 40), {"BLOCK": 16}, {"num_warps": 4})
    assert fn.normal_launches == [((3,), (x, 40), {"BLOCK": 16, "num_warps": 4})]
    _launch.launch(fn, (5, 2), (x, 56), {"BLOCK": 16}, {"num_warps": 4})
    assert len(fn.normal_launches) == 1  # no second bind
    (call,) = fn.compiled[0].calls
    # grid padded to 3-D, the current stream, handles, no launch metadata or hooks, then
    # every parameter in signature order: runtime args, constexprs, defaults.
    assert call == (5, 2, 1, 1234, "fn-handle", "packed", None, None, None, x, 56, 16, False)


@pytest.mark.parametrize("change", ["misaligned pointer", "int becomes 1", "int loses 16",
                                    "int past 32 bits", "dtype", "constexpr", "option"])
def test_a_different_specialization_is_a_miss(cached_path, change):
    fn = _FakeJit()
    x = torch.zeros(64)
    args, constexprs, options = [x, 32], {"BLOCK": 16}, {"num_warps": 4}
    _launch.launch(fn, (1,), tuple(args), constexprs, options)
    if change == "misaligned pointer":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int becomes 1":
        args[1] = 1
    elif change == "int loses 16":
        args[1] = 33
    elif change == "int past 32 bits":
        args[1] = 2**32
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float64)
    elif change == "constexpr":
        constexprs = {"BLOCK": 32}
    else:
        options = {"num_warps": 8}
    _launch.launch(fn, (1,), tuple(args), constexprs, options)
    assert len(fn.normal_launches) == 2, "a launch with another specialization reused a kernel"
    assert fn.compiled[0].calls == []


def test_interpreter_hooks_switch_and_other_versions_take_the_normal_path(cached_path,
                                                                          monkeypatch):
    fn = _FakeJit()
    x = torch.zeros(64)
    for setting in ("interpret", "hook", "disabled", "other triton"):
        with monkeypatch.context() as m:
            if setting == "interpret":
                m.setattr(knobs.runtime, "interpret", True)
            elif setting == "hook":
                chain = knobs.HookChain()
                chain.add(lambda *a: None)
                m.setattr(knobs.runtime, "launch_enter_hook", chain)
            elif setting == "disabled":
                m.setattr(_launch, "enabled", False)
            else:
                m.setattr(_launch, "_TRITON_CHECKED", ("9.9.",))
            for _ in range(2):
                _launch.launch(fn, (1,), (x, 32), {"BLOCK": 16}, {})
    assert len(fn.normal_launches) == 8
    assert all(not c.calls for c in fn.compiled)


def test_triton_default_knobs_take_the_cached_path():
    """With Triton's own defaults (no profiler hooks), the cached path is not switched off."""
    assert not _launch._hooked(knobs.runtime.launch_enter_hook)
    assert not _launch._hooked(knobs.runtime.launch_exit_hook)


def test_arguments_of_other_types_are_never_cached(cached_path):
    fn = _FakeJit()
    for _ in range(2):
        _launch.launch(fn, (1,), (object(), 32), {"BLOCK": 16}, {})
    assert len(fn.normal_launches) == 2 and not _launch._CACHE


def test_missing_parameter_is_a_clear_error(cached_path):
    with pytest.raises(TypeError, match="no value for parameter 'BLOCK'"):
        _launch.launch(_FakeJit(), (1,), (torch.zeros(4), 32), {}, {})


def test_host_helpers_match_triton():
    import triton

    for n in range(0, 3000):
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n)
    for a in range(0, 200):
        for b in range(1, 20):
            assert _launch.cdiv(a, b) == triton.cdiv(a, b)


def _specialization_samples():
    x = torch.zeros(64)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
            2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 16, -1, -16, -17, -(2**31), -(2**31) - 1]
    tensors = [x, x[1:], x[2:], x[4:], x[8:], torch.zeros(3, dtype=torch.float64),
               torch.zeros(5, dtype=torch.bfloat16)[1:], torch.zeros(8, dtype=torch.int32),
               torch.zeros(8, dtype=torch.int64)[2:]]
    return ints + tensors + [True, False, None, 0.5, 1.0]


def test_the_launch_key_is_as_fine_as_the_installed_tritons_specialization():
    """Two launches that share a cache key must get the same kernel from Triton: every pair
    of sample arguments with equal ``_arg_key`` has equal Triton specialization (type and
    alignment/divisibility attributes). Runs against whatever Triton is installed, so each
    supported version checks the rules ``_launch`` relies on."""
    from triton._C.libtriton import native_specialize_impl

    backend = pytest.importorskip("triton.backends.nvidia.compiler").CUDABackend
    samples = _specialization_samples()
    seen = {}
    for arg in samples:
        key = _launch._arg_key(arg)
        assert key is not _launch._UNSUPPORTED
        spec = native_specialize_impl(backend, arg, False, True, True)
        if key in seen:
            assert seen[key][1] == spec, (
                f"{seen[key][0]!r} and {arg!r} share the launch key {key} but Triton "
                f"specializes them as {seen[key][1]} and {spec}")
        else:
            seen[key] = (arg, spec)


def test_the_installed_triton_is_one_the_launch_path_was_checked_on():
    """pyproject's triton range and _TRITON_CHECKED move together: a supported Triton that
    silently took the slow path would be a performance bug."""
    import triton

    assert _launch._version_checked(), (
        f"triton {triton.__version__} is not in _launch._TRITON_CHECKED")
