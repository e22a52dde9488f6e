"""gas_lab.accumulate (and the lesson-01 explorer and plots built on it).

References here are written out with plain torch, independently of the library's
``normalized_loss``, so a wrong reduction in the library cannot hide behind itself.
"""

import pytest
import torch
import torch.nn.functional as F

from gas_lab.accumulate import (
    FORGOT_DIVIDE,
    REDUCTIONS,
    Batch,
    Window,
    accumulate_gradients,
    compare_grads,
    even_sizes,
    full_batch_gradient,
    grads_of,
    mse_loss,
    normalized_loss,
    ragged_sizes,
    split_batch,
    token_losses,
    train_one_device,
)
from gas_lab.toys import (
    TinySeqModel,
    regression_batch,
    regression_mlp,
    sequence_batch,
    spread_lengths,
)

TOL = 1e-5


def _hand_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return grads_of(model)


def _hand_token_ref(batch, seed=0):
    """Full-batch per-token gradient, written out by hand."""
    model = TinySeqModel(seed)
    logits = model(batch.x)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.y.reshape(-1), reduction="none"
    )
    m = batch.mask.reshape(-1).float()
    return _hand_grads(model, (ce * m).sum() / m.sum())


def _hand_sequence_ref(batch, seed=0):
    model = TinySeqModel(seed)
    logits = model(batch.x)
    ce = F.cross_entropy(logits.transpose(1, 2), batch.y, reduction="none")  # (B, T)
    m = batch.mask.float()
    return _hand_grads(model, ((ce * m).sum(1) / m.sum(1)).mean())


# ---------------------------------------------------------------- splitting
def test_split_equal_keeps_order_and_rows():
    batch = regression_batch(12)
    micro = split_batch(batch, 3)
    assert [len(mb) for mb in micro] == [4, 4, 4]
    assert torch.equal(torch.cat([mb.x for mb in micro]), batch.x)
    assert torch.equal(torch.cat([mb.y for mb in micro]), batch.y)


def test_split_ragged_and_arbitrary_sizes():
    batch = regression_batch(10)
    assert ragged_sizes(10, 4) == [4, 4, 2]
    assert ragged_sizes(8, 4) == [4, 4]
    assert even_sizes(10, 3) == [4, 3, 3]
    micro = split_batch(batch, [1, 6, 3])
    assert [len(mb) for mb in micro] == [1, 6, 3]
    assert torch.equal(micro[1].x, batch.x[1:7])


def test_split_carries_the_mask():
    batch = sequence_batch([5, 3, 1, 4], max_len=6)
    micro = split_batch(batch, [3, 1])
    assert torch.equal(micro[1].mask, batch.mask[3:])
    assert [mb.n_tokens for mb in micro] == [9, 4]
    assert Window.of(micro) == Window(n_micro=2, n_samples=4, n_tokens=13)


@pytest.mark.parametrize("sizes", [3, [4, 4], [0, 10], [5, 6]])
def test_split_rejects_sizes_that_do_not_fit(sizes):
    with pytest.raises(ValueError):
        split_batch(regression_batch(10), sizes)


def test_sequence_batch_mask_matches_lengths():
    batch = sequence_batch([4, 1, 3], max_len=5)
    assert batch.mask.sum(1).tolist() == [4, 1, 3]
    assert (batch.x[batch.mask == 0] == 0).all()


def test_spread_lengths_range():
    assert spread_lengths(5, 16, 0.0) == [16] * 5
    lengths = spread_lengths(24, 16, 1.0)
    assert lengths[0] == 16 and lengths[-1] == 1 and lengths == sorted(lengths, reverse=True)


# ---------------------------------------------------------------- reductions
def test_normalized_loss_values_by_hand():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    window = Window(n_micro=2, n_samples=5, n_tokens=10)
    assert normalized_loss(losses, mask, "microbatch-mean", window).item() == pytest.approx(
        (1 + 2 + 4) / 3 / 2
    )
    assert normalized_loss(losses, mask, FORGOT_DIVIDE, window).item() == pytest.approx(7 / 3)
    assert normalized_loss(losses, mask, "sequence", window).item() == pytest.approx(
        (1.5 + 4.0) / 5
    )
    assert normalized_loss(losses, mask, "token", window).item() == pytest.approx(7 / 10)
    with pytest.raises(ValueError) as refused:
        normalized_loss(losses, mask, "mean", window)
    listed = str(refused.value).split("choose from ")[1].split(", ")
    assert sorted(listed) == sorted((*REDUCTIONS, FORGOT_DIVIDE))  # every value it accepts
    for accepted in listed:
        normalized_loss(losses, mask, accepted, window)


def test_the_floor_speaks_the_checkers_words():
    """One vocabulary: every reduction of the floor is one the loop checker declares."""
    from gas_lab.check.objectives import REDUCTIONS as CHECKED

    assert set(REDUCTIONS) - {"microbatch-mean"} <= set(CHECKED)


@pytest.mark.parametrize("n_micro", [1, 2, 4, 8])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_equal_micro_batches_match_full_batch(n_micro, reduction):
    batch = regression_batch(16, seed=n_micro)
    ref = full_batch_gradient(regression_mlp(0), batch, mse_loss)
    model = regression_mlp(0)
    # direct hand reference, too: MSE mean over the whole batch
    hand = _hand_grads(model, (model(batch.x) - batch.y).pow(2).mean())
    got = accumulate_gradients(regression_mlp(0), split_batch(batch, n_micro), mse_loss, reduction)
    assert compare_grads(ref, hand).max_rel < TOL
    assert compare_grads(got, ref).max_rel < TOL


def test_forgotten_divide_is_n_times_too_large():
    batch = regression_batch(16)
    right = accumulate_gradients(
        regression_mlp(0), split_batch(batch, 4), mse_loss, "microbatch-mean"
    )
    wrong = accumulate_gradients(regression_mlp(0), split_batch(batch, 4), mse_loss, FORGOT_DIVIDE)
    assert compare_grads(wrong, {k: 4 * v for k, v in right.items()}).max_rel < TOL
    assert compare_grads(wrong, right).max_rel > 1.0


def test_ragged_split_needs_the_sequence_reduction():
    batch = regression_batch(10, seed=2)
    micro = split_batch(batch, ragged_sizes(10, 4))
    ref = full_batch_gradient(regression_mlp(0), batch, mse_loss)
    for norm in ("sequence", "token"):
        assert (
            compare_grads(
                accumulate_gradients(regression_mlp(0), micro, mse_loss, norm), ref
            ).max_rel
            < TOL
        )
    wrong = accumulate_gradients(regression_mlp(0), micro, mse_loss, "microbatch-mean")
    assert compare_grads(wrong, ref).max_rel > 1e-2


def test_masked_sequences_token_and_sequence_match_hand_references():
    batch = sequence_batch([8, 8, 7, 5, 3, 2, 2, 1], max_len=8, seed=4)
    micro = split_batch(batch, [3, 3, 2])
    token_mean = accumulate_gradients(TinySeqModel(0), micro, token_losses, "token")
    sequence_mean = accumulate_gradients(TinySeqModel(0), micro, token_losses, "sequence")
    microbatch_mean = accumulate_gradients(TinySeqModel(0), micro, token_losses, "microbatch-mean")
    assert compare_grads(token_mean, _hand_token_ref(batch)).max_rel < TOL
    assert compare_grads(sequence_mean, _hand_sequence_ref(batch)).max_rel < TOL
    assert (
        compare_grads(full_batch_gradient(TinySeqModel(0), batch, token_losses), token_mean).max_rel
        < TOL
    )
    assert compare_grads(microbatch_mean, _hand_token_ref(batch)).max_rel > 1e-2
    # the two honest reductions are different objectives once lengths differ
    assert compare_grads(sequence_mean, token_mean).max_rel > 1e-2


def test_padding_content_is_ignored():
    batch = sequence_batch([5, 2, 4, 1], max_len=6, seed=1)
    noisy = Batch(batch.x.clone(), batch.y.clone(), batch.mask)
    noisy.x[batch.mask == 0] = 7  # junk in the padding must not change anything
    noisy.y[batch.mask == 0] = 3
    a = accumulate_gradients(TinySeqModel(0), split_batch(batch, 2), token_losses, "token")
    b = accumulate_gradients(TinySeqModel(0), split_batch(noisy, 2), token_losses, "token")
    # masked positions are multiplied by 0 before the sum, so their junk contributes nothing
    assert compare_grads(a, b).max_abs == 0.0


def test_stale_gradients_are_cleared_once_per_window():
    batch = regression_batch(8)
    model = regression_mlp(0)
    for p in model.parameters():
        p.grad = torch.full_like(p, 5.0)
    got = accumulate_gradients(model, split_batch(batch, 2), mse_loss)
    assert compare_grads(got, full_batch_gradient(regression_mlp(0), batch, mse_loss)).max_rel < TOL


def test_batchnorm_train_differs_eval_and_layernorm_match():
    batch = regression_batch(32, seed=1)
    micro = split_batch(batch, 4)

    def pair(norm, mode):
        a, b = regression_mlp(0, norm=norm), regression_mlp(0, norm=norm)
        a.train(mode == "train")
        b.train(mode == "train")
        return compare_grads(
            accumulate_gradients(a, micro, mse_loss), full_batch_gradient(b, batch, mse_loss)
        )

    assert pair("batch", "train").max_rel > 1e-2
    assert pair("batch", "eval").max_rel < TOL
    assert pair("layer", "train").max_rel < TOL


# ---------------------------------------------------------------- comparison and training
def test_compare_grads_reports_abs_and_rel():
    ref = {"w": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.5])}
    got = {"w": torch.tensor([1.5, -4.0]), "b": torch.tensor([0.5])}
    diff = compare_grads(got, ref)
    assert diff.max_abs == pytest.approx(0.5)
    assert diff.max_rel == pytest.approx(0.5 / 4.0)
    assert "5.00e-01" in str(diff)
    with pytest.raises(KeyError):
        compare_grads({"w": ref["w"]}, ref)


def test_sgd_without_divide_equals_n_times_the_learning_rate():
    batches = [regression_batch(16, seed=s) for s in range(5)]
    bug, fast = regression_mlp(0), regression_mlp(0)
    bug_losses = train_one_device(
        bug, torch.optim.SGD(bug.parameters(), lr=0.01), batches, 4, reduction=FORGOT_DIVIDE
    )
    fast_losses = train_one_device(fast, torch.optim.SGD(fast.parameters(), lr=0.04), batches, 4)
    assert bug_losses == pytest.approx(fast_losses, rel=1e-5)
    for p, q in zip(bug.parameters(), fast.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_train_records_gradient_norms_and_clips_them():
    batches = [regression_batch(16, seed=s) for s in range(3)]
    norms_bug, norms_right = [], []
    for norm, out in ((FORGOT_DIVIDE, norms_bug), ("microbatch-mean", norms_right)):
        model = regression_mlp(0)
        train_one_device(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            batches,
            4,
            reduction=norm,
            grad_norms=out,
        )
    assert len(norms_bug) == 3
    assert norms_bug == pytest.approx([4 * n for n in norms_right], rel=1e-5)
    model = regression_mlp(0)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    train_one_device(
        model, torch.optim.SGD(model.parameters(), lr=1.0), batches[:1], 4, max_grad_norm=1e-3
    )
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert norms_right[0] > 1e-2  # so the clip below really bites
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(1e-3, rel=1e-3)


def test_train_reduces_the_loss():
    batches = [regression_batch(16, seed=s) for s in range(30)]
    model = regression_mlp(0)
    losses = train_one_device(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, 4)
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------- explorer compute, widget, plots
def test_explorer_compute_no_spread_means_every_reduction_agrees():
    from gas_lab.lessons.widgets import error_vs_reference

    for norm in REDUCTIONS:
        assert error_vs_reference(norm, 4, spread=0.0).max_rel < TOL


def test_explorer_compute_spread_breaks_microbatch_mean_only():
    from gas_lab.lessons.widgets import error_vs_reference, explorer_errors

    assert error_vs_reference("microbatch-mean", 1, spread=1.0).max_rel < TOL  # N=1 is the batch
    errors = explorer_errors(1.0, [2, 3, 5])  # 3 and 5 do not divide 24: ragged splits
    assert set(errors) == set(REDUCTIONS)
    assert all(e > 1e-2 for e in errors["microbatch-mean"])
    assert all(e < TOL for e in errors["token"])
    # the error grows with the spread of lengths at fixed N
    grow = [error_vs_reference("microbatch-mean", 4, s).max_rel for s in (0.25, 0.5, 0.9)]
    assert grow == sorted(grow)


def test_explorer_widget_builds_and_follows_its_controls():
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    from gas_lab.lessons.widgets import accumulation_explorer

    box = accumulation_explorer(n_max=4)
    n, spread, norm, label, _out = box.children
    assert "microbatch-mean, N=4" in label.value
    before = float(label.value.rsplit(" ", 1)[1])
    assert before > 1e-2
    norm.value = "token"
    assert float(label.value.rsplit(" ", 1)[1]) < TOL
    n.value, spread.value = 2, 0.0
    assert "N=2, spread=0.00" in label.value


def test_plots_draw_one_line_per_series():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gas_lab.lessons.plots import plot_error_vs_n, plot_loss_curves

    fig = plot_error_vs_n([1, 2, 4], {"microbatch-mean": [0.0, 0.1, 0.2], "token": [0, 0, 0]})
    ax = fig.axes[0]
    assert len(ax.lines) == 2 + 1  # two series and the float32-noise guide
    assert min(ax.lines[0].get_ydata()) > 0  # exact zeros drawn at the floor on a log axis
    fig2 = plot_loss_curves({"a": [3.0, 2.0, 1.0], "b": [3.0, 4.0, 9.0]}, title="t")
    assert [line.get_label() for line in fig2.axes[0].lines] == ["a", "b"]
    plt.close("all")
