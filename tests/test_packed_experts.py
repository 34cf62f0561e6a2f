"""Packed experts: oneDNN on a second, packed copy of the weights for experts with 4 or more rows."""

import pytest
import torch

import allocmoe.routing.experts as experts_module
from allocmoe import AllocMoeError
from allocmoe.cli import main
from allocmoe.routing.experts import PACKED_ATTR, PACKED_FROM_ROWS, pack_experts, weights_first_experts_forward
from conftest import build_tiny, experts_with_biases


@pytest.mark.parametrize("model_type", ["deepseek_v2", "gpt_oss"])     # gpt_oss: transposed weights, biases
@torch.no_grad()
def test_packed_experts_compute_what_transformers_computes(model_type, monkeypatch):
    from transformers.integrations.moe import grouped_mm_experts_forward

    monkeypatch.setattr(experts_module, "WEIGHTS_FIRST_MIN_ELEMENTS", 0)   # tiny experts qualify
    calls = []
    packed_linear = experts_module._packed_linear
    monkeypatch.setattr(experts_module, "_packed_linear", lambda x, w: calls.append(len(x)) or packed_linear(x, w))
    model = build_tiny(model_type)
    gen = torch.Generator().manual_seed(3)
    experts = experts_with_biases(model, gen)
    num_experts = experts.num_experts
    hidden = torch.randn(12, model.config.hidden_size, generator=gen)
    index = torch.tensor([[0, 1]] * 6 + [[2, 3], [4, 5], [6, 7], [2, 5], [3, 6], [num_experts, 4]])   # 6 rows .. 1 row
    weights = torch.rand(12, 2, generator=gen).masked_fill(index == num_experts, 0.0)
    reference = grouped_mm_experts_forward(experts, hidden, index.clamp(max=num_experts - 1), weights)
    with pack_experts(model) as handle:
        assert getattr(experts, PACKED_ATTR) and handle.bytes > 0
        out = weights_first_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(index[index < num_experts], minlength=num_experts)
    assert sorted(calls) == sorted(2 * [n for n in counts.tolist() if n >= PACKED_FROM_ROWS])   # up and down
    assert calls and (counts < PACKED_FROM_ROWS).any()                    # both paths ran
    assert not hasattr(experts, PACKED_ATTR)                              # the copies are gone


def test_packing_tiny_experts_is_refused_and_bench_says_so(tiny_folder, capsys):
    with pytest.raises(AllocMoeError, match="no experts to pack"):
        pack_experts(build_tiny("deepseek_v2"))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", str(tiny_folder), "--budget", "0.5", "--method", "uniform", "--packed-experts",
              "--input-len", "8", "--output-len", "2", "--repeats", "1", "--quiet"])
    assert exit_.value.code == 2 and "no experts to pack" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", str(tiny_folder), "--budget", "0.5", "--method", "uniform", "--packed-experts",
              "--dtype", "bfloat16", "--quiet"])
    assert exit_.value.code == 2 and "--packed-experts serves the CPU kernel in float32" in capsys.readouterr().err


def test_packing_that_would_not_fit_in_memory_is_refused_before_any_copy(monkeypatch):
    import allocmoe.core.memory

    monkeypatch.setattr(experts_module, "WEIGHTS_FIRST_MIN_ELEMENTS", 0)
    model = build_tiny("deepseek_v2")
    need = sum(p.numel() * 4 for name, p in model.named_parameters() if ".experts." in name)
    monkeypatch.setattr(allocmoe.core.memory, "available_memory_bytes", lambda device, meminfo=None: need)    # 80% of it is too little
    with pytest.raises(AllocMoeError, match="packing the experts needs .* for a second copy of the routed experts"):
        pack_experts(model)
    assert not any(hasattr(m, PACKED_ATTR) for m in model.modules())
    monkeypatch.setattr(allocmoe.core.memory, "available_memory_bytes", lambda device, meminfo=None: 2 * need)
    with pack_experts(model) as handle:
        assert handle.bytes == need
