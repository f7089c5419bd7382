"""parallel.checkpointing: checkpointed blocks give the model's logits and gradients; the saved
bytes and the live-bytes peak are counted exactly on small cases, and checkpointing the target
model saves fewer bytes (its blocks' inputs, not their insides) and peaks lower."""
import pytest
import torch
from _numerics import FP64_RELATIVE
from torch import nn

from infra_lab.model import weights
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.parallel import checkpointing

B, T = 4, 64


@pytest.fixture(scope="module")
def model():
    saved, config, _ = weights.load(weights.path_for("target"))
    return TorchTransformer(config, saved)


@pytest.fixture(scope="module")
def double_model():
    """The target model in float64, for the exactness checks: float32's gradients differ by 6e-8
    (backward adds the recomputed blocks' contributions in another order), float64's by 0."""
    saved, config, _ = weights.load(weights.path_for("target"))
    return TorchTransformer(config, saved).to(torch.float64)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0))


def logits_and_gradients(model, tokens, run):
    model.zero_grad(set_to_none=True)
    logits = run(tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.weights.items()}


@pytest.mark.numerics
@pytest.mark.parametrize("checkpoint", [False, True])
def test_forward_gives_the_model_logits_and_gradients(double_model, tokens, checkpoint):
    model = double_model
    logits, gradients = logits_and_gradients(model, tokens, model)
    got, got_gradients = logits_and_gradients(model, tokens, lambda x: checkpointing.forward(model, x, checkpoint))
    assert got.dtype == torch.float64
    # float64 both sides: FP64_RELATIVE of the largest logit (20) and of the largest gradient (1.6)
    assert (got - logits).abs().max() <= FP64_RELATIVE * logits.abs().max()
    largest = max(float(g.abs().max()) for g in gradients.values())
    assert max(float((got_gradients[n] - g).abs().max()) for n, g in gradients.items()) <= FP64_RELATIVE * largest


def test_saved_bytes_count_each_storage_once_and_skip_parameters():
    a, b = torch.randn(100, requires_grad=True), torch.randn(100, requires_grad=True)
    assert checkpointing.saved_activation_bytes(lambda: (a * b).sum()) == 2 * 100 * 4
    assert checkpointing.saved_activation_bytes(lambda: (a.view(10, 10) * a.view(10, 10)).sum()) == 100 * 4
    x, weight = torch.randn(10, 20, requires_grad=True), nn.Parameter(torch.randn(20, 30))
    assert checkpointing.saved_activation_bytes(lambda: (x @ weight).sum()) == 10 * 20 * 4  # x, not the weight
    assert checkpointing.saved_activation_bytes(lambda: (x @ weight.t().t()).sum()) == 10 * 20 * 4
    assert checkpointing.saved_activation_bytes(lambda: x.sum()) == 0  # a sum's backward needs no input


def test_peak_live_bytes_follows_the_tensors_alive():
    def run():
        first = torch.ones(1000)
        second = torch.ones(2000)  # alive with first: 12,000 bytes
        del first
        torch.ones(500)

    assert checkpointing.peak_live_bytes(run) == (1000 + 2000) * 4


def test_checkpointing_saves_the_block_inputs_only(model, tokens):
    results = checkpointing.compare(model, tokens, repeats=1)
    plain, checkpointed = results[False], results[True]
    config = model.config
    block_inputs = config.n_layers * B * T * config.d_model * 4  # (B, T, d) float32 per block
    assert block_inputs <= checkpointed.saved_bytes < plain.saved_bytes / 4
    # the backward pass recomputes a block, so the peak is above what the forward pass saved, but
    # still below the peak without checkpointing
    assert checkpointed.saved_bytes < checkpointed.peak_bytes < plain.peak_bytes
    assert plain.seconds > 0 and checkpointed.seconds > 0
    assert all(p.grad is None for p in model.parameters())


def test_compare_names_a_bad_repeat_count(model, tokens):
    with pytest.raises(ValueError, match="repeats must be >= 1; got 0"):
        checkpointing.compare(model, tokens, repeats=0)


def test_the_trace_peaks_where_peak_live_bytes_does_and_shows_the_recomputation(model, tokens):
    traces = {checkpoint: checkpointing.live_bytes_trace(model, tokens, checkpoint) for checkpoint in (False, True)}
    results = checkpointing.compare(model, tokens, repeats=1)
    for checkpoint, trace in traces.items():
        assert max(trace.live_bytes) == results[checkpoint].peak_bytes
        assert 0 < trace.backward_from < len(trace.live_bytes)
        # at the end of the forward pass: what autograd saved, plus the loss and what backward is
        # about to read, all created in the step
        assert trace.live_bytes[trace.backward_from - 1] >= results[checkpoint].saved_bytes
    plain, checkpointed = traces[False], traces[True]
    assert checkpointed.backward_from == pytest.approx(plain.backward_from, rel=0.1)  # the same forward ops
    assert len(checkpointed.live_bytes) - checkpointed.backward_from > \
        len(plain.live_bytes) - plain.backward_from  # backward runs every block's forward again
    assert checkpointed.live_bytes[checkpointed.backward_from - 1] < plain.live_bytes[plain.backward_from - 1] / 4
    assert all(p.grad is None for p in model.parameters())
