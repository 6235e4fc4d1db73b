"""The configuration tree: one default per setting, the same fields from flags, YAML and `LLM(...)`
keywords, a generated CLI, and bad values refused in one line before anything starts."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.config import (
    GROUPS,
    ConfigError,
    ReplicaConfig,
    ServeConfig,
    UnknownSettingError,
    markdown_table,
    settings,
)
from cluster.scheduler.cache_manager import CacheManager
from worker.config import EngineConfig
from worker.kernels import Kernels

ROOT = Path(__file__).resolve().parents[1]


def load_launch():
    spec = importlib.util.spec_from_file_location("launch", ROOT / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_launch(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    return out, time.monotonic() - start


BAD_FLAGS = [
    (["--dtype", "foo"], "--dtype", "bfloat16"),
    (["--device", "tpu"], "--device", "cpu"),
    (["--page-size", "0"], "--page-size", ">= 1"),
    (["--port", "99999"], "--port", "from 1 to 65535"),
    (["--port", "eighty"], "--port", "an integer"),
    (["--api-key="], "--api-key", "non-empty"),
    (["--max-body-bytes", "-1"], "--max-body-bytes", ">= 1"),
    (["--cache-type", "lru"], "--cache-type", "radix, naive"),
    (["--routing", "random"], "--routing", "cache_aware, round_robin"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "<= 1"),
    (["--tp-size", "0"], "--tp-size", ">= 1"),
    (["--decode-reserve-tokens", "-1"], "--decode-reserve-tokens", ">= 0"),
    (["--request-timeout-s", "0"], "--request-timeout-s", "> 0"),
    (["--placement-strategy", "ANYWHERE"], "--placement-strategy", "STRICT_PACK"),
    (["--log-level", "LOUD"], "--log-level", "DEBUG"),
    (["--overlap=no"], "--overlap", "--no-overlap"),
    (["--pagesize", "4"], "--pagesize", "--page-size"),
    ([], "--model", "required"),
]


@pytest.mark.parametrize("args,flag,allowed", BAD_FLAGS, ids=[" ".join(a) or "no-model" for a, _, _ in BAD_FLAGS])
def test_a_bad_flag_ends_in_one_line_naming_it_within_three_seconds(tmp_path, args, flag, allowed):
    out, elapsed = run_launch(*args, cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and flag in lines[0] and allowed in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert elapsed < 3.0


@pytest.mark.parametrize(
    "args,flag", [(["--max-seq-len", "100000"], "--max-seq-len"), (["--tp-size", "3"], "--tp-size")]
)
def test_a_value_the_model_cannot_take_ends_in_one_line_before_ray_starts(tmp_path, qwen3_path, args, flag):
    out, elapsed = run_launch("--model", str(qwen3_path), *args, cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and flag in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert elapsed < 3.0


def test_a_bad_value_in_a_yaml_file_names_the_file_and_the_key(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: x\npage_size: 0\n")
    out, elapsed = run_launch("--config", str(tmp_path / "bad.yaml"), cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"launch.py: error: {tmp_path / 'bad.yaml'}: page_size must be an integer >= 1, not 0"
    ]
    assert elapsed < 3.0


def test_yaml_flags_and_llm_keywords_land_in_the_same_fields(tmp_path, qwen3_path):
    from cluster import LLM

    values = {
        "page_size": 4,
        "num_pages": 512,
        "cache_type": "naive",
        "overlap": False,
        "decode_reserve_tokens": 7,
        "mixed_steps": False,
        "max_extend_tokens": 256,
    }
    (tmp_path / "c.yaml").write_text(
        "".join(f"{k}: {str(v).lower()}\n" for k, v in values.items()) + f"model: {qwen3_path}\n"
    )
    from_yaml = ServeConfig.from_yaml(str(tmp_path / "c.yaml"))
    launch = load_launch()
    argv = [
        "--model",
        str(qwen3_path),
        "--page-size",
        "4",
        "--num-pages",
        "512",
        "--cache-type",
        "naive",
        "--no-overlap",
        "--decode-reserve-tokens",
        "7",
        "--no-mixed-steps",
        "--max-extend-tokens",
        "256",
    ]
    from_flags = launch.build_config(launch.parse_args(argv))
    with LLM(str(qwen3_path), **values) as llm:
        offline = llm.config
        assert llm.engine.page_size == 4 and llm.scheduler.config.overlap is False
    assert from_yaml.engine == from_flags.engine == offline.engine
    assert from_yaml.scheduler == from_flags.scheduler == offline.scheduler
    assert (offline.engine.page_size, offline.scheduler.decode_reserve_tokens) == (4, 7)


def test_flags_override_the_yaml_file(tmp_path, qwen3_path):
    (tmp_path / "c.yaml").write_text(f"model: {qwen3_path}\npage_size: 4\nport: 9000\n")
    launch = load_launch()
    config = launch.build_config(launch.parse_args(["--config", str(tmp_path / "c.yaml"), "--page-size", "8"]))
    assert (config.engine.page_size, config.port) == (8, 9000)


def test_server_and_offline_defaults_agree():
    serve, offline = ServeConfig(), ReplicaConfig()
    assert serve.engine == offline.engine and serve.scheduler == offline.scheduler
    assert serve.engine.page_size == 16
    assert {n: s.default for n, s in settings(ReplicaConfig).items()} == {
        n: s.default for n, s in settings(ServeConfig).items() if n in settings(ReplicaConfig)
    }


def test_llm_has_no_defaults_of_its_own_and_takes_every_replica_setting():
    from cluster import LLM

    params = list(inspect.signature(LLM.__init__).parameters.values())
    assert [p.kind for p in params[1:]] == [
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    ]
    assert params[2].name == "kernels" and params[2].default == EngineConfig().kernels == Kernels()
    assert {"mixed_steps", "overlap", "tp_size", "page_size"} <= set(settings(ReplicaConfig))


def test_the_cache_manager_has_no_reserve_default_of_its_own():
    reserve = inspect.signature(CacheManager.__init__).parameters["decode_reserve_tokens"]
    assert reserve.default is inspect.Parameter.empty


@pytest.mark.parametrize("env", ["1", "0"])
def test_an_explicit_overlap_is_honoured_whatever_the_environment(monkeypatch, qwen3_path, env):
    from cluster import LLM

    monkeypatch.setenv("RAYLM_OVERLAP", env)
    explicit = env == "0"  # the opposite of what the variable would say
    assert ServeConfig().override(overlap=explicit).replica_config().scheduler.overlap is explicit
    with LLM(str(qwen3_path), overlap=explicit, num_pages=64) as llm:
        assert llm.scheduler.config.overlap is explicit


def test_an_unknown_llm_keyword_is_named_with_close_matches(qwen3_path):
    from cluster import LLM

    with pytest.raises(TypeError, match="pagesize.*page_size"):
        LLM(str(qwen3_path), pagesize=4)
    with pytest.raises(TypeError, match="port.*server"):
        LLM(str(qwen3_path), port=8000)


def test_a_bad_llm_value_is_named_before_the_engine_loads(qwen3_path):
    from cluster import LLM

    with pytest.raises(ConfigError, match="page_size must be an integer >= 1, not 0"):
        LLM(str(qwen3_path), page_size=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(qwen3_path), dtype="fp8")


def test_every_engine_option_but_the_kernels_is_a_flag_and_a_yaml_key(tmp_path):
    engine_fields = {s.name for s in settings(ServeConfig).values() if s.path[0] == "engine"}
    fields = EngineConfig.__dataclass_fields__.values()
    assert engine_fields == {f.metadata.get("name") or f.name for f in fields if f.metadata.get("setting", True)}
    # the kernels' choice is the offline API's alone; the draft model is speculative_model, set for rank 0, and
    # its engine is marked as a draft's
    assert {f.name for f in fields if not f.metadata.get("setting", True)} == {
        "kernels",
        "draft_model",
        "drafts",
        "max_verify_rows",
    }
    launch = load_launch()
    config = launch.build_config(launch.parse_args(["--model", str(tmp_path), "--cuda-graph-max-bs", "0"]))
    assert config.engine.cuda_graph_max_bs == 0
    assert ServeConfig().override(cuda_graph_max_bs=8).engine.cuda_graph_max_bs == 8


def test_extend_graphs_are_captured_no_larger_than_a_step():
    assert ServeConfig().rank0_engine.extend_graph_tokens == 2048
    small = ServeConfig().override(max_extend_tokens=1000)
    assert small.engine.extend_graph_tokens == 2048  # as set; the ranks' engines get what a step can hold
    assert small.rank0_engine.extend_graph_tokens == small.ranks_engine.extend_graph_tokens == 1000
    off = ServeConfig().override(extend_graph_tokens=0, speculative_method="ngram")
    assert off.rank0_engine.extend_graph_tokens == 0


@pytest.mark.parametrize(
    "name", ["kernels", "fused_kernels", "triton_kernels", "small_linear", "decode_kernel", "attention_backend", "seed"]
)
def test_kernel_choices_are_no_settings_and_survive_an_override(name):
    assert name not in settings(ServeConfig)
    with pytest.raises(UnknownSettingError):
        ReplicaConfig().override(**{name: False})
    chosen = ReplicaConfig(engine=EngineConfig(kernels=Kernels(fused=False, decode="triton")))
    assert chosen.override(page_size=4).engine.kernels == Kernels(fused=False, decode="triton")


def test_every_flag_has_help_its_default_and_its_choices_in_the_readme_groups():
    parser = load_launch().build_parser()
    by_dest = {a.dest: (a, g.title) for g in parser._action_groups for a in g._group_actions}
    for name, s in settings(ServeConfig).items():
        action, group = by_dest[name]
        assert s.help in action.help and f"default: {s.default_text}" in action.help
        assert group == s.group
        if s.choices:
            assert all(c in action.metavar for c in s.choices)
    assert [g.title for g in parser._action_groups][-len(GROUPS) :] == list(GROUPS)


def test_the_readme_configure_table_is_the_one_the_fields_generate():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "regenerate the table with: python -m cluster.config"


def test_a_nested_or_unknown_yaml_key_is_named(tmp_path):
    (tmp_path / "c.yaml").write_text("engine:\n  page_size: 4\n")
    with pytest.raises(ValueError, match="engine is not a setting"):
        ServeConfig.from_yaml(str(tmp_path / "c.yaml"))


def test_a_server_refuses_what_the_model_cannot_take_before_starting_ray(qwen3_path):
    from router.tier.deployment import Deployment

    with pytest.raises(ConfigError, match="tp_size must divide the model's 4 attention heads"):
        Deployment(ServeConfig().override(model=str(qwen3_path), tp_size=3))


@pytest.mark.parametrize(
    "cores, replicas, routers, expected",
    [
        (2, 1, None, 0),  # a small machine: the launching process serves
        (16, 1, None, 2),  # two router actors per replica
        (16, 4, None, 2),  # ... as long as the node has the cores for them
        (64, 4, None, 8),
        (2, 1, 3, 3),  # a set value is kept
        (64, 1, 0, 0),
    ],
)
def test_the_default_router_count_follows_the_replicas_and_the_nodes_cores(
    monkeypatch, cores, replicas, routers, expected
):
    import cluster.config as config_module

    monkeypatch.setattr(config_module, "usable_cores", lambda: cores)
    assert ServeConfig(replicas=replicas, routers=routers).num_routers == expected


def test_every_rank_holds_rows_for_a_verify_steps_samples_and_the_same_number():
    """With speculation, a verify step runs each speculating request's proposals and one more as decode
    rows: every rank's engine (rank 0's too) holds that many, capped by a step's token budget."""
    plain = ReplicaConfig().override(max_running_reqs=8)
    assert plain.ranks_engine.max_decode_rows == 8 and plain.rank0_engine.max_verify_rows is None
    spec = plain.override(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=4)
    assert spec.ranks_engine.max_decode_rows == spec.rank0_engine.max_decode_rows == 4 * 4
    capped = spec.override(max_extend_tokens=10)
    assert capped.ranks_engine.max_decode_rows == 10
