"""Token grids on each rank's window (see ``sequence_dims/grid_rules`` and ``grid_windows``): the
entry fetches the window by one halo exchange, the exit keeps the rank's own tokens."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dcp_compile.compiler import grid_windows
from dcp_compile.compiler.passes.sequence_dims import Rewrite
from dcp_compile.compiler.passes.shard_sequence.interpreter import ShardingInterpreter
from dcp_compile.compiler.passes.shard_sequence.lowerings import CannotShard, lowering


@lowering(Rewrite.ENTER_GRID_WINDOW)
def lower_enter_grid_window(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    region = sharding.analysis.grid_regions[n]
    local = sharding.as_chunk(n.args[0])
    if sharding.length is None:
        raise CannotShard("the sequence length is unknown where the grid is entered")
    arguments = sharding.window_arguments(region)
    _, units = grid_windows.window_units(*arguments)
    window = grid_windows.exchange_grid_window(local, region.token_dim, *arguments, sharding.group)
    sharding.grid_windows[n] = units
    sharding.rewrites.append(f"{n.name}: this rank's window of the token grid (halo exchange of "
                             f"{region.radius} step(s) of {region.unit} tokens each side, no gather)")
    return window.reshape(sharding.window_sizes(n, region))


@lowering(Rewrite.LEAVE_GRID_WINDOW)
def lower_leave_grid_window(sharding: ShardingInterpreter, n: fx.Node) -> Any:
    region = sharding.analysis.grid_exits[n]
    if region.entry not in sharding.grid_windows:  # the entry ran on gathered tokens
        return sharding.narrow(sharding.run_full(n), sharding.seq_of(n))
    tokens_dim = region.exits[n]
    window = sharding.as_full(n.args[0]).reshape(sharding.window_sizes(n, region, tokens_dim))
    return grid_windows.own_tokens_of_grid_window(window, tokens_dim, *sharding.window_arguments(region))
