"""Models whose attention is windowed (`sliding_window`: Mistral-7B-v0.1, Mixtral and Qwen configs with
`use_sliding_window`). The engine attends every earlier token, which is windowed attention only while a
sequence fits in the window: such a model is served up to its window, and a longer context asked for is an
error, not output that silently leaves transformers' past the window."""

from __future__ import annotations

import pytest
from fixtures import hf_greedy
from helpers import checked_llm, greedy
from tiny_checkpoints import build_checkpoint, random_prompts

from cluster import LLM, InvalidRequestError
from cluster.config import ConfigError, ReplicaConfig
from worker.config import EngineConfig
from worker.engine import Engine
from worker.model_context import WindowedAttentionError, served_context, sliding_window_of

WINDOW = 24


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Mixtral with an attention window of WINDOW tokens (max_position_embeddings 512)."""
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("windowed"), overrides={"sliding_window": WINDOW})


def test_a_windowed_model_is_served_up_to_its_window_as_transformers_runs_it(windowed):
    prompts = random_prompts(3, 6, WINDOW - 8, seed=2)
    with checked_llm(windowed, page_size=4) as llm:
        assert llm.engine.max_seq_len == WINDOW
        got = [o.token_ids for o in llm.generate(prompts, greedy(6, ignore_eos=True))]
        with pytest.raises(InvalidRequestError, match=f"context is {WINDOW} tokens"):
            llm.generate([list(range(3, 3 + WINDOW))], greedy(2))
    assert got == hf_greedy(windowed, prompts, 6, ignore_eos=True)


def test_a_context_longer_than_the_window_is_an_error(windowed):
    with pytest.raises(ConfigError, match=f"max_seq_len.*attention window of {WINDOW} tokens"):
        LLM(str(windowed), max_seq_len=64)
    with pytest.raises(ConfigError, match=f"max_seq_len.*attention window of {WINDOW} tokens"):
        ReplicaConfig().override(model=str(windowed), max_seq_len=64).check_against_model()
    # and the engine's own check, for one built without the server's settings
    config = EngineConfig(model_path=str(windowed), max_seq_len=64, device="cpu")
    with pytest.raises(WindowedAttentionError, match=f"max_seq_len 64 .* window of {WINDOW} tokens"):
        Engine(config)


@pytest.mark.parametrize(
    "config,window",
    [
        ({"sliding_window": 4096}, 4096),  # Mistral-7B-v0.1
        ({"sliding_window": None}, None),  # Mixtral-8x7B, Mistral v0.2 on
        ({"sliding_window": 32768, "use_sliding_window": False}, None),  # Qwen2.5's configs
        ({"sliding_window": 4096, "use_sliding_window": True}, 4096),
        ({"sliding_window": 4096, "layer_types": ["full_attention"] * 2}, None),  # transformers' per-layer kinds
        ({"sliding_window": 4096, "layer_types": ["full_attention", "sliding_attention"]}, 4096),
        ({}, None),  # Llama
    ],
)
def test_the_window_is_read_as_each_family_states_it(config, window):
    assert sliding_window_of(config) == window


def test_the_served_context_is_the_window_only_where_the_window_is_shorter():
    assert served_context(None, 512, None) == (512, False)
    assert served_context(None, 512, 4096) == (512, False)
    assert served_context(None, 32768, 4096) == (4096, True)
    assert served_context(2048, 32768, 4096) == (2048, False)
    with pytest.raises(WindowedAttentionError):
        served_context(8192, 32768, 4096)


def test_a_drafts_window_does_not_bound_the_served_context(windowed, tmp_path):
    # a draft attending past its window only proposes worse tokens, which the model checks
    target = build_checkpoint("mixtral", tmp_path / "target")
    with checked_llm(
        target, speculative_method="draft", speculative_model=str(windowed), num_speculative_tokens=2
    ) as llm:
        assert llm.engine.max_seq_len == 512
        prompts = random_prompts(2, WINDOW + 4, WINDOW + 10, seed=4)
        got = [o.token_ids for o in llm.generate(prompts, greedy(6, ignore_eos=True))]
    assert got == hf_greedy(target, prompts, 6, ignore_eos=True)


def test_the_launch_check_reads_the_window_as_the_engine_does(tmp_path):
    # an older Qwen2 config: use_sliding_window on, but max_window_layers past every layer and no layer_types,
    # so transformers runs every layer over the whole context; the launch check once read a window of 24
    import json

    path = build_checkpoint("qwen2", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=28)
    (path / "config.json").write_text(json.dumps(config))
    ReplicaConfig().override(model=str(path), max_seq_len=64).check_against_model()
    with checked_llm(path, max_seq_len=64) as llm:
        assert llm.engine.max_seq_len == 64
