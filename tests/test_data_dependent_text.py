"""Joint attention over each sample's valid text tokens, selected with ``torch.nonzero``
(Mochi's attention processor), compiled with ``capture_dynamic_output_shape_ops``.

Two mechanisms carry it. The count of valid tokens is an unbacked size the analysed graph
creates with ``nonzero``; the re-trace creates a new one, which the sharding pass reads off the
op's new output (``SymbolicSizes.learn_created``) instead of failing with "carried by no graph
input". Each sample's ``[video | valid text]`` output is padded with zeros to ``video + all
text``; padding a joint sequence at its end extends its replicated trailing segment, so it is
no gather (it was one per sample and layer). Parity on two gloo ranks, at a length the SP size
divides and one it does not, one graph, every attention sharded, no gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world

WIDTH, HEADS, TEXT = 24, 3, 6


class SelectedTextJointAttention(nn.Module):
    """Video tokens and each sample's valid text tokens attend jointly; the output is padded back
    to every text position and split into the two streams."""

    def __init__(self) -> None:
        super().__init__()
        self.video_qkv, self.text_qkv = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.video_out, self.text_out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.unflatten(2, (3, HEADS, -1)).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, video: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (q, k, v), (tq, tk, tv) = self._heads(self.video_qkv(video)), self._heads(self.text_qkv(text))
        length, total = q.size(2), q.size(2) + tq.size(2)
        outputs = []
        for index in range(video.shape[0]):
            valid = torch.nonzero(text_mask[index], as_tuple=False).flatten()
            joint = [torch.cat([a[index : index + 1], b[index : index + 1, :, valid]], dim=2)
                     for a, b in ((q, tq), (k, tk), (v, tv))]
            attended = F.scaled_dot_product_attention(*joint)
            outputs.append(F.pad(attended, (0, 0, 0, total - attended.size(2))))
        hidden = torch.cat(outputs, dim=0).transpose(1, 2).flatten(2, 3)
        video_part, text_part = hidden.split_with_sizes([length, total - length], dim=1)
        return video + self.video_out(video_part), text + self.text_out(text_part)


def _worker(rank: int, world_size: int, lengths: tuple[int, ...]) -> list[dict]:
    import dcp_compile as dcp

    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # this process only
    torch.manual_seed(0)
    model = SelectedTextJointAttention()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": world_size})
    results = []
    for length in lengths:
        generator = torch.Generator().manual_seed(length)
        video, text = torch.randn(2, length, WIDTH, generator=generator), torch.randn(2, TEXT, WIDTH, generator=generator)
        text_mask = torch.ones(2, TEXT, dtype=torch.bool)
        text_mask[1, -2:] = False  # the second prompt is 2 tokens shorter
        model.zero_grad()
        expected = model(video, text, text_mask)
        sum(out.square().mean() for out in expected).backward()
        eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        record = dcp.explain(compiled, video, text, text_mask)
        actual = compiled(video, text, text_mask)
        sum(out.square().mean() for out in actual).backward()
        dcp.sync_gradients(model)
        variants = [v for graph in record.graphs for v in graph.variants.values() if v.sp_size > 1]
        results.append({
            "length": length,
            "graphs": len(record.graphs),
            "output_error": max((a - e).abs().max().item() for a, e in zip(actual, expected)),
            "grad_error": max((model.get_parameter(n).grad - g).abs().max().item() for n, g in eager_grads.items()),
            "sites": [(len(v.sharded_sites), v.attention_sites) for v in variants],
            "gathers": [[str(g) for g in v.gathers] for v in variants],
        })
    return results


def test_joint_attention_over_selected_text_is_sharded_at_parity():
    for per_length in run_in_process_world(_worker, 2, (12, 7), timeout=600):
        for result in per_length:
            assert result["graphs"] == 1, result  # no graph break at nonzero
            assert result["sites"] == [(2, 2)], result  # one joint attention per sample, both sharded
            assert result["gathers"] == [[]], result
            assert result["output_error"] < 1e-5 and result["grad_error"] < 1e-5, result
