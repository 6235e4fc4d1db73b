"""FlashInfer's kernel builds one at a time on a host. FlashInfer compiles a module on first use under
that module's own lock, but every build runs ninja in one shared folder, whose `.ninja_log` ninja
rewrites at the end of each run: two engines starting at once on a fresh host (one a GPU) lose each
other's log entries, and every later start rebuilds the modules whose entries were lost. One host-wide
lock around each build keeps the log whole. It is taken inside the module's own lock and held only
while ninja runs (no collective inside), so tensor-parallel ranks that build at once cannot deadlock."""

from __future__ import annotations

from types import ModuleType

from filelock import FileLock

LOCK_NAME = "raylm-ninja.lock"
_MARK = "_one_at_a_time"


def serialize_builds(core: ModuleType) -> bool:
    """Wraps `core.JitSpec.build` (flashinfer.jit.core) so that builds on this host run one at a time,
    under a lock file in FlashInfer's own lock folder (`core.get_tmpdir()`). Idempotent; False where the
    module lacks what it wraps (another FlashInfer version), which leaves FlashInfer as it is."""
    spec = getattr(core, "JitSpec", None)
    build = getattr(spec, "build", None)
    if build is None or not hasattr(core, "get_tmpdir"):
        return False
    if getattr(build, _MARK, False):
        return True

    def one_at_a_time(self, *args, **kwargs):
        with FileLock(str(core.get_tmpdir() / LOCK_NAME), thread_local=False):
            return build(self, *args, **kwargs)

    setattr(one_at_a_time, _MARK, True)
    one_at_a_time.__wrapped__ = build
    spec.build = one_at_a_time
    return True


def serialize_flashinfer_builds() -> bool:
    """serialize_builds on the installed FlashInfer; False where there is none."""
    try:
        from flashinfer.jit import core
    except ImportError:
        return False
    return serialize_builds(core)
