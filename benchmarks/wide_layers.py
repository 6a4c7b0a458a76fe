"""Wide layers: null-space treatments of debiased K-FAC at equal samples, cifar_cnn.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/wide_layers.py --ckpt map --draws 3 --n-test 10000

The Laplace approximation over the dense head of ``cifar_cnn`` (``Linear(1024, 32)``, ReLU,
``Linear(32, 10)``; the convolutions fixed at the MAP, their 1,024-d features precomputed): the
head holds the wide factor (input dimension 1,024 > 256 + 256). N = 10,000 training images.
Per draw: 9 disjoint chunks of 256 training images (K-FAC of each, scaled to N), combined into a
single batch of k x 256 (B̃ = B), and debiased 256 + (k-1) x 256 and floor(k/2) x 256 + rest,
each with ``null_space="aligned"`` and ``"isotropic"``, and 256 + (k-1) x 256 with nested
directions in B's null space (``nested_factor``: the first half of B̃ chooses them, the second
half measures them), for k = 2, 5, 9 and 1 + auto's k = 4 (512, 1,280, 2,304, 1,024 samples; nested from k = 5); and
``fit(loader, n_magnitude_batches="auto")`` (batches of 256 in the draw's order, default
``null_space="isotropic"``), whose rule gives the 1,024-d input factor k = 3 magnitude batches
(256 + 3 x 256 = 1,024 samples: its row equals "deb 256+3x256 isotropic", through the fit's API).
Projected-probit predictive on the test images over δ = 1e-4 ... 1e3; the max over
δ of the relative test-NLL gap to full-batch K-FAC (all 10,000 images). ``--ckpt map``: the
headline's finished MAP; ``--ckpt last``: its latest training checkpoint.
Writes benchmarks/results/wide_layers.{json,md}.
"""
import argparse, json, sys, time
import numpy as np, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)
from torch.utils.data import DataLoader, TensorDataset
from benchmarks.cifar10.data import load_data
from benchmarks.cifar10.train import MapConfig, map_dir
from laplace_debiased.evaluation.models import cifar_cnn
from laplace_debiased.kron.laplace import DebiasedKronLaplace, DebiasedKronDecomposed
from laplace_debiased.curvature.completion import debiased_factor_mode, nested_factor
from laplace_debiased.posterior.from_laplace import laplace_params
from laplace_debiased.posterior.jacobians import logit_jacobians
from laplace_debiased.posterior.kron_structure import KronStructure
from laplace_debiased.posterior.links import probit_from_variances

p = argparse.ArgumentParser()
p.add_argument("--ckpt", default="map"); p.add_argument("--draws", type=int, default=2)
p.add_argument("--n-test", type=int, default=2000); p.add_argument("--out", default=str(__import__("pathlib").Path(__file__).resolve().parent / "results" / "wide_layers.json"))
a = p.parse_args()
GRID = [10.0 ** e for e in range(-4, 4)]
data = load_data(None)
X, y = data.train.tensors
X, y = X[:10000], y[:10000]
train = TensorDataset(X, y)
N = len(y)
model = cifar_cnn()
d = map_dir(MapConfig())
if a.ckpt == "map":
    model.load_state_dict(torch.load(d / "map.pt", weights_only=False)["state_dict"])
else:
    blob = torch.load(d / "last.pt", weights_only=False)
    model.load_state_dict(blob["model"])
    print(f"checkpoint after epoch {len(blob['history'])}", flush=True)
model.eval()
Xt, yt = data.test.tensors[0][: a.n_test], data.test.tensors[1][: a.n_test]
# Laplace over the dense layers only (the convolutions fixed at the MAP; their K-FAC factors have
# full rank at 256 images anyway): the dense head on precomputed 1024-d features.
with torch.no_grad():
    feats = model[:10]
    X = torch.cat([feats(x) for x in X.split(500)])
    Xt = torch.cat([feats(x) for x in Xt.split(500)])
model = model[10:]
train = TensorDataset(X, y)
print("head:", model, "features", tuple(X.shape), flush=True)

def kfac(idx, batch=None):
    loader = DataLoader(train, batch_size=batch or len(idx), sampler=list(idx), shuffle=False)
    if batch:  # the full-batch reference: stock K-FAC (N = 10k samples)
        from laplace import KronLaplace
        la = KronLaplace(model, "classification"); la.fit(loader)
        return [[F for F in blk] for blk in la.H_facs.kfacs], la
    la = DebiasedKronLaplace(model, "classification", n_direction_batches=len(loader), n_magnitude_batches=len(loader))
    la.fit(loader, magnitude_loader=loader)
    return [[F for F in blk] for blk in la.H_facs.kfacs], la

def auto_fit(perm):
    """``n_magnitude_batches="auto"`` on batches of 256 in the order ``perm``: (B, B̃) factors, the choice."""
    loader = DataLoader(train, batch_size=256, sampler=list(perm), shuffle=False)
    la = DebiasedKronLaplace(model, "classification", n_magnitude_batches="auto")
    la.fit(loader)
    return la.H_facs.kfacs, la.H_facs_magnitude.kfacs, la.fit_batches[-1].auto

def avg(facs):
    return [[sum(f[b][j] for f in facs) / len(facs) for j in range(len(facs[0][b]))] for b in range(len(facs[0]))]

def structure(direction, magnitude, mode, numels):
    """Debiased K-FAC structure; ``mode`` "aligned"/"isotropic", or "nested" with ``magnitude`` a
    pair (B̃₁ chooses in B's null space, B̃₂ measures; equal halves)."""
    Us, ls = [], []
    if mode == "nested":
        choose, measure = magnitude
        factor_pairs = [[nested_factor(D, M1, M2) for D, M1, M2 in zip(Fd, F1, F2)] for Fd, F1, F2 in zip(direction, choose, measure)]
    else:
        factor_pairs = [[debiased_factor_mode(D, M, mode) for D, M in zip(Fd, Fm)] for Fd, Fm in zip(direction, magnitude)]
    for pairs in factor_pairs:
        Us.append([u for u, _ in pairs]); ls.append([l for _, l in pairs])
    zeros = [[int((l <= 0).sum()) for l in blk] for blk in ls]
    return KronStructure(DebiasedKronDecomposed(Us, ls), 1.0, numels), zeros

def nll_curves(structs):
    params = laplace_params(ref_la)
    sums = {k: np.zeros(len(GRID)) for k in structs}
    for xs, ys in zip(Xt.split(100), yt.split(100)):
        f, jacs = logit_jacobians(model, params, xs)
        f64 = f.double(); fc = f64 - f64.mean(-1, keepdim=True)
        for k, s in structs.items():
            var = s.variances(s.rotate(jacs), GRID, project=True)
            pr = probit_from_variances(fc, var)  # (G, n, C)
            sums[k] += -torch.log(pr[:, torch.arange(len(ys)), ys].clamp_min(1e-300)).sum(1).numpy()
    return {k: (v / len(yt)).tolist() for k, v in sums.items()}

t0 = time.time()
full, ref_la = kfac(np.arange(N), batch=500)
numels = [p.numel() for p in laplace_params(ref_la)]
print(f"full fit {time.time()-t0:.0f}s", flush=True)
results = {"grid": GRID, "n_test": a.n_test, "ckpt": a.ckpt, "draws": []}
full_struct = KronStructure(DebiasedKronDecomposed(
    [[torch.linalg.eigh(F.double())[1] for F in blk] for blk in full],
    [[torch.linalg.eigvalsh(F.double()).clamp_min(0) for F in blk] for blk in full]), 1.0, numels)
full_nll = nll_curves({"full": full_struct})["full"]
print("full", np.round(full_nll, 4), flush=True)
results["full"] = full_nll
for r in range(a.draws):
    rng = np.random.default_rng(r)
    perm = rng.permutation(N)
    chunks = [kfac(perm[i * 256:(i + 1) * 256])[0] for i in range(9)]
    structs, zeros = {}, {}
    B, Bt, auto = auto_fit(perm)
    print(f"draw {r}: {auto.describe()}", flush=True)
    results.setdefault("auto", []).append(auto.describe())
    for k in sorted({2, 5, 9, 1 + auto.used}):  # 1 + auto.used = 4: the equal-sample rows of "auto"
        s = 256 * k
        structs[f"single {s}"], zeros[f"single {s}"] = structure(avg(chunks[:k]), avg(chunks[:k]), "aligned", numels)
        for mode in ("aligned", "isotropic"):
            structs[f"deb 256+{k-1}x256 {mode}"], zeros[f"deb 256+{k-1}x256 {mode}"] = structure(chunks[0], avg(chunks[1:k]), mode, numels)
            h = k // 2
            structs[f"deb {h}x256+{k-h}x256 {mode}"], zeros[f"deb {h}x256+{k-h}x256 {mode}"] = structure(avg(chunks[:h]), avg(chunks[h:k]), mode, numels)
        if k >= 5:  # nested: B = 256, B̃ = (k-1) x 256 in two equal halves (B̃₁ chooses in B's null space, B̃₂ measures)
            m = 1 + (k - 1) // 2
            name = f"deb 256+{k-1}x256 nested"
            structs[name], zeros[name] = structure(chunks[0], (avg(chunks[1:m]), avg(chunks[m:k])), "nested", numels)
        if k == 1 + auto.used:
            name = f"auto 256+{auto.used}x256 isotropic"
            structs[name], zeros[name] = structure(B, Bt, "isotropic", numels)
    curves = nll_curves(structs)
    gaps = {k: float(np.max(np.abs(np.array(v) - full_nll) / np.array(full_nll))) for k, v in curves.items()}
    results["draws"].append({"curves": curves, "gaps": gaps, "zeros": zeros})
    for k in curves:
        print(f"draw {r} {k:<32} gap {100*gaps[k]:7.2f} %  nll {np.round(curves[k], 3).tolist()}  zeros {zeros.get(k)}", flush=True)
    json.dump(results, open(a.out, "w"))
print(f"done {time.time()-t0:.0f}s")


def markdown(res: dict) -> str:
    """Mean (min-max) over draws of the max relative test-NLL gap, per variant."""
    names = list(res["draws"][0]["gaps"])
    lines = [f"# Wide layers: null-space treatments at equal samples ({len(res['draws'])} draws)", "",
             "`" + " ".join(["python benchmarks/wide_layers.py", *sys.argv[1:]]) + "`", "",
             __doc__.split("\n\n", 1)[1].strip(), "",
             "| variant | max rel. test-NLL gap to full batch over δ, mean [%] | min - max over draws [%] |",
             "|---|---|---|"]
    for n in names:
        g = [100 * d["gaps"][n] for d in res["draws"]]
        lines.append(f"| {n} | {np.mean(g):.2f} | {min(g):.2f} - {max(g):.2f} |")
    lines += ["", "Full-batch test NLL over δ = " + ", ".join(f"{d:g}" for d in res["grid"]) + ": "
              + ", ".join(f"{v:.4f}" for v in res["full"])]
    auto = sorted(set(res.get("auto", [])))
    lines += ["", f"`fit(..., n_magnitude_batches=\"auto\")` ({len(res.get('auto', []))} draws): " + " / ".join(auto)]
    return "\n".join(lines) + "\n"


results["seconds"] = time.time() - t0
json.dump(results, open(a.out, "w"))
open(a.out.replace(".json", ".md"), "w").write(markdown(results))
