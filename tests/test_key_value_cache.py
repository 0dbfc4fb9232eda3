"""A Hugging Face decoder left at ``use_cache=True`` warns once, naming the fix, and still shards.

On a fake 2-rank process group (graph structure only): the K/V cache outputs are gathered to the
full sequence on every rank after each SP 2 call, which training never reads.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.compiler import key_value_outputs


def _tiny_llama(use_cache: bool | None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    extra = {} if use_cache is None else {"use_cache": use_cache}
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=None,
        attn_implementation="sdpa", **extra,
    )
    return LlamaForCausalLM(config)


def _explain(model: torch.nn.Module):
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})
    ids = torch.randint(0, 64, (2, 24))
    return dcp.explain(compiled, input_ids=ids, labels=ids)


@pytest.mark.parametrize("use_cache", [None, False])
def test_use_cache_warns_once_naming_use_cache_false(fake_world, monkeypatch, caplog, use_cache):
    monkeypatch.setattr(key_value_outputs, "_warned", False)
    caplog.set_level(logging.WARNING, logger="dcp_compile")
    record = _explain(_tiny_llama(use_cache))
    variant = record.graphs[0].variants[dcp.Variant(2)]
    assert len(variant.sharded_sites) == 2 and not variant.gathers, str(record)  # still sharded
    warnings = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    if use_cache is False:
        assert not warnings, [r.getMessage() for r in warnings]
        return
    # transformers' default: 2 layers x (K, V) returned in the cache, gathered on every rank.
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "returns 4 attention key/value tensors" in warnings[0].getMessage()
    assert warnings[0].exc_info is None  # a warning line, not a traceback
    torch._dynamo.reset()
    _explain(_tiny_llama(None))  # a second model in the same process: no second warning
    assert len([r for r in caplog.records if "use_cache=False" in r.getMessage()]) == 1
