"""Triton's interpreter, which runs the kernels on CPU tensors in the tests, made faster where it repeats
itself."""

from __future__ import annotations


def patch_the_language_once_a_launch() -> None:
    """Triton's interpreter patches the triton.language modules a function sees (tl, tl.core) for a kernel's
    launch, and again for every call of a device function inside it (tl.zeros is one: an
    inspect.getmembers over the modules each time): a third of an interpreted FP8 GEMV's time. Within a
    launch, a module patched once is not patched again; outside a launch, and where this Triton's
    interpreter has other internals, nothing changes."""
    import inspect
    import threading

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    names = ("_patch_lang", "GridExecutor", "_LangPatchScope")
    if not all(hasattr(interpreter, name) for name in names):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()
    # a function's language modules on its first call (Triton's rewrite may add tl to its module's globals
    # later; the launch around it has patched tl already)
    langs_of: dict[object, frozenset[int]] = {}

    def patch_once(fn, *args, **kwargs):
        langs = langs_of.get(fn)
        if langs is None:
            found = (v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            langs = langs_of[fn] = frozenset(id(v) for v in found)
        patched = getattr(state, "patched", None)
        # a function that sees no language module goes to Triton, which says so
        if langs and patched is not None and langs <= patched:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = patch_lang(fn, *args, **kwargs)
        if patched is not None:
            patched |= langs
        return scope

    def launch_patching_once(self, *args, **kwargs):
        outer = getattr(state, "patched", None)  # a launch inside another's keeps the outer's on return
        state.patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once
