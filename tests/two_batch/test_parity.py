"""Drop-in parity: a workflow written for a stock structure runs with its debiased counterpart.

Each workflow is a list of named steps (fit, marginal likelihood, prior and σ tuning,
predictives, ...). It runs once with a stock structure and once with the debiased one, with
only the ``hessian_structure`` string changed. Every step that passes with the stock structure
must pass with the debiased one, and its numbers must be of the same order (the debiased fit
uses two independent batches B, B̃ instead of all data, so they are not equal).

Stock counterparts: ``full`` → ``debiased_full``, ``kron`` → ``debiased_kron``; stock
``lowrank`` cannot be built with the pip ``asdfghjkl``, so ``debiased_lowrank`` is held against
stock ``full`` (the posterior it approximates).

The Hugging Face workflows use a tiny randomly initialised GPT-2 sequence classifier built from
a config (nothing is downloaded) on ``BatchEncoding`` batches made by hand, as laplace-torch's
LLM example does with a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import peft
import pytest
import torch
import transformers
from laplace import Laplace, marglik_training
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  registers the structures

PAIRS = [("full", "debiased_full"), ("kron", "debiased_kron"), ("full", "debiased_lowrank")]
SAME_ORDER = 10.0  # debiased and stock numbers must agree within this factor


# ---------------------------------------------------------------------------- step runner
Step = tuple[str, Callable[[Any], Any]]


def run_steps(la: Any, steps: list[Step]) -> dict[str, Any]:
    """Run the steps in order on one Laplace object; a failed step records its exception and
    the workflow goes on (as a user would after a failure they do not depend on)."""
    results: dict[str, Any] = {}
    for name, step in steps:
        try:
            results[name] = step(la)
        except Exception as err:  # noqa: BLE001  recorded and compared with the stock run
            results[name] = err
    return results


def _numbers(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().double()]
    if isinstance(value, (int, float)):
        return [torch.tensor(float(value), dtype=torch.float64)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _numbers(v)]
    return []


def assert_parity(stock: dict[str, Any], debiased: dict[str, Any], structure: str) -> None:
    """Every step passing for stock passes for debiased, with finite numbers whose mean
    magnitudes agree within ``SAME_ORDER``."""
    for name, ref in stock.items():
        if isinstance(ref, Exception):
            continue
        got = debiased[name]
        assert not isinstance(got, Exception), f"{structure}: step {name!r} passes with the stock structure but raised {got!r}"
        for a, b in zip(_numbers(got), _numbers(ref)):
            assert a.shape == b.shape, f"{structure}: step {name!r} shape {tuple(a.shape)} vs stock {tuple(b.shape)}"
            assert torch.isfinite(a).all(), f"{structure}: step {name!r} gives non-finite numbers"
            scale_a, scale_b = float(a.abs().mean()), float(b.abs().mean())
            if scale_b > 1e-8:
                ratio = scale_a / scale_b
                assert 1 / SAME_ORDER < ratio < SAME_ORDER, f"{structure}: step {name!r} is {ratio:.3g}× the stock value"



# ---------------------------------------------------------------------------- regression
def sine_regression(n: int = 150, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, generator=g) * 8
    return X, torch.sin(X) + 0.3 * torch.randn(n, 1, generator=g)


def trained_regressor(X: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """A 1-16-1 tanh MLP trained to (near) MAP, float32 as in laplace-torch's example."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        opt.step()
    return model


def tune_sigma_and_prior(la: Any, n_steps: int = 30) -> tuple[float, float]:
    """laplace-torch's example: Adam on log prior precision and log σ of the marginal likelihood."""
    log_prior = torch.zeros(1, requires_grad=True)
    log_sigma = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(n_steps):
        opt.zero_grad()
        (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
        opt.step()
    return float(log_prior.exp()), float(log_sigma.exp())


def marginal_equals_joint(la: Any, x: torch.Tensor) -> torch.Tensor:
    """laplace-torch's example asserts that la(x)'s variance is the diagonal of la(x, joint=True)."""
    _, var = la(x)
    _, cov = la(x, joint=True)
    torch.testing.assert_close(var.flatten(), torch.diagonal(cov), rtol=1e-5, atol=1e-7)
    return var


def regression_steps(loader: DataLoader, x_test: torch.Tensor) -> list[Step]:
    return [
        ("fit", lambda la: la.fit(loader)),
        ("log_marglik", lambda la: la.log_marginal_likelihood()),
        ("marglik_prior", lambda la: (la.optimize_prior_precision(method="marglik"), la.prior_precision)[1]),
        ("sigma_tuning", tune_sigma_and_prior),
        ("predict", lambda la: la(x_test)),
        ("marginal_vs_joint", lambda la: marginal_equals_joint(la, x_test)),
        ("sample", lambda la: la.sample(3).shape),
    ]


@pytest.mark.parametrize("stock, debiased", PAIRS)
@pytest.mark.parametrize("loader_kind", ["one_batch", "mini_batches"])
def test_full_batch_regression_workflow(stock, debiased, loader_kind):
    X, y = sine_regression()
    model = trained_regressor(X, y)
    batch_size = len(X) if loader_kind == "one_batch" else 50
    loader = DataLoader(TensorDataset(X, y), batch_size=batch_size)
    x_test = torch.linspace(-2, 10, 40).unsqueeze(-1)
    steps = regression_steps(loader, x_test)
    results = {
        name: run_steps(Laplace(model, "regression", subset_of_weights="all", hessian_structure=name), steps)
        for name in (stock, debiased)
    }
    assert not isinstance(results[stock]["fit"], Exception)
    assert_parity(results[stock], results[debiased], debiased)


@pytest.mark.parametrize("stock, debiased", PAIRS)
@pytest.mark.parametrize("loader_kind", ["one_batch", "mini_batches"])
def test_marglik_training_workflow(stock, debiased, loader_kind):
    X, y = sine_regression(n=60)
    loader = DataLoader(TensorDataset(X, y), batch_size=len(X) if loader_kind == "one_batch" else 20)
    results = {}
    for structure in (stock, debiased):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        la, _, margliks, losses = marglik_training(
            model, loader, "regression", hessian_structure=structure, n_epochs=4,
            n_hypersteps=3, optimizer_kwargs={"lr": 1e-2}, backend=CurvlinopsGGN,
        )
        results[structure] = {"marglik": torch.tensor(margliks[-1]), "loss": torch.tensor(losses[-1]), "sigma": la.sigma_noise}
    assert_parity(results[stock], results[debiased], debiased)


# ---------------------------------------------------------------------------- reward modelling
class RewardModel(nn.Module):
    """Scalar reward: pairs ``(n, 2, d)`` → pair logits ``(n, 2)`` (fit), ``(n, d)`` → ``(n, 1)`` (predict)."""

    def __init__(self, d: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out.squeeze(-1) if x.ndim == 3 else out


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("stock, debiased", PAIRS)
def test_reward_modelling_workflow(stock, debiased, subset):
    g = torch.Generator().manual_seed(0)
    pairs = torch.randn(60, 2, 4, generator=g)
    loader = DataLoader(TensorDataset(pairs, torch.randint(0, 2, (60,), generator=g)), batch_size=20)
    x_test = torch.randn(7, 4, generator=g)
    model = RewardModel()
    steps = [
        ("fit", lambda la: la.fit(loader)),
        ("predict", lambda la: la(x_test)),
        ("marglik_prior", lambda la: (la.optimize_prior_precision(method="marglik"), la.prior_precision)[1]),
        ("predict_tuned", lambda la: la(x_test)),
    ]
    results = {
        s: run_steps(Laplace(model, "reward_modeling", subset_of_weights=subset, hessian_structure=s), steps)
        for s in (stock, debiased)
    }
    assert not isinstance(results[stock]["fit"], Exception)
    mean, var = results[debiased]["predict"]
    assert mean.shape == (7, 1) and var.shape == (7, 1, 1)  # regression at predict
    assert_parity(results[stock], results[debiased], debiased)


class FlatRewardModel(nn.Module):
    """laplace-torch's test reward model: pairs ``(n, 2, d)`` flattened to rows ``(2n, d)`` before
    the network, so every layer sees two rows per sample; ``(n, d)`` → ``(n, 1)`` at predict.
    ``flatten=False``: the same function on ``(n, 2, d)``, the pair as two positions per sample."""

    def __init__(self, d: int = 3, flatten: bool = True, bias: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(d, 8, bias=bias), nn.Tanh(), nn.Linear(8, 1, bias=bias)).double()
        self.flatten = flatten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:
            return self.net(x)
        if not self.flatten:
            return self.net(x).squeeze(-1)
        return self.net(x.reshape(-1, x.shape[-1])).reshape(len(x), 2)


def _reward_data(n: int = 12) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 2, 3, dtype=torch.float64, generator=g), torch.randint(0, 2, (n,), generator=g))


def _dense(la: Any) -> torch.Tensor:
    P = la.posterior_precision
    if isinstance(P, tuple):
        (U, lam), prior = P
        return (U * lam) @ U.T + torch.diag(prior.expand(U.shape[0]))
    return P if isinstance(P, torch.Tensor) else P.to_matrix()


def _curvature(la: Any) -> torch.Tensor:
    """The dense curvature ``H`` (low rank: ``U diag(λ) Uᵀ``)."""
    if isinstance(la.H, tuple):
        U, lam = la.H
        return (U * lam) @ U.T
    return la.H if isinstance(la.H, torch.Tensor) else la.H.to_matrix()


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("stock, debiased", PAIRS)
def test_reward_model_on_flattened_pairs_fits_as_stock(stock, debiased, subset):
    """laplace-torch's reward model (pairs flattened to ``2n`` rows inside the model): with B̃ = B
    every structure's posterior equals stock's reward-modelling fit (float64)."""
    one_batch = DataLoader(_reward_data(), batch_size=12)
    kwargs = {"rank": 10_000} if debiased == "debiased_lowrank" else {}
    ref = Laplace(FlatRewardModel(), "reward_modeling", subset_of_weights=subset, hessian_structure=stock,
                  prior_precision=0.5)
    ref.fit(one_batch)
    la = Laplace(FlatRewardModel(), "reward_modeling", subset_of_weights=subset, hessian_structure=debiased,
                 prior_precision=0.5, **kwargs)
    la.fit(one_batch, magnitude_loader=one_batch)
    rtol = 1e-10 if debiased == "debiased_kron" else 1e-6  # stock's dense GGN agrees to 6e-8 here
    torch.testing.assert_close(_dense(la), _dense(ref), rtol=rtol, atol=1e-10)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for got, want in zip(la(x), ref(x)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure, ratio", [("debiased_kron", 2.0), ("debiased_full", 1.0), ("debiased_lowrank", 1.0)])
def test_reward_model_on_flattened_pairs_splits_rows_by_sample(structure, ratio, subset):
    """Two batches (B ≠ B̃, one pass): each flattened row is counted in its own sample's batch.
    The reference is the same network on ``(n, 2, d)``: the exact GGN (full, low rank) is the
    same; K-FAC's input factor (stock's convention) sums a flattened sample's two rows where it
    averages two positions, so without biases the debiased K-FAC curvature is twice as large."""
    loader = DataLoader(_reward_data(), batch_size=6)
    H = []
    for flatten in (True, False):
        la = Laplace(FlatRewardModel(flatten=flatten, bias=False), "reward_modeling", subset_of_weights=subset,
                     hessian_structure=structure, prior_precision=0.5)
        la.fit(loader)
        H.append(_curvature(la))
    torch.testing.assert_close(H[0], ratio * H[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_reward_model_on_flattened_pairs_fits_debiased_ekfac(subset):
    """EKFAC (no stock counterpart) fits laplace-torch's reward model and predicts as regression."""
    la = Laplace(FlatRewardModel(), "reward_modeling", subset_of_weights=subset, hessian_structure="debiased_ekfac")
    la.fit(DataLoader(_reward_data(), batch_size=6))
    mean, var = la(torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    assert mean.shape == (5, 1) and var.shape == (5, 1, 1) and bool((var > 0).all())


# ---------------------------------------------------------------------------- Hugging Face GPT-2
VOCAB, SEQ, N_LABELS, PAD = 24, 6, 2, 0


class SequenceClassifier(nn.Module):
    """laplace-torch's LLM-example wrapper: the model takes the whole ``BatchEncoding``."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    def forward(self, data) -> torch.Tensor:
        return self.hf_model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits


def tiny_gpt2(attention: str = "eager") -> nn.Module:
    """Stock structures need forward-mode AD (curvlinops), which CPU flash attention ("sdpa",
    the default) lacks; the debiased structures fall back to reverse mode there."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=8, n_layer=1, n_head=2, num_labels=N_LABELS, pad_token_id=PAD,
        attn_implementation=attention,
    )
    return transformers.GPT2ForSequenceClassification(config)


def encodings(n: int, seed: int) -> list[dict]:
    """``n`` left-padded token sequences with labels, one sample per item."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        length = 2 + int(torch.randint(0, SEQ - 1, (1,), generator=g))
        ids = torch.full((SEQ,), PAD)
        ids[SEQ - length :] = torch.randint(1, VOCAB, (length,), generator=g)
        items.append({"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": int(i % N_LABELS)})
    return items


def collate(items: list[dict]) -> transformers.BatchEncoding:
    return transformers.BatchEncoding(
        {
            "input_ids": torch.stack([it["input_ids"] for it in items]),
            "attention_mask": torch.stack([it["attention_mask"] for it in items]),
            "labels": torch.tensor([it["labels"] for it in items]),
        }
    )


def hf_loaders() -> tuple[DataLoader, transformers.BatchEncoding]:
    train = DataLoader(encodings(24, 0), batch_size=8, collate_fn=collate)
    return train, collate(encodings(5, 1))


def gradient_subset(model: nn.Module) -> nn.Module:
    """Only the last block's MLP output projection and the score head are trained."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("hf_model.transformer.h.0.mlp.c_proj", "hf_model.score")))
    return model


def lora(model: nn.Module) -> nn.Module:
    """LoRA adapters on the attention projection via peft; the backbone is frozen."""
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    model.hf_model = peft.get_peft_model(model.hf_model, config)
    return model


HF_SETUPS = {
    "last_layer": ("last_layer", lambda m: m, {"feature_reduction": "pick_last"}),
    "requires_grad_subset": ("all", gradient_subset, {}),
    "lora": ("all", lora, {}),
}


@pytest.mark.parametrize("stock, debiased", PAIRS)
@pytest.mark.parametrize("setup", list(HF_SETUPS))
def test_gpt2_sequence_classifier_workflow(stock, debiased, setup):
    subset, prepare, kwargs = HF_SETUPS[setup]
    train, x_test = hf_loaders()
    steps = [
        ("fit", lambda la: la.fit(train)),
        ("predict_probit", lambda la: la(x_test, link_approx="probit")),
        ("predict_mc", lambda la: la(x_test, pred_type="nn", link_approx="mc", n_samples=4)),
        ("log_marglik", lambda la: la.log_marginal_likelihood()),
        ("marglik_prior", lambda la: (la.optimize_prior_precision(method="marglik"), la.prior_precision)[1]),
    ]
    results = {}

    def run(structure: str) -> None:
        model = prepare(SequenceClassifier(tiny_gpt2())).eval()
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure, **kwargs)
        results[structure] = run_steps(la, steps)
        if setup != "last_layer" and not isinstance(results[structure]["fit"], Exception):
            assert la.n_params == n_trainable  # only requires_grad parameters are weights

    run(stock)
    run(debiased)
    # stock K-FAC refuses GPT-2's Conv1D ("parameters in un-supported layers") and its later
    # steps see an unfitted object; debiased_kron fits it and is held against the full GGN then
    reference = stock
    if isinstance(results[stock]["fit"], Exception) and stock != "full":
        run(reference := "full")
    assert_parity(results[reference], results[debiased], debiased)
    if not isinstance(results[stock]["predict_probit"], Exception):
        torch.testing.assert_close(results[debiased]["predict_probit"].sum(-1), torch.ones(5), atol=1e-5, rtol=0)


@pytest.mark.parametrize("structure", ["debiased_full", "debiased_kron", "debiased_lowrank"])
@pytest.mark.parametrize("setup", ["lora", "last_layer"])
def test_gpt2_every_debiased_structure_on_batch_encodings(setup, structure):
    """Each debiased structure fits the default (sdpa attention) GPT-2 on BatchEncoding batches,
    LoRA adapters and the last layer, and gives normalised probabilities."""
    subset, prepare, kwargs = HF_SETUPS[setup]
    train, x_test = hf_loaders()
    model = prepare(SequenceClassifier(tiny_gpt2("sdpa"))).eval()
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure, **kwargs)
    la.fit(train)
    probs = la(x_test)
    assert probs.shape == (5, N_LABELS) and torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(5), atol=1e-5, rtol=0)
    assert math.isfinite(float(la.log_marginal_likelihood()))
