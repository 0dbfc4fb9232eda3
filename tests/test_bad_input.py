"""Bad input gets an error that names the value and the fix."""

from __future__ import annotations

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.compiler.options import parse_options
from dcp_compile.testing.process_world import run_in_process_world
from dcp_compile.compiler.variant_selection import Bucket, BucketTable, Variant


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sp'\].*valid options are .*sp_size"):
        parse_options({"sp": 2})


def test_unknown_inner_compiler():
    with pytest.raises(ValueError, match="unknown inner compiler 'tvm'.*inductor"):
        parse_options({"inner": "tvm"})


@pytest.mark.parametrize("value", [1.5, "2", True])
def test_non_integer_sp_size(value):
    with pytest.raises(TypeError, match="sp_size must be a positive integer"):
        parse_options({"sp_size": value})


def test_sp_size_without_process_group():
    with pytest.raises(RuntimeError, match=r"sp_size=2 needs an initialized torch.distributed.*init_process_group"):
        parse_options({"sp_size": 2})


def _sp_size_larger_than_world(rank, world_size):
    with pytest.raises(ValueError, match=r"sp_size=3 is larger than the world \(2 ranks\); use at most 2"):
        parse_options({"sp_size": 3})
    return True


def test_sp_size_must_fit_the_world():
    assert run_in_process_world(_sp_size_larger_than_world, 2, timeout=120) == [True, True]


def _rank_left_out_worker(rank, world_size):
    """World 3: SP 2 is ranks 0-1; rank 2 is in no SP-2 group and is told so, without a hang."""
    from dcp_compile.runtime.process_groups import create_sp_groups, sp_group

    create_sp_groups([2])
    if rank < 2:
        assert sp_group(2).ranks == (0, 1)
    else:
        with pytest.raises(ValueError, match=r"rank 2 is in no SP group of size 2.*\[\[0, 1\]\].*ranks \[2\] are left out"):
            sp_group(2)
    return True


def test_sp_size_that_does_not_divide_the_world():
    assert run_in_process_world(_rank_left_out_worker, 3, timeout=120) == [True, True, True]


def test_compile_surfaces_option_errors():
    model = torch.compile(torch.nn.Linear(4, 4), backend="dcp", options={"recompute": "sometimes"})
    with pytest.raises(Exception, match="unknown recompute policy 'sometimes'"):
        model(torch.randn(2, 4))


def test_length_over_every_bucket():
    table = BucketTable([Bucket(16, Variant(1)), Bucket(64, Variant(1, "full"))])
    with pytest.raises(ValueError, match=r"sequence length 65 is longer than every bucket \(the largest has max_len=64\)"):
        table.select(65)


def test_bucket_boundaries_are_inclusive():
    table = BucketTable([Bucket(64, Variant(1, "full")), Bucket(16, Variant(1)), Bucket(None, Variant(1, "attention"))])
    assert table.select(16).variant == Variant(1)
    assert table.select(17).variant == Variant(1, "full")
    assert table.select(64).variant == Variant(1, "full")
    assert table.select(10**6).variant == Variant(1, "attention")


def test_use_takes_a_microbatch_or_a_variant_and_rejects_others():
    microbatch = dcp.schedule.MicroBatch(indices=(0,), variant=Variant(1, "full"), loss_scale=1.0, group_ranks=(0,),
                                predicted_time=0.0)
    with dcp.use(microbatch) as variant:
        assert variant == Variant(1, "full")
    with dcp.use(Variant(2, "attention")) as variant:
        assert variant == Variant(2, "attention")

    class LooksLikeAPlan:  # duck-typed attributes are not a plan: say what is expected
        sp_size, recompute = 1, "full"

    with pytest.raises(TypeError, match="needs a dcp.schedule.MicroBatch"):
        with dcp.use(LooksLikeAPlan()):
            pass


def test_bucket_errors():
    with pytest.raises(ValueError, match="needs 'max_len'"):
        parse_options({"buckets": [{"sp_size": 1}]})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_options({"buckets": [{"max_len": 4, "sp": 1}]})
    with pytest.raises(ValueError, match="share a max_len"):
        parse_options({"buckets": [{"max_len": 4}, {"max_len": 4}]})


def _no_lazy_group_worker(rank, world_size):
    """A forward call never creates process groups: an SP size nobody created is a clear error."""
    from dcp_compile.runtime.process_groups import sp_group

    with pytest.raises(ValueError, match=r"no process groups exist for SP size 2.*dcp.runtime.create_sp_groups\(\[2\]\)"):
        sp_group(2)
    return True


def test_process_groups_are_never_created_lazily():
    assert run_in_process_world(_no_lazy_group_worker, 2, timeout=120) == [True, True]
