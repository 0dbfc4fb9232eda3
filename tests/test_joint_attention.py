"""Joint attention (text + image tokens in one attention, SD3/Flux/HunyuanVideo style): only the
long image stream is sharded; the text stream is replicated around the chunk, rides through the
head all-to-all whole, and the splits back into the two streams need no gather.

Parity on 2 real gloo ranks (outputs and SP-summed gradients against eager on the full batch),
sharding asserted (every attention site sharded, at most the unpatchify's gather); the layout
checks run on the fake process group.
"""

from __future__ import annotations

import torch

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role
from dcp_compile.testing.process_world import run_in_process_world
from model_zoo import ZOO
from parity import parity_worker
from passes.pass_helpers import analyse, compile_variants
from dcp_compile.variant import Variant

aten = torch.ops.aten


def test_joint_attention_at_parity_and_sharded_on_two_ranks():
    results = run_in_process_world(parity_worker, 2, ["joint_dit"], [15, 12], "eager", timeout=600)
    assert all(result["checked"] == 2 for result in results)
    assert all(result["sharded_variants"] >= 2 for result in results), results


def test_the_image_stream_is_the_sharded_length():
    case = ZOO["joint_dit"]
    gm, analysis = analyse(case.build(), *case.make_inputs(15).values())
    sequence = analysis.sequence
    assert str(sequence.length) != str(analysis.attention_sites[0].query.meta["val"].shape[-2].node.expr)
    joint = [role for node, role in sequence.roles.items() if node.target is aten.cat.default
             and role.sequence_dims and role.sequence_dims[0].joint]
    assert len(joint) >= 9, sequence.table()  # q, k, v of the three blocks (+ rotary positions)
    rewrites = sorted(role.rewrite for role in sequence.roles.values() if role.rewrite)
    assert rewrites.count(Rewrite.SPLIT_SEGMENTS) == 1
    assert {Rewrite.TAKE_SHARDED_SEGMENT, Rewrite.TAKE_TRAILING_SEGMENT} <= set(rewrites)
    assert all(role.role != Role.MIXING or role.rewrite or "unpatchify" in role.reason for role in sequence.roles.values()), \
        [(n.name, r.reason) for n, r in sequence.roles.items() if r.role == Role.MIXING and not r.rewrite]


def test_no_gather_but_the_unpatchify(fake_world):
    case = ZOO["joint_dit"]
    inputs = tuple(case.make_inputs(15).values())
    (record,) = compile_variants(case.build(), inputs, [Variant(2)]).values()
    assert record.fallback_reason is None and record.local_fallbacks == []
    assert len(record.sharded_sites) == 3
    assert [g.reason for g in record.gathers] == ["a reshape that splits the sequence dimension (e.g. an unpatchify)"]
