"""EAGLE-3 draft heads (speculative_method eagle3), written as published: each proposal is what a plain
torch reading of the published architecture proposes over Hugging Face's hidden states of the model;
greedy outputs equal those without speculation and Hugging Face's, for two families, overlap on and off,
tp 2; seeded sampled outputs equal those without; pages (the head's too) stay whole after rejections and
preemptions; a head that does not fit is refused with a clear error."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import PROMPT_TEXTS, hf_greedy
from helpers import checked_llm, encode_all, greedy
from safetensors.torch import load_file
from tiny_checkpoints import build_cycling_checkpoint, build_eagle3_head
from transformers import AutoModelForCausalLM

from cluster import SamplingParams
from cluster.config import ConfigError, ReplicaConfig
from cluster.scheduler.draft import Eagle3Proposer
from worker.models.eagle3 import Eagle3ConfigError, aux_layer_ids

DRAFT_VOCAB = 300  # of the tiny tokenizer's 360: some of the model's tokens the head never proposes


def eagle3(head, k: int = 3) -> dict:
    return dict(
        speculative_method="eagle3",
        speculative_model=str(head),
        num_speculative_tokens=k,
        speculative_adaptive=False,
        speculative_max_pause=0,
    )


@pytest.fixture(scope="module")
def random_head(qwen3_path, tmp_path_factory):
    return build_eagle3_head(qwen3_path, tmp_path_factory.mktemp("head"), draft_vocab_size=DRAFT_VOCAB)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def cycling(request, model_paths, tmp_path_factory):
    """A model whose output mostly follows cycles of tokens, and a head proposing each token's successor in
    its cycle (within its smaller vocabulary): some proposals kept, some rejected."""
    model, successor = build_cycling_checkpoint(
        model_paths[request.param], tmp_path_factory.mktemp(f"cycling-{request.param}")
    )
    head = build_eagle3_head(
        model, tmp_path_factory.mktemp(f"head-{request.param}"), draft_vocab_size=DRAFT_VOCAB, successor_of=successor
    )
    return model, head


# -- the reference: the published architecture in plain torch ---------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x [L, heads, d] at positions 0..L-1."""
    d = x.shape[-1]
    freqs = torch.outer(torch.arange(len(x), dtype=torch.float64), theta ** -(torch.arange(0, d, 2) / d))
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None].float(), torch.cat([freqs.sin()] * 2, -1)[:, None].float()
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _head_forward(w: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor):
    """The head over a whole sequence: (logits over its vocabulary, prenorm hidden states)."""
    eps, heads = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    m = "midlayer."
    normed = _rms(hidden, w[m + "hidden_norm.weight"], eps)
    x = torch.cat([_rms(embeds, w[m + "input_layernorm.weight"], eps), normed], -1)
    q, k, v = ((x @ w[m + f"self_attn.{p}_proj.weight"].T).view(len(x), heads, -1) for p in ("q", "k", "v"))
    q, k = _rotate(q, theta), _rotate(k, theta)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), -1) @ w[m + "self_attn.o_proj.weight"].T
    r = att + hidden
    y = _rms(r, w[m + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[
        m + "mlp.down_proj.weight"
    ].T
    prenorm = mlp + r
    return _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T, prenorm


@functools.cache
def _loaded(model_dir: str, head_dir: str):
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    return (
        cfg,
        load_file(str(Path(head_dir) / "model.safetensors")),
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
    )


def reference_proposals(model_dir, head_dir, tokens: list[int], k: int) -> list[int]:
    """k greedy proposals after `tokens`, the model's hidden states taken from Hugging Face's forward
    (hidden_states[i] is the input of layer i) over every token but the last."""
    cfg, w, hf = _loaded(str(model_dir), str(head_dir))
    layers = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        embed = hf.get_input_embeddings().weight
        hidden = torch.cat([states[i][0] for i in layers], -1) @ w["fc.weight"].T
        ids, out = list(tokens[1:]), []
        for _ in range(k):
            logits, prenorm = _head_forward(w, cfg, embed[torch.tensor(ids)], hidden)
            best = int(logits[-1].argmax())
            out.append(best + int(w["d2t"][best]))
            ids.append(out[-1])
            hidden = torch.cat([hidden, prenorm[-1:]])  # the next position goes on from the head's own
    return out


@pytest.mark.parametrize("overlap", [True, False])
def test_each_proposal_is_the_published_heads_over_the_models_hidden_states(
    qwen3_path, random_head, monkeypatch, overlap
):
    """Checked on the first run of the prompts and on a second, whose prompts the prefix cache holds: the
    model's hidden states of a cached prefix are kept with its KV."""
    seen = []
    propose = Eagle3Proposer.propose

    def recording(self, reqs, caps, after=None, verified=None):
        out = propose(self, reqs, caps, after, verified)
        seen.extend((list(r.input_ids), d) for r, d in zip(reqs, out) if d)
        return out

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    with checked_llm(qwen3_path, overlap=overlap, page_size=4, **eagle3(random_head)) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:4])
        first = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        hits = llm.stats().prefix_hit_tokens
        again = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        assert llm.stats().prefix_hit_tokens > hits
    assert first == again == hf_greedy(qwen3_path, prompts, 10)
    assert len(seen) > 16
    for tokens, drafted in seen:  # catch-ups over a prompt (cached or not), and over a verify step's tokens
        assert drafted == reference_proposals(qwen3_path, random_head, tokens, len(drafted))


# -- outputs -----------------------------------------------------------------------------------------


def _generate(path, prompts, params, **kw):
    with checked_llm(path, **kw) as llm:
        ids = encode_all(llm, prompts) if isinstance(prompts[0], str) else prompts
        outs = llm.generate(ids, params)
        return [o.token_ids for o in outs], llm.stats(), ids


@pytest.mark.parametrize("overlap,page_size", [(True, 4), (False, 1)])
def test_greedy_with_an_eagle3_head_equals_without_and_hf(cycling, overlap, page_size):
    model, head = cycling
    kw = dict(overlap=overlap, page_size=page_size)
    on, stats, prompts = _generate(model, PROMPT_TEXTS, greedy(24), **kw, **eagle3(head))
    off, _, _ = _generate(model, prompts, greedy(24), **kw)
    assert stats.spec_decode_num_accepted_tokens > 0  # proposals were kept ...
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # ... and some rejected
    assert on == off == hf_greedy(model, prompts, 24)


def test_seeded_sampling_with_an_eagle3_head_equals_without_logprobs_too(cycling):
    model, head = cycling
    params = [
        SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=i, logprobs=2, ignore_eos=True)
        for i in range(len(PROMPT_TEXTS))
    ]
    with checked_llm(model, page_size=4, **eagle3(head)) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        on = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        stats = llm.stats()
    with checked_llm(model, page_size=4) as llm:
        off = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert stats.spec_decode_num_accepted_tokens > 0
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    for (_, a), (_, b) in zip(on, off):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_requests_with_processors_grammars_and_choices_keep_their_outputs_with_an_eagle3_head(cycling):
    """The head proposes for every request (without their penalties, biases and grammars, which are the
    model's); each verify sample applies them after the proposals before it: the outputs are those
    without speculation."""
    from cluster import GrammarSpec

    model, head = cycling
    params = [
        greedy(20, ignore_eos=True, repetition_penalty=1.3),
        greedy(20, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20, min_p=0.1, min_tokens=12, ignore_eos=True),
        greedy(30, grammar=GrammarSpec("regex", "((ab|ba) ){4,8}")),
        SamplingParams(temperature=1.0, seed=6, max_tokens=16, n=2, ignore_eos=True),
        greedy(24, stop_token_ids=list(range(100, 140)), min_tokens=4),
    ]
    with checked_llm(model, page_size=4) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS[:3])
        ids = [p for p in prompts for _ in params]
        off = [[c.token_ids for c in o.outputs] for o in llm.generate(ids, params * len(prompts))]
    with checked_llm(model, page_size=4, **eagle3(head)) as llm:
        on = [[c.token_ids for c in o.outputs] for o in llm.generate(ids, params * len(prompts))]
        stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert on == off


def test_pages_stay_whole_after_rejections_and_preemptions(cycling):
    model, head = cycling
    kw = dict(page_size=4, num_pages=80, decode_reserve_tokens=1)
    with checked_llm(model, **kw, **eagle3(head)) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        on = [o.token_ids for o in llm.generate(prompts, greedy(24, ignore_eos=True))]
        stats = llm.stats()
        draft = llm.scheduler.spec.draft
        assert draft.allocator.num_free == draft.allocator.num_pages and not draft.seqs
    assert stats.preempted > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert on == hf_greedy(model, prompts, 24, ignore_eos=True)


def test_tp2_greedy_with_an_eagle3_head_equals_hf(ray_cluster, qwen3_path, tmp_path):
    """At tp 2 each rank holds a shard of the embeddings: the head, on rank 0, reads them whole from the
    model's checkpoint."""
    model, successor = build_cycling_checkpoint(qwen3_path, tmp_path / "model")
    head = build_eagle3_head(model, tmp_path / "head", draft_vocab_size=DRAFT_VOCAB, successor_of=successor)
    with checked_llm(model, tp_size=2, page_size=4, **eagle3(head)) as llm:
        prompts = encode_all(llm, PROMPT_TEXTS)
        on = [o.token_ids for o in llm.generate(prompts, greedy(16))]
        assert llm.stats().spec_decode_num_accepted_tokens > 0
    assert on == hf_greedy(model, prompts, 16)


# -- what is refused ---------------------------------------------------------------------------------


def test_eagle3_needs_a_head_and_a_head_needs_eagle3(qwen3_path, random_head, tmp_path):
    with pytest.raises(ConfigError, match="speculative_model"):
        ReplicaConfig().override(model=str(qwen3_path), speculative_method="eagle3").validate()
    as_draft = ReplicaConfig().override(
        model=str(qwen3_path), speculative_method="draft", speculative_model=str(random_head)
    )
    with pytest.raises(ConfigError, match="speculative_model.*must be a model"):
        as_draft.check_against_model()
    as_head = ReplicaConfig().override(
        model=str(qwen3_path), speculative_method="eagle3", speculative_model=str(qwen3_path)
    )
    with pytest.raises(ConfigError, match="EAGLE-3 head"):
        as_head.check_against_model()
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    cfg = json.loads((random_head / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] // 2}))
    as_narrow = ReplicaConfig().override(
        model=str(qwen3_path), speculative_method="eagle3", speculative_model=str(narrow)
    )
    with pytest.raises(ConfigError, match="reads hidden states 32 wide, the model's are 64"):
        as_narrow.check_against_model()


def test_a_head_is_served_only_beside_its_model(random_head):
    from worker.loader import CheckpointError

    with pytest.raises(CheckpointError, match="EAGLE-3 draft head.*speculative_method eagle3"):
        checked_llm(random_head).__enter__()


def test_the_heads_layers_are_its_configs_or_the_published_default_within_the_model(random_head):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(random_head))
    assert aux_layer_ids(cfg, 2) == (0, 1, 1)
    cfg.eagle_config = {}
    assert aux_layer_ids(cfg, 36) == (2, 18, 33)
    with pytest.raises(Eagle3ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        aux_layer_ids(cfg, 2)  # the default needs 4 layers
    cfg.eagle_config = {"use_aux_hidden_state": False}
    with pytest.raises(Eagle3ConfigError, match="use_aux_hidden_state"):
        aux_layer_ids(cfg, 36)


def test_a_head_whose_layer_is_named_layers_0_loads_as_one_named_midlayer(qwen3_path, random_head, tmp_path):
    import shutil

    from safetensors.torch import save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(random_head, renamed)
    w = load_file(str(random_head / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in w.items()}, str(renamed / "model.safetensors"))
    runs = []
    for head in (random_head, renamed):
        with checked_llm(qwen3_path, page_size=4, **eagle3(head)) as llm:
            prompts = encode_all(llm, PROMPT_TEXTS[:3])
            llm.generate(prompts, greedy(12))
            runs.append(llm.stats().spec_decode_num_draft_tokens)
            params = dict(llm.scheduler.spec.draft.engine.model.named_parameters())
            runs.append(float(params["model.layers.0.self_attn.qkv_proj.weight"].sum()))
    assert runs[0] > 0 and runs[:2] == runs[2:]


def test_the_memory_budget_counts_the_heads_cache_and_the_hidden_state_it_reads(qwen3_path, random_head):
    from worker.kv_cache import KVCachePool

    budget_gb = 0.004  # small enough that max_running_reqs' whole contexts do not cap the pages
    with checked_llm(qwen3_path, cpu_kv_cache_gb=budget_gb, page_size=4, **eagle3(random_head)) as llm:
        engine, head = llm.engine, llm.scheduler.spec.draft.engine
        assert head.num_pages == engine.num_pages
        hidden = engine.hf_config.hidden_size
        # a hidden state a token, fc(the model's three) as the head reads it
        assert tuple(engine.aux_hidden.shape) == ((engine.num_pages + 1) * 4, hidden)
        own = KVCachePool.bytes_per_page(
            engine.hf_config.num_hidden_layers, 4, engine.kv.num_kv_heads, engine.kv.head_dim, engine.kv_dtype
        )
        heads = KVCachePool.bytes_per_page(1, 4, head.kv.num_kv_heads, head.kv.head_dim, head.kv_dtype)
        aux = hidden * 4 * engine.dtype.itemsize
        assert engine.num_pages == int(budget_gb * 2**30 // (own + heads + aux))
        assert llm.generate([[5, 6, 7, 5, 6]], greedy(8))[0].token_ids


@pytest.mark.gpu
def test_on_gpu_an_eagle3_head_drafts_beside_the_models_cuda_graphs_in_bfloat16(tmp_path):
    """The model keeps the head's hidden states from its CUDA graphs' decode and verify replays as from its
    eager prompt steps, and the head drafts with FlashInfer's kernels in bfloat16, its decode steps from
    its own graphs: proposals are kept, and the outputs are those without speculation (where bfloat16
    near-ties do not part them: nearly all)."""
    from tiny_checkpoints import build_qwen3_hd128, random_prompts

    model, successor = build_cycling_checkpoint(build_qwen3_hd128(tmp_path / "base"), tmp_path / "model")
    head = build_eagle3_head(model, tmp_path / "head", draft_vocab_size=DRAFT_VOCAB, successor_of=successor)
    kw = dict(dtype="bfloat16", num_pages=16384, max_running_reqs=16, page_size=16)
    prompts = random_prompts(12, 5, 60)
    with checked_llm(model, **kw, **eagle3(head)) as llm:
        assert llm.engine.graphs is not None and llm.engine.aux_hidden.dtype == torch.bfloat16
        assert llm.scheduler.spec.draft.engine.graphs is not None  # the head's decode steps replay graphs
        on = [o.token_ids for o in llm.generate(prompts, greedy(40, ignore_eos=True))]
        stats = llm.stats()
    with checked_llm(model, **kw) as llm:
        off = [o.token_ids for o in llm.generate(prompts, greedy(40, ignore_eos=True))]
    assert stats.spec_decode_num_accepted_tokens > 0
    assert sum(a == b for a, b in zip(on, off)) >= len(prompts) - 1
