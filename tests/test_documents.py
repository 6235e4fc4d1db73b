"""vLLM's `documents` in chat: handed to the chat template, as transformers' apply_chat_template takes them,
for a retrieval-augmented template to render; a model whose template renders none refuses them (400)
rather than leave them out without a word."""

from __future__ import annotations

import shutil

import httpx
import pytest
from helpers import client, serving

from cluster.model_info import load_tokenizer

MSG = [{"role": "user", "content": "Where is the cat?"}]
DOCS = [{"title": "notes", "text": "The cat sat on the mat."}, {"title": "more", "text": "The dog ran off."}]
# the tests' template, after each document as its title and text
RAG_PREFIX = "{% for d in documents or [] %}[{{ d['title'] }}] {{ d['text'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def rag_path(tmp_path_factory, qwen3_path):
    """The tiny model with a template that renders documents before the conversation."""
    out = tmp_path_factory.mktemp("rag") / "model"
    shutil.copytree(qwen3_path, out)
    tokenizer = load_tokenizer(str(out))
    tokenizer.chat_template = RAG_PREFIX + tokenizer.chat_template
    tokenizer.save_pretrained(out)
    return out


def test_documents_reach_the_template_and_the_prompt(ray_cluster, rag_path):
    tokenizer = load_tokenizer(str(rag_path))
    want = tokenizer.apply_chat_template(MSG, documents=DOCS, add_generation_prompt=True, tokenize=False)
    assert want.startswith("[notes] The cat sat on the mat.\n")
    with serving(rag_path, num_pages=256) as srv:
        r = client(srv).chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_body={"documents": DOCS, "return_token_ids": True}
        )
        assert r.model_extra["prompt_token_ids"] == tokenizer(want, add_special_tokens=False).input_ids
        counted = httpx.post(srv.url + "/tokenize", json={"messages": MSG, "documents": DOCS}, timeout=30).json()
        assert counted["tokens"] == r.model_extra["prompt_token_ids"]
        bad = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": MSG, "max_tokens": 2, "documents": [{"title": 1}]},
            timeout=30,
        )
        assert bad.status_code == 400 and "documents" in bad.json()["error"]["message"], bad.text
