"""Inductor lowerings for the compileops ops.

Installed as ``compileops.lowerings`` (the source tree keeps it beside ``compileops/``).
``install()`` registers every lowering (idempotent). Users never need to call it:
``import compileops`` arms :func:`install_on_inductor_import`, which runs ``install()`` right
after ``torch._inductor.lowering`` finishes importing (or at once if it already has). That
keeps ``import compileops`` free of the multi-second Inductor import while guaranteeing the
lowerings exist before Inductor lowers its first graph.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import pathlib
import sys
import threading

_INDUCTOR_LOWERING_MODULE = "torch._inductor.lowering"

_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Register every compileops lowering with Inductor. Safe to call more than once."""
    global _installed
    if _installed:
        return
    # Load Inductor's lowering table before taking the lock: if our import hook is armed,
    # that import itself calls install() (which then does the work) and must not deadlock.
    from compileops.lowerings import _compat

    _compat.load_inductor_lowerings()
    with _install_lock:
        if _installed:
            return
        from compileops.lowerings import (
            embedding,
            grouped_linear,
            grouped_linear_fp8,
            mlstm,
            user_patterns,
        )

        embedding.register()
        grouped_linear.register()
        grouped_linear_fp8.register()
        mlstm.register()
        user_patterns.register()
        _tag_compile_cache()
        _installed = True


def source_fingerprint() -> str:
    """Hash of every compileops/lowerings source file (kernels, lowerings, templates)."""
    import compileops

    digest = hashlib.sha256()
    # This package installs as compileops.lowerings; in a source checkout it sits beside
    # compileops/ rather than inside it, so each root is found from its own module (and in
    # an installed wheel the second root lies inside the first: its files count once).
    seen = set()
    for root in (pathlib.Path(compileops.__file__).parent, pathlib.Path(__file__).parent):
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".jinja")):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _tag_compile_cache() -> None:
    """Put our sources into torch.compile's cache key.

    Inductor's on-disk caches key on the FX graph, torch and the config, not on our lowering
    code: after an upgrade of compileops a cached graph would keep running the old kernels
    (seen: a stale kernel served after the CPU bounds check changed). The public
    ``torch.compiler.config.cache_key_tag`` enters the key, so we append our fingerprint to
    whatever tag the user set.
    """
    import torch.compiler

    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return
    ours = f"compileops-{source_fingerprint()}"
    if ours not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}+{ours}" if config.cache_key_tag else ours


def is_installed() -> bool:
    return _installed


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of Inductor's lowering module so that
    :func:`install` runs as soon as that module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _INDUCTOR_LOWERING_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _InstallingLoader(spec.loader)
                return spec
        return None


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _remove_hook()
        install()


_hook = _InstallAfterImport()


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def install_on_inductor_import() -> None:
    """Install now if Inductor's lowering table is loaded, else right after it loads."""
    if _INDUCTOR_LOWERING_MODULE in sys.modules:
        install()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
