"""The curvature maths: pure functions and operators, tensors in, tensors out.

* [`linalg`][laplace_debiased.curvature.linalg] -- the debiasing formulas (diag(UᵀCU), debiased K-FAC
  factors), in float64;
* [`operators`][laplace_debiased.curvature.operators] -- curvature-vector products of mini-batch quadratics
  (over curvlinops);
* [`eigen`][laplace_debiased.curvature.eigen] -- top-k eigenpairs (Lanczos or Gram route) and their
  re-measurement on B̃.
"""
